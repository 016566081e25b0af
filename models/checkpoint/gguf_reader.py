"""Reads a llama.cpp GGUF file into HF config, HF-named tensors and a tokenizer.

gguf-py's `GGUFReader` memory-maps the file; tensors are dequantized with
`gguf.quants.dequantize` (F32, F16, BF16, Q8_0, Q4_0, Q4_1, the K-quants, ... whatever the
installed gguf supports). F32 and F16 keep their dtype; everything else becomes float32.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import gguf
import numpy as np
from gguf import GGMLQuantizationType, GGUFValueType

from jaxkv.models.checkpoint.gguf_config import gguf_config
from jaxkv.models.checkpoint.gguf_names import UNSUPPORTED_TENSORS, PERMUTED_ARCHS, gguf_to_hf_name, unpermute_rotary_rows
from jaxkv.models.checkpoint.gguf_tokenizer import tokenizer_from_gguf_metadata
from jaxkv.models.tokenizer import Tokenizer


def _field_value(field) -> Any:
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
    return {k: _field_value(f) for k, f in reader.fields.items() if not k.startswith("GGUF.")}


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
            raise ValueError(f"GGUF tensor {tensor.name!r} has unsupported type {qtype.name}") from e
    return out.reshape(shape)


def read_gguf(path: str | os.PathLike) -> tuple[dict, dict[str, np.ndarray], Tokenizer | None, str | None]:
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
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"GGUF file {str(p)!r} does not exist")
    reader = gguf.GGUFReader(str(p))
    meta = read_gguf_metadata(reader)
    by_name = {t.name: t for t in reader.tensors}
    if "token_embd.weight" not in by_name:
        raise ValueError(f"GGUF file {str(p)!r} has no 'token_embd.weight' tensor")
    vocab_size = int(by_name["token_embd.weight"].shape[-1])
    config = gguf_config(meta, vocab_size=vocab_size, tied_embeddings="output.weight" not in by_name)

    arch = meta["general.architecture"]
    heads = {"attn_q": config["num_attention_heads"], "attn_k": config["num_key_value_heads"]}
    tensors: dict[str, np.ndarray] = {}
    for name, tensor in by_name.items():
        if name in UNSUPPORTED_TENSORS:
            raise ValueError(f"GGUF tensor {name!r} (rope frequency factors) is not supported yet")
        value = dequantize_tensor(tensor)
        kind = name.split(".")[2] if name.startswith("blk.") else None
        if arch in PERMUTED_ARCHS and kind in heads:
            value = unpermute_rotary_rows(value, heads[kind])
        tensors[gguf_to_hf_name(name)] = value
    tokenizer = tokenizer_from_gguf_metadata(meta)
    return config, tensors, tokenizer, meta.get("tokenizer.chat_template")
