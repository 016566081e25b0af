"""Device-to-device transport for the KV connector: ``jax.experimental.transfer`` + a pyzmq note.

One ``TransferAgent`` per worker process. The prefill side (P) gathers a request's pages into
fresh arrays and *offers* them under a uuid; the decode side (D) *pulls* arrays of the same
shapes, dtypes and shardings into fresh arrays of its own and scatters them into its cache
itself (a late or stale pull can only ever fill its own arrays). When D holds the data it
sends P a note over pyzmq, so that P can drop its copy::

    P: agent.offer(uuid, [pages_t0, pages_t1], hold_timeout_s=60)   # [K, page_bytes] uint8 each
    D: agent.start_pull(p_address, uuid, specs, deadline_s=10)       # returns at once
    D: agent.poll_pulled()  -> [(uuid, [arrays])] or [(uuid, exception)], each uuid once
    P: agent.poll_sent()    -> ({uuid}, set())   done; or (set(), {uuid}) hold timeout passed

Facts this design rests on, measured with jax 0.10.2 on CPU (see tests/distributed):

- ``TransferConnection.pull`` returns at once with arrays that become ready when the data
  has arrived (``Array.is_ready()``), or ready with an error (reading them raises). So pulls
  are polled; there are no threads. ``pull``'s own ``timeout`` is never enforced on the
  puller: a pull of a uuid P never registers stays pending for good while P lives, so the
  deadline is ours (``poll_pulled`` gives up on it). The timeout is still passed on, because
  P's server drops a parked pull past it (D then sees "Pull expired") the next time P calls
  ``await_pull``, which frees D's destination buffers.
- ``await_pull(..., timeout=t)`` releases an un-pulled registration (and the arrays it holds)
  past ``t``, but only when the server next handles an ``await_pull``. ``poll_sent`` therefore
  registers a 1-byte array under a reserved uuid ("a sweep") when it reports an offer
  expired, and at most every ``sweep_interval_s`` otherwise. The server truncates both
  sides' timeouts to whole seconds, so they are rounded up (``_wall_deadline``): an offer
  expires up to 1 s after its ``hold_timeout_s``. ``_reset_rendevous_table`` drops every
  registration at once (too coarse); pulling one's own registration back works too but copies.
- Sharded arrays (a ``NamedSharding`` over local devices) go as they are, shard i to shard
  i: D must pull with the same shape, dtype and sharding layout as P offered. Another number
  of shards fails the pull ("Async transfer object was deleted before transfers
  completed"); the same number split another way (rows instead of columns) is not detected
  and delivers shards to the wrong places.
- Dropping a pending pull's arrays, the connection or the server returns at once, and a
  process with pulls pending exits promptly.

Thread safety: every public method takes one lock, so the agent may be shared between
threads, but none of them blocks beyond that lock (the pyzmq sends are non-blocking).
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import logging
import threading
import time
import weakref
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import jax

logger = logging.getLogger(__name__)

# A uuid is a uint64 for the transfer server; the largest one is kept for the sweep.
MAX_UUID = 2**64 - 2
SWEEP_UUID = 2**64 - 1


@dataclasses.dataclass
class _Offer:
    expires_at: float  # time.monotonic() just past the server's own timeout
    notify_token: Any


@dataclasses.dataclass
class _Pull:
    arrays: list  # the pull's own fresh arrays, pending until ready
    peer: dict
    deadline_s: float  # as given: seconds after start_pull
    expires_at: float  # time.monotonic()
    notify_token: Any
    error: BaseException | None = None  # failed or cancelled already: reported next poll


def _host_port(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _wall_deadline(seconds: float) -> tuple[datetime.datetime, float]:
    """The transfer server's ``timeout`` for ``seconds`` from now, and when it passes in
    ``time.monotonic()`` terms (plus a margin).

    The server truncates the (naive, local) datetime to whole seconds (measured: a 0.5 s
    timeout taken at x.1 s expired at once, one taken at x.6 s lasted 0.4 s), so it is
    rounded up instead: the server's timeout is ``seconds`` to ``seconds + 1`` from now.
    """
    now = datetime.datetime.now()
    mono = time.monotonic()
    t = now + datetime.timedelta(seconds=seconds)
    if t.microsecond:
        t = t.replace(microsecond=0) + datetime.timedelta(seconds=1)
    return t, mono + (t - now).total_seconds() + 0.01


class TransferAgent:
    """A transfer server plus a notification socket, for one worker process.

    Args:
        host: the address peers reach this process at (loopback by default); the transfer
            server and the notification socket both listen on it, on free ports.
        devices: local devices whose arrays are offered and pulled (default: all local
            devices); they must share one client, which the transfer server runs on.
        sweep_interval_s: the longest a parked pull or an expired registration waits for
            ``poll_sent`` to release it.
    """

    def __init__(self, host: str = "127.0.0.1", *, devices=None, sweep_interval_s: float = 1.0):
        import jax
        import zmq
        from jax.experimental import transfer

        self._devices = list(devices) if devices is not None else jax.local_devices()
        clients = {d.client for d in self._devices}
        if len(clients) != 1:
            raise ValueError(f"devices {self._devices} span {len(clients)} clients, expected 1")
        self._lock = threading.Lock()
        self._server = transfer.start_transfer_server(
            clients.pop(), _host_port(host, 0), [_host_port(host, 0)]
        )
        self._zmq = zmq.Context()
        self._notify_in = self._zmq.socket(zmq.PULL)
        self._notify_in.setsockopt(zmq.LINGER, 0)
        if ":" in host:
            self._notify_in.setsockopt(zmq.IPV6, 1)
        port = self._notify_in.bind_to_random_port(f"tcp://{_host_port(host, 0).rsplit(':', 1)[0]}")
        self._address = {
            "transfer": self._server.address(),
            "notify": f"tcp://{_host_port(host, port)}",
        }
        self._offers: dict[int, _Offer] = {}
        self._pulls: dict[int, _Pull] = {}
        self._connections: dict[str, Any] = {}  # transfer address -> TransferConnection
        self._notify_out: dict[str, Any] = {}  # notify address -> zmq PUSH socket
        self._sweep_array = None
        self._last_sweep = time.monotonic()
        self._sweep_interval_s = sweep_interval_s
        self._closed = False
        # An agent dropped without close(): its sockets close before its context ends (left
        # to the garbage collector, a context in a reference cycle may be finalized first,
        # and its term() then blocks forever on the still-open sockets).
        self._finalizer = weakref.finalize(
            self, _close_sockets, self._zmq, [self._notify_in], self._notify_out
        )

    @property
    def address(self) -> dict[str, str]:
        """What a peer needs to pull from or notify this agent (JSON-able)."""
        return dict(self._address)

    # ---------------------------------------------------------------- P side

    def offer(
        self, uuid: int, arrays: list[jax.Array], *, hold_timeout_s: float, notify_token: Any = None
    ) -> None:
        """Registers ``arrays`` to be pulled once under ``uuid``; returns at once.

        Args:
            uuid: in ``[0, MAX_UUID]``, not offered already (unique per transfer).
            arrays: e.g. one ``[K, page_bytes]`` uint8 array per KV tensor, possibly sharded;
                the registration holds them until pulled or ``hold_timeout_s`` has passed.
                Do not delete or donate them meanwhile (the pull would fail).
            hold_timeout_s: how long to wait for the pull. The server keeps whole seconds,
                so this is rounded up to the next whole second of the wall clock (up to 1 s
                more); past that ``poll_sent`` reports the uuid expired and releases it.
            notify_token: a JSON-able value the puller must echo (``start_pull``'s
                ``notify_token``) for ``poll_sent`` to count it done; None accepts any note.
        """
        if not 0 <= uuid <= MAX_UUID:
            raise ValueError(f"uuid {uuid} outside [0, {MAX_UUID}]")
        if not arrays:
            raise ValueError(f"offer of uuid {uuid} has no arrays")
        with self._lock:
            self._check_open()
            if uuid in self._offers:
                raise ValueError(f"uuid {uuid} is already offered")
            timeout, expires_at = _wall_deadline(hold_timeout_s)
            self._server.await_pull(uuid, list(arrays), timeout=timeout)
            self._offers[uuid] = _Offer(expires_at, notify_token)

    def poll_sent(self) -> tuple[set[int], set[int]]:
        """Offers resolved since the last call: ``(done, expired)``, each uuid once.

        ``done``: the puller has the data (its note arrived). ``expired``: the hold timeout
        passed first; the registration is released (no later pull gets it). A pull that completes just before the
        timeout while its note is still on the way is reported expired: the puller has valid
        data all the same (the offered arrays were P's own copy).
        """
        import zmq

        with self._lock:
            self._check_open()
            done = set()
            while True:
                try:
                    msg = json.loads(self._notify_in.recv(zmq.NOBLOCK))
                except zmq.Again:
                    break
                offer = self._offers.get(msg["uuid"])
                if offer is None:
                    continue  # expired already, or a note for another life
                if offer.notify_token is not None and offer.notify_token != msg.get("token"):
                    logger.warning(
                        "note for uuid %s with token %r, expected %r: ignored",
                        msg["uuid"],
                        msg.get("token"),
                        offer.notify_token,
                    )
                    continue
                del self._offers[msg["uuid"]]
                done.add(msg["uuid"])
            now = time.monotonic()
            expired = {u for u, o in self._offers.items() if o.expires_at <= now}
            for u in expired:
                del self._offers[u]
            if expired or now - self._last_sweep >= self._sweep_interval_s:
                self._sweep(now)
            return done, expired

    def num_offered(self) -> int:
        """Offers not yet reported by ``poll_sent``."""
        with self._lock:
            return len(self._offers)

    def _sweep(self, now: float) -> None:
        """Makes the server drop expired registrations and parked pulls: it does so only
        while handling an ``await_pull``, so register one byte (expiring at once)."""
        import jax
        import jax.numpy as jnp

        if self._sweep_array is None:
            self._sweep_array = jax.device_put(jnp.zeros((1,), jnp.uint8), self._devices[0])
        self._server.await_pull(SWEEP_UUID, [self._sweep_array], timeout=_wall_deadline(0.0)[0])
        self._last_sweep = now

    # ---------------------------------------------------------------- D side

    def start_pull(
        self,
        peer_address: dict[str, str],
        uuid: int,
        specs: list[jax.ShapeDtypeStruct],
        *,
        deadline_s: float,
        notify_token: Any = None,
    ) -> None:
        """Starts pulling ``uuid`` from the peer into fresh arrays; returns at once.

        Args:
            peer_address: the offering agent's ``address``.
            uuid: as offered; not in flight here already.
            specs: one per offered array, same order: shape, dtype and a ``sharding`` over
                this agent's devices with the same layout as the offered array's, e.g.
                ``ShapeDtypeStruct((K, page_bytes), jnp.uint8, sharding=...)``.
            deadline_s: seconds from now; ``poll_pulled`` reports a TimeoutError past it.
                Also sent to the peer, whose server drops the parked pull past it (by the
                peer's wall clock).
            notify_token: echoed to the peer in the done note (see ``offer``).
        """
        if not specs:
            raise ValueError(f"pull of uuid {uuid} has no specs")
        with self._lock:
            self._check_open()
            if uuid in self._pulls:
                raise ValueError(f"uuid {uuid} is already being pulled")
            pull = _Pull(
                [], dict(peer_address), deadline_s, time.monotonic() + deadline_s, notify_token
            )
            try:
                conn = self._connection(peer_address["transfer"])
                pull.arrays = conn.pull(uuid, list(specs), timeout=_wall_deadline(deadline_s)[0])
            except Exception as e:  # noqa: BLE001 - e.g. a bad spec: reported like any failure
                pull.error = e
            self._pulls[uuid] = pull

    def poll_pulled(self) -> list[tuple[int, list[jax.Array] | BaseException]]:
        """Pulls resolved since the last call, each uuid exactly once.

        Returns:
            ``(uuid, arrays)`` with the arrays ready (same order as the specs), or
            ``(uuid, exception)``: ``TimeoutError`` past the deadline, the runtime error if
            the peer is gone or refused, ``CancelledError`` after ``cancel``.
        """
        with self._lock:
            self._check_open()
            now = time.monotonic()
            out = []
            for uuid, pull in list(self._pulls.items()):
                result = pull.error
                if result is None:
                    if all(a.is_ready() for a in pull.arrays):
                        try:
                            for a in pull.arrays:
                                a.block_until_ready()  # ready: raises the error, if any
                            result = pull.arrays
                        except Exception as e:  # noqa: BLE001 - the transfer's error is the result
                            result = e
                    elif now >= pull.expires_at:
                        result = TimeoutError(
                            f"pull of uuid {uuid} from {pull.peer['transfer']} missed its "
                            f"deadline of {pull.deadline_s} s"
                        )
                    else:
                        continue
                del self._pulls[uuid]
                if isinstance(result, list):
                    self._notify(pull.peer["notify"], uuid, pull.notify_token)
                out.append((uuid, result))
            return out

    def cancel(self, uuid: int) -> bool:
        """Abandons an in-flight pull: its data is discarded when it arrives, and the next
        ``poll_pulled`` reports ``(uuid, CancelledError)``. False if not in flight."""
        from concurrent.futures import CancelledError

        with self._lock:
            pull = self._pulls.get(uuid)
            if pull is None or pull.error is not None:
                return False
            pull.error = CancelledError(f"pull of uuid {uuid} cancelled")
            pull.arrays = []  # the transfer fills them, then they are freed
            return True

    def num_pulling(self) -> int:
        """Pulls not yet reported by ``poll_pulled``."""
        with self._lock:
            return len(self._pulls)

    def _connection(self, address: str):
        conn = self._connections.get(address)
        if conn is None:
            conn = self._connections[address] = self._server.connect(address)
        return conn

    def _notify(self, address: str, uuid: int, token: Any) -> None:
        import zmq

        sock = self._notify_out.get(address)
        if sock is None:
            sock = self._notify_out[address] = self._zmq.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SNDHWM, 1 << 16)
            if address.startswith("tcp://["):
                sock.setsockopt(zmq.IPV6, 1)
            sock.connect(address)
        try:
            sock.send(json.dumps({"uuid": uuid, "token": token}).encode(), zmq.NOBLOCK)
        except zmq.Again:
            logger.warning("done note for uuid %s to %s dropped (peer not reading)", uuid, address)

    # ---------------------------------------------------------------- lifetime

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("TransferAgent is closed")

    def close(self) -> None:
        """Drops every offer, pull, connection and socket; returns at once, also with pulls
        stuck in flight. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._offers.clear()
            self._pulls.clear()
            self._finalizer()  # closes every socket, then ends the context
            self._connections.clear()
            self._server = None
            self._sweep_array = None

    def __enter__(self) -> TransferAgent:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _close_sockets(ctx, sockets: list, by_address: dict) -> None:
    """Closes ``sockets`` and every socket of ``by_address`` (linger 0), then ends ``ctx``."""
    for sock in [*sockets, *by_address.values()]:
        sock.close(linger=0)
    by_address.clear()
    ctx.term()
