"""Random init is usable: greedy continuations vary (no single repeated token, prompt-dependent)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxkv.models import build_model, dense_forward, get_config

_forward = nnx.jit(dense_forward)


def _greedy(model, prompt: list[int], new: int, width: int = 24) -> list[int]:
    buf = np.zeros((1, width), np.int32)
    buf[0, : len(prompt)] = prompt
    n = len(prompt)
    for _ in range(new):
        buf[0, n] = int(jnp.argmax(_forward(model, jnp.asarray(buf))[0, n - 1]))
        n += 1
    return buf[0, len(prompt) : n].tolist()


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-hybrid"])
def test_greedy_tokens_vary(name):
    model = build_model(get_config(name, num_hidden_layers=4), seed=0)
    a = _greedy(model, [1, 15, 300, 4000], 12)
    b = _greedy(model, [1, 77, 9], 12)
    assert a != b, (a, b)
    for seq in (a, b):
        assert len(set(seq)) >= 6, seq
