"""The worker process of ``MultiprocExecutor``: one JAX process of a ``jax.distributed`` job.

Started as ``python -m jaxkv.executor.worker_proc`` with its ``SpawnArgs`` pickled on stdin
(by the executor on the head node, or by a ``--headless`` launcher on another node). It

1. sets up JAX before the first backend call (what a multi-process CPU job needs on jax
   0.10.2): ``JAX_PLATFORMS`` (cpu here, so the CUDA plugin stays out), ``jax_num_cpu_devices``
   host devices (the spawner's ``--xla_force_host_platform_device_count`` is dropped from
   ``XLA_FLAGS``), gloo CPU collectives (``jax_cpu_collectives_implementation="gloo"``, bound to
   the address that reaches the coordinator, not the hostname's; without
   it a computation over a mesh that spans processes fails on CPU), then
   ``jax.distributed.initialize(coordinator_address, num_processes, process_id,
   initialization_timeout)`` (GPU: ``local_device_ids``, the ``devices_per_worker`` GPUs of
   this local rank);
   the coordinator runs in rank 0's process. ``jax.devices()`` is then global, so the Worker's
   ``make_tp_mesh`` spans the processes. jax installs a SIGTERM handler (its preemption
   notifier) that keeps the process alive, so the executor stops a worker by message, then
   SIGKILL;
2. connects a zmq DEALER (identity = its rank) to the executor's ROUTER and says READY;
3. runs every call it receives on its ``WorkerWrapperBase`` in order, replying to each.

``execute_model`` is split as the runner splits it: the step is dispatched when its message
arrives and collected when the next message arrives (a later step: dispatched first, so the
device runs it while the host collects; anything else: collected first). Every worker sees
the same messages in the same order, so every worker runs the same sequence of jitted steps,
which a mesh over processes requires (SPMD). A ``collect`` message asks for the step in flight.

Liveness: a thread sends a heartbeat every ``HEARTBEAT_S`` on a second DEALER (so the
executor can tell a hung or vanished remote worker) and ends the process when its parent
dies (the executor, or the headless launcher; also ``PR_SET_PDEATHSIG`` on Linux). The
control socket uses zmq heartbeats, and its disconnection (the executor's process gone)
ends the process too.
"""

from __future__ import annotations

import dataclasses
import os
import pickle
import signal
import sys
import threading
import time
import traceback

#: seconds between a worker's heartbeats
HEARTBEAT_S = 0.5


@dataclasses.dataclass(frozen=True)
class SpawnArgs:
    """What a worker process needs before it can hear from the executor."""

    rank: int  # global rank: jax process id, index of its KV config
    local_rank: int  # rank on this node
    world_size: int  # worker processes in the job
    coordinator_address: str  # jax.distributed coordinator "host:port" (in rank 0)
    control_address: str  # the executor's zmq ROUTER, "tcp://host:port"
    platform: str = "cpu"  # JAX_PLATFORMS of the worker
    devices_per_worker: int = 1  # CPU host devices per process (GPU: one per process)
    init_timeout_s: int = 120  # jax.distributed.initialize's deadline
    wrapper_class: str = "jaxkv.worker.worker_base:WorkerWrapperBase"


def _set_parent_death_signal() -> None:
    """Linux: SIGKILL this process when the thread that started it dies."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _init_jax(args: SpawnArgs):
    """Platform, devices and collectives, then the distributed job. Returns the jax module."""
    os.environ["JAX_PLATFORMS"] = args.platform
    import jax  # lazy: after the environment is set

    if args.platform == "cpu":
        jax.config.update("jax_num_cpu_devices", args.devices_per_worker)
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    n = args.devices_per_worker  # GPUs: this process's n of the host's, by local rank
    local_ids = (
        list(range(args.local_rank * n, (args.local_rank + 1) * n))
        if args.platform in ("gpu", "cuda", "rocm")
        else None
    )
    if args.world_size > 1:
        jax.distributed.initialize(
            coordinator_address=args.coordinator_address,
            num_processes=args.world_size,
            process_id=args.rank,
            local_device_ids=local_ids,
            initialization_timeout=args.init_timeout_s,
        )
        if args.platform == "cpu":
            _bind_gloo(args.coordinator_address)
    return jax


def _address_towards(address: str) -> str:
    """This host's address on the route to ``host:port`` (no packet is sent)."""
    import socket

    host, port = address.rsplit(":", 1)
    host = host.strip("[]")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        s.connect((host, int(port)))
        return s.getsockname()[0]


