"""The KV connectors' page gather / scatter (jaxkv.worker.kv_connector.PagedKVCaches) on an H200,
deviceless: a scatter of pulled pages updates the cache in place (donated and aliased, temp
memory independent of the cache's size), and a gather copies only the pages it reads."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from jaxkv import gpu_aot
from jaxkv.worker.kv_connector import PagedKVCaches, pages_bucket
from tests.gpu_aot.helpers import pallas_runner

pytestmark = pytest.mark.gpu_aot


@pytest.mark.parametrize("family", ["tiny-llama", "tiny-hybrid"])
def test_page_scatter_in_place_and_gather_small_on_h200(h200, family):
    writes, reads = [], []
    for mib in (16, 64):
        runner = pallas_runner(family, kv_cache_memory_bytes=mib << 20, kv_cache_dtype="bfloat16")
        kv = PagedKVCaches(runner)
        cache = sum(b.nbytes for b in runner.buffers)
        k = 8
        ids = np.arange(1, k + 1, dtype=np.int32)
        pages = tuple(jax.ShapeDtypeStruct(kv.page_shape(k), np.uint8) for _ in runner.buffers)
        w = gpu_aot.aot_compile(
            jax.jit(kv.write_fn, donate_argnums=0), h200, runner.buffers, ids, pages
        ).memory_analysis()
        assert w.alias_size_in_bytes >= cache, (
            w.alias_size_in_bytes,
            cache,
        )  # in place, not copied
        writes.append(w.temp_size_in_bytes)
        r = gpu_aot.aot_compile(jax.jit(kv.read_fn), h200, runner.buffers, ids).memory_analysis()
        moved = len(runner.buffers) * pages_bucket(k) * kv.page_bytes
        assert (
            moved <= r.output_size_in_bytes <= moved + 256 and r.temp_size_in_bytes <= moved
        )  # + a tuple table
        reads.append(r.temp_size_in_bytes)
    assert writes[0] == writes[1] and reads[0] == reads[1], (
        writes,
        reads,
    )  # no term in the cache size
