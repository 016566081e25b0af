"""Two "hosts" (network namespaces on a switch, tests/netns.py) run one engine with tensor
parallel 2 across them: node 0 (the engine and worker rank 0) on host A, node 1 (``jaxkv
generate --headless``: worker rank 1) on host B, talking over their own addresses. Faults
while requests run: a short blip of B's link, B's link cut past the heartbeat timeout, B's
processes killed, A's processes killed first. For each: what the user sees (the tokens of a
fault-free run, or an error naming the lost rank within a stated bound) and no process left
on either host. Root only (skipped elsewhere, with the reason)."""

from __future__ import annotations

import json
import queue
import subprocess
import sys
import threading
import time

import pytest

from tests.executor.helpers import ROOT, worker_env
from tests.netns import Network, netns_skip_reason

_SKIP = netns_skip_reason()
pytestmark = [pytest.mark.slow, pytest.mark.skipif(_SKIP is not None, reason=_SKIP or "")]

PORT = 29500  # every namespace has its own ports
ENGINE = dict(
    kv_cache_memory_bytes=8 << 20,
    max_model_len=512,
    max_num_seqs=4,
    max_num_batched_tokens=64,
    warmup=False,
)
PROMPTS = [[5 + i for i in range(n)] for n in (7, 30, 61)]
MAX_TOKENS = 120
HEARTBEAT_S = 5.0  # MultiprocExecutor.heartbeat_timeout_s


@pytest.fixture(scope="module")
def reference():
    """The tokens of a one-process engine with the same weights (tiny-llama, seed 0)."""
    from jaxkv import LLM, SamplingParams

    llm = LLM("tiny-llama", **ENGINE)
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in PROMPTS],
        SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True),
        use_tqdm=False,
    )
    llm.shutdown()
    return [o.outputs[0].token_ids for o in outs]


class TwoHosts:
    """Node 1 (headless) on host B, node 0 (tests.distributed.netns_node) on host A."""

    def __init__(self, net: Network, tmp_path, rounds: int = 1):
        tmp_path.mkdir(parents=True, exist_ok=True)
        self.net = net
        self.a, self.b = net.hosts
        self.logs = tmp_path
        spec = tmp_path / "spec.json"
        spec.write_text(
            json.dumps(
                {
                    "engine": dict(
                        ENGINE,
                        tensor_parallel_size=2,
                        distributed_executor_backend="mp",
                        nnodes=2,
                        node_rank=0,
                        master_addr=self.a.address,
                        master_port=PORT,
                    ),
                    "prompts": PROMPTS,
                    "max_tokens": MAX_TOKENS,
                    "rounds": rounds,
                }
            )
        )
        env = worker_env()
        self.node1 = self.b.popen(
            [
                sys.executable,
                "-m",
                "jaxkv.entrypoints.cli",
                "generate",
                "--headless",
                "--nnodes",
                "2",
                "--node-rank",
                "1",
                "--master-addr",
                self.a.address,
                "--master-port",
                str(PORT),
                "-tp",
                "2",
            ],
            env=env,
            cwd=ROOT,
            stdout=open(tmp_path / "node1.out", "w"),
            stderr=subprocess.STDOUT,
        )
        self.node0 = self.a.popen(
            [sys.executable, "-u", "-m", "tests.distributed.netns_node", str(spec)],
            env=env,
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=open(tmp_path / "node0.err", "w"),
            text=True,
        )
        self.lines: queue.Queue = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        first = self.next_line(240)
        assert first == "ready", self.log()

    def _read(self) -> None:
        for line in self.node0.stdout:
            self.lines.put(line.strip())
        self.lines.put(None)

    def next_line(self, timeout: float):
        try:
            line = self.lines.get(timeout=timeout)
        except queue.Empty:
            pytest.fail(f"node 0 said nothing for {timeout} s\n{self.log()}")
        if line is None:
            pytest.fail(f"node 0 ended (rc {self.node0.wait()})\n{self.log()}")
        return line

    def result(self, timeout: float = 120) -> dict:
        """Node 0's next JSON line (other lines, e.g. library logs, are skipped)."""
        deadline = time.monotonic() + timeout
        while True:
            line = self.next_line(max(0.1, deadline - time.monotonic()))
            if line.startswith("{"):
                return json.loads(line)

    def silent_rank_error(self, since: float, what: str) -> None:
        """Node 0's next answer is the WorkerDiedError of a rank 1 that sent no heartbeat,
        within the heartbeat timeout + 5 s of ``since``; node 0 then ends, leaving nothing on A."""
        result = self.result(timeout=HEARTBEAT_S + 30)
        noticed = time.monotonic() - since
        assert result.get("error") == "WorkerDiedError", (result, self.log())
        assert "worker rank 1" in result["message"] and "no heartbeat" in result["message"], result
        assert noticed < HEARTBEAT_S + 5, (noticed, result)
        print(f"{what}: error after {noticed:.1f} s")
        assert self.node0.wait(timeout=30) == 1
        assert self.a.wait_empty(10), self.a.pids()

    def log(self) -> str:
        return "".join(
            f"--- {name}\n{(self.logs / name).read_text()[-3000:]}\n"
            for name in ("node0.err", "node1.out")
            if (self.logs / name).exists()
        )


