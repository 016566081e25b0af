"""The engine core in its own process (vLLM V1's ``EngineCoreProc``) and the front end's client.

::

    front end (AsyncLLM)                          engine-core process (EngineCoreProc)
      input  PUSH --- ADD / ABORT / SHUTDOWN --->  PULL: add and abort requests
      output PULL <--- OUTPUTS (every step) -----  PUSH: step while there is work
      process sentinel: a dead core is an error, never a hang

The front end binds two ``ipc://`` sockets in a private temporary directory (nothing listens
on the network) and spawns the core, which connects, builds the engine (loads the model,
plans the KV cache, warms up) and answers READY with the resolved ``EngineConfig``, the
model config and the tokenizer, so the front end needs no weights.

The busy loop (``EngineCoreProc.run``): block on the input socket while idle (checking every
second that the parent still lives), drain every queued message, step while the scheduler has
work, push each step's outputs with the scheduler's stats. A step that raises is undone by
``EngineCore.recover`` and reported as ``failed`` ids with the error, the core keeps serving.

Serialisation: each step's ``CoreOutputs`` (the hot path: one message per step holding every
running request's new tokens) use msgspec's typed msgpack; requests (once each) and the
start-up reply use pickle, as they carry arbitrary Python objects (the tokenizer, validated
SamplingParams). Measured on the 2-core dev VM, encode + decode of one step's 64 outputs:
msgspec 104 us (10.7 kB), pickle 260 us (5.2 kB); with 5 logprobs each 177 vs 426 us.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import os
import pickle
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import msgspec
import zmq

from jaxkv.core import EngineCoreOutput, RequestStatus

#: How long the core blocks on its input while idle before checking that its parent lives (ms).
IDLE_POLL_MS = 1000


class MsgType(bytes, enum.Enum):
    ADD = b"A"  # front -> core: pickle(list[Request]), one request's completions (all or none)
    ABORT = b"X"  # front -> core: pickle((list[str], RequestStatus))
    SHUTDOWN = b"S"  # front -> core
    READY = b"R"  # core -> front: pickle((EngineConfig, ModelConfig, tokenizer, info dict))
    STARTUP_FAILED = b"F"  # core -> front: pickle(str) the error
    OUTPUTS = b"O"  # core -> front: msgspec CoreOutputs


class CoreStats(msgspec.Struct, array_like=True):
    """The scheduler's state after a step (``SchedulerStats``, the prefix-cache interval as counts)."""

    num_running_reqs: int
    num_waiting_reqs: int
    kv_cache_usage: float
    prefix_cache_queries: int  # tokens looked up since start
    prefix_cache_hits: int  # tokens found since start
    prefix_cache_hit_rate: float  # over the recent requests (the scheduler's window)
    num_preemptions: int  # since start
    kv_transfer_bytes: int = 0  # KV connector: bytes loaded from another instance
    kv_transfer_seconds: float = 0.0  # ... and the seconds those loads took (start to data)
    kv_external_tokens: int = 0  # tokens computed elsewhere and loaded
    kv_failed_loads: int = 0  # loads that failed (their requests recomputed)
    num_compiles: int = 0  # programs compiled since start (warm-up included)


class CoreOutputs(msgspec.Struct, array_like=True):
    """One message from the core: a step's outputs, or a failure, with the scheduler's stats."""

    outputs: list[EngineCoreOutput]
    scheduled: list[str] = []  # core ids scheduled in the step
    schedule_time: float = 0.0  # time.perf_counter() of the schedule (CLOCK_MONOTONIC)
    stats: CoreStats | None = None
    failed: list[str] = []  # core ids aborted by a failed step or refused at add
    error: str | None = None  # why


def _enc_hook(obj):
    """numpy arrays (pooled hidden states) as msgpack extension 1: dtype, shape, bytes."""
    import numpy as np

    if isinstance(obj, np.ndarray):
        return msgspec.msgpack.Ext(1, pickle.dumps((obj.dtype.str, obj.shape, obj.tobytes())))
    raise NotImplementedError(f"cannot serialise {type(obj).__name__}")


