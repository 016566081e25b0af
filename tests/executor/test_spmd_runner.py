"""The in-process engine run SPMD in two processes of one ``jax.distributed`` job (one CPU
device each, gloo collectives): ``ModelRunner`` over a mesh that spans processes builds its
inputs with ``make_array_from_process_local_data`` and reads results from its local shard,
and its greedy tokens equal the dense forward's (chunked prefill, a prefix hit, preemption)."""

from __future__ import annotations

import json
import os
import pathlib
import socket
import subprocess
import sys

import pytest

from tests.engine.helpers import dense_greedy, small_model

ROOT = pathlib.Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_two_process_runner_matches_dense(tmp_path):
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT))
    env.pop("XLA_FLAGS", None)
    port, out = free_port(), str(tmp_path / "out.json")
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "tests.executor.spmd_engine_case", str(r), str(port), out],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in range(2)
    ]
    try:
        logs = [p.communicate(timeout=240)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
            p.wait()
    assert all(p.returncode == 0 for p in procs), "\n".join(log[-3000:] for log in logs)
    r0, r1 = (json.loads(pathlib.Path(f"{out}.{r}").read_text()) for r in range(2))
    assert r0 == r1
    model = small_model("tiny-llama")
    for p, toks in zip(r0["prompts"], r0["tokens"]):
        assert toks == dense_greedy(model, p, len(toks))
    assert r0["cached"][2] >= 32 and r0["preemptions"] > 0, r0
