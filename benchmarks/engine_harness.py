"""Driving a jaxkv engine for the benchmarks: build, per-step timing, timed runs, decode steps.

Per-step timing wraps the engine's own methods on the *instance* (no engine code is edited, and
``LLMEngine.step`` is the code being measured):

  step      wall time of ``engine.step()``
  schedule  ``scheduler.schedule()``
  execute   ``runner.dispatch()`` + ``runner.collect()``; inside them ``device`` = the calls
            of the compiled programs (``runner._run``: forward, sampler, ...; their inputs'
            host->device transfers are in ``runner._to_device``, counted too) + the wait for the
            results (``runner._fetch``: the device->host transfer); the rest is input
            preparation and unpacking
  update    ``scheduler.update_from_output()``
  host%     (step - device) / step

A step during which the runner compiled a program is flagged (after the default warm-up there
should be none: ``compiles`` in the tables).
"""

from __future__ import annotations

import dataclasses
import statistics
import time

import numpy as np

from jaxkv.engine import LLMEngine
from jaxkv.sampling_params import RequestOutputKind, SamplingParams


@dataclasses.dataclass
class StepRecord:
    step_s: float
    schedule_s: float
    execute_s: float
    update_s: float
    device_s: float
    num_reqs: int
    num_tokens: int
    compiled: bool

    @property
    def decode_only(self) -> bool:
        return self.num_reqs > 0 and self.num_tokens == self.num_reqs


class StepTimer:
    """Installs timing wrappers on one engine's scheduler and runner instances."""

    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self.records: list[StepRecord] = []
        self._cur: dict = {}
        sched, runner = engine.scheduler, engine.runner
        sched.schedule = self._timed(sched.schedule, "schedule_s")
        sched.update_from_output = self._timed(sched.update_from_output, "update_s")
        runner.dispatch = self._timed(runner.dispatch, "execute_s")
        runner.collect = self._timed(runner.collect, "execute_s")
        self._runner = runner
        for name in ("_run", "_to_device", "_fetch"):
            setattr(runner, name, self._device_timed(getattr(runner, name)))

    def _device_timed(self, fn):
        def wrapper(*args):
            t0 = time.perf_counter()
            out = fn(*args)
            self._cur["device_s"] = self._cur.get("device_s", 0.0) + time.perf_counter() - t0
            return out

        return wrapper

    def _timed(self, fn, key):
        def wrapper(*args, **kwargs):
            t0 = time.perf_counter()
            out = fn(*args, **kwargs)
            self._cur[key] = self._cur.get(key, 0.0) + time.perf_counter() - t0
            if key == "schedule_s":
                self._cur["num_reqs"] = len(out.num_scheduled_tokens)
                self._cur["num_tokens"] = out.total_num_scheduled_tokens
            return out

        return wrapper

    def step(self):
        self._cur = {}
        compiles, t0 = self._runner.num_compiles, time.perf_counter()
        outs = self.engine.step()
        c = self._cur
        self.records.append(
            StepRecord(
                step_s=time.perf_counter() - t0,
                schedule_s=c.get("schedule_s", 0.0),
                execute_s=c.get("execute_s", 0.0),
                update_s=c.get("update_s", 0.0),
                device_s=c.get("device_s", 0.0),
                num_reqs=c.get("num_reqs", 0),
                num_tokens=c.get("num_tokens", 0),
                compiled=self._runner.num_compiles != compiles,
            )
        )
        return outs


def build_engine(model, tokenizer, **kwargs) -> tuple[LLMEngine, StepTimer]:
    kwargs.setdefault("warmup", False)  # the caller warms up and times it separately
    engine = LLMEngine.from_config(model, tokenizer=tokenizer, **kwargs)
    return engine, StepTimer(engine)


def greedy(max_tokens: int) -> SamplingParams:
    # FINAL_ONLY: the harness reads finished outputs only, as LLM.generate does
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=0.0,
        ignore_eos=True,
        output_kind=RequestOutputKind.FINAL_ONLY,
    )


def _drain(engine: LLMEngine, timer: StepTimer, prompts, max_tokens) -> dict:
    ids = []
    for p, m in zip(prompts, max_tokens):
        rid = engine.next_request_id()
        engine.add_request(rid, p, greedy(m))
        ids.append(rid)
    done = {}
    while len(done) < len(ids):
        for out in timer.step():
            if out.finished:
                done[out.request_id] = out
        if not engine.has_unfinished_requests() and len(done) < len(ids):
            raise RuntimeError("engine has no unfinished requests but outputs are missing")
    return {"outputs": [done[r] for r in ids]}


def _snapshot(engine: LLMEngine) -> dict:
    return dict(
        generated=engine.num_generated_tokens,
        scheduled=engine.num_prompt_tokens_computed,
        prefix_hit=engine.prefix_hit_tokens,
        preemptions=engine.scheduler.num_preemptions,
        compiles=engine.runner.num_compiles,
        compile_s=engine.runner.compile_seconds,
        draft=engine.runner.num_draft_tokens,
        accepted=engine.runner.num_accepted_tokens,
    )


