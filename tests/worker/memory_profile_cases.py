"""The memory profile of a worker whose model is split over a two-device mesh.

Not collected by a plain ``pytest`` run: ``test_memory_profile.py`` runs it in a subprocess
with two CPU host devices (``XLA_FLAGS=--xla_force_host_platform_device_count=2``).
"""

from __future__ import annotations

import jax
import pytest
from flax import nnx

from jaxkv.models import build_model, get_config
from jaxkv.models.sharding import make_tp_mesh
from jaxkv.worker.memory_profile import device_weight_bytes, profile_largest_programs
from jaxkv.worker.program_set import FORWARD, ProgramKey
from tests.engine.helpers import SMALL, make_llm

pytestmark = pytest.mark.skipif(jax.device_count() < 2, reason="needs 2 devices")

LIMITS = dict(max_num_seqs=8, max_num_batched_tokens=128, max_model_len=256)


def test_profile_on_a_mesh_equals_the_tp_engines_step():
    """A model initialised onto the mesh, profiled with the worker's own (half) KV heads:
    the per-device temp equals the tensor-parallel engine's compiled step's."""
    mesh = make_tp_mesh(2)
    model = build_model(get_config("tiny-llama", **SMALL), seed=0, mesh=mesh)
    llm = make_llm(
        model,
        tensor_parallel_size=2,
        kv_cache_memory_bytes=8 << 20,
        attention_backend="xla",
        **LIMITS,
    )
    runner = llm.llm_engine.runner
    specs = {n: g.kv_cache_spec for g in runner.config.kv_cache_groups for n in g.layer_names}
    assert {s.num_kv_heads for s in specs.values()} == {1}  # 2 KV heads over 2 devices
    step = profile_largest_programs(
        model,
        specs,
        mesh=mesh,
        attention_backend="xla",
        eos_token_id=llm.llm_engine.input_processor.eos_token_id,
        **LIMITS,
    )[0]
    real = runner.programs.get(ProgramKey(FORWARD, runner.buckets.tokens[-1])).memory_analysis()
    assert step.program == "forward[128]" and step.temp_bytes == real.temp_size_in_bytes > 0


def test_device_weight_bytes_counts_own_shards():
    """Split parameters count half per device, replicated ones (norms) whole."""
    config = get_config("tiny-llama", **SMALL)
    one = nnx.state(build_model(config, seed=0))
    two = nnx.state(build_model(config, seed=0, mesh=make_tp_mesh(2)))
    total = sum(x.nbytes for x in jax.tree_util.tree_leaves(one))
    norms = sum(x.nbytes for x in jax.tree_util.tree_leaves(one) if x.ndim == 1)
    assert device_weight_bytes(two) == (total - norms) // 2 + norms
