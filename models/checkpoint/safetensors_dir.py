"""Hugging Face checkpoint directories: config.json + one or more *.safetensors.

A directory holds either a single ``model.safetensors``, several shards listed in
``model.safetensors.index.json`` (``{"weight_map": {tensor name: shard file}}``), or, without an
index, any number of ``*.safetensors`` files that are all read. Tensors come back as numpy
arrays in their stored dtype and HF layout (linear weights ``[out, in]``); bf16 is numpy's
``ml_dtypes.bfloat16`` (importing ml_dtypes registers it, which safetensors' numpy backend
needs to hand back BF16 tensors). F8_E4M3 / F8_E5M2 tensors (fp8 checkpoints), which that
backend cannot return, are memory-mapped from the file directly as ``ml_dtypes.float8_e4m3fn``
/ ``float8_e5m2``.
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import ml_dtypes  # also registers bfloat16 with numpy, which safe_open needs
import numpy as np
from safetensors import safe_open
from safetensors.numpy import save_file

from jaxkv.models.checkpoint.tensors import CheckpointTensors, Index

INDEX_FILE = "model.safetensors.index.json"
CONFIG_FILE = "config.json"

#: safetensors dtypes read by memory-mapping the file (safetensors' numpy backend has none)
_MAPPED_DTYPES = {"F8_E4M3": ml_dtypes.float8_e4m3fn, "F8_E5M2": ml_dtypes.float8_e5m2}


def _mapped_tensor(shard: Path, name: str) -> np.ndarray:
    """Tensor ``name`` of safetensors file ``shard`` as a read-only ``np.memmap`` of its
    bytes in its dtype (one of ``_MAPPED_DTYPES``): slicing it reads only the slice."""
    with open(shard, "rb") as f:
        (header_len,) = struct.unpack("<Q", f.read(8))
        entry = json.loads(f.read(header_len))[name]
    start, end = entry["data_offsets"]
    shape = tuple(entry["shape"])
    if end == start:
        return np.zeros(shape, _MAPPED_DTYPES[entry["dtype"]])
    raw = np.memmap(
        shard, dtype=np.uint8, mode="r", offset=8 + header_len + start, shape=(end - start,)
    )
    return raw.view(_MAPPED_DTYPES[entry["dtype"]]).reshape(shape)


def read_config(path: str | os.PathLike) -> dict:
    """Returns the parsed ``config.json`` of an HF checkpoint directory."""
    root = Path(path)
    if not root.is_dir():
        raise ValueError(f"checkpoint directory {str(root)!r} does not exist or is not a directory")
    config_path = root / CONFIG_FILE
    if not config_path.is_file():
        raise ValueError(f"no {CONFIG_FILE} in checkpoint directory {str(root)!r}")
    with open(config_path, encoding="utf-8") as f:
        return json.load(f)


def _shard_files(root: Path) -> list[Path]:
    index_path = root / INDEX_FILE
    if index_path.is_file():
        with open(index_path, encoding="utf-8") as f:
            weight_map = json.load(f).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ValueError(f"{str(index_path)!r} has no 'weight_map'")
        names = sorted(set(weight_map.values()))
        missing = [n for n in names if not (root / n).is_file()]
        if missing:
            raise ValueError(
                f"shard(s) {missing} listed in {str(index_path)!r} are missing from {str(root)!r}"
            )
        return [root / n for n in names]
    files = sorted(root.glob("*.safetensors"))
    if not files:
        raise ValueError(f"no *.safetensors files in checkpoint directory {str(root)!r}")
    return files


class SafetensorsTensors(CheckpointTensors):
    """The tensors of an HF checkpoint directory, memory-mapped: ``read(name, index)`` reads
    only the requested slice (``safe_open(...).get_slice``), so a device's shard of a
    parameter costs its own bytes, not the whole tensor's.

    Raises ValueError as ``read_safetensors_dir`` does (missing files, duplicate names).
    """

    def __init__(self, path: str | os.PathLike):
        root = Path(path)
        if not root.is_dir():
            raise ValueError(
                f"checkpoint directory {str(root)!r} does not exist or is not a directory"
            )
        self._files = []
        self._where: dict[str, object] = {}
        self._shard: dict[str, Path] = {}
        self._mapped: dict[str, np.ndarray] = {}  # F8 tensors, memory-mapped on first read
        try:
            for shard in _shard_files(root):
                handle = safe_open(str(shard), framework="numpy")
                self._files.append(handle)
                for name in handle.keys():
                    if name in self._where:
                        raise ValueError(
                            f"tensor {name!r} appears in more than one file under {str(root)!r}"
                        )
                    self._where[name] = handle
                    self._shard[name] = shard
        except BaseException:
            self.close()
            raise

    def shapes(self) -> dict[str, tuple[int, ...]]:
        return {name: tuple(h.get_slice(name).get_shape()) for name, h in self._where.items()}

    def stored_dtype(self, name: str) -> str:
        """Tensor ``name``'s safetensors dtype ("BF16", "F32", "F8_E4M3", ...), no data read."""
        return self._where[name].get_slice(name).get_dtype()

    def read(self, name: str, index: Index | None = None) -> np.ndarray:
        handle = self._where[name]
        if self.stored_dtype(name) in _MAPPED_DTYPES:
            if name not in self._mapped:
                self._mapped[name] = _mapped_tensor(self._shard[name], name)
            arr = self._mapped[name]
            return np.array(arr if index is None else arr[tuple(index)])
        if index is None:
            return handle.get_tensor(name)
        return handle.get_slice(name)[tuple(index)]

    def close(self) -> None:
        for handle in self._files:
            handle.__exit__(None, None, None)
        self._files = []
        self._mapped = {}


