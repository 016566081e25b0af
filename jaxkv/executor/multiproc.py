"""MultiprocExecutor (vLLM's ``distributed_executor_backend="mp"``): one worker process per
JAX process of a ``jax.distributed`` job; the engine core stays in the calling process.

Layout::

    engine core (this process)                       worker processes (jaxkv.executor.worker_proc)
    MultiprocExecutor --- zmq ROUTER (control) ---> DEALER rank 0 (driver; jax coordinator)
        pickled calls, in order, to every rank      DEALER rank 1 ...   (this node or --headless nodes)
        <--- replies, heartbeats (hb-<rank>)        each: WorkerWrapperBase -> Worker -> ModelRunner

``tensor_parallel_size`` workers in all (one CPU host device or one GPU each), split evenly
over ``nnodes`` nodes: node ``k`` starts ranks ``k * local .. (k + 1) * local - 1``. Node 0 runs
the engine core and this executor; every other node runs ``jaxkv generate --headless ...`` or
``python -m jaxkv.executor.headless --headless ...`` (``jaxkv.executor.headless``), which
starts only its workers and waits. Every worker
joins the same ``jax.distributed`` job (coordinator in rank 0's process at
``master_addr:master_port``) and builds the same global ``"tp"`` mesh; the executor's control
socket is ``master_addr:master_port + 1``. With one node and ``master_port=0`` both ports are
free ones picked here.

Each step the ``SchedulerOutput`` goes to every worker (pickled once, sent to each); every
worker runs the same jitted step (SPMD over the mesh) and only the driver returns its
``ModelRunnerOutput`` (the others answer None, so the executor still sees every rank finish or
fail). Device data never crosses the control plane: collectives go through JAX (gloo on CPU).

Failures: every wait has a deadline (``startup_timeout_s``, ``execute_timeout_s``,
``rpc_timeout_s``); while waiting, the executor polls its own workers' processes and every
worker's heartbeat (``heartbeat_timeout_s``), so a dead worker is a ``WorkerDiedError`` naming
its rank and pid within about a second, and a silent one (remote, or a local one that is
stopped or holds the GIL: its heartbeat thread stops with it) within the heartbeat timeout; a
worker that waits with the GIL released (in a collective) is caught by the step's skew
deadline: ranks run the same SPMD step, so once one rank has answered a step (or raised in
it), the others must answer within ``collective_timeout_s`` (30 s: far above the skew of a
busy machine, far below ``execute_timeout_s``) or they are stuck in the step's collectives:
a ``WorkerTimeoutError`` naming them (and the rank that raised, if one did). A dead or hung
worker leaves the job unusable (the others may wait in a collective forever): the executor
then stops every process and refuses further calls. An exception every rank of a step
raises, or one raised by a rank whose peers finished, leaves the job usable. A worker's exception comes back
as the same exception type (when it pickles) with the worker's formatted traceback as a note.
``shutdown()``, and garbage collection of the executor (``weakref.finalize``), stop every
worker; a worker also ends itself when its parent or the executor's socket goes away.

Serialisation: pickle (protocol 5). msgspec would need typed schemas for every boundary object
(``SchedulerOutput`` holds ``SamplingParams``, sets, nested dataclasses; rpcs carry arbitrary
values and functions); ``benchmarks/executor_hop.py`` measures both on a batch-64 decode
``SchedulerOutput`` (see benchmarks/RESULTS.md, "The process hop").
"""

from __future__ import annotations

import itertools
import os
import pickle
import signal
import socket
import subprocess
import sys
import time
import weakref
from collections.abc import Callable
from typing import Any

import zmq

from jaxkv.core.outputs import merge_connector_stats
from jaxkv.executor.abstract import Executor
from jaxkv.executor.worker_proc import SpawnArgs


class WorkerDiedError(RuntimeError):
    """A worker process exited, or stopped sending heartbeats."""


class WorkerTimeoutError(TimeoutError):
    """A call was not answered within its deadline (a hung worker)."""


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def default_platform() -> str:
    """The workers' JAX platform: ``JAX_PLATFORMS`` if set, else cuda where an NVIDIA GPU is."""
    env = os.environ.get("JAX_PLATFORMS", "").split(",")[0]
    return env or ("cuda" if os.path.exists("/dev/nvidiactl") else "cpu")


