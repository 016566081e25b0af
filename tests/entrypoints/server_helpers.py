"""Starting and stopping a ``jaxkv serve`` process on a free loopback port, and a small HF
checkpoint with a tokenizer and a chat template for it (random weights: texts are gibberish,
but every code path that needs a tokenizer runs)."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "models"))
from ckpt_fixtures import hf_config_dict, small_config, write_llama_gguf  # noqa: E402

#: Engine flags of the test servers and of the in-process LLMs they are compared with (same
#: settings: the same programs, compiled once through the session's XLA cache). Both warm up
#: as a user's would (the default): every program is compiled before the first request.
ENGINE = dict(
    max_model_len=128, kv_cache_memory_bytes=1 << 20, max_num_seqs=8, max_num_batched_tokens=128
)


def serve_flags(engine: dict = ENGINE) -> list[str]:
    return [
        "--max-model-len",
        str(engine["max_model_len"]),
        "--kv-cache-memory",
        str(engine["kv_cache_memory_bytes"]),
        "--max-num-seqs",
        str(engine["max_num_seqs"]),
        "--max-num-batched-tokens",
        str(engine["max_num_batched_tokens"]),
    ]


def make_model_dir(path: Path) -> Path:
    """A 2-layer llama (vocabulary 288) as safetensors with the byte-level BPE tokenizer of
    tests/models/ckpt_fixtures.py (EOS ``<|im_end|>``, a ChatML template)."""
    import gguf
    import numpy as np

    from jaxkv.models import build_model, hf_state_dict
    from jaxkv.models.checkpoint import (
        read_gguf_metadata,
        tokenizer_from_gguf_metadata,
        write_safetensors_dir,
    )

    config = small_config(eos_token_id=2, bos_token_id=1)
    hf = hf_config_dict(config)
    write_safetensors_dir(path, hf, hf_state_dict(build_model(config, seed=1)))
    vocab_only = path / "vocab.gguf"
    write_llama_gguf(
        vocab_only,
        hf,
        {"model.embed_tokens.weight": np.zeros((hf["vocab_size"], hf["hidden_size"]), np.float32)},
    )
    tokenizer_from_gguf_metadata(read_gguf_metadata(gguf.GGUFReader(str(vocab_only)))).save(path)
    vocab_only.unlink()
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _compile_cache_env(tmp: Path) -> dict:
    """A JAXKV_CACHE_DIR of the test's own; the XLA cache is the session's, inherited through
    JAXKV_COMPILE_CACHE (tests/conftest.py), so the server's engine core and the in-process
    engines compile each program once."""
    return {"JAXKV_CACHE_DIR": str(tmp)}


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for process {pid}")


class Server:
    """``jaxkv serve`` in a subprocess; ``url``, ``pid``, ``log()``; ``stop()`` by pid."""

    def __init__(
        self,
        model: str,
        args: list[str],
        tmp: Path,
        *,
        startup_s: float = 300.0,
        env: dict | None = None,
    ):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = tmp / "server.log"
        env = {**os.environ, **_compile_cache_env(tmp), "PYTHONPATH": str(ROOT), **(env or {})}
        cmd = [
            sys.executable,
            "-m",
            "jaxkv.entrypoints.cli",
            "serve",
            model,
            "--port",
            str(self.port),
            "--uvicorn-log-level",
            "warning",
            *args,
        ]
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT
            )
        self.pid = self.proc.pid
        try:
            self._wait_healthy(startup_s)
        except BaseException:
            self.stop()
            raise

    def _wait_healthy(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"jaxkv serve exited ({self.proc.returncode}):\n{self.log()}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{self.url}/health", timeout=2.0).status_code == 200:
                    return
            time.sleep(0.5)
        raise TimeoutError(f"jaxkv serve not healthy after {timeout_s} s:\n{self.log()}")

    def log(self, tail: int = 5000) -> str:
        return self.log_path.read_text(errors="replace")[-tail:]

    def rss_mb(self) -> float:
        """The server process's resident memory (the front end; the core is its child)."""
        return rss_mb(self.pid)

    def open_files(self) -> int:
        return len(os.listdir(f"/proc/{self.pid}/fd"))

    def core_pid(self) -> int:
        """The engine-core process: the server's child running jaxkv.engine.core_proc."""
        for stat in Path("/proc").glob("[0-9]*/stat"):
            with contextlib.suppress(OSError):
                fields = stat.read_text().rsplit(")", 1)[1].split()
                if int(fields[1]) == self.pid:
                    return int(stat.parent.name)
        raise RuntimeError("no engine-core process")

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.kill(self.pid, signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                os.kill(self.pid, signal.SIGKILL)
                self.proc.wait(5)
