"""The test of record for the forward program: the KV cache is updated in place, never copied.

From ``compiled.memory_analysis()``: the buffers are aliased to the outputs, and the temporary
memory does not grow with the cache (it is activations and gathered pages, not a cache copy).
"""

import pytest

from jaxkv.worker.program_set import FORWARD, ProgramKey
from tests.engine.helpers import make_llm, small_model


def _compiled_memory(runner, *, size):
    T = runner.buckets.tokens[0] if size == "decode" else runner.buckets.tokens[-1]
    return runner.programs.get(ProgramKey(FORWARD, T)).memory_analysis()


@pytest.mark.parametrize("family", ["tiny-llama", "tiny-hybrid"])
@pytest.mark.parametrize("size", ["decode", "mixed"])  # the smallest and the largest forward
def test_step_updates_cache_in_place(family, size):
    model = small_model(family)
    temps = []
    for mib in (16, 64):
        llm = make_llm(model, kv_cache_memory_bytes=mib << 20, max_model_len=256)
        runner = llm.llm_engine.runner
        cache = sum(b.nbytes for b in runner.buffers)
        ma = _compiled_memory(runner, size=size)
        assert ma.alias_size_in_bytes >= cache  # buffers (and tables) donated and aliased
        temps.append(ma.temp_size_in_bytes)
        assert ma.temp_size_in_bytes < 0.25 * cache or mib == 16
    # Temp memory is independent of the cache size: 4x the cache, same temp (no copy).
    assert abs(temps[1] - temps[0]) < 0.02 * (64 << 20), temps