def _worker_env() -> dict:
    """The spawner's environment, its import path made explicit (so the worker imports the
    same code), and no forced host-device count (the worker sets its own)."""
    env = dict(os.environ)
    paths = [os.path.abspath(p or os.getcwd()) for p in sys.path]
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(p for p in paths if os.path.isdir(p)))
    flags = [
        f for f in env.get("XLA_FLAGS", "").split() if "force_host_platform_device_count" not in f
    ]
    env["XLA_FLAGS"] = " ".join(flags)
    return env


def start_worker(args: SpawnArgs) -> subprocess.Popen:
    """Starts one worker process with ``args`` pickled on its stdin."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "jaxkv.executor.worker_proc"],
        stdin=subprocess.PIPE,
        env=_worker_env(),
        cwd=os.getcwd(),
    )
    proc.stdin.write(pickle.dumps(args))
    proc.stdin.close()
    return proc


def stop_processes(procs, grace_s: float = 3.0) -> None:
    """Waits up to ``grace_s`` for ``procs`` to exit, then SIGTERM (jax's preemption notifier
    catches it in a worker, so only briefly), then SIGKILL; reaps all."""
    for sig, wait_s in ((None, grace_s), (signal.SIGTERM, 0.3), (signal.SIGKILL, 5.0)):
        deadline = time.monotonic() + wait_s
        for p in procs:
            if sig is not None and p.poll() is None:
                p.send_signal(sig)
        for p in procs:
            try:
                p.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        if all(p.poll() is not None for p in procs):
            return


class _Control:
    """The executor's processes and sockets; ``close`` is its finalizer (no executor reference)."""

    def __init__(self):
        self.ctx = zmq.Context()
        self.router = self.ctx.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.LINGER, 0)
        self.router.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a send to a gone peer raises
        self.router.setsockopt(zmq.HEARTBEAT_IVL, 1000)
        self.router.setsockopt(zmq.HEARTBEAT_TIMEOUT, 5000)
        self.procs: dict[int, subprocess.Popen] = {}  # rank -> this node's worker
        self.ranks: list[int] = []  # every rank that said READY
        self.closed = False

    def send(self, rank: int, payload: bytes) -> None:
        self.router.send_multipart([str(rank).encode(), payload], copy=False)

    def close(self, grace_s: float = 3.0) -> None:
        if self.closed:
            return
        self.closed = True
        bye = pickle.dumps(("shutdown",))
        for rank in self.ranks:
            try:
                self.router.send_multipart([str(rank).encode(), bye], zmq.NOBLOCK)
            except zmq.ZMQError:
                pass
        stop_processes(list(self.procs.values()), grace_s)
        self.router.close(0)
        self.ctx.term()


class _PendingStep:
    """A dispatched step: ``result()`` waits for the driver's ``ModelRunnerOutput``."""

    __slots__ = ("_executor", "_call_id")

    def __init__(self, executor, call_id: int):
        self._executor, self._call_id = executor, call_id

    def result(self):
        return self._executor._step_result(self._call_id)