def _ext_hook(code: int, data: memoryview):
    if code == 1:
        import numpy as np

        dtype, shape, raw = pickle.loads(data)
        return np.frombuffer(raw, dtype=dtype).reshape(shape).copy()
    raise NotImplementedError(f"unknown msgpack extension {code}")


_ENCODER = msgspec.msgpack.Encoder(enc_hook=_enc_hook)
_DECODER = msgspec.msgpack.Decoder(CoreOutputs, ext_hook=_ext_hook)


def _stats_of(core) -> CoreStats:
    st = core.make_stats()
    totals = core.scheduler.prefix_cache_metrics
    sched = core.scheduler
    kv = sched.kv_connector_stats
    return CoreStats(
        st.num_running_reqs,
        st.num_waiting_reqs,
        float(st.kv_cache_usage),
        totals.total_queries,
        totals.total_hits,
        float(st.prefix_cache_hit_rate),
        st.num_preemptions,
        int(kv.get("bytes_pulled", kv.get("bytes_loaded", 0))),
        float(kv.get("pull_seconds", kv.get("load_seconds", 0.0))),
        sched.num_external_computed_tokens,
        sched.num_failed_kv_loads,
        getattr(core, "num_compiles", 0),
    )


# ---- the engine-core process --------------------------------------------------------------------


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
                outputs, list(so.num_scheduled_tokens), core.last_schedule_time, _stats_of(core)
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
        self.out.send_multipart([MsgType.OUTPUTS.value, _ENCODER.encode(msg)], copy=False)


# ---- the front end's client -----------------------------------------------------------------------


class EngineDeadError(RuntimeError):
    """The engine-core process died (or stopped answering); the server answers 503."""