def _bind_gloo(coordinator_address: str) -> None:
    """Gloo's TCP transport on the address that reaches the coordinator. Left alone, gloo
    listens on (and tells its peers) what this machine's hostname resolves to, often
    127.0.0.1 or 127.0.1.1 (/etc/hosts): peers on other hosts then cannot connect."""
    from jax._src import distributed, xla_bridge  # lazy: no public knob for this
    from jax._src.lib import _jax

    hostname = _address_towards(coordinator_address)

    def make_cpu_client():
        return xla_bridge.make_cpu_client(
            _jax.make_gloo_tcp_collectives(
                distributed_client=distributed.global_state.client, hostname=hostname
            )
        )

    xla_bridge.register_backend_factory("cpu", make_cpu_client, priority=0)


def _import(path: str):
    import importlib

    module, name = path.split(":")
    return getattr(importlib.import_module(module), name)


class _Heartbeat(threading.Thread):
    """Sends a heartbeat every HEARTBEAT_S; ends the process when its parent is gone."""

    def __init__(self, ctx, address: str, rank: int):
        super().__init__(daemon=True, name="jaxkv-heartbeat")
        self.ctx, self.address, self.rank = ctx, address, rank
        self.parent = os.getppid()
        self.stop = threading.Event()

    def run(self) -> None:
        import zmq

        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.IDENTITY, f"hb-{self.rank}".encode())
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, 4)
        sock.connect(self.address)
        payload = pickle.dumps(("hb", self.rank, os.getpid()))
        while not self.stop.wait(HEARTBEAT_S):
            if os.getppid() != self.parent:
                os._exit(3)  # the executor (or launcher) died: no orphans
            try:
                sock.send(payload, zmq.NOBLOCK)
            except zmq.Again:
                pass
        sock.close(0)


def _exception_payload(exc: BaseException) -> tuple:
    """(exception or None when it does not pickle, type name, message, formatted traceback)."""
    tb = "".join(traceback.format_exception(exc))
    try:
        blob = pickle.dumps(exc)
        pickle.loads(blob)
    except Exception:  # noqa: BLE001 - any exception type that does not round-trip
        blob = None
    return (blob, type(exc).__name__, str(exc), tb)


