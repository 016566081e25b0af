"""TransferAgent on CPU: pulls between processes over loopback, deadlines, cancel, hold
timeouts and shardings. The other process is tests/distributed/transfer_peer.py, driven over
its stdin; every wait on it has a deadline, so a hang fails the test instead of hanging CI."""

from __future__ import annotations

import json
import os
import pathlib
import queue
import resource
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import CancelledError

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxkv.distributed.kv_transfer.transfer_agent import MAX_UUID, TransferAgent

ROOT = pathlib.Path(__file__).resolve().parents[2]
PEER = pathlib.Path(__file__).with_name("transfer_peer.py")


def pattern(uuid: int, rows: int, cols: int) -> np.ndarray:
    """[rows, cols] uint8, as transfer_peer.pattern."""
    return (
        ((np.arange(rows * cols, dtype=np.uint64) * 31 + uuid * 7) % 251)
        .astype(np.uint8)
        .reshape(rows, cols)
    )


def spec(rows: int, cols: int) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(
        (rows, cols), jnp.uint8, sharding=jax.sharding.SingleDeviceSharding(jax.devices("cpu")[0])
    )


@pytest.fixture(autouse=True)
def _on_cpu():
    """The peers run on CPU; so do this process's agents and arrays, also where a GPU is."""
    with jax.default_device(jax.devices("cpu")[0]):
        yield


