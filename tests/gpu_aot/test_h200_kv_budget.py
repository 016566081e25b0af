"""The temp term of a worker's KV budget on an H200 executable, deviceless (jaxkv.gpu_aot).

``Worker.determine_available_memory`` subtracts the temp memory of the largest program of
each kind only (``memory_profile.largest_program_keys``: the forward of the top token bucket):
on the GPU executable that forward's temp must bound the smaller forwards'.
"""

from __future__ import annotations

import pytest

from tests.gpu_aot.helpers import compile_forward, pallas_runner

pytestmark = pytest.mark.gpu_aot


@pytest.mark.slow
@pytest.mark.gpu_aot_full  # 3 compiles, over the main leg's per-test budget
def test_largest_forward_temp_bounds_the_others_on_h200(h200):
    runner = pallas_runner("tiny-llama")  # 4 requests, 64 tokens a step
    tokens = runner.buckets.tokens
    largest = compile_forward(runner, h200, tokens[-1]).memory_analysis().temp_size_in_bytes
    for t in (tokens[-2], runner.max_num_seqs):  # the next bucket down and a decode of every row
        temp = compile_forward(runner, h200, t).memory_analysis().temp_size_in_bytes
        assert 0 < temp <= largest, (t, temp, largest)
