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


class LanguageModelTensors(CheckpointTensors):
    """The language model of a multimodal checkpoint under the text model's HF names: Gemma 3's
    ``language_model.model.X`` (transformers < 4.52) or ``model.language_model.X`` as
    ``model.X``, its LM head as ``lm_head.weight``; the vision tower and projector are left out.

    Example: ``model.language_model.layers.0.mlp.up_proj.weight`` ->
    ``model.layers.0.mlp.up_proj.weight``; ``model.vision_tower.*`` is not listed.
    """

    _PREFIXES = (
        ("language_model.model.", "model."),
        ("model.language_model.", "model."),
        ("language_model.lm_head.", "lm_head."),
        ("lm_head.", "lm_head."),
    )

    def __init__(self, source: CheckpointTensors):
        self._source = source
        self._names: dict[str, str] = {}  # text-model name -> stored name
        for stored in source.shapes():
            for prefix, replacement in self._PREFIXES:
                if stored.startswith(prefix):
                    self._names[replacement + stored[len(prefix) :]] = stored
                    break

    def shapes(self) -> dict[str, tuple[int, ...]]:
        stored = self._source.shapes()
        return {name: stored[s] for name, s in self._names.items()}

    def read(self, name: str, index: Index | None = None) -> np.ndarray:
        return self._source.read(self._names[name], index)

    def close(self) -> None:
        self._source.close()
