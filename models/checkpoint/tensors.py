"""A checkpoint's tensors, read on demand: whole, or one slice (a device's shard).

``CheckpointTensors`` is what ``jaxkv.models.weights.load_hf_params`` reads parameters from:
HF names and HF layouts (linear weights ``[out, in]``), shapes known before any data is read,
and ``read(name, index)`` returning only the ``index`` slice where the format allows it
(safetensors: a memory-mapped slice; GGUF: the dequantized tensor, then sliced).
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

#: An index into a tensor: one slice per axis (what ``jax.make_array_from_callback`` asks for).
Index = tuple[slice, ...]


class CheckpointTensors:
    """HF-named tensors of one checkpoint; a context manager that closes open files."""

    def shapes(self) -> dict[str, tuple[int, ...]]:
        """``{HF name: HF shape}`` of every tensor, without reading tensor data."""
        raise NotImplementedError

    def read(self, name: str, index: Index | None = None) -> np.ndarray:
        """Tensor ``name`` in its stored dtype and HF layout, or only its ``index`` slice."""
        raise NotImplementedError

    def close(self) -> None:
        """Releases open files (reads after this may fail)."""

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class InMemoryTensors(CheckpointTensors):
    """Tensors already in host memory: ``{HF name: array}``."""

    def __init__(self, tensors: Mapping[str, np.ndarray]):
        self._tensors = tensors

    def shapes(self) -> dict[str, tuple[int, ...]]:
        return {name: tuple(np.shape(t)) for name, t in self._tensors.items()}

    def read(self, name: str, index: Index | None = None) -> np.ndarray:
        arr = np.asarray(self._tensors[name])
        return arr if index is None else arr[index]
