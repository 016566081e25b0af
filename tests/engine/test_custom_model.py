"""A model of one's own, served by the engine through the model protocol alone.

The model below is unlike the built-in families on purpose: learned absolute position
embeddings, LayerNorm, attention and MLP in parallel off one norm (GPT-J style), a sliding
window on every other layer, a tied head, and its own config class. It implements what the
engine needs (``config``, ``kv_layer_infos``, ``__call__`` over the paged buffers with
``jaxkv.models.attend_paged``, ``compute_logits``) and a dense forward of its own; the engine's
greedy tokens must equal that dense forward's, with chunked prefill, prefix hits and
preemption. docs/models.md, "A model of your own", points here.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxkv import LLM, SamplingParams
from jaxkv.models import LayerKVInfo, attend_paged


@dataclasses.dataclass(frozen=True)
class ParallelConfig:
    vocab_size: int = 256
    hidden_size: int = 64
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 16
    num_layers: int = 2
    window: int = 8  # odd layers attend to the last 8 positions
    max_position_embeddings: int = 256
    dtype: str = "float32"
    eos_token_id: int | None = None
    # The engine reads vocab_size, head_dim, max_position_embeddings, dtype and eos_token_id.


class ParallelBlock(nnx.Module):
    def __init__(self, cfg: ParallelConfig, i: int, rngs: nnx.Rngs):
        h, d = cfg.hidden_size, cfg.head_dim
        self.norm = nnx.LayerNorm(h, rngs=rngs)
        self.qkv = nnx.Linear(h, (cfg.num_heads + 2 * cfg.num_kv_heads) * d, rngs=rngs)
        self.o = nnx.Linear(cfg.num_heads * d, h, rngs=rngs)
        self.up = nnx.Linear(h, 4 * h, rngs=rngs)
        self.down = nnx.Linear(4 * h, h, rngs=rngs)
        self.window = cfg.window if i % 2 else None
        self.cfg = cfg

    def qkv_split(self, x):  # [..., T, hidden] -> q [..., T, Hq, D], k, v [..., T, Hkv, D]
        c = self.cfg
        q, k, v = jnp.split(
            self.qkv(x), [c.num_heads * c.head_dim, (c.num_heads + c.num_kv_heads) * c.head_dim], -1
        )
        lead = x.shape[:-1]
        return (
            q.reshape(*lead, c.num_heads, c.head_dim),
            k.reshape(*lead, c.num_kv_heads, c.head_dim),
            v.reshape(*lead, c.num_kv_heads, c.head_dim),
        )

    def __call__(self, h, attend):  # attend(q, k, v) -> o [..., T, Hq, D]
        x = self.norm(h)
        o = attend(*self.qkv_split(x))
        return h + self.o(o.reshape(*o.shape[:-2], -1)) + self.down(jax.nn.gelu(self.up(x)))


class ParallelLM(nnx.Module):
    def __init__(self, cfg: ParallelConfig, *, seed: int = 0):
        rngs = nnx.Rngs(seed)
        self.config = cfg
        self.embed = nnx.Embed(cfg.vocab_size, cfg.hidden_size, rngs=rngs)
        self.pos = nnx.Embed(cfg.max_position_embeddings, cfg.hidden_size, rngs=rngs)
        self.blocks = nnx.List([ParallelBlock(cfg, i, rngs) for i in range(cfg.num_layers)])
        self.norm = nnx.LayerNorm(cfg.hidden_size, rngs=rngs)

    # -- the protocol ------------------------------------------------------------------------
    def kv_layer_infos(self) -> dict[str, LayerKVInfo]:
        c = self.config
        return {
            f"blocks.{i}": LayerKVInfo(c.num_kv_heads, c.head_dim, b.window)
            for i, b in enumerate(self.blocks)
        }

    def __call__(self, input_ids, positions, kv_buffers, attn_metadata, binding):
        # input_ids, positions: [T] int32; kv_buffers: per KV tensor [N * page_bytes] uint8;
        # attn_metadata: per KV-cache group -> (hidden [T, hidden], new kv_buffers)
        buffers = list(kv_buffers)
        h = self.embed(input_ids) + self.pos(positions)
        for i, block in enumerate(self.blocks):
            group, tensor = binding.lookup(f"blocks.{i}")

            def attend(q, k, v, block=block, group=group, tensor=tensor):
                o, buffers[tensor] = attend_paged(
                    q,
                    k,
                    v,
                    buffers[tensor],
                    attn_metadata[group],
                    binding,
                    sm_scale=self.config.head_dim**-0.5,
                    sliding_window=block.window,
                )
                return o

            h = block(h, attend)
        return self.norm(h), tuple(buffers)

    def compute_logits(self, hidden, *, vocab_major: bool = False):
        w = self.embed.embedding[...]  # [V, hidden], tied
        if vocab_major:  # [V, R]
            return jnp.einsum("vh,rh->vr", w, hidden).astype(jnp.float32)
        return jnp.einsum("...h,vh->...v", hidden, w).astype(jnp.float32)

    # -- its own dense reference -------------------------------------------------------------
    def dense_logits(self, ids):  # [L] int32 -> [L, V]
        c = self.config
        length = ids.shape[0]
        pos = jnp.arange(length)
        h = self.embed(ids) + self.pos(pos)
        for block in self.blocks:

            def attend(q, k, v, block=block):
                g = c.num_heads // c.num_kv_heads
                k, v = jnp.repeat(k, g, axis=1), jnp.repeat(v, g, axis=1)
                s = jnp.einsum("qhd,khd->hqk", q, k) * c.head_dim**-0.5
                mask = pos[None, :] <= pos[:, None]
                if block.window is not None:
                    mask &= pos[None, :] > pos[:, None] - block.window
                p = jax.nn.softmax(jnp.where(mask[None], s, -jnp.inf), axis=-1)
                return jnp.einsum("hqk,khd->qhd", p, v)

            h = block(h, attend)
        return self.compute_logits(self.norm(h))


def _dense_greedy(model, fwd, prompt, n):
    tokens = list(prompt)
    for _ in range(n):
        ids = np.zeros(128, np.int32)
        ids[: len(tokens)] = tokens
        tokens.append(int(np.argmax(np.asarray(fwd(jnp.asarray(ids)))[len(tokens) - 1])))
    return tokens[len(prompt) :]


def test_a_model_of_ones_own_matches_its_dense_forward():
    model = ParallelLM(ParallelConfig())
    fwd = jax.jit(model.dense_logits)
    rng = np.random.default_rng(0)
    shared = rng.integers(0, 256, 40).tolist()
    prompts = [shared + rng.integers(0, 256, n).tolist() for n in (5, 23)] + [
        rng.integers(0, 256, 30).tolist()
    ]
    llm = LLM(
        model,
        kv_cache_memory_bytes=4 << 20,
        max_num_seqs=4,
        max_num_batched_tokens=32,
        num_gpu_blocks_override=14,
        warmup=False,
    )  # 32-token chunks; 14 blocks preempt
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    for p, o in zip(prompts, outs):
        assert o.outputs[0].token_ids == _dense_greedy(model, fwd, p, 24)
    stats = llm.llm_engine.get_stats()
    assert stats.num_preemptions > 0 and stats.prefix_hit_tokens > 0, stats
    pool = llm.llm_engine.scheduler.kv_cache_manager.block_pool
    assert pool.get_num_free_blocks() == pool.num_gpu_blocks - 1
