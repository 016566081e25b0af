"""Helpers for the multi-process executor tests: a small model saved where worker processes
can load it, the engine config for it, and process checks."""

from __future__ import annotations

import os
import pathlib
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "models"))  # ckpt_fixtures (the HF config writer)


def save_small_model(family: str, path: pathlib.Path, **overrides):
    """``tests.engine.helpers.small_model(family, **overrides)`` written as an HF safetensors
    directory at ``path`` (what a worker process loads); returns the model built here."""
    from ckpt_fixtures import hf_config_dict

    from jaxkv.models import hf_state_dict
    from jaxkv.models.checkpoint import write_safetensors_dir
    from tests.engine.helpers import small_model

    model = small_model(family, **overrides)
    if not (path / "config.json").exists():
        write_safetensors_dir(path, hf_config_dict(model.config), hf_state_dict(model))
    return model


def pid_alive(pid: int) -> bool:
    """True while ``pid`` exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def all_gone(pids, within: float = 5.0) -> bool:
    """True once none of ``pids`` is alive, polling for at most ``within`` seconds."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if not any(pid_alive(p) for p in pids):
            return True
        time.sleep(0.1)
    return False


def executor_config(model_path, **overrides):
    """The engine config a ``MultiprocExecutor`` is started with: a real ``EngineConfig`` (so
    a field the workers read is never missing here), small and on two processes."""
    from jaxkv.core import SchedulerConfig
    from jaxkv.engine_config import EngineConfig

    fields = dict(
        model_name=str(model_path),
        model=str(model_path),
        dtype="float32",
        seed=0,
        tensor_parallel_size=2,
        block_size=16,
        cache_dtype="float32",
        kv_cache_memory_bytes=8 << 20,
        max_num_seqs=4,
        max_num_batched_tokens=64,
        max_model_len=512,
        attention_backend="auto",
        warmup=False,
        distributed_executor_backend="mp",
    )
    fields.update(overrides)
    fields["scheduler_config"] = SchedulerConfig(
        max_num_seqs=fields["max_num_seqs"],
        max_num_batched_tokens=fields["max_num_batched_tokens"],
        max_model_len=fields["max_model_len"],
    )
    return EngineConfig(**fields)


def worker_env() -> dict:
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT))
    env.pop("XLA_FLAGS", None)
    return env