class EngineCoreClient:
    """Starts the engine-core process and talks to it (the front end's side).

    Args:
      model: a model name or path the core process loads.
      engine_kwargs: ``resolve_engine_config``'s keyword arguments.
      startup_timeout_s: longest wait for the core's READY (model load, KV plan, warm-up).

    Attributes (from the core's READY): ``config`` (EngineConfig), ``model_config``,
    ``tokenizer``, ``info`` (``num_blocks``, ``pid``).
    """

    def __init__(self, model: str, engine_kwargs: dict, *, startup_timeout_s: float = 600.0):
        if not isinstance(model, (str, os.PathLike)):
            raise TypeError(
                f"the engine-core process loads the model itself: pass a name or path, got {model!r}"
            )
        self._dir = tempfile.mkdtemp(prefix="jaxkv-core-")
        self.ctx = zmq.Context()
        self.input = self.ctx.socket(zmq.PUSH)
        self.output = self.ctx.socket(zmq.PULL)
        for sock in (self.input, self.output):
            sock.setsockopt(zmq.LINGER, 0)
        input_addr, output_addr = f"ipc://{self._dir}/input", f"ipc://{self._dir}/output"
        self.input.bind(input_addr)
        self.output.bind(output_addr)
        args = (os.fspath(model), engine_kwargs, input_addr, output_addr, os.getpid())
        self.dead: EngineDeadError | None = None
        self.proc = _spawn(args)
        try:
            self.config, self.model_config, self.tokenizer, self.info = self._wait_ready(
                startup_timeout_s
            )
        except BaseException:
            self.shutdown()
            raise

    def _wait_ready(self, timeout_s: float):
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.output.poll(100):
                kind, payload = self.output.recv_multipart()
                if kind == MsgType.READY.value:
                    return pickle.loads(payload)
                if kind == MsgType.STARTUP_FAILED.value:
                    raise ValueError(f"the engine core failed to start: {pickle.loads(payload)}")
                raise RuntimeError(f"unexpected message {kind!r} from the engine core before READY")
            if self.proc.poll() is not None:
                raise EngineDeadError(
                    f"the engine-core process exited during start-up (exit code "
                    f"{self.proc.returncode})"
                )
        raise EngineDeadError(f"the engine core was not ready after {timeout_s:.0f} s")

    # ---- requests (front end -> core) ----------------------------------------------------------

    def add_requests(self, requests: list) -> None:
        self._send(MsgType.ADD, pickle.dumps(requests, protocol=5))

    def abort_requests(
        self, request_ids: list[str], status: RequestStatus = RequestStatus.FINISHED_ABORTED
    ) -> None:
        if request_ids:
            self._send(MsgType.ABORT, pickle.dumps((list(request_ids), status), protocol=5))

    def _send(self, kind: MsgType, payload: bytes) -> None:
        if self.dead is not None:
            raise self.dead
        self.input.send_multipart([kind.value, payload], copy=False)

    # ---- outputs (core -> front end) -------------------------------------------------------------

    async def get_output(self, async_socket, timeout_s: float) -> CoreOutputs | None:
        """The next message, or None after ``timeout_s``; EngineDeadError once the core died."""
        self.check_alive()
        if not await async_socket.poll(int(timeout_s * 1000)):
            self.check_alive()
            return None
        kind, payload = await async_socket.recv_multipart(copy=False)
        if kind.bytes != MsgType.OUTPUTS.value:
            raise RuntimeError(f"unexpected message {kind.bytes!r} from the engine core")
        return _DECODER.decode(payload.buffer)

    def async_output_socket(self):
        """An asyncio view of the output socket (zmq.asyncio), for the output-reader task."""
        import zmq.asyncio

        return zmq.asyncio.Socket.from_socket(self.output)

    def check_alive(self) -> None:
        if self.dead is None and self.proc.poll() is not None:
            self.dead = EngineDeadError(
                f"the engine-core process died (exit code {self.proc.returncode})"
            )
        if self.dead is not None:
            raise self.dead

    def mark_dead(self, reason: str) -> EngineDeadError:
        """Declares the core dead (it stopped answering) and stops it."""
        if self.dead is None:
            self.dead = EngineDeadError(reason)
        with contextlib.suppress(Exception):
            self.proc.kill()
        return self.dead

    def shutdown(self, timeout_s: float = 5.0) -> None:
        """Asks the core to stop, then terminates / kills it; closes the sockets. Idempotent."""
        proc = self.proc
        if proc.poll() is None:
            with contextlib.suppress(Exception):
                self.input.send_multipart([MsgType.SHUTDOWN.value, b""], zmq.NOBLOCK)
            for stop in (None, proc.terminate, proc.kill):
                if stop is not None:
                    stop()
                try:
                    proc.wait(timeout_s if stop is None else 2.0)
                    break
                except subprocess.TimeoutExpired:
                    continue
        if self.dead is None:
            self.dead = EngineDeadError("the engine core was shut down")
        for sock in (self.input, self.output):
            sock.close(linger=0)
        self.ctx.term()
        shutil.rmtree(self._dir, ignore_errors=True)


def _spawn(args: tuple) -> subprocess.Popen:
    """Starts ``python -m jaxkv.engine.core_client`` (a fresh interpreter: no fork of a process
    that may run jax threads, and no re-import of the caller's ``__main__`` as multiprocessing's
    spawn does) and hands it ``args`` pickled on its stdin. The child imports the same jaxkv
    (its source root goes first on PYTHONPATH)."""
    import jaxkv

    root = str(Path(jaxkv.__file__).resolve().parents[1])
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [root] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    )
    proc = subprocess.Popen(
        [sys.executable, "-m", "jaxkv.engine.core_client"], stdin=subprocess.PIPE, env=env
    )
    try:
        proc.stdin.write(pickle.dumps(args))
        proc.stdin.close()
    except BaseException:
        proc.kill()
        proc.wait()
        raise
    return proc


async def wait_for_exit(proc: subprocess.Popen, loop: asyncio.AbstractEventLoop) -> None:
    """Returns when ``proc`` exits: its pidfd (the process sentinel) becomes readable."""
    fd = os.pidfd_open(proc.pid)
    done = loop.create_future()
    loop.add_reader(fd, lambda: done.done() or done.set_result(None))
    try:
        await done
    finally:
        loop.remove_reader(fd)
        os.close(fd)


if __name__ == "__main__":  # the engine-core process (EngineCoreClient starts it)
    run_engine_core(*pickle.loads(sys.stdin.buffer.read()))