def test_blip_shorter_than_the_heartbeat_changes_nothing(tmp_path, reference):
    """B's link down for 1 s in the middle of the first generate: both generates return the
    fault-free tokens; node 0's exit ends node 1; nothing is left on either host."""
    with Network(2) as net:
        hosts = TwoHosts(net, tmp_path, rounds=2)
        time.sleep(1.0)
        net.cut(hosts.b)
        time.sleep(1.0)
        net.restore(hosts.b)
        first, second = hosts.result(), hosts.result()
        assert first.get("tokens") == reference, (first, hosts.log())
        assert first["seconds"] > 2.0, first  # the blip came while it ran
        assert second.get("tokens") == reference, second
        assert first["free_blocks"] == first["total_blocks"] == second["free_blocks"], (
            first
        )  # no leaks
        assert hosts.node0.wait(timeout=60) == 0, hosts.log()
        assert hosts.node1.wait(timeout=60) == 0, hosts.log()
        assert hosts.a.wait_empty(10) and hosts.b.wait_empty(10)


def test_link_cut_past_the_heartbeat_is_an_error_naming_the_rank(tmp_path, reference):
    """B's link down for 2 heartbeat timeouts while generate runs: node 0's caller gets an
    error naming worker rank 1 within the heartbeat timeout + 5 s of the cut; once the link
    is back, node 1 (whose executor is gone) ends too; nothing is left on either host, and
    a new engine on the same hosts gives the fault-free tokens."""
    with Network(2) as net:
        hosts = TwoHosts(net, tmp_path)
        time.sleep(1.0)
        net.cut(hosts.b)
        cut_at = time.monotonic()
        hosts.silent_rank_error(cut_at, "link cut")
        time.sleep(max(0.0, 2 * HEARTBEAT_S - (time.monotonic() - cut_at)))
        net.restore(hosts.b)
        restored_at = time.monotonic()
        assert hosts.b.wait_empty(60), (hosts.b.pids(), hosts.log())
        print(f"link restored: node 1 gone after {time.monotonic() - restored_at:.1f} s")
        again = TwoHosts(net, tmp_path / "again")  # a new engine on the same hosts works
        assert again.result().get("tokens") == reference, again.log()
        assert again.node0.wait(timeout=60) == 0 and again.node1.wait(timeout=60) == 0


def test_remote_host_killed_is_an_error_naming_the_rank(tmp_path):
    """Every process on B killed while generate runs (the host died): an error naming worker
    rank 1 within the heartbeat timeout + 5 s; node 0 ends and leaves nothing on A."""
    with Network(2) as net:
        hosts = TwoHosts(net, tmp_path)
        time.sleep(1.0)
        hosts.b.kill_all()
        killed_at = time.monotonic()
        result = hosts.result(timeout=HEARTBEAT_S + 30)
        assert result.get("error") in ("WorkerDiedError", "WorkerTimeoutError"), (
            result,
            hosts.log(),
        )
        assert "worker rank 1" in result["message"], result
        assert time.monotonic() - killed_at < HEARTBEAT_S + 5, result
        print(f"remote host killed: {result['error']} after {time.monotonic() - killed_at:.1f} s")
        assert hosts.node0.wait(timeout=30) == 1
        assert hosts.a.wait_empty(10) and hosts.b.wait_empty(5)


def test_coordinator_host_killed_first_ends_the_remote_node(tmp_path):
    """Every process on A (the engine, worker rank 0, the jax.distributed coordinator) killed
    while generate runs: node 1's worker and launcher end within 30 s; nothing is left on B."""
    with Network(2) as net:
        hosts = TwoHosts(net, tmp_path)
        time.sleep(1.0)
        hosts.a.kill_all()
        killed_at = time.monotonic()
        assert hosts.b.wait_empty(30), (hosts.b.pids(), hosts.log())
        print(f"coordinator host killed: node 1 gone after {time.monotonic() - killed_at:.1f} s")
        assert hosts.node1.wait(timeout=5) != 0


def test_remote_worker_stopped_is_an_error_naming_the_rank(tmp_path):
    """Every process on B stopped (SIGSTOP: alive, silent, its peer waiting in the step's
    collectives): an error naming worker rank 1 within the heartbeat timeout + 5 s; node 0
    leaves nothing on A (B's stopped processes are the network's to kill)."""
    import signal

    with Network(2) as net:
        hosts = TwoHosts(net, tmp_path)
        time.sleep(1.0)
        hosts.b.kill_all(signal.SIGSTOP)
        hosts.silent_rank_error(time.monotonic(), "remote worker stopped")
