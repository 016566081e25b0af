"""The engine core in its own process (vLLM V1's ``EngineCoreProc``).

::

    front end (AsyncLLM)                          engine-core process (EngineCoreProc)
      input  PUSH --- ADD / ABORT / SHUTDOWN --->  PULL: add and abort requests
      output PULL <--- OUTPUTS (every step) -----  PUSH: step while there is work
      process sentinel: a dead core is an error, never a hang

The front end (``core_client.EngineCoreClient``) starts ``python -m jaxkv.engine.core_proc``,
which connects to its two sockets, builds the engine (loads the model, plans the KV cache,
warms up) and answers READY with the resolved ``EngineConfig``, the model config and the
tokenizer, so the front end needs no weights.

The busy loop (``EngineCoreProc.run``): block on the input socket while idle (checking every
second that the parent still lives), drain every queued message, step while the scheduler has
work, push each step's outputs with the scheduler's stats. A step that raises is undone by
``EngineCore.recover`` and reported as ``failed`` ids with the error, the core keeps serving.
The messages are ``codec``'s.
"""

from __future__ import annotations

import os
import pickle
import signal
import sys
import traceback

import zmq

from jaxkv.engine.codec import CoreOutputs, CoreStats, MsgType, encode_core_outputs

#: How long the core blocks on its input while idle before checking that its parent lives (ms).
IDLE_POLL_MS = 1000


def _stats_of(core) -> CoreStats:
    st = core.make_stats()
    totals = core.scheduler.prefix_cache_metrics
    sched = core.scheduler
    kv = sched.kv_connector_stats
    return CoreStats(
        num_running_reqs=st.num_running_reqs,
        num_waiting_reqs=st.num_waiting_reqs,
        kv_cache_usage=float(st.kv_cache_usage),
        prefix_cache_queries=totals.total_queries,
        prefix_cache_hits=totals.total_hits,
        prefix_cache_hit_rate=float(st.prefix_cache_hit_rate),
        num_preemptions=st.num_preemptions,
        kv_transfer_bytes=int(kv.get("bytes_pulled", kv.get("bytes_loaded", 0))),
        kv_transfer_seconds=float(kv.get("pull_seconds", kv.get("load_seconds", 0.0))),
        kv_external_tokens=sched.num_external_computed_tokens,
        kv_failed_loads=sched.num_failed_kv_loads,
        num_compiles=getattr(core, "num_compiles", 0),
    )


