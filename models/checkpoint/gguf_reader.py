"""Reads a llama.cpp GGUF file into HF config, HF-named tensors and a tokenizer.

gguf-py's `GGUFReader` memory-maps the file; tensors are dequantized with
`gguf.quants.dequantize` (F32, F16, BF16, Q8_0, Q4_0, Q4_1, the K-quants, ... whatever the
installed gguf supports). F32 and F16 keep their dtype; everything else becomes float32.
``GGUFTensors.read_q8_0`` reads a Q8_0 tensor as its blocks instead (int8 values and one
scale per 32 inputs), what ``load_model(..., quantization="int8")`` keeps in device memory.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import gguf
import numpy as np
from gguf import GGMLQuantizationType, GGUFValueType

from jaxkv.models.checkpoint.gguf_config import gguf_config
from jaxkv.models.checkpoint.gguf_names import (
    NORM_SHIFTED_ARCHS,
    PERMUTED_ARCHS,
    UNSUPPORTED_TENSORS,
    gguf_to_hf_name,
    unpermute_rotary_rows,
)
from jaxkv.models.checkpoint.gguf_tokenizer import tokenizer_from_gguf_metadata
from jaxkv.models.checkpoint.tensors import CheckpointTensors, Index
from jaxkv.models.tokenizer import Tokenizer


def field_value(field) -> Any:
    """A reader field as a python value (str, int, float, bool, or a list of them)."""
    types = field.types
    if not types:
        return None

    def scalar(part, vtype):
        if vtype == GGUFValueType.STRING:
            return bytes(part).decode("utf-8", errors="replace")
        value = part[0]
        if vtype == GGUFValueType.FLOAT32:  # shortest float32 repr: 1e-05, not 9.9999997e-06
            return float(str(np.float32(value)))
        value = value.item() if hasattr(value, "item") else value
        return bool(value) if vtype == GGUFValueType.BOOL else value

    if types[0] == GGUFValueType.ARRAY:
        if len(types) > 2:  # nested arrays: not used by the keys we read
            return None
        return [scalar(field.parts[i], types[-1]) for i in field.data]
    return scalar(field.parts[field.data[0]], types[0])


def read_gguf_metadata(reader: gguf.GGUFReader) -> dict[str, Any]:
    """``{key: value}`` of all metadata except the ``GGUF.*`` header fields."""
    return {k: field_value(f) for k, f in reader.fields.items() if not k.startswith("GGUF.")}


def dequantize_tensor(tensor) -> np.ndarray:
    """A reader tensor as a numpy array in numpy dim order (``reversed(tensor.shape)``)."""
    shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))
    qtype = tensor.tensor_type
    if qtype in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):
        out = np.asarray(tensor.data)
    else:
        try:
            out = gguf.quants.dequantize(tensor.data, qtype)
        except NotImplementedError as e:
            raise ValueError(
                f"GGUF tensor {tensor.name!r} has unsupported type {qtype.name}"
            ) from e
    return out.reshape(shape)


class GGUFTensors(CheckpointTensors):
    """A GGUF checkpoint opened for reading: its HF config, metadata and tokenizer at once
    (metadata only), its tensors on demand in HF names and layouts (``read_gguf``'s).

    ``read(name, index)`` dequantizes the whole tensor (quantized blocks run along rows, so
    a slice is no cheaper) and then slices it; the last tensor is kept, so the shards of one
    parameter dequantize it once.

    Raises:
      ValueError: missing file, unsupported architecture, tensor name or tensor (rope
        frequency factors), no token embedding; a tensor type on ``read``.
    """

    def __init__(self, path: str | os.PathLike):
        p = Path(path)
        if not p.is_file():
            raise ValueError(f"GGUF file {str(p)!r} does not exist")
        self.path = p
        reader = gguf.GGUFReader(str(p))
        self.metadata = read_gguf_metadata(reader)
        by_name = {t.name: t for t in reader.tensors}
        if "token_embd.weight" not in by_name:
            raise ValueError(f"GGUF file {str(p)!r} has no 'token_embd.weight' tensor")
        vocab_size = int(by_name["token_embd.weight"].shape[-1])
        self.hf_config = gguf_config(
            self.metadata, vocab_size=vocab_size, tied_embeddings="output.weight" not in by_name
        )
        for name in by_name:
            if name in UNSUPPORTED_TENSORS:
                raise ValueError(
                    f"GGUF tensor {name!r} (rope frequency factors) is not supported yet"
                )
        arch = self.metadata["general.architecture"]
        self._tensors = {gguf_to_hf_name(name, arch): t for name, t in by_name.items()}
        # Gemma: stored as 1 + w, read back as w
        self._shifted = {
            n for n in self._tensors if arch in NORM_SHIFTED_ARCHS and n.endswith("norm.weight")
        }
        heads = {
            "attn_q": self.hf_config["num_attention_heads"],
            "attn_k": self.hf_config["num_key_value_heads"],
        }
        self._permuted_heads = {}  # HF name -> heads whose rotary rows llama.cpp permuted
        if arch in PERMUTED_ARCHS:
            for name in by_name:
                kind = name.split(".")[2] if name.startswith("blk.") else None
                if kind in heads:
                    self._permuted_heads[gguf_to_hf_name(name, arch)] = heads[kind]
        self._last: tuple[str, np.ndarray] | None = None

    def tokenizer(self) -> Tokenizer | None:
        return tokenizer_from_gguf_metadata(self.metadata)

    def shapes(self) -> dict[str, tuple[int, ...]]:
        return {
            name: tuple(int(d) for d in reversed(t.shape.tolist()))
            for name, t in self._tensors.items()
        }

    def read(self, name: str, index: Index | None = None) -> np.ndarray:
        if self._last is None or self._last[0] != name:
            self._last = None  # free the previous tensor before dequantizing the next
            value = dequantize_tensor(self._tensors[name])
            if name in self._permuted_heads:
                value = unpermute_rotary_rows(value, self._permuted_heads[name])
            if name in self._shifted:
                value = value - np.asarray(1.0, value.dtype)
            self._last = (name, value)
        value = self._last[1]
        return value if index is None else value[tuple(index)]

    def read_q8_0(self, name: str) -> tuple[np.ndarray, np.ndarray] | None:
        """Tensor ``name`` as its Q8_0 blocks, not dequantized, or None when it is not Q8_0.

        Returns ``(q [rows, cols] int8, scale [rows, cols / 32] float32)`` in HF layout
        (llama q/k rows unpermuted like ``read``'s): ``q * scale`` repeated over each block of
        32 columns equals ``read(name)`` bit for bit (gguf's dequantization is the same
        float32 product of the int8 value and the float16 scale).
        """
        tensor = self._tensors[name]
        if tensor.tensor_type != GGMLQuantizationType.Q8_0:
            return None
        shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))
        block, type_size = gguf.GGML_QUANT_SIZES[GGMLQuantizationType.Q8_0]  # 32, 34 bytes
        raw = np.asarray(tensor.data).view(np.uint8).reshape(-1, type_size)  # [blocks, 34]
        scale = raw[:, :2].copy().view(np.float16).astype(np.float32)  # [blocks, 1]
        q = raw[:, 2:].view(np.int8)  # [blocks, 32]
        q = q.reshape(shape)
        scale = scale.reshape(*shape[:-1], shape[-1] // block)
        if name in self._permuted_heads:  # rows are output channels: blocks move whole
            q = unpermute_rotary_rows(q, self._permuted_heads[name])
            scale = unpermute_rotary_rows(scale, self._permuted_heads[name])
        return np.ascontiguousarray(q), np.ascontiguousarray(scale)

    def close(self) -> None:
        self._last = None


def read_gguf(
    path: str | os.PathLike,
) -> tuple[dict, dict[str, np.ndarray], Tokenizer | None, str | None]:
    """Reads a GGUF checkpoint.

    Returns:
      ``(config_dict, tensors, tokenizer, chat_template)``: an HF config.json-style dict;
      ``{HF name: np.ndarray}`` in HF layout (linear weights ``[out, in]``, llama q/k rows in
      HF rotate-half order); the tokenizer from the metadata (None if absent); the chat
      template source (None if absent). When the file has no ``output.weight`` the config says
      ``tie_word_embeddings: true`` and no ``lm_head.weight`` is returned.

    Raises:
      ValueError: missing file, unsupported architecture, tensor type, tensor name or tokenizer.
    """
    with GGUFTensors(path) as source:
        tensors = {name: source.read(name) for name in source.shapes()}
        return (
            source.hf_config,
            tensors,
            source.tokenizer(),
            source.metadata.get("tokenizer.chat_template"),
        )
