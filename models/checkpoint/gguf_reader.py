"""Reads a llama.cpp GGUF file into HF config, HF-named tensors and a tokenizer.

gguf-py's `GGUFReader` memory-maps the file; tensors are dequantized with
`gguf.quants.dequantize` (F32, F16, BF16, Q8_0, Q4_0, Q4_1, the K-quants, ... whatever the
installed gguf supports). F32 and F16 keep their dtype; everything else becomes float32.
``GGUFTensors.read_q8_0`` reads a Q8_0 tensor as its blocks instead (int8 values and one
scale per 32 inputs), what ``load_model(..., quantization="int8")`` keeps in device memory;
``GGUFTensors.read_q4`` reads a Q4_0 / Q4_1 / Q4_K tensor as 4-bit blocks of 32 with a scale
and an offset each (``jaxkv.models.quant``'s "q4" layout), and ``quantized_layout`` says how
``quantization="q4"`` lays out each layer of the file.
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
from jaxkv.models.quant import GGUF_BLOCK, Q4_BLOCK, LayerQuant, pack_q4
from jaxkv.models.tokenizer import Tokenizer

#: GGUF types ``read_q4`` reads as "q4" blocks
Q4_TYPES = (GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1, GGMLQuantizationType.Q4_K)
#: quantized GGUF types of more than 4 bits a weight (other than Q8_0)
WIDER_THAN_Q4 = tuple(
    getattr(GGMLQuantizationType, t)
    for t in ("Q5_0", "Q5_1", "Q5_K", "Q6_K", "Q8_1", "Q8_K")
    if hasattr(GGMLQuantizationType, t)
)


def _q4_k_blocks(raw: np.ndarray, d: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Q4_K super-blocks ``raw [rows, n, 144]`` (``d [rows, n, 1]`` float16, their first two
    bytes) -> ``(packed [rows, n * 128], scale, offset [rows, n * 8] float32)``: each 256-value
    super-block's eight sub-blocks of 32 as "q4" blocks, ``scale = d * sc``, ``offset =
    -(dmin * m)`` (gguf's dequantization is ``d * sc * q - dmin * m``)."""
    rows, n, _ = raw.shape
    dmin = raw[..., 2:4].copy().view(np.float16).astype(np.float32)  # [rows, n, 1]
    sc, m = gguf.quants.Q4_K.get_scale_min(raw[..., 4:16].reshape(rows * n, 12))  # [rows*n, 8]
    scale = d.astype(np.float32) * sc.reshape(rows, n, 8).astype(np.float32)
    offset = -(dmin * m.reshape(rows, n, 8).astype(np.float32))
    qs = raw[..., 16:].reshape(rows, n, 4, 1, 32)  # 4 chunks of 32 bytes: sub-blocks 2c, 2c + 1
    q = (qs >> np.array([0, 4], np.uint8).reshape(1, 1, 1, 2, 1)) & np.uint8(15)
    q = q.reshape(rows, n * 256)  # [rows, cols] values 0..15
    packed = pack_q4(np.ascontiguousarray(q.T)).T  # [rows, cols / 2]
    return packed, scale.reshape(rows, n * 8), offset.reshape(rows, n * 8)


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

        Returns ``(q [rows, cols] int8, scale [rows, cols / 32] float16)`` in HF layout
        (llama q/k rows unpermuted like ``read``'s), the scales as stored: ``q * scale`` in
        float32, repeated over each block of 32 columns, equals ``read(name)`` bit for bit
        (gguf's dequantization is the same float32 product of the int8 value and the float16
        scale).
        """
        tensor = self._tensors[name]
        if tensor.tensor_type != GGMLQuantizationType.Q8_0:
            return None
        shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))
        block, type_size = gguf.GGML_QUANT_SIZES[GGMLQuantizationType.Q8_0]  # 32, 34 bytes
        raw = np.asarray(tensor.data).view(np.uint8).reshape(-1, type_size)  # [blocks, 34]
        scale = raw[:, :2].copy().view(np.float16)  # [blocks, 1]
        q = raw[:, 2:].view(np.int8)  # [blocks, 32]
        q = q.reshape(shape)
        scale = scale.reshape(*shape[:-1], shape[-1] // block)
        if name in self._permuted_heads:  # rows are output channels: blocks move whole
            q = unpermute_rotary_rows(q, self._permuted_heads[name])
            scale = unpermute_rotary_rows(scale, self._permuted_heads[name])
        return np.ascontiguousarray(q), np.ascontiguousarray(scale)

    def read_q4(self, name: str) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
        """Tensor ``name`` as "q4" blocks (``jaxkv.models.quant.pack_q4``), not dequantized,
        or None when it is not Q4_0, Q4_1 or Q4_K.

        Returns ``(packed [rows, cols / 2] uint8, scale [rows, cols / 32], offset [rows, cols /
        32])`` in HF layout (llama q/k rows unpermuted like ``read``'s), each row packed along
        its columns as ``pack_q4`` packs a column: ``q * scale + offset`` per block of 32
        columns, in float32, equals ``read(name)`` bit for bit. Scales and offsets are the
        stored float16 values (Q4_0: ``d`` and ``-8 d``; Q4_1: ``d`` and ``m``) or, for Q4_K,
        float32 products of its super-block's float16 ``d`` / ``dmin`` and each sub-block's
        6-bit scale / minimum (``d * sc`` and ``-(dmin * m)``, which float16 cannot hold).
        """
        tensor = self._tensors[name]
        qtype = tensor.tensor_type
        if qtype not in Q4_TYPES:
            return None
        shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))
        rows, cols = int(np.prod(shape[:-1])), shape[-1]
        block, type_size = gguf.GGML_QUANT_SIZES[qtype]
        raw = np.asarray(tensor.data).view(np.uint8).reshape(rows, cols // block, type_size)
        d = raw[..., :2].copy().view(np.float16)  # [rows, blocks, 1]
        if qtype == GGMLQuantizationType.Q4_K:
            packed, scale, offset = _q4_k_blocks(raw, d)
        else:
            if qtype == GGMLQuantizationType.Q4_0:  # d * (q - 8) = q * d + (-8 d), exactly
                nibbles, offset = raw[..., 2:], (d.astype(np.float32) * -8).astype(np.float16)
                if not np.isfinite(offset).all():
                    raise ValueError(f"GGUF tensor {name!r}: a Q4_0 scale too large for q4")
            else:  # Q4_1: d * q + m
                nibbles, offset = raw[..., 4:], raw[..., 2:4].copy().view(np.float16)
            packed, scale = nibbles.reshape(rows, cols // 2), d  # already pack_q4's order
        parts = [
            packed.reshape(*shape[:-1], cols // 2),
            scale.reshape(*shape[:-1], cols // 32),
            offset.reshape(*shape[:-1], cols // 32),
        ]
        if name in self._permuted_heads:  # rows are output channels: blocks move whole
            parts = [unpermute_rotary_rows(a, self._permuted_heads[name]) for a in parts]
        return tuple(np.ascontiguousarray(a) for a in parts)

    def quantized_layout(self, mode: str | None) -> dict[str, LayerQuant]:
        """HF weight name -> ``LayerQuant`` of the layers ``quantize_model(model, mode)``
        should lay out other than its default for ``mode`` (``"lm_head.weight"`` for a tied
        head made from the embedding; names of tensors no layer quantizes are harmless).
        "int8": every layer in Q8_0's form, blocks of 32 with float16 scales (Q8_0 tensors
        kept as stored). "q4": a Q4_K tensor's scales are float32; a Q8_0 tensor, and one of
        another format over 4 bits (Q5_*, Q6_K), stays in Q8_0's form, so no weight is
        re-quantized below the file's own width. Other modes: empty."""
        if mode not in ("int8", "q4"):
            return {}
        q8_0 = LayerQuant("int8", GGUF_BLOCK, "float16")
        tied = "lm_head.weight" not in self._tensors
        layout = {}
        for name, tensor in self._tensors.items():
            qtype = tensor.tensor_type
            if mode == "int8":
                if len(tensor.shape) != 2:
                    continue
                quant = q8_0
            elif qtype == GGMLQuantizationType.Q4_K:
                quant = LayerQuant("q4", Q4_BLOCK, "float32")
            elif qtype == GGMLQuantizationType.Q8_0 or qtype in WIDER_THAN_Q4:
                quant = q8_0
            else:
                continue
            layout[name] = quant
            if tied and name == "model.embed_tokens.weight":
                layout["lm_head.weight"] = quant
        return layout

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