def run_workload(
    engine: LLMEngine, timer: StepTimer, prompts, max_tokens, *, warm_pass: bool = True
) -> dict:
    """Untimed warm pass (same requests: same step shapes, so the timed pass compiles nothing),
    prefix cache reset, then the timed pass. All requests arrive at t0 (offline)."""
    warm = None
    if warm_pass:
        s0, t0 = _snapshot(engine), time.perf_counter()
        _drain(engine, timer, prompts, max_tokens)
        s1 = _snapshot(engine)
        warm = {
            "seconds": time.perf_counter() - t0,
            "compiles": s1["compiles"] - s0["compiles"],
            "compile_s": s1["compile_s"] - s0["compile_s"],
        }
        if not engine.scheduler.reset_prefix_cache():
            raise RuntimeError("could not reset the prefix cache after the warm pass")
    engine.peak_kv_cache_usage = 0.0
    timer.records.clear()
    s0 = _snapshot(engine)
    t0 = time.perf_counter()
    res = _drain(engine, timer, prompts, max_tokens)
    elapsed = time.perf_counter() - t0
    s1 = _snapshot(engine)
    outs = res["outputs"]
    ttft, tpot = [], []
    for o in outs:
        m = o.metrics
        ttft.append(m.time_to_first_token)
        n = len(o.outputs[0].token_ids)
        tpot.append(m.decode_time / (n - 1) if n > 1 and m.decode_time is not None else None)
    delta = {k: s1[k] - s0[k] for k in s0}
    return {
        "elapsed_s": elapsed,
        "tokens": [o.outputs[0].token_ids for o in outs],
        "cached_tokens": [o.num_cached_tokens for o in outs],
        "ttft_s": ttft,
        "tpot_s": tpot,
        "records": list(timer.records),
        "generated_tokens": delta["generated"],
        "scheduled_tokens": delta["scheduled"],
        "prefix_hit_tokens": delta["prefix_hit"],
        "preemptions": delta["preemptions"],
        "compiles": delta["compiles"],
        "compile_s": delta["compile_s"],
        "spec_draft_tokens": delta["draft"],
        "spec_accepted_tokens": delta["accepted"],
        "peak_kv_usage": engine.peak_kv_cache_usage,
        "warm_pass": warm,
    }


def host_breakdown(records: list[StepRecord], *, batch: int | None = None) -> dict:
    """Sums over non-compiling steps (decode-only steps at ``batch`` requests when given)."""
    rs = [r for r in records if not r.compiled and r.num_reqs > 0]
    if batch is not None:
        rs = [r for r in rs if r.decode_only and r.num_reqs == batch]
    if not rs:
        return {"steps": 0}
    step = sum(r.step_s for r in rs)
    dev = sum(r.device_s for r in rs)
    prep = sum(r.execute_s - r.device_s for r in rs)
    return {
        "steps": len(rs),
        "step_ms_median": 1e3 * statistics.median(r.step_s for r in rs),
        "host_pct": 100.0 * (step - dev) / step,
        "schedule_pct": 100.0 * sum(r.schedule_s for r in rs) / step,
        "prepare_pct": 100.0 * prep / step,
        "update_pct": 100.0 * sum(r.update_s for r in rs) / step,
        "device_pct": 100.0 * dev / step,
    }


def decode_step_times(
    engine: LLMEngine, timer: StepTimer, prompts: list[list[int]], steps: int, max_tokens: int
) -> dict:
    """Median time of ``steps`` pure-decode steps with every request of ``prompts`` running
    (steps that compiled are skipped); the requests are aborted once measured."""
    timer.records.clear()
    ids = []
    for p in prompts:
        rid = engine.next_request_id()
        engine.add_request(rid, p, greedy(max_tokens))
        ids.append(rid)
    good, live = [], set(ids)
    while engine.has_unfinished_requests() and len(good) < steps:
        live -= {o.request_id for o in timer.step() if o.finished}
        r = timer.records[-1]
        if r.decode_only and r.num_reqs == len(prompts) and not r.compiled:
            good.append(r)
    if live:
        engine.abort_request(sorted(live))
        while engine.has_unfinished_requests():  # lets the runner forget the aborted rows
            timer.step()
    if not good:
        return {"steps": 0, "step_ms_median": None}
    return {
        "steps": len(good),
        "step_ms_median": 1e3 * statistics.median(r.step_s for r in good),
        "step_ms_min": 1e3 * min(r.step_s for r in good),
        "device_ms_median": 1e3 * statistics.median(r.device_s for r in good),
        "compiled_steps": sum(r.compiled for r in timer.records),
    }


def seeded_tokens(rng: np.random.Generator, n: int, vocab: int) -> list[int]:
    """Random token ids avoiding the lowest ids (specials)."""
    return rng.integers(4, vocab, n).tolist()
