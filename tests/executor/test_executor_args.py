"""vLLM's executor and multi-node arguments of ``LLM(...)`` / ``resolve_engine_config``: each
bad combination a ValueError / TypeError naming the argument, before anything loads or starts.
(The flags of ``jaxkv generate`` that set them: tests/test_cli.py.)"""

from __future__ import annotations

import types

import pytest

from jaxkv.engine_config import check_executor_args, resolve_engine_config

GOOD = dict(
    nnodes=2,
    node_rank=0,
    master_addr="127.0.0.1",
    master_port=29500,
    headless=False,
    tensor_parallel_size=2,
)


@pytest.mark.parametrize(
    "backend, changes, error, message",
    [
        (
            "ray",
            {},
            ValueError,
            "distributed_executor_backend must be one of ('uni', 'mp'), got 'ray'",
        ),
        ("mp", dict(nnodes="2"), TypeError, "nnodes must be an int, got '2'"),
        ("mp", dict(headless=1), TypeError, "headless must be"),
        (
            "mp",
            dict(node_rank=2, headless=True),
            ValueError,
            "node_rank must be in [0, nnodes): got node_rank=2, nnodes=2",
        ),
        (
            "mp",
            dict(master_port=0),
            ValueError,
            "nnodes > 1 needs an explicit master_port below 65535",
        ),
        ("mp", dict(master_port=65535), ValueError, "got 65535"),
        (
            "mp",
            dict(master_addr=""),
            TypeError,
            "master_addr must be a host name or address, got ''",
        ),
        (
            "mp",
            dict(tensor_parallel_size=3),
            ValueError,
            "tensor_parallel_size=3 must divide evenly over nnodes=2",
        ),
        (
            "mp",
            dict(devices_per_worker=2),
            ValueError,
            "must divide evenly over nnodes=2 x devices_per_worker=2",
        ),
        ("mp", dict(devices_per_worker=0), ValueError, "devices_per_worker=0: must be >= 1"),
        (
            "uni",
            dict(nnodes=1, devices_per_worker=2),
            ValueError,
            "and 1 unless distributed_executor_backend='mp'",
        ),
        ("mp", dict(node_rank=1), ValueError, "node_rank=1 runs only this node's workers"),
        ("mp", dict(headless=True), ValueError, "headless is for the nodes that only run workers"),
        ("uni", {}, ValueError, "nnodes=2 / headless=False need distributed_executor_backend='mp'"),
        ("mp", dict(node_rank=1, headless=True), ValueError, "headless=True builds no engine"),
    ],
)
def test_bad_executor_arguments_name_the_argument(backend, changes, error, message):
    with pytest.raises(error) as info:
        check_executor_args(backend, "tiny-llama", **{**GOOD, **changes})
    assert message in str(info.value)


def test_a_headless_node_is_checked_without_an_engine():
    """What ``jaxkv generate --headless`` checks (engine=False): a node-1 launcher is fine."""
    check_executor_args("mp", None, **{**GOOD, "node_rank": 1, "headless": True}, engine=False)
    check_executor_args("mp", "tiny-llama", **GOOD)


def test_llm_arguments_are_checked_before_anything_loads():
    with pytest.raises(ValueError, match="headless=True builds no engine"):
        resolve_engine_config(
            "tiny-llama",
            distributed_executor_backend="mp",
            nnodes=2,
            node_rank=1,
            headless=True,
            master_port=1234,
            tensor_parallel_size=2,
            warmup=False,
        )
    with pytest.raises(ValueError, match="loads the model in each worker process"):
        built = types.SimpleNamespace(config=None, kv_layer_infos=dict)  # what an NNX model shows
        resolve_engine_config(built, distributed_executor_backend="mp", warmup=False)