class Peer:
    """transfer_peer.py in a subprocess: ``send`` a command, ``expect`` an event by a deadline."""

    def __init__(self, num_devices: int = 1):
        env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT))
        env["XLA_FLAGS"] = (
            env.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={num_devices}"
        ).strip()
        self.proc = subprocess.Popen(
            [sys.executable, str(PEER)],
            cwd=ROOT,
            env=env,
            text=True,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        self.events: queue.Queue = queue.Queue()
        self.stderr: list[str] = []
        threading.Thread(
            target=self._read, args=(self.proc.stdout, self.events.put), daemon=True
        ).start()
        threading.Thread(
            target=self._read, args=(self.proc.stderr, self.stderr.append), daemon=True
        ).start()
        self.address = self.expect("address", timeout_s=60)[1]

    @staticmethod
    def _read(stream, sink) -> None:
        for line in stream:
            sink(line)

    def send(self, *cmd) -> None:
        self.proc.stdin.write(json.dumps(list(cmd)) + "\n")
        self.proc.stdin.flush()

    def expect(self, kind: str, timeout_s: float) -> list:
        end = time.monotonic() + timeout_s
        while True:
            try:
                event = json.loads(self.events.get(timeout=max(0.0, end - time.monotonic())))
            except queue.Empty:
                raise AssertionError(
                    f"no {kind!r} event from the peer within {timeout_s} s; "
                    f"stderr tail:\n{''.join(self.stderr)[-3000:]}"
                ) from None
            if event[0] == kind:
                return event

    def quit(self, timeout_s: float) -> float:
        """Asks the peer to exit; the seconds it took (AssertionError past timeout_s)."""
        t0 = time.monotonic()
        self.send("quit")
        try:
            assert self.proc.wait(timeout=timeout_s) == 0, "".join(self.stderr)[-3000:]
        except subprocess.TimeoutExpired:
            raise AssertionError(f"the peer did not exit within {timeout_s} s") from None
        return time.monotonic() - t0

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(timeout=10)


@pytest.fixture
def peer_factory():
    peers = []

    def make(num_devices: int = 1) -> Peer:
        peers.append(Peer(num_devices))
        return peers[-1]

    yield make
    for p in peers:
        p.kill()


@pytest.fixture
def agents():
    made = []

    def make() -> TransferAgent:
        made.append(TransferAgent(devices=jax.devices("cpu")[:1]))
        return made[-1]

    yield make
    for a in made:
        a.close()


def wait_pulled(agent: TransferAgent, n: int, timeout_s: float) -> dict:
    """Polls until n pulls resolved; {uuid: result}, asserting each uuid came once."""
    results: dict = {}
    end = time.monotonic() + timeout_s
    while len(results) < n:
        assert time.monotonic() < end, f"only {len(results)} of {n} pulls resolved in {timeout_s} s"
        for uuid, result in agent.poll_pulled():
            assert uuid not in results, f"uuid {uuid} reported twice"
            results[uuid] = result
        time.sleep(0.005)
    return results


def wait_sent(agent: TransferAgent, n: int, timeout_s: float) -> tuple[set, set]:
    done, expired = set(), set()
    end = time.monotonic() + timeout_s
    while len(done) + len(expired) < n:
        assert time.monotonic() < end, f"{len(done)} done, {len(expired)} expired of {n}"
        d, e = agent.poll_sent()
        assert not (d & done or e & expired or d & e), "a uuid reported twice"
        done |= d
        expired |= e
        time.sleep(0.005)
    return done, expired


def test_module_imports_without_jax():
    code = (
        "import sys, jaxkv.distributed.kv_transfer.transfer_agent as m; "
        "assert 'jax' not in sys.modules, 'jax imported'; print('ok')"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
        timeout=60,
    )
    assert proc.stdout.strip() == "ok", proc.stderr[-2000:]


def test_roundtrip_between_two_processes(peer_factory, agents):
    """P in a subprocess offers [64, 4096] bytes; D here pulls them equal; P hears done. A
    pull that reaches P before the offer waits for it."""
    p, d = peer_factory(), agents()
    p.send("offer", 11, 64, 4096, 30.0, False)
    time.sleep(0.05)
    d.start_pull(p.address, 11, [spec(64, 4096)], deadline_s=20)
    (result,) = wait_pulled(d, 1, timeout_s=20).values()
    assert not isinstance(result, BaseException), result
    np.testing.assert_array_equal(np.asarray(result[0]), pattern(11, 64, 4096))
    assert p.expect("done", timeout_s=10) == ["done", 11]
    assert d.num_pulling() == 0

    d.start_pull(p.address, 12, [spec(2, 256)], deadline_s=20)  # before the offer: waits
    time.sleep(0.2)
    assert d.poll_pulled() == []
    p.send("offer", 12, 2, 256, 30.0, False)
    (result,) = wait_pulled(d, 1, timeout_s=20).values()
    np.testing.assert_array_equal(np.asarray(result[0]), pattern(12, 2, 256))
    assert p.expect("done", timeout_s=10) == ["done", 12]


def test_sharded_roundtrip_two_devices_per_process(peer_factory):
    """A [16, 1024] array split over a 2-device "tp" mesh goes as it is, shard for shard."""
    p, d = peer_factory(num_devices=2), peer_factory(num_devices=2)
    p.send("offer", 3, 16, 1024, 30.0, True)
    time.sleep(0.05)
    d.send("pull", 3, 16, 1024, 20.0, True, p.address)
    assert d.expect("pulled", timeout_s=20) == ["pulled", 3, True, "equal"]
    assert p.expect("done", timeout_s=10) == ["done", 3]


def test_peer_killed_before_pull_fails_within_deadline(peer_factory, agents):
    p, d = peer_factory(), agents()
    p.send("offer", 5, 8, 256, 30.0, False)
    d.start_pull(p.address, 6, [spec(8, 256)], deadline_s=20)  # never offered: parked at P
    time.sleep(0.2)
    p.kill()
    t0 = time.monotonic()
    d.start_pull(p.address, 5, [spec(8, 256)], deadline_s=1.5)  # offered, but P is gone
    results = wait_pulled(d, 2, timeout_s=5)
    assert time.monotonic() - t0 < 1.5 + 3.0  # the deadline, not the other pull's 20 s
    assert isinstance(results[6], Exception) and "closed" in str(results[6]).lower(), results[6]
    assert isinstance(results[5], Exception), results[5]


def test_never_registered_times_out_and_process_exits(peer_factory, agents):
    """A pull of a uuid P never offers fails at D's deadline; D, with that pull and another
    still pending in the transfer library, exits promptly."""
    p, d = agents(), peer_factory()
    t0 = time.monotonic()
    d.send("pull", 99, 4, 256, 1.5, False, p.address)
    d.send("pull", 100, 4, 256, 600.0, False, p.address)
    event = d.expect("pulled", timeout_s=10)
    elapsed = time.monotonic() - t0
    assert event[:3] == ["pulled", 99, False] and event[3].startswith("TimeoutError"), event
    assert "uuid 99" in event[3] and "1.5 s" in event[3] and p.address["transfer"] in event[3]
    assert 1.4 < elapsed < 1.5 + 4.0  # the deadline, not the other pull's 600 s
    assert d.quit(timeout_s=10) < 5.0


def test_cancel_in_flight_reported_once(agents):
    p, d = agents(), agents()
    d.start_pull(p.address, 7, [spec(4, 256)], deadline_s=20)
    assert d.cancel(7)
    assert not d.cancel(7)
    (result,) = wait_pulled(d, 1, timeout_s=1).values()
    assert isinstance(result, CancelledError)
    p.offer(7, [jnp.asarray(pattern(7, 4, 256))], hold_timeout_s=0.5)  # arrives after cancel
    end = time.monotonic() + 0.3
    while time.monotonic() < end:
        assert d.poll_pulled() == []
        time.sleep(0.01)
    assert not d.cancel(7) and d.num_pulling() == 0
    assert p.num_offered() == 1  # pulled, but no done note for a cancelled pull
    assert wait_sent(p, 1, timeout_s=3) == (set(), {7})


def test_close_returns_promptly_with_pulls_stuck(agents):
    p, d = agents(), agents()
    d.start_pull(p.address, 1, [spec(4, 256)], deadline_s=600)
    t0 = time.monotonic()
    d.close()
    d.close()
    assert time.monotonic() - t0 < 2.0  # not the stuck pull's 600 s
    with pytest.raises(RuntimeError, match="closed"):
        d.poll_pulled()


def test_short_hold_is_not_cut_by_the_servers_whole_seconds(agents):
    """The server truncates timeouts to whole seconds: a 0.3 s hold offered at x.1 s used to
    expire at once (the pull then parked for good). Rounded up, it is served."""
    p, d = agents(), agents()
    while not 0.05 < time.time() % 1 < 0.15:
        time.sleep(0.005)
    p.offer(9, [jnp.asarray(pattern(9, 4, 256))], hold_timeout_s=0.3)
    d.start_pull(p.address, 9, [spec(4, 256)], deadline_s=2)
    (result,) = wait_pulled(d, 1, timeout_s=3).values()
    assert isinstance(result, list), result
    assert wait_sent(p, 1, timeout_s=2) == ({9}, set())


def _rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 2**20


def test_hold_timeout_expires_and_releases_registration(agents):
    """An un-pulled offer is reported expired after its hold timeout and a later pull does
    not get it."""
    p, d = agents(), agents()
    p.offer(1, [jnp.asarray(pattern(1, 4, 256))], hold_timeout_s=0.2)
    assert p.poll_sent() == (set(), set())
    assert wait_sent(p, 1, timeout_s=3) == (set(), {1})
    d.start_pull(p.address, 1, [spec(4, 256)], deadline_s=1.0)
    (result,) = wait_pulled(d, 1, timeout_s=3).values()
    assert isinstance(result, TimeoutError), result


def test_expired_offer_memory_is_freed_without_another_offer(agents):
    """The server drops an expired registration only while handling an ``await_pull``: the
    sweep in ``poll_sent`` is what frees the last offer's 128 MiB (without it they stay)."""
    p = agents()
    n = 128 << 20
    p.offer(1, [jnp.zeros((4,), jnp.uint8)], hold_timeout_s=0.01)  # warm-up allocations
    wait_sent(p, 1, timeout_s=3)
    rss0 = _rss_mib()
    x = jnp.full((n,), 5, jnp.uint8)
    p.offer(2, [x], hold_timeout_s=0.2)
    del x
    held = _rss_mib() - rss0
    assert wait_sent(p, 1, timeout_s=3) == (set(), {2})
    left = _rss_mib() - rss0
    assert held > 96 and left < 32, f"RSS +{held:.0f} MiB while offered, +{left:.0f} MiB after"


def test_many_concurrent_pulls(agents):
    """64 uuids offered at once and pulled at once all arrive, each its own bytes."""
    p, d = agents(), agents()
    uuids = range(1000, 1064)
    for u in uuids:
        p.offer(
            u,
            [jnp.asarray(pattern(u, 16, 1024)), jnp.asarray(pattern(u + 1, 2, 512))],
            hold_timeout_s=30,
            notify_token=f"req-{u}",
        )
    for u in uuids:
        d.start_pull(
            p.address, u, [spec(16, 1024), spec(2, 512)], deadline_s=20, notify_token=f"req-{u}"
        )
    results = wait_pulled(d, 64, timeout_s=20)
    for u in uuids:
        a, b = results[u]
        np.testing.assert_array_equal(np.asarray(a), pattern(u, 16, 1024))
        np.testing.assert_array_equal(np.asarray(b), pattern(u + 1, 2, 512))
    assert wait_sent(p, 64, timeout_s=5) == (set(uuids), set())


def test_note_with_wrong_token_is_ignored(agents):
    p, d = agents(), agents()
    p.offer(4, [jnp.asarray(pattern(4, 4, 256))], hold_timeout_s=0.5, notify_token="right")
    d.start_pull(p.address, 4, [spec(4, 256)], deadline_s=5, notify_token="wrong")
    wait_pulled(d, 1, timeout_s=5)
    assert wait_sent(p, 1, timeout_s=3) == (set(), {4})


def test_misuse_raises_value_errors(agents):
    p = agents()
    x = [jnp.zeros((4,), jnp.uint8)]
    with pytest.raises(ValueError, match="outside"):
        p.offer(MAX_UUID + 1, x, hold_timeout_s=1)
    with pytest.raises(ValueError, match="no arrays"):
        p.offer(1, [], hold_timeout_s=1)
    p.offer(1, x, hold_timeout_s=1)
    with pytest.raises(ValueError, match="already offered"):
        p.offer(1, x, hold_timeout_s=1)
    p.start_pull(p.address, 2, [spec(1, 4)], deadline_s=5)
    with pytest.raises(ValueError, match="already being pulled"):
        p.start_pull(p.address, 2, [spec(1, 4)], deadline_s=5)
