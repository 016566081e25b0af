"""HF parameter names <-> model parameters.

The module tree mirrors HF's, so a parameter's HF name is its module path plus a leaf name:
  ("model", "layers", 3, "self_attn", "q_proj", "kernel")  <->  "model.layers.3.self_attn.q_proj.weight"
Leaves: Linear ``kernel [in, out]`` <-> HF ``weight [out, in]`` (transposed); ``bias`` as is;
RMSNorm ``weight`` as is; Embed ``embedding [V, hidden]`` <-> ``weight`` as is.

Names that carry no parameters are skipped as vLLM does: ``*.rotary_emb.inv_freq`` buffers
and ``lm_head.weight`` when the embeddings are tied (some tied checkpoints still store it).
"""

from __future__ import annotations

from collections.abc import Mapping

import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxkv.models.transformer import CausalLM

_LEAF_NAMES = {"kernel": "weight", "bias": "bias", "weight": "weight", "embedding": "weight"}


def _hf_layout(model: CausalLM) -> dict[str, tuple[tuple, tuple[int, ...], bool]]:
    """HF name -> (nnx path, HF shape, transposed?) for every parameter of ``model``."""
    layout = {}
    for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        leaf = path[-1]
        if leaf not in _LEAF_NAMES:
            raise ValueError(f"parameter {path} has no HF name mapping")
        name = ".".join(str(p) for p in path[:-1]) + "." + _LEAF_NAMES[leaf]
        shape = tuple(var.get_value().shape)  # works for abstract (eval_shape) models too
        transposed = leaf == "kernel"
        layout[name] = (path, shape[::-1] if transposed else shape, transposed)
    return layout


def _skippable(name: str, model: CausalLM) -> bool:
    return name.endswith("rotary_emb.inv_freq") or (
        name == "lm_head.weight" and model.config.tie_word_embeddings)


def load_hf_weights(model: CausalLM, tensors: Mapping[str, np.ndarray]) -> CausalLM:
    """Sets every parameter from HF-named tensors (in place; returns ``model``), cast to config.dtype.

    Raises ValueError naming every missing tensor, every unexpected one, and every shape
    mismatch (HF shape, i.e. ``[out, in]`` for projections), before touching the model.
    """
    layout = _hf_layout(model)
    missing = sorted(set(layout) - set(tensors))
    unexpected = sorted(n for n in tensors if n not in layout and not _skippable(n, model))
    mismatched = [f"{n}: got {tuple(np.shape(tensors[n]))}, expected {layout[n][1]}"
                  for n in sorted(set(layout) & set(tensors))
                  if tuple(np.shape(tensors[n])) != layout[n][1]]
    problems = []
    if missing:
        problems.append(f"missing tensors ({len(missing)}): {missing}")
    if unexpected:
        problems.append(f"unexpected tensors ({len(unexpected)}): {unexpected}")
    if mismatched:
        problems.append(f"shape mismatches ({len(mismatched)}): {mismatched}")
    if problems:
        raise ValueError(f"cannot load HF weights into {type(model).__name__} "
                         f"({model.config.architecture}, {model.config.num_hidden_layers} layers): "
                         + "; ".join(problems))
    dtype = jnp.dtype(model.config.dtype)
    updates = []
    for name, (path, _, transposed) in layout.items():
        arr = np.asarray(tensors[name])
        updates.append((path, jnp.asarray(arr.T if transposed else arr, dtype=dtype)))
    nnx.update(model, nnx.from_flat_state(updates))
    return model


def hf_state_dict(model: CausalLM) -> dict[str, np.ndarray]:
    """The inverse of ``load_hf_weights``: HF name -> numpy array in HF layout (config.dtype)."""
    out = {}
    params = dict(nnx.to_flat_state(nnx.state(model, nnx.Param)))
    for name, (path, _, transposed) in _hf_layout(model).items():
        arr = np.asarray(params[path][...])
        out[name] = np.ascontiguousarray(arr.T) if transposed else arr
    return out
