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

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxkv.models.checkpoint.tensors import CheckpointTensors, InMemoryTensors
from jaxkv.models.quant import (
    GGUF_BLOCK,
    LayerQuant,
    QuantizedLinear,
    QuantizedLMHead,
    quantize_layer,
    quantized_modules,
)
from jaxkv.models.sharding import model_rules, param_sharding
from jaxkv.models.transformer import CausalLM

_LEAF_NAMES = {"kernel": "weight", "bias": "bias", "weight": "weight", "embedding": "weight"}


def _hf_layout(model: CausalLM) -> dict[str, tuple[tuple, tuple[int, ...], bool]]:
    """HF name -> (nnx path, HF shape, transposed?) for every parameter of ``model``.

    A quantized module (``jaxkv.models.quant``) is one entry, its float HF tensor: path the
    module's, HF shape the float one's; its scales have no HF name. A quantized head of tied
    embeddings has none (it is made from ``model.embed_tokens.weight``)."""
    qmods = quantized_modules(model)
    layout = {}
    for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        leaf = path[-1]
        owner = qmods.get(tuple(path[:-1]))
        if owner is not None and leaf != "bias":
            if leaf not in ("kernel", "weight"):  # scales
                continue
            if isinstance(owner, QuantizedLMHead) and model.config.tie_word_embeddings:
                continue
        if leaf not in _LEAF_NAMES:
            raise ValueError(f"parameter {path} has no HF name mapping")
        name = ".".join(str(p) for p in path[:-1]) + "." + _LEAF_NAMES[leaf]
        shape = tuple(var.get_value().shape)  # works for abstract (eval_shape) models too
        transposed = leaf == "kernel"
        if owner is not None and leaf != "bias" and owner.mode == "q4":  # two inputs a byte
            shape = (2 * shape[0], shape[1]) if transposed else (shape[0], 2 * shape[1])
        if owner is not None and leaf != "bias":
            path = tuple(path[:-1])  # the module: hf_params quantizes the float tensor into it
        layout[name] = (path, shape[::-1] if transposed else shape, transposed)
    return layout


def _skippable(name: str, model: CausalLM) -> bool:
    return name.endswith("rotary_emb.inv_freq") or (
        name == "lm_head.weight" and model.config.tie_word_embeddings
    )


def check_hf_shapes(model: CausalLM, shapes: Mapping[str, tuple[int, ...]]) -> None:
    """Raises ValueError naming every missing tensor, every unexpected one, and every shape
    mismatch (HF shape, i.e. ``[out, in]`` for projections) of checkpoint tensors of
    ``shapes`` (``{HF name: shape}``) against ``model``'s parameters (abstract models too)."""
    layout = _hf_layout(model)
    missing = sorted(set(layout) - set(shapes))
    unexpected = sorted(n for n in shapes if n not in layout and not _skippable(n, model))
    mismatched = [
        f"{n}: got {tuple(shapes[n])}, expected {layout[n][1]}"
        for n in sorted(set(layout) & set(shapes))
        if tuple(shapes[n]) != layout[n][1]
    ]
    problems = []
    if missing:
        problems.append(f"missing tensors ({len(missing)}): {missing}")
    if unexpected:
        problems.append(f"unexpected tensors ({len(unexpected)}): {unexpected}")
    if mismatched:
        problems.append(f"shape mismatches ({len(mismatched)}): {mismatched}")
    if problems:
        raise ValueError(
            f"cannot load HF weights into {type(model).__name__} "
            f"({model.config.architecture}, {model.config.num_hidden_layers} layers): "
            + "; ".join(problems)
        )


def load_hf_weights(model: CausalLM, tensors: Mapping[str, np.ndarray]) -> CausalLM:
    """Sets every parameter from HF-named tensors (in place; returns ``model``), cast to config.dtype.

    Raises ValueError naming every missing tensor, every unexpected one, and every shape
    mismatch (HF shape, i.e. ``[out, in]`` for projections), before touching the model.
    """
    check_hf_shapes(model, {n: tuple(np.shape(t)) for n, t in tensors.items()})
    nnx.update(model, hf_params(model, InMemoryTensors(tensors)))
    return model


