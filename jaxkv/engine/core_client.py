"""The front end's client of the engine-core process (vLLM V1's ``EngineCoreClient``).

The front end binds two ``ipc://`` sockets in a private temporary directory (nothing listens
on the network) and spawns the core (``core_proc``: ``EngineCoreProc``), which connects,
builds the engine and answers READY; then requests go in on one socket and each step's
``CoreOutputs`` come back on the other (the message format: ``codec``). A dead core process
is an error (``EngineDeadError``), never a hang.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import pickle
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import zmq

from jaxkv.core import RequestStatus
from jaxkv.engine.codec import CoreOutputs, CoreStats, MsgType, decode_core_outputs
from jaxkv.engine.core_proc import IDLE_POLL_MS, EngineCoreProc, run_engine_core

__all__ = [
    "IDLE_POLL_MS",
    "CoreOutputs",
    "CoreStats",
    "EngineCoreClient",
    "EngineCoreProc",
    "EngineDeadError",
    "MsgType",
    "run_engine_core",
    "wait_for_exit",
]


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
        return decode_core_outputs(payload.buffer)

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
    """Starts ``python -m jaxkv.engine.core_proc`` (a fresh interpreter: no fork of a process
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
        [sys.executable, "-m", "jaxkv.engine.core_proc"], stdin=subprocess.PIPE, env=env
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
