"""Hugging Face checkpoints that ship fp8 weights, loaded as vLLM loads them: the float8_e4m3fn
bits kept as stored in ``QuantizedLinear(mode="fp8")`` / ``QuantizedLMHead`` (weight-only:
activations stay float).

``quantization_config`` layouts (``fp8_scheme``):

* ``quant_method: "fp8"`` with ``weight_block_size: [128, 128]`` (transformers'
  FineGrainedFP8, DeepSeek-V3, Qwen3-FP8): ``X.weight`` float8_e4m3fn ``[out, in]`` and
  ``X.weight_scale_inv`` float32 ``[ceil(out / 128), ceil(in / 128)]``, ``w = q *
  scale_inv[o // 128, i // 128]``. Without ``weight_block_size`` (vLLM's per-tensor fp8): a
  scalar ``X.weight_scale``.
* ``quant_method: "compressed-tensors"``, ``format`` "float-quantized" / "naive-quantized"
  (or "mixed-precision" with one of those in each group),
  every ``config_groups`` weight scheme ``{"num_bits": 8, "type": "float", "symmetric":
  true}`` with ``strategy`` "channel" (``X.weight_scale [out, 1]``), "tensor" (``[1]`` or
  ``[]``) or "block" (``block_structure [bo, bi]``, scale ``[ceil(out / bo), ceil(in /
  bi)]``).

A static ``X.input_scale`` is read past and ignored (activations are not quantized);
``activation_scheme`` / ``input_activations`` are accepted for the same reason. Which linear
layers are fp8 is read from the tensors (a ``weight`` with a scale next to it); layers the
checkpoint keeps in float (``ignore``, ``modules_to_not_convert``, ``lm_head``) are quantized
at load as ``quantization="fp8"`` quantizes a float checkpoint.

jaxkv's layouts (``jaxkv.models.quant``), bit for bit: per channel -> ``scale [out]``; per
tensor -> ``scale [out]``, the one value repeated; a ``bo x bi`` block -> ``block_scale
[in / bi, out]`` (HF orientation ``[out, in / bi]`` here), each row block's scale repeated
over its ``bo`` outputs (a ragged last output block is fine; ``in`` must divide by ``bi``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import ml_dtypes
import numpy as np

from jaxkv.models.checkpoint.tensors import CheckpointTensors, Index

#: ``quant_method`` values whose fp8 weights load (as quantization "fp8")
FP8_QUANT_METHODS = ("fp8", "compressed-tensors")
_CT_FORMATS = ("float-quantized", "naive-quantized")
_CT_STRATEGIES = ("channel", "tensor", "block")
_SCALE_SUFFIXES = ("weight_scale_inv", "weight_scale")


@dataclasses.dataclass(frozen=True)
class Fp8Scheme:
    """What a checkpoint's ``quantization_config`` allows: the weight scale ``strategies``
    ("block", "channel", "tensor") and the ``(out, in)`` size of a "block" strategy's blocks."""

    quant_method: str
    strategies: frozenset[str]
    block: tuple[int, int] | None = None


def _bad(what: str, value: Any, quant_method: str) -> ValueError:
    return ValueError(
        f"unsupported quantization_config {what}={value!r} (quant_method {quant_method!r}); "
        "jaxkv loads fp8 (float8_e4m3fn) weights: quant_method 'fp8', or 'compressed-tensors' "
        "with 8-bit float, symmetric 'channel' / 'tensor' / 'block' weight scales"
    )


def _block_size(value: Any, what: str, quant_method: str) -> tuple[int, int]:
    if (
        not isinstance(value, (list, tuple))
        or len(value) != 2
        or not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in value)
    ):
        raise _bad(what, value, quant_method)
    return int(value[0]), int(value[1])


def _fp8_method(qc: Mapping[str, Any]) -> Fp8Scheme:
    method = "fp8"
    scheme = qc.get("activation_scheme", "dynamic")
    if scheme not in ("dynamic", "static"):
        raise _bad("activation_scheme", scheme, method)
    fmt = qc.get("fmt", "e4m3")
    if fmt not in ("e4m3", "float8_e4m3fn"):
        raise _bad("fmt", fmt, method)
    block = qc.get("weight_block_size")
    if block is None:
        return Fp8Scheme(method, frozenset({"tensor"}))
    return Fp8Scheme(method, frozenset({"block"}), _block_size(block, "weight_block_size", method))


