"""Gemma 3 (five sliding-window layers to one global, per-head q/k norm, two RoPE bases) under
tensor parallelism on two devices, against the dense forward.

Not collected by a plain ``pytest`` run (the file name does not start with ``test_``):
``test_gemma3.py::test_gemma3_tensor_parallel_on_two_host_devices`` runs it in a subprocess
with two CPU host devices (``XLA_FLAGS=--xla_force_host_platform_device_count=2``, set before
jax starts), as ``test_tensor_parallel.py`` runs ``tp_cases.py``. On a machine with two or more
accelerators it runs as is: ``pytest tests/engine/tp_gemma3_cases.py``.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest

from jaxkv.models.sharding import param_name
from jaxkv.sampling_params import SamplingParams
from tests.engine.helpers import assert_no_block_leaks, dense_greedy, gemma3_model, make_llm

pytestmark = pytest.mark.skipif(jax.device_count() < 2, reason="needs 2 devices")

WINDOW = 16


def _model(seed=0):
    return gemma3_model(num_kv_heads=2, window=WINDOW, seed=seed)


def test_gemma3_tp2_matches_dense_with_chunks_and_prefix_hits():
    """Greedy tokens equal the dense forward's with the weights and KV heads split over two
    devices: a 60-token prompt in a 32-token budget (chunked, past the window) and a 40-token
    shared prefix hit from the cache (longer than the window); no block leaks."""
    model = _model()
    llm = make_llm(
        model,
        tensor_parallel_size=2,
        max_num_seqs=4,
        max_num_batched_tokens=32,
        max_model_len=256,
        block_size=4,
    )
    runner = llm.llm_engine.runner
    shards = {
        param_name(p): (x.shape, x.addressable_shards[0].data.shape)
        for p, x in jax.tree_util.tree_leaves_with_path(runner.state)
    }
    assert shards["model.layers.0.self_attn.q_proj.kernel"] == ((64, 64), (64, 32)), shards
    assert shards["model.layers.5.self_attn.k_proj.kernel"] == ((64, 32), (64, 16)), shards
    assert shards["model.layers.0.self_attn.q_norm.weight"] == ((16,), (16,)), shards  # replicated
    assert len({s.device for s in runner.buffers[0].addressable_shards}) == 2
    rng = np.random.default_rng(4)
    shared = rng.integers(3, 256, size=40).tolist()
    first = [shared + rng.integers(3, 256, size=5).tolist(), rng.integers(3, 256, size=60).tolist()]
    later = [shared + rng.integers(3, 256, size=7).tolist()]
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    outs = llm.generate(first, params, use_tqdm=False)
    outs += llm.generate(later, params, use_tqdm=False)
    assert outs[2].num_cached_tokens == 40, [o.num_cached_tokens for o in outs]
    for p, o in zip(first + later, outs):
        assert o.outputs[0].token_ids == dense_greedy(model, p, 10), (len(p), p[:4])
    assert_no_block_leaks(llm)
