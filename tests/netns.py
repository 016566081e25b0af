"""Little networks for fault tests: "hosts" are Linux network namespaces joined by veth pairs
to a switch (a bridge in a namespace of its own), each with its own address; a test starts
processes inside them and cuts a host's link (``ip link set ... down``) while work runs.

Needs root and ``ip netns`` (iproute2): ``netns_skip_reason()`` says why not, for a skip. What
a ``Network`` creates is removed on ``close()`` (a context manager and an ``atexit`` hook call
it), also when a test fails or is interrupted; namespaces a killed test process left behind
(their names carry its pid) are removed by the next ``Network``. Traffic stays inside the
namespaces: the host's own interfaces are never touched.

    with Network(2) as net:                   # hosts 10.99.0.1 and 10.99.0.2
        a, b = net.hosts
        p = b.popen([sys.executable, "-m", "..."], stdout=...)
        net.cut(b); time.sleep(1); net.restore(b)
        b.kill_all()                          # every process in the namespace
        assert not b.pids()
"""

from __future__ import annotations

import atexit
import os
import shutil
import signal
import subprocess
import time

PREFIX = "jaxkv-t"  # namespace names: jaxkv-t<pid>-<n>-<host> / -sw


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check)


def netns_skip_reason() -> str | None:
    """None when network namespaces can be made here, else why not."""
    if os.geteuid() != 0:
        return "network-namespace fault tests need root (ip netns add)"
    if shutil.which("ip") is None:
        return "network-namespace fault tests need iproute2's ip"
    name = f"{PREFIX}{os.getpid()}-probe"
    try:
        r = _ip("netns", "add", name, check=False)
        if r.returncode != 0:
            return f"ip netns add failed: {r.stderr.strip()}"
    finally:
        _ip("netns", "del", name, check=False)
    return None


def remove_stale() -> None:
    """Deletes namespaces left by test processes that no longer exist."""
    listing = _ip("netns", "list", check=False).stdout.split()
    for name in listing:
        if not name.startswith(PREFIX):
            continue
        pid = name[len(PREFIX) :].split("-", 1)[0]
        if pid.isdigit() and not os.path.exists(f"/proc/{pid}"):
            _kill_pids(name)
            _ip("netns", "del", name, check=False)


def _pids(ns: str) -> list[int]:
    out = _ip("netns", "pids", ns, check=False).stdout.split()
    return [int(p) for p in out if p.isdigit()]


def _kill_pids(ns: str, sig: int = signal.SIGKILL) -> list[int]:
    pids = _pids(ns)
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass
    return pids


class Host:
    """One namespace: ``address`` on the switch, ``popen`` runs a command inside it."""

    def __init__(self, ns: str, address: str, veth: str):
        self.ns, self.address, self.veth = ns, address, veth

    def popen(self, args: list[str], **kwargs) -> subprocess.Popen:
        return subprocess.Popen(["ip", "netns", "exec", self.ns, *args], **kwargs)

    def run(self, args: list[str], **kwargs) -> subprocess.CompletedProcess:
        return subprocess.run(["ip", "netns", "exec", self.ns, *args], **kwargs)

    def pids(self) -> list[int]:
        """Every process alive in the namespace (zombies excluded)."""
        alive = []
        for pid in _pids(self.ns):
            try:
                with open(f"/proc/{pid}/stat") as f:
                    if f.read().split(") ", 1)[1][0] != "Z":
                        alive.append(pid)
            except (FileNotFoundError, IndexError):
                pass
        return alive

    def kill_all(self, sig: int = signal.SIGKILL) -> list[int]:
        """Signals every process in the namespace (the host "dies"); returns their pids."""
        return _kill_pids(self.ns, sig)

    def wait_empty(self, timeout: float) -> bool:
        """True once no process is left in the namespace (within ``timeout`` seconds)."""
        deadline = time.monotonic() + timeout
        while self.pids():
            if time.monotonic() > deadline:
                return False
            time.sleep(0.1)
        return True


class Network:
    """``n`` hosts (10.99.0.1 ..) on one switch. See the module docstring."""

    def __init__(self, n: int, subnet: str = "10.99.0"):
        remove_stale()
        Network._count += 1
        tag = f"{PREFIX}{os.getpid()}-{Network._count}"
        self.switch = f"{tag}-sw"
        self.hosts: list[Host] = []
        self._names = [self.switch]
        self._closed = False
        atexit.register(self.close)
        try:
            _ip("netns", "add", self.switch)
            bridge = "br0"
            _ip("-n", self.switch, "link", "add", bridge, "type", "bridge")
            _ip("-n", self.switch, "link", "set", bridge, "up")
            for i in range(n):
                ns = f"{tag}-h{i}"
                _ip("netns", "add", ns)
                self._names.append(ns)
                inner, outer = f"jk{os.getpid() % 100000}h{i}", f"jk{os.getpid() % 100000}s{i}"
                _ip(
                    "link",
                    "add",
                    inner,
                    "netns",
                    ns,
                    "type",
                    "veth",
                    "peer",
                    "name",
                    outer,
                    "netns",
                    self.switch,
                )
                _ip("-n", self.switch, "link", "set", outer, "master", bridge)
                _ip("-n", self.switch, "link", "set", outer, "up")
                address = f"{subnet}.{i + 1}"
                _ip("-n", ns, "addr", "add", f"{address}/24", "dev", inner)
                _ip("-n", ns, "link", "set", inner, "up")
                _ip("-n", ns, "link", "set", "lo", "up")
                self.hosts.append(Host(ns, address, outer))
        except BaseException:
            self.close()
            raise

    _count = 0

    def cut(self, host: Host) -> None:
        """Takes the host's link down (its cable pulled at the switch): nothing passes."""
        _ip("-n", self.switch, "link", "set", host.veth, "down")

    def restore(self, host: Host) -> None:
        _ip("-n", self.switch, "link", "set", host.veth, "up")

    def close(self) -> None:
        """Kills every process in the namespaces and deletes them (idempotent)."""
        if self._closed:
            return
        self._closed = True
        for ns in self._names:
            _kill_pids(ns)
        for ns in self._names:
            _ip("netns", "del", ns, check=False)

    def __enter__(self) -> Network:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