def _compressed_tensors(qc: Mapping[str, Any]) -> Fp8Scheme:
    method = "compressed-tensors"
    mixed = qc.get("format") == "mixed-precision"  # then each group names its own format
    if qc.get("format") not in _CT_FORMATS and not mixed:
        raise _bad("format", qc.get("format"), method)
    for key in ("kv_cache_scheme", "transform_config"):
        if qc.get(key):
            raise _bad(key, qc[key], method)
    sparsity = qc.get("sparsity_config")
    if sparsity and sparsity.get("format", "dense") != "dense":
        raise _bad("sparsity_config", sparsity, method)
    groups = qc.get("config_groups")
    if not isinstance(groups, Mapping) or not groups:
        raise _bad("config_groups", groups, method)
    strategies, blocks = set(), set()
    for name, group in groups.items():
        if not isinstance(group, Mapping):
            raise _bad(f"config_groups.{name}", group, method)
        if (group.get("format") is not None or mixed) and group.get("format") not in _CT_FORMATS:
            raise _bad(f"config_groups.{name}.format", group.get("format"), method)
        if group.get("output_activations"):
            raise _bad(
                f"config_groups.{name}.output_activations", group["output_activations"], method
            )
        w = group.get("weights")
        if not isinstance(w, Mapping):
            raise _bad(f"config_groups.{name}.weights", w, method)
        where = f"config_groups.{name}.weights"
        checks = (
            ("num_bits", w.get("num_bits") == 8),
            ("type", w.get("type") == "float"),
            ("symmetric", w.get("symmetric", True) is True),
            ("strategy", w.get("strategy") in _CT_STRATEGIES),
            ("dynamic", not w.get("dynamic", False)),
            ("group_size", w.get("group_size") is None),
            ("actorder", not w.get("actorder")),
        )
        for key, ok in checks:
            if not ok:
                raise _bad(f"{where}.{key}", w.get(key), method)
        strategies.add(w["strategy"])
        if w["strategy"] == "block":
            blocks.add(_block_size(w.get("block_structure"), f"{where}.block_structure", method))
    if len(blocks) > 1:
        raise _bad("block_structure", sorted(blocks), method)
    return Fp8Scheme(method, frozenset(strategies), blocks.pop() if blocks else None)


def fp8_scheme(hf_config: Mapping[str, Any]) -> Fp8Scheme | None:
    """The ``Fp8Scheme`` of an HF ``config.json`` dict (its ``quantization_config``, or its
    ``text_config``'s), None when it has none. ValueError naming any other quantization (an
    unknown ``quant_method``, awq, gptq, int4 / int8 weights, dynamic or group strategies,
    asymmetric scales, a quantized KV cache, ...)."""
    qc = hf_config.get("quantization_config")
    text = hf_config.get("text_config")
    if qc is None and isinstance(text, Mapping):
        qc = text.get("quantization_config")
    if qc is None:
        return None
    if not isinstance(qc, Mapping):
        raise ValueError(f"unsupported quantization_config {qc!r} (not a mapping)")
    method = qc.get("quant_method")
    if method == "fp8":
        return _fp8_method(qc)
    if method == "compressed-tensors":
        return _compressed_tensors(qc)
    raise ValueError(
        f"unsupported quantization_config quant_method {method!r}; supported: "
        f"{FP8_QUANT_METHODS} with fp8 weights (load an unquantized checkpoint otherwise)"
    )


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


