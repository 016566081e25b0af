"""PagedKVCaches on CPU: a scatter of loaded pages updates the cache in place (the buffers are
donated and aliased; temp memory does not grow with the cache), a gather then a scatter of the
same pages round-trips the bytes, and padding ids (-1) write nothing."""

from __future__ import annotations

import jax
import numpy as np

from jaxkv.worker.kv_connector import PagedKVCaches
from tests.engine.helpers import make_llm, small_model


def test_scatter_in_place_and_round_trip():
    temps = []
    for mib in (8, 32):
        runner = make_llm(
            small_model("tiny-hybrid"), kv_cache_memory_bytes=mib << 20
        ).llm_engine.runner
        kv = PagedKVCaches(runner)
        cache = sum(b.nbytes for b in runner.buffers)
        ids = runner.placement.to_device(np.arange(1, 9, dtype=np.int32))
        pages = tuple(jax.ShapeDtypeStruct(kv.page_shape(8), np.uint8) for _ in runner.buffers)
        ma = kv._write.lower(runner.buffers, ids, pages).compile().memory_analysis()
        assert ma.alias_size_in_bytes >= cache
        temps.append(ma.temp_size_in_bytes)
    assert temps[0] == temps[1] and temps[0] < cache // 4, temps

    rng = np.random.default_rng(0)
    data = tuple(
        jax.numpy.asarray(rng.integers(0, 256, kv.page_shape(3), dtype=np.uint8))
        for _ in runner.buffers
    )
    before = [np.asarray(b).copy() for b in runner.buffers]
    kv.write_pages([5, -1, 7], data)  # the middle row is padding: dropped
    got = kv.read_pages([5, 7, 6])
    for t in range(len(data)):
        assert np.array_equal(np.asarray(got[t])[0], np.asarray(data[t])[0])
        assert np.array_equal(np.asarray(got[t])[1], np.asarray(data[t])[2])
        page = kv.page_bytes
        assert np.array_equal(
            np.asarray(got[t])[2], before[t][6 * page : 7 * page]
        )  # block 6 untouched
        after = np.asarray(runner.buffers[t])
        untouched = np.ones(after.size, bool)
        untouched[5 * page : 6 * page] = untouched[7 * page : 8 * page] = False
        assert np.array_equal(after[untouched], before[t][untouched])