class MultiprocExecutor(Executor):
    """See the module docstring. Deadlines are attributes (seconds), overridable per instance
    before use or on a subclass."""

    startup_timeout_s: float = 180.0  # workers up, jax.distributed joined, model loaded
    execute_timeout_s: float = 300.0  # one step (vLLM's VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS)
    rpc_timeout_s: float = 900.0  # collective_rpc without its own timeout (warm-up compiles)
    heartbeat_timeout_s: float = 5.0  # a worker silent this long is dead
    collective_timeout_s: float = 30.0  # a step's ranks answer within this of each other
    poll_ms: int = 50  # liveness is checked at least this often while waiting

    def _init_executor(self, model) -> None:
        self._kv_seen: dict[str, dict[str, int]] = {}  # KV transfers reported by some ranks
        c = self.config
        if model is not None and not isinstance(getattr(c, "model", None), str):
            raise ValueError(
                "MultiprocExecutor loads the model in each worker process "
                "(EngineConfig.model); it cannot take a model built in this process"
            )
        del model  # the workers load config.model; a copy the front end loaded is not used here
        if c.headless or c.node_rank != 0:
            raise ValueError(
                f"the executor runs on node 0; node_rank={c.node_rank} "
                f"(headless={c.headless}) runs jaxkv.executor.headless.run_headless() / --headless instead"
            )
        per_worker = int(getattr(c, "devices_per_worker", 1) or 1)
        tp = c.tensor_parallel_size
        if tp % (per_worker * c.nnodes):
            raise ValueError(
                f"tensor_parallel_size={tp} must split evenly over nnodes={c.nnodes} "
                f"with {per_worker} device(s) per worker"
            )
        self.world_size = tp // per_worker
        local = self.world_size // c.nnodes
        host = c.master_addr
        if c.master_port:
            coord_port, control_port = c.master_port, c.master_port + 1
        else:
            coord_port, control_port = _free_port(host), 0
        self._ids = itertools.count(1)
        self._replies: dict[int, dict[int, tuple]] = {}  # call id -> rank -> (ok, value)
        self._ignored: set[int] = set()  # calls whose replies nobody waits for
        self._dropped: set[int] = set()  # calls that raised: later replies dropped
        self._unflushed: int | None = None  # a non-blocking step not yet asked for
        self._failure: str | None = None
        self._info: dict[int, dict] = {}  # rank -> {"pid", "host"}
        self._last_beat: dict[int, float] = {}
        self._deferred_error: BaseException | None = None
        #: the driver's perf_counter() times of the last blocking step: its message arrived,
        #: dispatch began, collect ended, reply pickled; then when this process received it
        #: (one host's CLOCK_MONOTONIC): the step is (began, ended), the rest is the hop
        self.last_step_timing: tuple | None = None
        self.last_send_time = 0.0  # perf_counter() when the last blocking step was sent
        ctl = self._ctl = _Control()
        self._finalizer = weakref.finalize(self, ctl.close)
        if control_port:
            ctl.router.bind(f"tcp://{host}:{control_port}")
        else:
            control_port = ctl.router.bind_to_random_port(f"tcp://{host}")
        self.control_address = f"tcp://{host}:{control_port}"
        self.coordinator_address = f"{host}:{coord_port}"
        self.platform = default_platform()
        for local_rank in range(local):
            args = SpawnArgs(
                rank=local_rank,
                local_rank=local_rank,
                world_size=self.world_size,
                coordinator_address=self.coordinator_address,
                control_address=self.control_address,
                platform=self.platform,
                devices_per_worker=per_worker,
                # past our own deadline, so a missing node is reported as such (below)
                # rather than as this node's worker giving up first
                init_timeout_s=int(self.startup_timeout_s) + 30,
            )
            ctl.procs[local_rank] = start_worker(args)
        try:
            self._wait_ready(time.monotonic() + self.startup_timeout_s)
            self._call_all(("init_worker", self.config), self.startup_timeout_s)
            self.collective_rpc("init_device", timeout=self.startup_timeout_s)
            self.collective_rpc("load_model", timeout=self.startup_timeout_s)
        except BaseException:
            self.shutdown()
            raise

    # ---- waiting --------------------------------------------------------------------------------

    def _describe(self, rank: int) -> str:
        info = self._info.get(rank, {})
        pid = info.get("pid") or (self._ctl.procs[rank].pid if rank in self._ctl.procs else "?")
        where = f" on {info['host']}" if info.get("host") and rank not in self._ctl.procs else ""
        return f"worker rank {rank} (pid {pid}{where})"

    def _fail(self, message: str, kind=WorkerDiedError):
        """The job is unusable: stop every process, refuse further calls, raise."""
        self._failure = message
        self._ctl.close(grace_s=0.2)  # the job is broken: no graceful wait
        raise kind(message)

    def _fail_if_exited(self, rank: int, proc, wait_s: float = 0.0) -> None:
        """``_fail`` naming how local worker ``rank`` died, if its process has exited (waiting
        up to ``wait_s`` for it to be reaped)."""
        try:
            rc = proc.wait(timeout=wait_s) if wait_s else proc.poll()
        except subprocess.TimeoutExpired:
            rc = None
        if rc is not None:
            how = f"killed by signal {-rc}" if rc < 0 else f"exit code {rc}"
            self._fail(f"{self._describe(rank)} died ({how})")

    def _check_alive(self, since: float) -> None:
        for rank, proc in self._ctl.procs.items():
            self._fail_if_exited(rank, proc)
        now = time.monotonic()
        for rank in self._ctl.ranks:  # local ones too: a stopped process has not exited
            silent = now - max(self._last_beat.get(rank, since), since)
            if silent > self.heartbeat_timeout_s:
                self._fail(
                    f"{self._describe(rank)} sent no heartbeat for {silent:.1f} s "
                    f"(hung, stopped or unreachable)"
                )

    def _drain(self, timeout_ms: int) -> None:
        """Receives whatever the workers sent (waiting up to ``timeout_ms`` for the first)."""
        router = self._ctl.router
        if not router.poll(timeout_ms):
            return
        while True:
            try:
                _, payload = router.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            received = time.perf_counter()
            msg = pickle.loads(payload)
            if msg[0] == "hb":
                self._last_beat[msg[1]] = time.monotonic()
                continue
            kind, call_id, rank, ok, value = msg[:5]
            self._last_beat[rank] = time.monotonic()
            if kind == "reply" and rank == 0 and msg[5] is not None:
                self.last_step_timing = msg[5] + (received,)
            if kind == "ready":
                self._info[rank] = value
                if rank not in self._ctl.ranks:
                    self._ctl.ranks.append(rank)
            elif call_id in self._dropped:  # a call that already raised its first error
                continue
            elif call_id in self._ignored:  # errors surface at the next wait
                seen = self._replies.setdefault(call_id, {})
                seen[rank] = (ok, None)
                if not ok and self._deferred_error is None:
                    self._deferred_error = self._remote_error(rank, value)
                if len(seen) == self.world_size:
                    self._ignored.discard(call_id)
                    del self._replies[call_id]
            else:
                self._replies.setdefault(call_id, {})[rank] = (ok, value)

    def _wait_ready(self, deadline: float) -> None:
        start = time.monotonic()
        while len(self._ctl.ranks) < self.world_size:
            if self._failure is not None:
                raise WorkerDiedError(self._failure)
            if time.monotonic() > deadline:
                missing = sorted(set(range(self.world_size)) - set(self._ctl.ranks))
                remote = [r for r in missing if r not in self._ctl.procs]
                c = self.config
                hint = (
                    f"; ranks {remote} run on other nodes: is `jaxkv generate --headless --nnodes "
                    f"{c.nnodes} --node-rank N --master-addr {c.master_addr} --master-port "
                    f"{c.master_port}` (or run_headless) running there? This node's workers wait "
                    f"in jax.distributed.initialize until every rank joins"
                    if remote
                    else ""
                )
                self._fail(
                    f"worker ranks {missing} did not start within {self.startup_timeout_s:.0f} s"
                    f"{hint}",
                    WorkerTimeoutError,
                )
            self._check_alive(start)
            self._drain(self.poll_ms)
        self._ctl.ranks.sort()

    def _remote_error(self, rank: int, payload) -> BaseException:
        blob, name, text, tb = payload
        where = self._describe(rank)
        if blob is not None:
            exc = pickle.loads(blob)
            exc.add_note(f"raised in {where}; its traceback:\n{tb}")
            return exc
        return RuntimeError(f"{where} raised {name}: {text}\n{tb}")

    def _wait(self, call_id: int, timeout: float | None, what: str, spmd: bool = False) -> list:
        """Every rank's answer to ``call_id``, by rank; the first error raises. ``spmd`` (a
        step): the ranks are coupled by collectives, so an error waits for the other ranks'
        answers, and every rank must answer within ``collective_timeout_s`` of the first."""
        start = time.monotonic()
        deadline = start + timeout
        first_answer = None
        while True:
            if self._deferred_error is not None:
                err, self._deferred_error = self._deferred_error, None
                raise err
            got = self._replies.get(call_id, {})
            failed = [r for r, (ok, _) in got.items() if not ok]
            if failed and (not spmd or len(got) == self.world_size):
                self._dropped.add(call_id)
                self._replies.pop(call_id, None)
                raise self._remote_error(failed[0], got[failed[0]][1])
            if len(got) == self.world_size:
                self._replies.pop(call_id)
                return [got[r][1] for r in range(self.world_size)]
            now = time.monotonic()
            if spmd and got:
                first_answer = first_answer or now
                if now - first_answer > self.collective_timeout_s:
                    self._collective_stuck(call_id, got, what)
            if now > deadline:
                missing = [self._describe(r) for r in range(self.world_size) if r not in got]
                self._fail(
                    f"{what} got no answer within {timeout:.1f} s from {', '.join(missing)}",
                    WorkerTimeoutError,
                )
            self._check_alive(start)
            self._drain(self.poll_ms)

    def _collective_stuck(self, call_id: int, got: dict, what: str) -> None:
        """Some ranks answered a step, the others have not within ``collective_timeout_s``."""
        missing = [self._describe(r) for r in range(self.world_size) if r not in got]
        failed = [r for r, (ok, _) in got.items() if not ok]
        if failed:
            err = self._remote_error(failed[0], got[failed[0]][1])
            cause = f"{self._describe(failed[0])} raised {type(err).__name__}: {err}"
        else:
            cause = f"{', '.join(self._describe(r) for r in sorted(got))} finished it"
        self._dropped.add(call_id)
        self._replies.pop(call_id, None)
        self._fail(
            f"{what}: {cause}; {', '.join(missing)} did not finish it within "
            f"collective_timeout_s={self.collective_timeout_s:.0f} s after: stuck in the "
            f"step's collectives (a failure on one rank, or a lost peer)",
            WorkerTimeoutError,
        )

    def _call_all(self, msg: tuple, timeout: float | None = None, what: str = "") -> int:
        """Sends ``(kind, call id, *msg[1:])`` to every rank; returns the call id."""
        if self._failure is not None:
            raise WorkerDiedError(f"the executor is down: {self._failure}")
        if self._ctl.closed:
            raise RuntimeError("the executor was shut down")
        call_id = next(self._ids)
        payload = pickle.dumps((msg[0], call_id, *msg[1:]), protocol=5)
        for rank in self._ctl.ranks:
            try:
                self._ctl.send(rank, payload)
            except (
                zmq.ZMQError
            ) as exc:  # a local worker that died says how (it may not be reaped yet)
                if rank in self._ctl.procs:
                    self._fail_if_exited(rank, self._ctl.procs[rank], wait_s=1.0)
                self._fail(f"{self._describe(rank)} is unreachable ({exc})")
        self._unflushed = None  # any message makes the workers answer the step in flight
        if timeout is not None:
            return self._wait(call_id, timeout, what or msg[0])
        return call_id

    # ---- the Executor interface -----------------------------------------------------------------

    def collective_rpc(
        self,
        method: str | Callable,
        timeout: float | None = None,
        args: tuple = (),
        kwargs: dict | None = None,
    ) -> list[Any]:
        name = method if isinstance(method, str) else getattr(method, "__qualname__", repr(method))
        return self._call_all(
            ("rpc", method, tuple(args), dict(kwargs or {})),
            self.rpc_timeout_s if timeout is None else timeout,
            what=f"collective_rpc({name!r})",
        )

    def execute_model(self, scheduler_output, non_block: bool = False):
        if not non_block:
            self.last_send_time = time.perf_counter()
            call_id = self._call_all(("execute_model", scheduler_output, True))
            return self._kv_aggregate(
                self._wait(call_id, self.execute_timeout_s, "execute_model", spmd=True)
            )
        call_id = self._call_all(("execute_model", scheduler_output, False))
        self._unflushed = call_id
        if (
            scheduler_output.total_num_scheduled_tokens == 0
            and getattr(self.config, "kv_transfer_config", None) is None
        ):
            self._ignored.add(call_id)  # nothing scheduled: no result (as UniProcExecutor)
            return None
        return _PendingStep(self, call_id)

    def _step_result(self, call_id: int):
        if self._unflushed == call_id:  # nothing sent since: ask for the step in flight
            self._call_all(("collect",))
        return self._kv_aggregate(
            self._wait(call_id, self.execute_timeout_s, "execute_model", spmd=True)
        )

    def _kv_aggregate(self, results: list):
        """The driver's output; with a KV connector, its report merged with every rank's
        (vLLM's KVOutputAggregator): a request's send or load has ended once every rank
        reported it; failed blocks are the union; counters are summed (``per_rank`` keeps
        each rank's)."""
        out = results[0]
        if out is None or out.kv_connector_output is None or self.world_size == 1:
            return out
        merged = out.kv_connector_output
        reports = [merged] + [r for r in results[1:] if r is not None]
        for kind in ("finished_sending", "finished_recving"):
            seen = self._kv_seen.setdefault(kind, {})
            done = set()
            for report in reports:
                for req_id in getattr(report, kind):
                    seen[req_id] = seen.get(req_id, 0) + 1
                    if seen[req_id] == self.world_size:
                        done.add(req_id)
                        del seen[req_id]
            setattr(merged, kind, done)
        for report in reports[1:]:
            merged.invalid_block_ids |= report.invalid_block_ids
        if any(report.stats for report in reports):
            merged.stats = merge_connector_stats([report.stats for report in reports])
        return out

    def check_health(self) -> None:
        """Raises WorkerDiedError when a worker is gone."""
        if self._failure is not None:
            raise WorkerDiedError(self._failure)
        self._drain(0)
        self._check_alive(time.monotonic() - self.heartbeat_timeout_s / 2)

    @property
    def worker_pids(self) -> dict[int, int]:
        """rank -> pid of every worker (remote ones as they reported it)."""
        return {r: self._info.get(r, {}).get("pid") for r in range(self.world_size)}

    def shutdown(self) -> None:
        self._finalizer()