class Fp8Tensors(CheckpointTensors):
    """An fp8 checkpoint's tensors under the float model's names: the scales (``*.weight_scale``,
    ``*.weight_scale_inv``) and ``*.input_scale`` are not listed, ``read`` of an fp8 weight
    returns it dequantized (float32, HF layout) and ``read_fp8`` returns its stored bits and
    scales in jaxkv's layout. Shapes are checked at construction (ValueError naming the
    layer)."""

    def __init__(self, source: CheckpointTensors, scheme: Fp8Scheme):
        self._source = source
        self.scheme = scheme
        shapes = source.shapes()
        scale_of: dict[str, str] = {}  # weight name -> its scale tensor's name
        hidden = set()
        for name in shapes:
            for suffix in _SCALE_SUFFIXES + ("input_scale",):
                if not name.endswith("." + suffix):
                    continue
                weight = name[: -len(suffix)] + "weight"
                if weight not in shapes:
                    raise ValueError(f"fp8 checkpoint: {name!r} has no {weight!r} next to it")
                hidden.add(name)
                if suffix != "input_scale":
                    if weight in scale_of:
                        raise ValueError(
                            f"fp8 checkpoint: {weight!r} has two scales, "
                            f"{scale_of[weight]!r} and {name!r}"
                        )
                    scale_of[weight] = name
                break
        self._shapes = {n: s for n, s in shapes.items() if n not in hidden}
        self._scale_of = scale_of
        #: weight name -> (strategy, input block or None)
        self._layout = {w: self._classify(w, shapes[w], shapes[s]) for w, s in scale_of.items()}

    def _classify(self, name: str, shape: tuple, scale_shape: tuple) -> tuple[str, int | None]:
        if len(shape) != 2:
            raise ValueError(f"fp8 checkpoint: {name!r} has shape {shape}, not [out, in]")
        n_out, n_in = shape
        block = self.scheme.block
        if (
            block is not None
            and len(scale_shape) == 2
            and scale_shape == (_ceil_div(n_out, block[0]), _ceil_div(n_in, block[1]))
        ):
            strategy = "block"
        elif scale_shape in ((), (1,)):
            strategy = "tensor"
        elif scale_shape in ((n_out,), (n_out, 1)):
            strategy = "channel"
        else:
            raise ValueError(
                f"fp8 checkpoint: the scale {scale_shape} of {name!r} {shape} fits none of "
                f"the strategies {sorted(self.scheme.strategies)}"
                + (f" (blocks {list(block)})" if block else "")
            )
        if strategy not in self.scheme.strategies:
            raise ValueError(
                f"fp8 checkpoint: {name!r} has a per-{strategy} scale {scale_shape}; its "
                f"quantization_config allows {sorted(self.scheme.strategies)}"
            )
        if strategy != "block":
            return strategy, None
        if n_in % block[1]:
            raise ValueError(
                f"fp8 checkpoint: {name!r} has {n_in} inputs, not a multiple of its block of "
                f"{block[1]} inputs (jaxkv's per-block scales cover whole blocks of inputs)"
            )
        return strategy, block[1]

    def quantized_layout(self) -> dict[str, int | None]:
        """``{weight name: block of inputs (None: one scale per output)}`` of every fp8
        weight: the layout its ``QuantizedLinear`` / ``QuantizedLMHead`` must have."""
        return {name: block for name, (_, block) in self._layout.items()}

    def shapes(self) -> dict[str, tuple[int, ...]]:
        return dict(self._shapes)

    def read_fp8(self, name: str) -> tuple[np.ndarray, np.ndarray] | None:
        """``(q [out, in] float8_e4m3fn, scale [out] | [out, in / block] float32)`` of fp8
        weight ``name`` (its bits as stored, its scales mapped as the module docstring says),
        None for a tensor stored in float."""
        if name not in self._layout:
            return None
        strategy, block = self._layout[name]
        q = np.asarray(self._source.read(name, None))
        if q.dtype != ml_dtypes.float8_e4m3fn:
            raise ValueError(
                f"fp8 checkpoint: {name!r} has a scale but is stored as {q.dtype}, not "
                "float8_e4m3fn (the only fp8 weight type jaxkv keeps)"
            )
        n_out, n_in = q.shape
        s = np.asarray(self._source.read(self._scale_of[name], None)).astype(np.float32)
        if strategy == "tensor":
            scale = np.full((n_out,), s.reshape(()), np.float32)
        elif strategy == "channel":
            scale = np.ascontiguousarray(s.reshape(n_out))
        else:  # [ceil(out / bo), in / bi] -> each row block's scales over its outputs
            scale = np.ascontiguousarray(np.repeat(s, self.scheme.block[0], axis=0)[:n_out])
        return q, scale

    def read(self, name: str, index: Index | None = None) -> np.ndarray:
        stored = self.read_fp8(name)
        if stored is None:
            arr = self._source.read(name, index)
            if arr.dtype in (ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e5m2):
                raise ValueError(f"fp8 checkpoint: {name!r} is stored as {arr.dtype} with no scale")
            return arr
        q, scale = stored
        n_out, n_in = q.shape
        if scale.ndim == 1:
            w = q.astype(np.float32) * scale[:, None]
        else:
            groups = scale.shape[1]
            w = q.reshape(n_out, groups, n_in // groups).astype(np.float32) * scale[:, :, None]
            w = w.reshape(n_out, n_in)
        return w if index is None else w[tuple(index)]

    def close(self) -> None:
        self._source.close()


def quantize_as_stored(model, layout: Mapping[str, int | None]):
    """``model`` (float, inside ``nnx.eval_shape`` or concrete) with every ``nnx.Linear`` and
    its LM head replaced, in place, by fp8 ``QuantizedLinear`` / ``QuantizedLMHead`` laid out
    as the checkpoint stores them: ``layout`` (``Fp8Tensors.quantized_layout``) gives each fp8
    weight's block of inputs; layers not in it (float in the checkpoint, or a tied head) get
    one scale per output, as ``quantize_model(model, "fp8")``. Returns ``model``."""
    from jaxkv.models.quant import quantize_model

    return quantize_model(model, "fp8", blocks=layout)