def hf_params(model: CausalLM, tensors: CheckpointTensors, *, mesh=None, rules=None) -> nnx.State:
    """``nnx.state(model, nnx.Param)`` created from checkpoint tensors (cast to config.dtype),
    one parameter at a time; ``model`` may be abstract (``nnx.eval_shape``), its values are
    not read. Call ``check_hf_shapes`` first.

    Without ``mesh`` each parameter is one array on the default device. With a ``"tp"`` mesh
    each is ``jax.make_array_from_callback`` with its ``jaxkv.models.sharding`` placement
    (``rules``, else the model's ``tp_partition_rules`` or DEFAULT_TP_RULES; ValueError when
    a split does not divide): the callback reads only the requested shard (a slice of the HF
    tensor, transposed for kernels) and is called for this process's devices only, so a mesh
    spanning several processes works and each process reads its own shards.
    """
    dtype = jnp.dtype(model.config.dtype)
    rules = model_rules(model) if rules is None else rules
    qmods = quantized_modules(model)
    updates = []

    def place(path, arr):  # a whole host array, placed (shard by shard on a mesh)
        if mesh is None:
            return jnp.asarray(arr)
        name = ".".join(str(p) for p in path)
        sharding = param_sharding(name, arr.shape, mesh, rules)
        return jax.make_array_from_callback(arr.shape, sharding, lambda index: arr[index])

    layout = _hf_layout(model)
    for name, (path, hf_shape, transposed) in layout.items():
        if path in qmods:
            updates.extend(_quantized_params(path, qmods[path], tensors, name, place))
            continue

        def host(index, name=name, transposed=transposed):  # index into the model's layout
            if index is not None and transposed:
                index = tuple(index)[::-1]
            arr = tensors.read(name, index)
            arr = arr.T if transposed else arr
            return np.ascontiguousarray(arr.astype(dtype, copy=False))

        shape = hf_shape[::-1] if transposed else hf_shape
        if mesh is None:
            value = jnp.asarray(host(None))
        else:
            sharding = param_sharding(".".join(str(p) for p in path), shape, mesh, rules)
            value = jax.make_array_from_callback(shape, sharding, host)
        updates.append((path, value))
    for path, module in qmods.items():  # a tied head: quantized from the embedding
        if isinstance(module, QuantizedLMHead) and model.config.tie_word_embeddings:
            updates.extend(
                _quantized_params(path, module, tensors, "model.embed_tokens.weight", place)
            )
    return nnx.from_flat_state(updates)


def _scale_dtype(module) -> np.dtype:
    """The dtype of a quantized module's scales (abstract modules too)."""
    scale = module.scale if module.block is None else module.block_scale
    return np.dtype(scale.get_value().dtype)


def _quantized_params(path: tuple, module, tensors: CheckpointTensors, name: str, place):
    """``[(leaf path, array)]`` of a quantized module from HF tensor ``name``, quantized on
    the host as the module is laid out (its mode, its block); a GGUF Q8_0 tensor whose blocks
    are the module's (int8, 32 inputs) is taken as stored (``read_q8_0``), bit for bit, and so
    are a GGUF Q4_0 / Q4_1 / Q4_K tensor for a "q4" module (``read_q4``) and an fp8
    checkpoint's fp8 weight (``read_fp8``, ``checkpoint.fp8_checkpoint``)."""
    linear = isinstance(module, QuantizedLinear)
    blocks = None
    if module.mode == "int8" and module.block == GGUF_BLOCK and hasattr(tensors, "read_q8_0"):
        blocks = tensors.read_q8_0(name)  # (q [out, in] int8, scale [out, in / 32]) or None
    if module.mode == "q4" and hasattr(tensors, "read_q4"):
        blocks = tensors.read_q4(name)  # (packed [out, in / 2], scale, offset [out, in / 32])
    if module.mode == "fp8" and hasattr(tensors, "read_fp8"):
        blocks = tensors.read_fp8(name)  # (q [out, in] fp8, scale [out] | [out, in / b]) or None
        if blocks is not None:
            stored = None if blocks[1].ndim == 1 else blocks[0].shape[1] // blocks[1].shape[1]
            if stored != module.block:
                raise ValueError(
                    f"{name}: the checkpoint's fp8 block {stored} is not the model's "
                    f"{module.block} (build the model with the checkpoint's layout)"
                )
    leaf_names = ["kernel" if linear else "weight"]
    leaf_names.append("scale" if module.block is None else "block_scale")
    if module.mode == "q4":
        leaf_names.append("block_offset")
    if blocks is not None:
        parts = tuple(a.T for a in blocks) if linear else blocks  # [in, out] | [V, hidden]
    else:
        w = np.asarray(tensors.read(name, None), np.float32)  # HF layout [out, in] / [V, h]
        quant = LayerQuant(module.mode, module.block, _scale_dtype(module).name)
        parts = quantize_layer(w.T, quant)
        if not linear:  # vocab-major [V, hidden], [V] | [V, hidden / block]
            parts = tuple(a.T for a in parts)
    expected = _scale_dtype(module)
    if parts[1].dtype != expected:  # a GGUF Q4_K tensor for a float16 "q4" module
        raise ValueError(
            f"{name}: its stored scales are {parts[1].dtype}, the model's {expected} (build "
            "the model with the checkpoint's layout)"
        )
    return [
        (path + (leaf,), place(path + (leaf,), np.ascontiguousarray(arr)))
        for leaf, arr in zip(leaf_names, parts, strict=True)
    ]


def hf_state_dict(model: CausalLM) -> dict[str, np.ndarray]:
    """The inverse of ``load_hf_weights``: HF name -> numpy array in HF layout (config.dtype);
    quantized kernels and an untied quantized head dequantized (``jaxkv.models.quant``)."""
    out = {}
    params = dict(nnx.to_flat_state(nnx.state(model, nnx.Param)))
    qmods = quantized_modules(model)
    for name, (path, _, transposed) in _hf_layout(model).items():
        if path in qmods:
            arr = np.asarray(qmods[path].dequantized())
        else:
            arr = np.asarray(params[path][...])
        out[name] = np.ascontiguousarray(arr.T) if transposed else arr
    return out
