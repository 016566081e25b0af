"""The test of record for the jitted step: the KV cache is updated in place, never copied.

From ``compiled.memory_analysis()``: the buffers are aliased to the outputs, and the temporary
memory does not grow with the cache (it is activations and gathered pages, not a cache copy).
"""

import jax.numpy as jnp
import pytest

from tests.engine.helpers import make_llm, small_model


def _compiled_memory(runner, *, max_q_len):
    S = runner.seq_buckets[0]
    T = runner.token_buckets[0] if max_q_len == 1 else runner.token_buckets[-1]
    shape, packed = runner._empty_step(T, S, max_q_len=max_q_len or T)
    compiled = runner._step.lower(runner.state, runner.buffers, runner.tables, runner.last_sampled,
                                  jnp.asarray(packed),
                                  shape=shape).compile()
    return compiled.memory_analysis()


@pytest.mark.parametrize("family", ["tiny-llama", "tiny-hybrid"])
@pytest.mark.parametrize("max_q_len", [1, None], ids=["decode", "mixed"])
def test_step_updates_cache_in_place(family, max_q_len):
    model = small_model(family)
    temps = []
    for mib in (16, 64):
        llm = make_llm(model, kv_cache_memory_bytes=mib << 20, max_model_len=256)
        runner = llm.llm_engine.runner
        cache = sum(b.nbytes for b in runner.buffers)
        ma = _compiled_memory(runner, max_q_len=max_q_len)
        assert ma.alias_size_in_bytes >= cache  # buffers (and tables) donated and aliased
        temps.append(ma.temp_size_in_bytes)
        assert ma.temp_size_in_bytes < 0.25 * cache or mib == 16
    # Temp memory is independent of the cache size: 4x the cache, same temp (no copy).
    assert abs(temps[1] - temps[0]) < 0.02 * (64 << 20), temps
