"""bf16 linear layers packed for the CPU's bf16 instructions, once, when an engine loads its model.

On a CPU with AMX (Intel Sapphire Rapids and later) or AVX512-BF16 (AMD Zen 4 and later, Intel
Cooper Lake), a one-device engine replaces every ``nnx.Linear`` with a bf16 kernel by an
:class:`AmxLinear` holding the same weights in the layout of ``jaxkv.pallas_kernels.amx`` (same
bytes, zero-padded to blocks of 32), and its matmuls run ``cpu_kernels/amx_matmul.cc`` at every
row count: AMX tiles, or AVX512-BF16 dot products where there are no tiles (and for a few rows).
A 64 x 576 x 1536 product of a decode step of 64 sequences of SmolLM2-135M: ~0.14 ms on the
tiles against XLA:CPU's ~0.22 ms (Intel Xeon), 0.26 against 0.38 ms on the dot products (AMD
EPYC); prefill products as fast as XLA's or faster (numbers in benchmarks/RESULTS.md). The
products equal XLA's bf16 dot with f32 results (the same bf16 inputs, f32 sums, one rounding).
A SwiGLU ``GatedMLP`` whose gate and up projections are packed computes its hidden layer in one
kernel (:meth:`AmxLinear.silu_gated`: x read once, neither projection written; the same values).

Not packed: float32 models, the LM head and the embedding (a bf16 head runs on the same
kernel as it is stored: ``amx.out_major_matmul``), quantized layers, tensor-parallel engines
(their kernels are split by ``models.sharding``'s rules on the ``[in, out]`` layout), and any
engine when ``JAXKV_CPU_AMX=0`` or the machine or build has neither AMX nor AVX512-BF16.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxkv.models.layers import gated_product
from jaxkv.models.quant import replace_module
from jaxkv.pallas_kernels import amx


class AmxLinear(nnx.Module):
    """``y = x @ kernel + bias`` in bf16, ``kernel [in, out]`` kept packed
    (``packed [ceil(out / 32), ceil(in / 32), 2, 16, 32]`` bf16, ``amx.pack``); ``bias [out]``
    bf16 or None. Computes like ``nnx.Linear(dtype=bfloat16)`` on the CPU: x cast to bf16, f32
    sums rounded once to bf16, then the bias added. ``linear_def``: the ``nnx.graphdef`` of the
    layer it was packed from, which :func:`unpack_linears` restores."""

    def __init__(self, packed, bias, *, in_features: int, out_features: int, linear_def):
        if packed.shape != amx.packed_shape(in_features, out_features):
            raise ValueError(
                f"packed {packed.shape} is not the layout of a [{in_features}, {out_features}] "
                f"kernel ({amx.packed_shape(in_features, out_features)})"
            )
        self.in_features, self.out_features = int(in_features), int(out_features)
        self.linear_def = linear_def
        self.packed = nnx.Param(packed)
        self.bias = None if bias is None else nnx.Param(bias)

    @classmethod
    def from_linear(cls, linear: nnx.Linear) -> AmxLinear:
        w = linear.kernel[...]  # [in, out] bf16
        bias = None if linear.bias is None else linear.bias[...].astype(jnp.bfloat16)
        return cls(
            amx.pack(w),
            bias,
            in_features=w.shape[0],
            out_features=w.shape[1],
            linear_def=nnx.graphdef(linear),
        )

    def kernel(self) -> jax.Array:  # [in, out] bf16
        return amx.unpack(self.packed[...], self.in_features, self.out_features)

    def _rows(self, x: jax.Array) -> jax.Array:  # [..., in] -> [R, in] bf16
        return x.reshape(int(np.prod(x.shape[:-1])), self.in_features).astype(jnp.bfloat16)

    def _portable_product(self, x2: jax.Array, packed: jax.Array) -> jax.Array:
        """``x2 [R, in] @ unpack(packed)`` in bf16 with XLA's dot: what the packed kernels
        compute, for platforms without them (not reached by engines: packing is CPU-only)."""
        w = amx.unpack(packed, self.in_features, self.out_features)
        return jnp.dot(x2, w, preferred_element_type=jnp.float32).astype(jnp.bfloat16)

    def __call__(self, x: jax.Array) -> jax.Array:  # [..., in] -> [..., out] bf16
        def on_cpu(x2, packed):  # rounded to bf16 in the kernel
            return amx.matmul(x2, packed, self.out_features, jnp.bfloat16)

        y = jax.lax.platform_dependent(
            self._rows(x), self.packed[...], cpu=on_cpu, default=self._portable_product
        )
        y = y.reshape(*x.shape[:-1], self.out_features)
        if self.bias is not None:
            y = y + self.bias[...]
        return y

    def silu_gated(self, up: AmxLinear, x: jax.Array) -> jax.Array | None:
        """``silu(self(x)) * up(x)`` as ``GatedMLP`` computes it on bf16 layers (the same
        roundings), ``[..., in] -> [..., out]`` bf16, in one kernel on the CPU
        (``amx.silu_gated_matmul``); None where it does not apply (``up`` not packed alike, a
        bias)."""
        if (
            not isinstance(up, AmxLinear)
            or self.bias is not None
            or up.bias is not None
            or (up.in_features, up.out_features) != (self.in_features, self.out_features)
        ):
            return None

        def on_cpu(x2, gate, up_packed):
            return amx.silu_gated_matmul(x2, gate, up_packed, self.out_features)

        def elsewhere(x2, gate, up_packed):
            project = self._portable_product
            return gated_product("silu", project(x2, gate), project(x2, up_packed))

        y = jax.lax.platform_dependent(
            self._rows(x), self.packed[...], up.packed[...], cpu=on_cpu, default=elsewhere
        )
        return y.reshape(*x.shape[:-1], self.out_features)


def _packable(node) -> bool:
    """A bf16 ``nnx.Linear`` whose kernel is a concrete array on the CPU (not an abstract
    model's shape, which compile-only checks pass, nor a traced value)."""
    if not isinstance(node, nnx.Linear):
        return False
    w = node.kernel.get_value()  # a ShapeDtypeStruct in an abstract model
    return (
        isinstance(w, jax.Array)
        and not isinstance(w, jax.core.Tracer)
        and w.ndim == 2
        and jnp.dtype(w.dtype) == jnp.bfloat16
        and jnp.dtype(node.dtype or w.dtype) == jnp.bfloat16
        and all(d.platform == "cpu" for d in w.devices())
    )


def pack_for_cpu(model):
    """``model`` with its bf16 ``nnx.Linear`` layers as :class:`AmxLinear` where this process
    runs the packed kernel (``amx.available()``: AMX tiles or AVX512-BF16), else ``model``
    itself. The packed model is a copy (``model``'s own layers are untouched) sharing every
    other array with it."""
    if not amx.available():
        return model
    return _replaced(model, _packable, AmxLinear.from_linear)


def unpack_linears(model):
    """``model`` with each :class:`AmxLinear` back as the bf16 ``nnx.Linear`` it was packed
    from (the same values), else ``model`` itself: the portable model that a GPU or TPU
    compile of a CPU engine's programs (``jaxkv.gpu_aot`` / ``jaxkv.tpu_aot``) compiles, as that
    platform would load it. A copy, sharing every other array with ``model``."""
    return _replaced(model, lambda node: isinstance(node, AmxLinear), _as_linear)


def _replaced(model, match, make):
    """A copy of ``model`` (sharing its arrays) with each submodule ``node`` where
    ``match(node)`` replaced by ``make(node)``; ``model`` itself when none matches."""
    paths = [path for path, node in nnx.iter_graph(model) if path and match(node)]
    if not paths:
        return model
    model = nnx.merge(*nnx.split(model))
    for path in paths:
        replace_module(model, path, make)
    return model


def _as_linear(layer: AmxLinear) -> nnx.Linear:
    weights = {"kernel": nnx.Param(layer.kernel())}
    if layer.bias is not None:
        weights["bias"] = nnx.Param(layer.bias[...])
    return nnx.merge(layer.linear_def, nnx.State(weights))


def packed_linears(model) -> int:
    """How many layers of ``model`` are :class:`AmxLinear`."""
    return sum(isinstance(node, AmxLinear) for _, node in nnx.iter_graph(model))
