"""The engine compiles a small set of programs once: their number is a sum over the buckets,
warm-up compiles all of them, nothing compiles while the engine works, and a restart reads
them back from jax's persistent cache.

Compiles are counted twice: by the runner's program set (``late_compiles``) and by jax's own
monitoring events, which see every XLA compile of the process (a program outside the set, a
``jnp`` call on the host that compiles a small kernel, ...).
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import jax.monitoring
import pytest

from jaxkv.worker.program_set import num_programs
from jaxkv.worker.step_programs import buckets_for
from tests.engine import mixed_workload
from tests.engine.helpers import assert_no_block_leaks, make_llm, small_model

ROOT = pathlib.Path(__file__).resolve().parents[2]
GOLDEN = json.loads((pathlib.Path(__file__).parent / "golden_mixed_workload.json").read_text())
NGRAM = {
    "method": "ngram",
    "num_speculative_tokens": 3,
    "prompt_lookup_max": 3,
    "prompt_lookup_min": 1,
}


class CompileEvents:
    """XLA compiles of this process while it is active (jax.monitoring)."""

    def __init__(self):
        self.active = False
        self.count = 0
        jax.monitoring.register_event_duration_secs_listener(self._on)

    def _on(self, event, duration, **_):
        if self.active and event == "/jax/core/compile/backend_compile_duration":
            self.count += 1


_EVENTS = CompileEvents()


@pytest.fixture(scope="module")
def model():
    return small_model("tiny-llama")


@pytest.mark.parametrize(
    "limits, spec",
    [
        (dict(max_num_seqs=8, max_num_batched_tokens=64), None),
        (dict(max_num_seqs=6, max_num_batched_tokens=200), None),
        (dict(max_num_seqs=4, max_num_batched_tokens=64), NGRAM),
    ],
)
def test_the_program_count_is_the_documented_sum(limits, spec):
    """F token buckets, Q request buckets, V position buckets: 2 F + 2 Q + V + 3 programs."""
    b = buckets_for(
        max_num_seqs=limits["max_num_seqs"],
        max_num_batched_tokens=limits["max_num_batched_tokens"],
        num_speculative_tokens=3 if spec else 0,
    )
    if limits["max_num_seqs"] == 8:
        assert (
            b.tokens == (1, 2, 4, 8, 16, 24, 32, 48, 64) and b.seqs == (1, 2, 4, 8) and b.spec == ()
        )
    if spec:
        assert b.spec == (1, 2, 4, 8, 16)  # 4 rows x (1 + 3 drafts)
    want = 2 * len(b.tokens) + 2 * len(b.seqs) + len(b.spec) + 3
    assert (
        num_programs(
            num_token_buckets=len(b.tokens),
            num_seq_buckets=len(b.seqs),
            num_spec_buckets=len(b.spec),
        )
        == want
    )


@pytest.mark.parametrize("spec", [None, NGRAM], ids=["plain", "ngram"])
def test_warmup_compiles_exactly_the_set(model, spec):
    llm = make_llm(
        model, max_num_seqs=4, max_num_batched_tokens=64, warmup=True, speculative_config=spec
    )
    runner = llm.llm_engine.runner
    b = runner.buckets
    want = num_programs(
        num_token_buckets=len(b.tokens), num_seq_buckets=len(b.seqs), num_spec_buckets=len(b.spec)
    )
    stats = llm.llm_engine.get_stats()
    assert runner.num_compiles == len(runner.programs.keys) == want == stats.num_programs
    assert stats.num_compiles == want and stats.late_compiles == 0


@pytest.mark.slow
@pytest.mark.parametrize(
    "engine_kwargs",
    [dict(), dict(async_scheduling=True), dict(speculative_config=NGRAM)],
    ids=["sync", "async", "ngram"],
)
def test_mixed_workload_compiles_nothing_after_warmup(model, engine_kwargs):
    """After the default warm-up, a workload with every sampling option, n > 1, stop strings,
    prompt logprobs, pooling, chunked prefill, prefix hits, preemption and aborts compiles
    nothing; its tokens equal the engine's before the program rework (greedy and seeded; with
    n-gram drafts seeded rows draw differently, so greedy ones only)."""
    llm = make_llm(
        model,
        tokenizer=mixed_workload.CharTokenizer(),
        warmup=True,
        **mixed_workload.ENGINE,
        **engine_kwargs,
    )
    engine = llm.llm_engine
    _EVENTS.active, _EVENTS.count = True, 0
    try:
        got = mixed_workload.run(engine, mixed_workload.requests())
    finally:
        _EVENTS.active = False
    assert _EVENTS.count == 0 and engine.runner.programs.late_compiles == []
    assert engine.get_stats().num_preemptions > 0 and engine.get_stats().prefix_hit_tokens > 0
    assert_no_block_leaks(llm)
    compared = 0
    for req_id, want in GOLDEN.items():
        if req_id not in got:  # aborted at a different point of the run
            continue
        if engine_kwargs.get("speculative_config") and not _greedy(req_id):
            continue
        if req_id.startswith("pool"):
            assert got[req_id] == pytest.approx(want, abs=2e-4), req_id
        else:
            assert got[req_id] == want, req_id
        compared += 1
    assert compared >= 15


def _greedy(req_id: str) -> bool:
    kind = req_id.rsplit("-", 1)[0]
    return kind in (
        "greedy",
        "logprobs",
        "prompt_logprobs",
        "penalties",
        "logit_bias",
        "allowed",
        "bad_words",
        "min_tokens",
        "stop",
        "pool",
    )


_RESTART = """
import json, sys, jax.monitoring
counts = {"compiles": 0, "hits": 0}
def on_duration(event, duration, **_):
    counts["compiles"] += event == "/jax/core/compile/backend_compile_duration"
def on_event(event, **_):
    counts["hits"] += event == "/jax/compilation_cache/cache_hits"
jax.monitoring.register_event_duration_secs_listener(on_duration)
jax.monitoring.register_event_listener(on_event)
from jaxkv import LLM, SamplingParams
llm = LLM("tiny-llama", max_num_seqs=4, max_num_batched_tokens=64, max_model_len=128,
          kv_cache_memory_bytes=4 << 20)
out = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4, temperature=0), use_tqdm=False)
print(json.dumps(dict(counts, tokens=out[0].outputs[0].token_ids,
                      programs=llm.llm_engine.get_stats().num_programs)))
"""


@pytest.mark.slow
def test_a_second_process_reads_every_program_back(tmp_path):
    """Two processes with the same configuration and ``JAXKV_COMPILE_CACHE``: the first
    compiles; the second compiles nothing (every compile a persistent-cache hit)."""
    env = dict(os.environ, JAXKV_COMPILE_CACHE=str(tmp_path / "xla"), PYTHONPATH=str(ROOT))
    runs = []
    for _ in range(2):
        proc = subprocess.run(
            [sys.executable, "-c", _RESTART],
            capture_output=True,
            text=True,
            env=env,
            timeout=600,
            cwd=tmp_path,
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        runs.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    first, second = runs
    assert first["compiles"] > first["programs"] and first["hits"] == 0
    assert second["hits"] == second["compiles"] == first["compiles"]  # every one read back
    assert second["tokens"] == first["tokens"]
    assert any(p.name.endswith("-cache") for p in (tmp_path / "xla").iterdir())
