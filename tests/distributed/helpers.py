"""Helpers of the KV-transfer tests: engines in processes of their own, workloads."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

#: tiny-llama engine settings every KV-transfer test shares (same weights: seed 0).
ENGINE = dict(
    kv_cache_memory_bytes=16 << 20,
    max_model_len=512,
    max_num_seqs=16,
    max_num_batched_tokens=256,
    warmup=False,
)


def prompts(n: int, *, block_size: int = 16, seed: int = 0, lengths=None) -> list[list[int]]:
    """``n`` prompts of ``k * block_size + 1`` tokens (every full block is stored), k in 1..8."""
    rng = np.random.default_rng(seed)
    if lengths is None:
        lengths = [block_size * int(k) + 1 for k in rng.integers(1, 9, size=n)]
    return [[int(t) for t in rng.integers(1, 500, size=m)] for m in lengths]


def start_engine(
    tmp_path, name: str, spec: dict, devices: int = 1, host=None
) -> tuple[subprocess.Popen, str]:
    """Starts ``tests.distributed.kv_engine`` on ``spec`` (with ``devices`` CPU devices; in
    ``host``, a ``tests.netns.Host``, when given); returns (process, result path)."""
    out = str(tmp_path / f"{name}.json")
    spec = dict(spec, out=out)
    path = tmp_path / f"{name}.spec.json"
    path.write_text(json.dumps(spec))
    env = dict(
        os.environ,
        JAX_PLATFORMS="cpu",
        PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
    )
    if devices > 1:
        env["XLA_FLAGS"] = (
            env.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={devices}"
        ).strip()
    popen = host.popen if host is not None else subprocess.Popen
    proc = popen(
        [sys.executable, "-m", "tests.distributed.kv_engine", str(path)],
        cwd=ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=open(str(tmp_path / f"{name}.log"), "w"),
    )
    return proc, out


def wait_for_file(path: str, proc: subprocess.Popen, log, timeout: float = 240) -> dict:
    """Waits for a JSON file an engine process writes (failing at once if it exits first)."""
    import time

    deadline = time.monotonic() + timeout
    while not os.path.exists(path):
        if proc.poll() is not None and not os.path.exists(path):
            raise AssertionError(
                f"engine exited {proc.returncode} before writing {path}:\n{log.read_text()[-3000:]}"
            )
        if time.monotonic() > deadline:
            proc.kill()
            raise AssertionError(f"no {path} after {timeout} s:\n{log.read_text()[-3000:]}")
        time.sleep(0.1)
    return json.loads(open(path).read())


def start_producer(
    tmp_path,
    name: str,
    ps: list[list[int]],
    engine: dict,
    drain_s: float = 120,
    devices: int = 1,
    model: str = "tiny-llama",
    warm=None,
    host=None,
):
    """A prefill instance in its own process: computes ``ps`` with ``max_tokens=1`` and
    ``do_remote_decode``, then keeps stepping until every send is reported (or ``drain_s``).
    Returns (process, its outputs' kv_transfer_params, the final result's path)."""
    proc, out = start_engine(
        tmp_path,
        name,
        {
            "engine": engine,
            "prompts": ps,
            "max_tokens": 1,
            "model": model,
            "params": [{"do_remote_decode": True}] * len(ps),
            "drain_s": drain_s,
            "warm": warm,
        },
        devices=devices,
        host=host,
    )
    first = wait_for_file(out + ".partial", proc, tmp_path / f"{name}.log")
    return proc, first["kv_transfer_params"], out


def finish(proc: subprocess.Popen, out: str, log, timeout: float = 120) -> dict:
    """Waits for an engine process to end; its final result."""
    try:
        rc = proc.wait(timeout=timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert rc == 0, f"exited {rc}:\n{log.read_text()[-3000:]}"
    return json.loads(open(out).read())


def run_engine(
    tmp_path, name: str, spec: dict, timeout: float = 240, devices: int = 1, host=None
) -> dict:
    proc, out = start_engine(tmp_path, name, spec, devices=devices, host=host)
    try:
        rc = proc.wait(timeout=timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
    log = (tmp_path / f"{name}.log").read_text()
    assert rc == 0, f"{name} exited {rc}:\n{log[-3000:]}"
    return json.loads(open(out).read())
