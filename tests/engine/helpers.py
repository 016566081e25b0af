"""Shared helpers for engine tests: small models and the dense greedy reference loop."""

from __future__ import annotations

import weakref

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv.engine import LLMEngine
from jaxkv.entrypoints.llm import LLM
from jaxkv.models import ModelConfig, build_model, dense_forward, get_config

SMALL = dict(
    num_hidden_layers=2,
    hidden_size=128,
    intermediate_size=256,
    vocab_size=512,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    max_position_embeddings=512,
)


#: ``get_config("tiny-llama", **LLAMA3_8B_LAYER)``: one layer of Llama-3-8B's shapes (hidden
#: 4096, MLP 14336, 32 / 8 heads of 128, vocabulary 128256) in bf16, for compile-only checks.
LLAMA3_8B_LAYER = dict(
    num_hidden_layers=1,
    hidden_size=4096,
    intermediate_size=14336,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=128,
    vocab_size=128256,
    max_position_embeddings=8192,
    dtype="bfloat16",
)


def llama3_8b_layer(quantization: str | None = None):
    """An abstract (``nnx.eval_shape``: nothing allocated) model of ``LLAMA3_8B_LAYER``."""
    from flax import nnx

    cfg = get_config("tiny-llama", **LLAMA3_8B_LAYER)
    return nnx.eval_shape(lambda: build_model(cfg, seed=0, quantization=quantization))


def llama3_8b_layer_runner(model, **engine):
    """The model runner of an engine on ``model`` (``llama3_8b_layer()``) for compile-only
    checks: Pallas attention, 64 sequences, a 512-token budget, 4k context, a 256 MiB cache;
    ``engine`` overrides."""
    args = dict(
        attention_backend="pallas",
        max_num_seqs=64,
        max_num_batched_tokens=512,
        max_model_len=4096,
        kv_cache_memory_bytes=256 << 20,
    )
    return make_llm(model, **{**args, **engine}).llm_engine.runner


def small_model(family: str = "tiny-llama", seed: int = 0, **overrides):
    kw = dict(SMALL)
    if family == "tiny-hybrid":
        kw.update(sliding_window=16, num_hidden_layers=4)
    kw.update(overrides)
    return build_model(get_config(family, **kw), seed=seed)


def gemma3_model(*, num_kv_heads: int = 1, window: int = 16, seed: int = 0):
    """A tiny random Gemma 3: 6 layers, 5 sliding-window layers of ``window`` then 1 global,
    q/k norms, RoPE bases 10^4 (local) and 10^6 (global)."""
    config = ModelConfig(
        architecture="gemma3",
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=6,
        num_attention_heads=4,
        num_key_value_heads=num_kv_heads,
        head_dim=16,
        sliding_window=window,
        query_pre_attn_scalar=16.0,
        qk_norm=True,
        rope_theta=1e6,
        rope_local_base_freq=1e4,
        hidden_act="gelu_pytorch_tanh",
        tie_word_embeddings=True,
        max_position_embeddings=512,
    )
    assert config.layer_types == ("sliding_attention",) * 5 + ("full_attention",)
    return build_model(config, seed=seed)


def make_llm(model, **kwargs) -> LLM:
    kwargs.setdefault("kv_cache_memory_bytes", 8 << 20)
    kwargs.setdefault("max_num_seqs", 8)
    kwargs.setdefault("max_num_batched_tokens", 64)
    kwargs.setdefault("block_size", 16)
    kwargs.setdefault("warmup", False)  # tests that count compiles warm up themselves
    llm = LLM.__new__(LLM)
    llm.llm_engine = LLMEngine.from_config(model, **kwargs)
    return llm


def assert_no_block_leaks(llm) -> None:
    """Every request has ended and every block is free again (all but the null block)."""
    engine = llm.llm_engine
    assert not engine.has_unfinished_requests()
    pool = engine.scheduler.kv_cache_manager.block_pool
    assert pool.get_num_free_blocks() == pool.num_gpu_blocks - 1


#: model -> its jitted dense forward (entries go with their model).
_DENSE_FORWARD: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def dense_greedy(
    model, prompt: list[int], max_tokens: int, pad_to: int = 256, banned=None
) -> list[int]:
    """Greedy loop on the dense, non-paged forward (causal, so right-padding is harmless).

    ``banned(outputs so far) -> token ids`` are set to -inf before each argmax.
    """
    fwd = _DENSE_FORWARD.get(model)
    if fwd is None:  # one compile per model and length, not per call
        ref = weakref.ref(model)  # a strong reference here would keep the key alive
        fwd = _DENSE_FORWARD[model] = jax.jit(lambda ids: dense_forward(ref(), ids))
    tokens = list(prompt)
    out = []
    length = max(pad_to, len(prompt) + max_tokens)
    for _ in range(max_tokens):
        ids = np.zeros((1, length), np.int32)
        ids[0, : len(tokens)] = tokens
        row = np.array(fwd(jnp.asarray(ids))[0, len(tokens) - 1])
        if banned is not None:
            row[list(banned(out))] = -np.inf
        tok = int(np.argmax(row))
        out.append(tok)
        tokens.append(tok)
    return out