class _Loop:
    """Receives calls in order and runs them on the wrapper (see the module docstring)."""

    def __init__(self, sock, wrapper, rank: int, local_rank: int):
        self.sock, self.wrapper, self.rank, self.local_rank = sock, wrapper, rank, local_rank
        self.in_flight = None  # (call id, StepHandle) of a dispatched step
        self.received = 0.0  # perf_counter() when the message at hand arrived

    def reply(self, call_id: int, ok: bool, value, timing: tuple | None = None) -> None:
        if timing is not None:
            timing += (time.perf_counter(),)
        try:
            blob = pickle.dumps(("reply", call_id, self.rank, ok, value, timing), protocol=5)
        except Exception as exc:  # noqa: BLE001 - a result that does not pickle is the call's error
            err = TypeError(
                f"the worker's result of type {type(value).__name__} cannot be pickled: {exc}"
            )
            blob = pickle.dumps(("reply", call_id, self.rank, False, _exception_payload(err), None))
        self.sock.send(blob)

    def run_call(self, call_id: int, fn) -> None:
        try:
            value = fn()
        except BaseException as exc:  # noqa: BLE001 - every error goes back to the caller
            self.reply(call_id, False, _exception_payload(exc))
        else:
            self.reply(call_id, True, value)

    def collect(self, entry, started: float | None = None) -> None:
        """Answers a dispatched step: the driver's ``ModelRunnerOutput``, None from the others;
        with ``started`` (a blocking step: when its dispatch began) also the step's timing
        (perf_counter when its message arrived, dispatch began, collect ended, the reply was
        pickled; CLOCK_MONOTONIC, so comparable across processes of one Linux host), so the
        executor can tell the hop from the step."""
        call_id, handle = entry
        try:
            out = self.wrapper.worker.collect(handle)
        except BaseException as exc:  # noqa: BLE001
            self.reply(call_id, False, _exception_payload(exc))
            return
        timing = (self.received, started, time.perf_counter()) if started is not None else None
        # Other ranks send only their KV connector's report (the executor aggregates them).
        self.reply(
            call_id,
            True,
            out if self.rank == 0 else getattr(out, "kv_connector_output", None),
            timing,
        )

    def flush(self) -> None:
        if self.in_flight is not None:
            entry, self.in_flight = self.in_flight, None
            self.collect(entry)

    def handle(self, msg: tuple) -> bool:
        """Runs one message; False on shutdown."""
        kind = msg[0]
        if kind == "shutdown":
            return False
        if kind == "execute_model":
            _, call_id, so, block = msg
            started = time.perf_counter()
            prev, self.in_flight = self.in_flight, None
            try:
                handle = self.wrapper.worker.dispatch(so)
            except BaseException as exc:  # noqa: BLE001
                if prev is not None:  # the step before is answered first (its own result)
                    self.collect(prev)
                self.reply(call_id, False, _exception_payload(exc))
                return True
            if prev is not None:  # dispatched this step first: the device runs it meanwhile
                self.collect(prev)
            if block:
                self.collect((call_id, handle), started)
            else:
                self.in_flight = (call_id, handle)
            return True
        self.flush()  # "collect", or an rpc: the step in flight is answered first
        if kind == "init_worker":  # the wrapper's own: builds the Worker from the engine config
            _, call_id, config = msg
            self.run_call(
                call_id, lambda: self.wrapper.init_worker(config, local_rank=self.local_rank)
            )
        if kind == "rpc":
            _, call_id, method, args, kwargs = msg
            self.run_call(call_id, lambda: self.wrapper.execute_method(method, *args, **kwargs))
        return True


def main() -> None:
    args: SpawnArgs = pickle.loads(
        sys.stdin.buffer.read()
    )  # imports from PYTHONPATH (the spawner's sys.path)
    _set_parent_death_signal()
    # Ctrl-C in a terminal reaches the whole process group: the engine core handles it (and
    # stops the workers); a worker interrupted on its own would only break the SPMD job.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    import zmq

    ctx = zmq.Context()
    beat = _Heartbeat(ctx, args.control_address, args.rank)
    beat.start()  # before jax.distributed: a stuck initialisation still has a watched parent
    _init_jax(args)
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.IDENTITY, str(args.rank).encode())
    sock.setsockopt(zmq.LINGER, 2000)
    sock.setsockopt(zmq.HEARTBEAT_IVL, 1000)  # zmq pings the executor; no answer for
    sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, 5000)  # 5 s closes the connection (seen below)
    monitor = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED | zmq.EVENT_HANDSHAKE_SUCCEEDED)
    sock.connect(args.control_address)
    wrapper = _import(args.wrapper_class)(rpc_rank=args.rank, global_rank=args.rank)
    sock.send(
        pickle.dumps(
            ("ready", 0, args.rank, True, {"pid": os.getpid(), "host": os.uname().nodename})
        )
    )
    loop = _Loop(sock, wrapper, args.rank, args.local_rank)
    poller = zmq.Poller()
    poller.register(sock, zmq.POLLIN)
    poller.register(monitor, zmq.POLLIN)
    connected = False
    from zmq.utils.monitor import recv_monitor_message

    try:
        while True:
            events = dict(poller.poll())
            if monitor in events:
                event = recv_monitor_message(monitor)["event"]
                if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                    connected = True
                elif event == zmq.EVENT_DISCONNECTED and connected:
                    os._exit(4)  # the executor's process is gone
            if sock in events:
                blob = sock.recv()
                loop.received = time.perf_counter()
                if not loop.handle(pickle.loads(blob)):
                    break
    finally:
        beat.stop.set()
    sock.close(linger=1000)
    # No jax.distributed.shutdown(): its barrier would wait for workers that may be gone.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
