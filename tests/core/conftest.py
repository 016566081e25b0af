"""Fixtures for the host-core tests: small KV-cache configs and request factories."""

import pytest

from jaxkv.core import Request, get_hash_fn, get_request_block_hasher
from jaxkv.kv_cache import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, SlidingWindowSpec
from jaxkv.sampling_params import SamplingParams


def full_spec(block_size=16):
    return FullAttentionSpec(block_size=block_size, num_kv_heads=1, head_size=64, dtype="float32")


def sw_spec(block_size=16, sliding_window=32):
    return SlidingWindowSpec(
        block_size=block_size,
        num_kv_heads=1,
        head_size=64,
        dtype="float32",
        sliding_window=sliding_window,
    )


def make_config(num_blocks, *specs):
    """A KVCacheConfig with one group per spec (tensors are irrelevant to the host core)."""
    groups = [
        KVCacheGroupSpec((f"layer{i}",), spec) for i, spec in enumerate(specs or (full_spec(),))
    ]
    return KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=(), kv_cache_groups=groups)


def make_request(
    request_id, token_ids, block_size=16, *, hash_algo="sha256", hashed=True, **params
):
    """A request with a sha256 block hasher (``hashed=False``: let the scheduler attach one)."""
    kwargs = {
        k: params.pop(k)
        for k in ("eos_token_id", "priority", "arrival_time", "cache_salt")
        if k in params
    }
    hasher = get_request_block_hasher(block_size, get_hash_fn(hash_algo)) if hashed else None
    return Request(request_id, token_ids, SamplingParams(**params), block_hasher=hasher, **kwargs)


@pytest.fixture
def cfg():
    return make_config


@pytest.fixture
def req():
    return make_request


@pytest.fixture
def specs():
    return full_spec, sw_spec


def fake_model_runner_output(scheduler, scheduler_output, token_fn=lambda req_id, step: 7):
    """What a worker would return: one token per request that finished its prompt, else []."""
    sampled = {}
    for req_id in scheduler_output.num_scheduled_tokens:
        request = scheduler.requests[req_id]
        done = request.num_computed_tokens >= request.num_tokens
        sampled[req_id] = [token_fn(req_id, request.num_output_tokens)] if done else []
    from jaxkv.core import ModelRunnerOutput

    return ModelRunnerOutput.from_sampled(sampled)


@pytest.fixture
def step():
    """``step(scheduler, token_fn=...) -> (SchedulerOutput, list[EngineCoreOutput])``."""

    def run(scheduler, token_fn=lambda req_id, i: 7):
        out = scheduler.schedule()
        return out, scheduler.update_from_output(
            out, fake_model_runner_output(scheduler, out, token_fn)
        )

    return run