def run_engine_core(
    model: str, engine_kwargs: dict, input_addr: str, output_addr: str, parent_pid: int
) -> None:
    """The core process's entry point: build the engine, answer READY, run the busy loop."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the front end's to handle
    ctx = zmq.Context()
    inp = ctx.socket(zmq.PULL)
    inp.connect(input_addr)
    out = ctx.socket(zmq.PUSH)
    out.connect(output_addr)
    out.setsockopt(zmq.LINGER, 2000)
    try:
        try:
            core = _build_core(model, engine_kwargs, out)
        except BaseException as exc:  # noqa: BLE001 - reported to the front end, which raises it
            message = f"{type(exc).__name__}: {exc}"
            out.send_multipart([MsgType.STARTUP_FAILED.value, pickle.dumps(message)])
            return
        try:
            EngineCoreProc(core, inp, out, parent_pid).run()
        finally:
            core.shutdown()
    finally:
        inp.close(linger=0)
        out.close()
        ctx.term()


def _build_core(model, engine_kwargs, out):
    from jaxkv.engine.core import EngineCore
    from jaxkv.engine_config import resolve_engine_config
    from jaxkv.executor import Executor

    loaded, model_config, tokenizer, config = resolve_engine_config(model, **engine_kwargs)
    core = EngineCore(config, Executor.get_class(config), loaded)
    kv = core.kv_cache_config
    info = {"num_blocks": kv.num_blocks, "pid": os.getpid(), "num_compiles": core.num_compiles}
    out.send_multipart([MsgType.READY.value, pickle.dumps((config, model_config, tokenizer, info))])
    return core


class EngineCoreProc:
    """The core's busy loop: add / abort what arrives, step while there is work, push outputs."""

    def __init__(self, core, inp, out, parent_pid: int):
        self.core = core
        self.inp = inp
        self.out = out
        self.parent_pid = parent_pid
        self.async_scheduling = core.config.scheduler_config.async_scheduling
        self.live: set[str] = set()  # core ids added whose finish the front end has not been sent

    def run(self) -> None:
        while True:
            if os.getppid() != self.parent_pid:  # the front end died: nobody to serve (checked
                return  # busy too: a PUSH with no reader blocks at its HWM)
            if not self.core.has_unfinished_requests() and not self.inp.poll(IDLE_POLL_MS):
                if self.core.has_pending_kv_transfers():  # finished requests' KV still being
                    self._step()  # sent: poll their sends
                continue
            failed, error, stopping = self._drain_input()
            if failed:
                self._send(CoreOutputs([], failed=failed, error=error, stats=_stats_of(self.core)))
            if stopping:
                return
            if self.core.has_unfinished_requests():
                self._step()
            elif not failed:  # aborts made it idle: report the freed blocks
                self._send(CoreOutputs([], stats=_stats_of(self.core)))

    def _drain_input(self) -> tuple[list[str], str | None, bool]:
        failed: list[str] = []
        error = None
        while True:
            try:
                kind, payload = self.inp.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return failed, error, False
            kind = MsgType(kind)
            if kind == MsgType.SHUTDOWN:
                return failed, error, True
            if kind == MsgType.ADD:
                requests = pickle.loads(payload)
                try:
                    self.core.add_requests(requests)
                    self.live.update(r.request_id for r in requests)
                except Exception as exc:  # noqa: BLE001 - refused: the front end fails the request
                    failed += [r.request_id for r in requests]
                    error = f"{type(exc).__name__}: {exc}"
            elif kind == MsgType.ABORT:
                ids, status = pickle.loads(payload)
                self.core.finish_requests(ids, status)
                self.live.difference_update(ids)

    def _step(self) -> None:
        core = self.core
        try:
            outputs, so = core.step()
            if self.async_scheduling:
                outputs += core.finish_in_flight_if_idle()
        except Exception as exc:  # noqa: BLE001 - undone here; the front end fails the requests
            self._recover(exc)
            return
        for o in outputs:
            if o.finish_reason is not None:
                self.live.discard(o.request_id)
        self._send(
            CoreOutputs(
                outputs=outputs,
                scheduled=list(so.num_scheduled_tokens),
                schedule_time=core.last_schedule_time,
                stats=_stats_of(core),
            )
        )

    def _recover(self, exc: Exception) -> None:
        from jaxkv.core.errors import culprit_of

        culprit = culprit_of(exc)
        kv_lost, _ = self.core.recover(culprit, lambda: [])
        # Every request the front end waits for that the core no longer has: the failed
        # step's, and any that finished without their output being sent.
        lost = sorted(rid for rid in self.live if not self.core.has_request(rid))
        self.live.difference_update(lost)
        where = f" while handling request {culprit!r}" if culprit is not None else ""
        error = f"engine step failed{where} ({type(exc).__name__}: {exc})" + (
            "; the KV cache was lost and the other running requests are recomputed"
            if kv_lost
            else ""
        )
        traceback.print_exception(exc)
        self._send(CoreOutputs([], failed=lost, error=error, stats=_stats_of(self.core)))

    def _send(self, msg: CoreOutputs) -> None:
        self.out.send_multipart([MsgType.OUTPUTS.value, encode_core_outputs(msg)], copy=False)


if __name__ == "__main__":  # the engine-core process (EngineCoreClient starts it)
    run_engine_core(*pickle.loads(sys.stdin.buffer.read()))