def read_safetensors_dir(path: str | os.PathLike) -> tuple[dict, dict[str, np.ndarray]]:
    """Reads an HF checkpoint directory.

    Returns:
      ``(config_dict, tensors)``: the parsed config.json and ``{HF name: np.ndarray}`` in the
      stored dtype and HF layout.

    Raises:
      ValueError: the directory, its config.json, its safetensors files or a listed shard is
        missing, or a tensor name appears in two files.
    """
    config = read_config(path)
    with SafetensorsTensors(path) as source:
        tensors = {name: source.read(name) for name in source.shapes()}
    return config, tensors


def write_safetensors_dir(
    path: str | os.PathLike,
    config: dict,
    tensors: dict[str, np.ndarray],
    *,
    max_shard_bytes: int | None = None,
) -> Path:
    """Writes ``config.json`` and the tensors as an HF checkpoint directory.

    Args:
      path: the directory (created if missing).
      config: the HF config dict, written as config.json.
      tensors: ``{HF name: np.ndarray}``; any dtype numpy/ml_dtypes knows (bf16 included).
      max_shard_bytes: when given, tensors are packed in name order into shards of at most this
        many bytes (a tensor larger than the cap gets a shard of its own), named
        ``model-0000i-of-0000n.safetensors`` with a ``model.safetensors.index.json``, as
        transformers' ``save_pretrained`` does. Otherwise one ``model.safetensors``.

    Returns:
      The directory path.
    """
    if max_shard_bytes is not None and max_shard_bytes <= 0:
        raise ValueError(f"max_shard_bytes must be positive, got {max_shard_bytes}")
    root = Path(path)
    root.mkdir(parents=True, exist_ok=True)
    with open(root / CONFIG_FILE, "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2)
    # (np.ascontiguousarray would turn a scalar [] into [1])
    arrays = {k: np.ascontiguousarray(v).reshape(np.shape(v)) for k, v in tensors.items()}
    if max_shard_bytes is None:
        save_file(arrays, str(root / "model.safetensors"))
        return root
    shards: list[dict[str, np.ndarray]] = [{}]
    size = 0
    for name in sorted(arrays):
        nbytes = arrays[name].nbytes
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = arrays[name]
        size += nbytes
    weight_map = {}
    for i, shard in enumerate(shards):
        file_name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(root / file_name))
        weight_map.update({name: file_name for name in shard})
    total = sum(a.nbytes for a in arrays.values())
    with open(root / INDEX_FILE, "w", encoding="utf-8") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
    return root
