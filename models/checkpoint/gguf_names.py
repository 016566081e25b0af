"""GGUF tensor names and layouts <-> Hugging Face names and layouts.

gguf-py's reader hands tensors back in numpy order (GGUF lists dims innermost first; the reader
reverses them), so a linear weight comes back as HF's ``[out, in]`` and needs no transpose.
What differs is the name and, for the ``llama`` architecture, the row order of q/k weights:
llama.cpp's HF converter permutes them for its interleaved rotary layout. Per head (``d =
head_dim``) HF rows ``[r_0 .. r_{d/2-1} | r_{d/2} .. r_{d-1}]`` (rotate-half pairs ``(i, i +
d/2)``) are stored as ``[r_0, r_{d/2}, r_1, r_{d/2+1}, ...]`` (adjacent pairs). Example, one
head, ``d = 4``: HF rows ``[a, b, c, d]`` are stored as ``[a, c, b, d]``.
"""

from __future__ import annotations

import re

import numpy as np

# GGUF per-block tensor name -> HF name inside ``model.layers.N.``.
_BLOCK_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# Gemma 2 / 3's sandwich norms: llama.cpp's ffn_norm is the norm before the feed-forward.
_GEMMA_BLOCK_NAMES = {
    **_BLOCK_NAMES,
    "ffn_norm": "pre_feedforward_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
# Architectures whose converter stores every RMSNorm weight as 1 + w (Gemma's norms scale by
# 1 + w; llama.cpp's by w): their norm weights are read back as w.
NORM_SHIFTED_ARCHS = frozenset({"gemma3"})
_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
# Tensors with no HF parameter that change the math: llama.cpp stores Llama 3.1's rope scaling
# as precomputed per-frequency factors. Loading without them would give a different model.
UNSUPPORTED_TENSORS = frozenset({"rope_freqs.weight"})
# Architectures whose converter permutes attn_q / attn_k rows (see module docstring).
PERMUTED_ARCHS = frozenset({"llama"})

_BLOCK_RE = re.compile(r"^blk\.(\d+)\.([a-z_0-9]+)\.(weight|bias)$")
_GLOBAL_RE = re.compile(r"^([a-z_]+)\.(weight|bias)$")


def gguf_to_hf_name(name: str, arch: str = "llama") -> str:
    """Maps a GGUF tensor name of architecture ``arch`` to its HF name, e.g.
    ``blk.3.attn_q.weight`` -> ``model.layers.3.self_attn.q_proj.weight``; ``blk.3.ffn_norm``
    is ``post_attention_layernorm`` in Llama and ``pre_feedforward_layernorm`` in Gemma 3.

    Raises:
      ValueError: a name this reader does not know.
    """
    block_names = _GEMMA_BLOCK_NAMES if arch == "gemma3" else _BLOCK_NAMES
    m = _BLOCK_RE.match(name)
    if m and m.group(2) in block_names:
        return f"model.layers.{m.group(1)}.{block_names[m.group(2)]}.{m.group(3)}"
    m = _GLOBAL_RE.match(name)
    if m and m.group(1) in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[m.group(1)]}.{m.group(2)}"
    raise ValueError(f"unknown GGUF tensor name {name!r}")


def unpermute_rotary_rows(w: np.ndarray, num_heads: int) -> np.ndarray:
    """Undoes llama.cpp's q/k row permutation.

    Args:
      w: ``[num_heads * head_dim, in]`` weight or ``[num_heads * head_dim]`` bias as stored in
        the GGUF file (adjacent rotary pairs).
      num_heads: heads of this projection (query heads for q, KV heads for k).

    Returns:
      The same rows in HF order (rotate-half pairs), same shape and dtype.
    """
    rows = w.shape[0]
    if num_heads <= 0 or rows % (2 * num_heads):
        raise ValueError(f"cannot unpermute {rows} rows into {num_heads} heads of even head_dim")
    half = rows // num_heads // 2
    tail = w.shape[1:]
    return w.reshape(num_heads, half, 2, *tail).swapaxes(1, 2).reshape(w.shape)
