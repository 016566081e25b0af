"""The temp term of a worker's KV budget on an H200 executable, deviceless (jaxkv.gpu_aot).

``Worker.determine_available_memory`` subtracts the temp memory of the largest step only
(``memory_profile.profile_largest_steps``: the top token and request buckets with prefill):
on the GPU executable that step's temp must bound the other steps'. Measured here (tiny-llama,
4 requests, 64 tokens): 1150504 bytes for (64 tokens, 4 rows), 1148952 for (64, 1),
305960 for the decode step (4, 4).
"""

from __future__ import annotations

import pytest

from tests.gpu_aot.helpers import compile_step, pallas_runner

pytestmark = pytest.mark.gpu_aot


@pytest.mark.slow
@pytest.mark.gpu_aot_full   # 3 compiles: 39 s at load 13 here, over the main leg's per-test budget
def test_largest_step_temp_bounds_the_others_on_h200(h200):
    runner = pallas_runner("tiny-llama")   # 4 requests, 64 tokens a step
    T, S = runner.token_buckets[-1], runner.seq_buckets[-1]
    largest = compile_step(runner, h200, T, S, T).memory_analysis().temp_size_in_bytes
    for t, s, q in ((T, 1, T), (S, S, 1)):   # the closest one (fewer rows) and decode
        temp = compile_step(runner, h200, t, s, q).memory_analysis().temp_size_in_bytes
        assert 0 < temp <= largest, (t, s, q, temp, largest)
