"""``load_model(mesh=...)`` in a real multi-process job: two CPU processes joined by
``jax.distributed`` (gloo collectives), a mesh over both processes' devices. Each process
creates, and checks, only the shards on its own device."""

from __future__ import annotations

import os
import pathlib
import socket
import subprocess
import sys

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from ckpt_fixtures import hf_config_dict, small_config

from jaxkv.models import build_model, hf_state_dict
from jaxkv.models.checkpoint import write_safetensors_dir

ROOT = pathlib.Path(__file__).resolve().parents[2]
WORKER = pathlib.Path(__file__).parent / "load_multiprocess_worker.py"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_processes_load_their_own_shards(tmp_path):
    config = small_config("tiny-llama", dtype="bfloat16")
    write_safetensors_dir(
        tmp_path,
        hf_config_dict(config),
        hf_state_dict(build_model(config, seed=3)),
        max_shard_bytes=40_000,
    )
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT))
    env.pop("XLA_FLAGS", None)
    port = _free_port()
    procs = [
        subprocess.Popen(
            [sys.executable, str(WORKER), str(i), str(port), str(tmp_path)],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for i in range(2)
    ]
    outs = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=300)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for i, (p, out) in enumerate(zip(procs, outs)):
        assert p.returncode == 0 and f"process {i}: ok" in out, out[-4000:]
