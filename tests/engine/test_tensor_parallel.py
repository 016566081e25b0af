"""Tensor parallelism: the partition rules here, the engine on two host devices in a subprocess.

jax fixes its device count when it starts, and this suite runs on one CPU device; the engine
cases (``tp_cases.py``) therefore run in a fresh interpreter with
``XLA_FLAGS=--xla_force_host_platform_device_count=2``.
"""

from __future__ import annotations

import pytest
from jax.sharding import PartitionSpec as P

from jaxkv.models.sharding import DEFAULT_TP_RULES, TP_AXIS, partition_spec
from tests.two_host_devices import run_cases_on_two_host_devices


@pytest.mark.parametrize(
    "name, ndim, spec",
    [
        ("model.layers.0.self_attn.q_proj.kernel", 2, P(None, TP_AXIS)),
        ("model.layers.7.self_attn.k_proj.bias", 1, P(TP_AXIS)),
        ("model.layers.3.self_attn.o_proj.kernel", 2, P(TP_AXIS, None)),
        ("model.layers.3.self_attn.o_proj.bias", 1, P()),
        ("model.layers.1.mlp.gate_proj.kernel", 2, P(None, TP_AXIS)),
        ("model.layers.1.mlp.up_proj.kernel", 2, P(None, TP_AXIS)),
        ("model.layers.1.mlp.down_proj.kernel", 2, P(TP_AXIS, None)),
        ("model.layers.1.self_attn.q_norm.weight", 1, P()),
        ("model.embed_tokens.embedding", 2, P(TP_AXIS, None)),
        ("lm_head.weight", 2, P(TP_AXIS, None)),
        ("lm_head.kernel", 2, P()),
        (
            "model.layers.0.self_attn.my_q_proj_extra.kernel",
            2,
            P(),
        ),  # a name that only contains one
    ],
)
def test_default_rules(name, ndim, spec):
    assert partition_spec(name, ndim, DEFAULT_TP_RULES) == spec


def test_rule_of_the_wrong_rank_is_refused():
    with pytest.raises(ValueError, match="gives .* which has 1 axes"):
        partition_spec("x.q_proj.kernel", 1)
    assert partition_spec("a.b", 3, ((r"\.b$", (None, TP_AXIS, None)),)) == P(None, TP_AXIS, None)


def test_engine_on_two_host_devices():
    """Runs tests/engine/tp_cases.py on two CPU devices; every case must pass, none skip."""
    run_cases_on_two_host_devices("tests/engine/tp_cases.py")
