"""Weight-only quantization: linear kernels and the LM head kept as int8, fp8 or 4-bit blocks in
device memory.

A quantized kernel is ``q`` (int8, or float8_e4m3fn for "fp8") plus float32 scales (float16
for a GGUF's int8 blocks, as Q8_0 stores them), symmetric (no zero point), with
``w ~= q * scale``:

* per output channel: ``scale [out]``, one per column of a ``[in, out]`` kernel
  (``amax over the inputs / qmax``);
* per block of ``block`` inputs: ``scale [in // block, out]`` (GGUF Q8_0's layout with
  block 32: a Q8_0 tensor's blocks load as they are stored, bit for bit).

``QuantizedLinear.__call__`` (``quantized_matmul``) computes inside the jitted forward: per
output channel ``(x @ q) * scale`` (the dot takes ``q`` converted to the compute dtype, which
XLA:GPU fuses into its GEMM: the weights stream from HBM at their own width), per block
``x @ (q * scale)`` (the kernel dequantized in temp first). No float copy of the weights is
stored.

Modes (``load_model(..., quantization=...)``, ``EngineConfig.quantization``):

* ``"int8"``: int8, per output channel; a GGUF checkpoint (and SmolLM2, converted from
  one) gets blocks of 32 inputs with float16 scales instead (Q8_0's form, 34 bytes per 32
  weights), so its Q8_0 tensors are kept as stored and its other tensors (F16/F32, Q4,
  K-quants) are dequantized then re-quantized to such blocks.
* ``"fp8"``: float8_e4m3fn per output channel (``amax / 448``), any checkpoint.
* ``"q4"``: 4-bit blocks of 32 inputs, each with a scale and an offset (GGUF Q4_1's form,
  ``w ~= q * scale + offset``, ``q`` in 0..15, two per byte): half a byte per weight plus the
  block's scale and offset (float16, 1/8 byte per weight; float32 for the blocks of a GGUF
  Q4_K tensor, whose scales are products no float16 holds). A GGUF checkpoint's Q4_0, Q4_1
  and Q4_K tensors are kept as stored, bit for bit (``q * scale + offset`` in float32 is
  gguf's own dequantization); other tensors are quantized at load (min / max per block).

What is quantized: every ``nnx.Linear`` of the model (q/k/v/o, gate/up/down) and the LM
head; a head tied to the embedding gets a quantized copy of its own while the embedding
lookup stays float. Norms, biases and the embedding stay in the model's dtype.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxkv.pallas_kernels.quant_formats import Q4_BLOCK, SCALE_DTYPES

#: ``quantization`` values (None: float weights).
QUANTIZATION_MODES = ("int8", "fp8", "q4")

#: inputs per block of GGUF's Q8_0 (and of the "int8" layout of GGUF checkpoints)
GGUF_BLOCK = 32


_QMAX = {"int8": 127.0, "fp8": 448.0}  # float8_e4m3fn's largest finite value is 448
_QDTYPE = {"int8": jnp.int8, "fp8": jnp.float8_e4m3fn}


def check_quantization(value) -> str | None:
    """``value`` if it is None or one of ``QUANTIZATION_MODES``; else ValueError naming it."""
    if value is not None and (not isinstance(value, str) or value not in QUANTIZATION_MODES):
        raise ValueError(f"quantization must be one of {QUANTIZATION_MODES} or None, got {value!r}")
    return value


def _quantize(w, block: int | None, mode: str, scale_dtype=np.float32):
    """``w [in, out]`` -> ``(q [in, out], scale [out] | [in // block, out] scale_dtype)``
    (float32, or float16 as GGUF Q8_0 stores them: ``q`` then rounds against the float16
    scale, so that ``q * scale`` is as close to ``w`` as that scale allows).

    numpy in, numpy out (host-side loading); jax in, jax out (inside a jitted init)."""
    xp = np if isinstance(w, np.ndarray) else jnp
    if w.ndim != 2:
        raise ValueError(f"quantization takes a [in, out] kernel, got shape {w.shape}")
    n_in, n_out = w.shape
    w32 = w.astype(np.float32)
    if block is None:
        groups = w32[None]  # [1, in, out]
    else:
        if n_in % block:
            raise ValueError(f"block {block} does not divide the {n_in} inputs of {w.shape}")
        groups = w32.reshape(n_in // block, block, n_out)  # [in / block, block, out]
    # times the float32 reciprocal, not "/ qmax": XLA rewrites a division by a constant so,
    # and a host load (numpy) must give the device init's (jax) scales bit for bit
    scale = xp.max(xp.abs(groups), axis=1) * np.float32(1.0 / _QMAX[mode])  # [G, out]
    scale = scale.astype(scale_dtype).astype(np.float32)  # the scale as it is kept
    safe = xp.where(scale == 0, np.float32(1), scale)[:, None, :]
    scaled = xp.clip(groups / safe, -_QMAX[mode], _QMAX[mode])
    if mode == "int8":
        scaled = xp.round(scaled)
    q = scaled.astype(_QDTYPE[mode]).reshape(n_in, n_out)
    scale = scale.astype(scale_dtype)
    return q, (scale[0] if block is None else scale)


def quantize_int8(w, block: int | None = None):
    """Symmetric int8 of a kernel ``w [in, out]`` (numpy or jax, any float dtype).

    Returns ``(q [in, out] int8, scale float32)``: ``scale [out]`` per output channel
    (``block=None``), or ``[in // block, out]`` per block of ``block`` inputs
    (``block=32``: GGUF Q8_0's grouping). ``q = round(w / scale)`` in [-127, 127], ``scale =
    amax / 127`` (an all-zero group has scale 0 and q 0). Error: ``|w - dequantize(q, scale)|
    <= scale / 2`` element-wise (plus float32 rounding).
    """
    return _quantize(w, block, "int8")


def quantize_fp8(w, block: int | None = None):
    """float8_e4m3fn of a kernel ``w [in, out]``: ``scale = amax / 448`` per output channel
    (``[out]``) or per block (``[in // block, out]``), ``q = fp8(w / scale)`` (round to
    nearest, 3 mantissa bits: relative error <= 2**-4 for normal values)."""
    return _quantize(w, block, "fp8")


def quantize(w, mode: str, block: int | None = None, scale_dtype=np.float32):
    """``quantize_int8`` or ``quantize_fp8`` by ``mode`` ("int8" / "fp8"), with scales in
    ``scale_dtype`` (float32, or float16: GGUF Q8_0's)."""
    if np.dtype(scale_dtype) not in SCALE_DTYPES:
        raise ValueError(f"scale_dtype must be float32 or float16, got {scale_dtype!r}")
    return _quantize(w, block, check_quantization(mode), np.dtype(scale_dtype))


def dequantize(q, scale, dtype=jnp.float32):
    """``q [in, out]`` times its scales (``[out]`` or ``[in // block, out]``; the block size
    is ``in // scale.shape[0]``) in ``dtype``: the float kernel ``[in, out]``.

    numpy in, numpy out; jax in (inside jit), jax out."""
    xp = np if isinstance(q, np.ndarray) and isinstance(scale, np.ndarray) else jnp
    dtype = np.dtype(dtype)
    if scale.ndim == 1:
        return q.astype(dtype) * scale.astype(dtype)[None, :]
    n_in, n_out = q.shape
    groups = scale.shape[0]
    w = q.reshape(groups, n_in // groups, n_out).astype(dtype) * scale.astype(dtype)[:, None, :]
    return xp.reshape(w, (n_in, n_out))


def pack_q4(q):
    """``q [in, out]`` (values 0..15; ``in`` a multiple of 32) -> ``[in / 2, out]`` uint8: in
    each block of 32 inputs, byte ``16 b + j`` holds input ``32 b + j`` in its low nibble and
    input ``32 b + 16 + j`` in its high one (GGUF Q4_0 / Q4_1's order within a block).

    numpy in, numpy out; jax in, jax out."""
    n_in, n_out = q.shape
    if n_in % Q4_BLOCK:
        raise ValueError(f"q4 takes a multiple of {Q4_BLOCK} inputs, got a kernel {q.shape}")
    g = q.astype(np.uint8).reshape(n_in // Q4_BLOCK, 2, Q4_BLOCK // 2, n_out)
    return (g[:, 0] | (g[:, 1] << np.uint8(4))).reshape(n_in // 2, n_out)


def unpack_q4(packed):
    """The inverse of ``pack_q4``: ``packed [in / 2, out]`` uint8 -> ``q [in, out]`` uint8."""
    xp = np if isinstance(packed, np.ndarray) else jnp
    half, n_out = packed.shape
    g = packed.reshape(half // (Q4_BLOCK // 2), 1, Q4_BLOCK // 2, n_out)
    both = xp.concatenate([g & np.uint8(15), g >> np.uint8(4)], axis=1)  # [in / 32, 2, 16, out]
    return both.reshape(2 * half, n_out)


def quantize_q4(w, scale_dtype=np.float16):
    """4-bit blocks of a kernel ``w [in, out]`` (numpy or jax; ``in`` a multiple of 32):
    ``(packed [in / 2, out] uint8, scale [in / 32, out], offset [in / 32, out])``, scale and
    offset in ``scale_dtype``: per block and output, ``offset`` the minimum, ``scale = (max -
    min) / 15``, ``q = round((w - offset) / scale)`` in 0..15 with the stored (rounded) scale
    and offset. Error: ``|w - dequantize_q4(...)| <= scale / 2`` plus the rounding of
    ``offset`` to ``scale_dtype``."""
    xp = np if isinstance(w, np.ndarray) else jnp
    if w.ndim != 2 or w.shape[0] % Q4_BLOCK:
        raise ValueError(f"q4 takes a [in, out] kernel with in a multiple of 32, got {w.shape}")
    n_in, n_out = w.shape
    groups = w.astype(np.float32).reshape(n_in // Q4_BLOCK, Q4_BLOCK, n_out)
    low, high = xp.min(groups, axis=1), xp.max(groups, axis=1)  # [in / 32, out]
    scale = ((high - low) * np.float32(1.0 / 15.0)).astype(scale_dtype)
    offset = low.astype(scale_dtype)
    s32, o32 = scale.astype(np.float32), offset.astype(np.float32)
    safe = xp.where(s32 == 0, np.float32(1), s32)
    q = xp.clip(xp.round((groups - o32[:, None, :]) / safe[:, None, :]), 0, 15)
    return pack_q4(q.reshape(n_in, n_out)), scale, offset


def dequantize_q4(packed, scale, offset, dtype=jnp.float32):
    """``packed [in / 2, out]`` (``pack_q4``) -> the float kernel ``[in, out]`` in ``dtype``:
    ``q * scale + offset`` computed in float32 per block of 32 inputs (gguf's dequantization
    of Q4_0, Q4_1 and Q4_K, bit for bit, given their scales and offsets). numpy in, numpy out;
    jax in, jax out."""
    xp = np if isinstance(packed, np.ndarray) and isinstance(scale, np.ndarray) else jnp
    q = unpack_q4(packed)
    n_in, n_out = q.shape
    groups = q.reshape(n_in // Q4_BLOCK, Q4_BLOCK, n_out).astype(np.float32)
    w = groups * scale.astype(np.float32)[:, None, :] + offset.astype(np.float32)[:, None, :]
    return xp.reshape(w, (n_in, n_out)).astype(dtype)


#: Most rows (tokens) a quantized matmul sends to the C++ kernel on the CPU; more go to XLA.
CPU_KERNEL_MAX_ROWS = 32
#: Float kernel dtypes whose decode-sized matmuls run the C++ kernel on the CPU
#: (``weight_dot_general``): XLA:CPU's bf16 dot at a few rows converts the whole kernel to f32
#: first (3.7 GB/s of bf16 at 1 row x 576 x 1536, against XLA's f32 dot at ~20 GB/s).
CPU_KERNEL_FLOAT_DTYPES = (jnp.dtype(jnp.bfloat16),)


def quantized_matmul(
    x, q, scale, dtype, *, offset=None, out_major: bool = False, out_dtype=None
) -> jax.Array:
    """``x [..., in] @ dequantize(q [in, out], scale)`` in ``dtype`` (jax, inside jit); with
    ``out_major``, ``q [out, in]`` and ``scale [out] | [out, in // block]`` (the LM head's
    vocabulary-major layout). With ``offset``, the "q4" layout: ``q`` is ``pack_q4``'s
    ``[in / 2, out]`` uint8 (``[out, in / 2]`` out-major), ``scale`` and ``offset``
    ``[in / 32, out]`` (``[out, in / 32]``), ``w = dequantize_q4(q, scale, offset)``. The
    result is ``[..., out]`` in ``out_dtype`` (default ``dtype``).

    On XLA (TPU, GPU, and the CPU above ``CPU_KERNEL_MAX_ROWS`` rows): per output channel
    (``scale [out]``) the dot takes the converted ``q`` and the scales multiply its f32 result;
    XLA:GPU then fuses the int8 / fp8 -> ``dtype`` convert into its GEMM (the kernel is read
    from HBM as stored, no dequantized copy in temp: tests/gpu_aot/test_h200_quantized.py),
    and so does the TPU compiler. Per block of int8 / fp8 inputs the kernel is dequantized
    first (``dequantize``, in temp). "q4" takes ``_q4_on_xla``'s form, which the TPU compiler
    fuses whole (no temp at 1 or 64 rows).

    On a GPU, per-block and "q4" kernels run a Pallas kernel instead
    (``jaxkv.pallas_kernels.block_dequant_matmul``: XLA:GPU fuses no per-block scale into a
    dot and would write the dequantized kernel to HBM). On the CPU, up to
    ``CPU_KERNEL_MAX_ROWS`` rows (decode steps) run a C++ kernel
    (``jaxkv.pallas_kernels.cpu_backend.quantized_matmul``, ``q4_matmul``), which reads each
    weight byte once: XLA:CPU converts the whole kernel to float before its dot. Both are
    chosen per platform when the program is lowered (``jax.lax.platform_dependent``), so each
    compile sees its own platform's form only.
    """
    out_dtype = dtype if out_dtype is None else out_dtype
    lead = x.shape[:-1]
    rows = int(np.prod(lead))
    n_out = q.shape[0] if out_major else q.shape[1]
    operands = (x, q, scale) if offset is None else (x, q, scale, offset)

    def on_xla(x, q, scale, offset=None):
        contract = (((x.ndim - 1,), (1 if out_major else 0,)), ((), ()))
        if offset is None and scale.ndim == 1:
            y = jax.lax.dot_general(
                x.astype(dtype), q.astype(dtype), contract, preferred_element_type=jnp.float32
            )  # [..., out] f32
            return (y * scale).astype(out_dtype)
        if offset is not None:
            return _q4_on_xla(x, q, scale, offset, dtype, out_major).astype(out_dtype)
        if out_major:
            q, scale = q.T, scale.T
        w = dequantize(q, scale, dtype)  # [in, out]
        contract = (((x.ndim - 1,), (0,)), ((), ()))
        return jax.lax.dot_general(x.astype(dtype), w, contract).astype(out_dtype)

    from jaxkv.pallas_kernels import block_dequant_matmul as bdm
    from jaxkv.pallas_kernels import cpu_backend  # builds its C++ only when asked

    n_in = x.shape[-1]
    branches = {}
    if 0 < rows <= CPU_KERNEL_MAX_ROWS and cpu_backend.use_cpu_kernels():

        def on_cpu(x, q, scale, offset=None):
            x2 = x.reshape(rows, n_in)
            if offset is None:
                y = cpu_backend.quantized_matmul(x2, q, scale, out_major=out_major)
            else:
                y = cpu_backend.q4_matmul(x2, q, scale, offset, out_major=out_major)
            return y.reshape(*lead, n_out).astype(out_dtype)

        branches["cpu"] = on_cpu
    if (
        rows > 0
        and scale.ndim == 2
        and bdm.supports(n_in, n_out, n_in // scale.shape[int(out_major)])
    ):

        def on_gpu(x, q, scale, offset=None):
            y = bdm.block_dequant_matmul(
                x.reshape(rows, n_in), q, scale, offset, out_major=out_major, dtype=dtype
            )
            return y.reshape(*lead, n_out).astype(out_dtype)

        branches["cuda"] = on_gpu
    if branches:
        return jax.lax.platform_dependent(*operands, default=on_xla, **branches)
    return on_xla(*operands)


def weight_dot_general(
    lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None, **kwargs
) -> jax.Array:
    """``jax.lax.dot_general`` for ``nnx.Linear`` (``layers.linear``'s ``dot_general``). On the
    CPU, a kernel of ``CPU_KERNEL_FLOAT_DTYPES`` (``x [..., in] @ kernel [in, out]``) takes the
    C++ kernel for up to ``CPU_FLOAT_KERNEL_MAX_ROWS`` rows (``quantized_matmul``: read as
    stored, f32 sums), and XLA's dot with f32 results, rounded once, for more (XLA:CPU's bf16
    dot with a bf16 result converts both operands to f32 first: 3.6x slower at 64 rows).
    Other platforms, dtypes and contractions: XLA's dot as asked."""

    def as_asked(lhs, rhs):
        return jax.lax.dot_general(
            lhs,
            rhs,
            dimension_numbers,
            precision=precision,
            preferred_element_type=preferred_element_type,
            **kwargs,
        )

    (lhs_contract, rhs_contract), batch = dimension_numbers
    rows = int(np.prod(lhs.shape[:-1]))
    if not (
        jnp.dtype(rhs.dtype) in CPU_KERNEL_FLOAT_DTYPES
        and tuple(lhs_contract) == (lhs.ndim - 1,)
        and tuple(rhs_contract) == (0,)
        and batch == ((), ())
        and rhs.ndim == 2
        and rows > 0
    ):
        return as_asked(lhs, rhs)
    out = jnp.dtype(preferred_element_type or jnp.result_type(lhs.dtype, rhs.dtype))
    return float_matmul(lhs, rhs, out, default=as_asked)


#: Most rows a bf16 matmul sends to the C++ kernel on the CPU; XLA's bf16 dot (f32 results)
#: is as fast from 16 rows (576 x 1536: 0.31 ms each at 16 rows, 0.33 / 0.51 ms at 32).
CPU_FLOAT_KERNEL_MAX_ROWS = 16


def float_matmul(
    x, w, out_dtype, *, out_major: bool = False, transposed: bool = False, default=None
) -> jax.Array:
    """``x [..., in] @ w [in, out]`` (``w [out, in]`` when ``out_major``) for a float ``w`` of
    ``CPU_KERNEL_FLOAT_DTYPES``, in ``out_dtype``; with ``transposed``, ``[out, R]`` for ``x
    [R, in]`` (the LM head's vocabulary-major logits). On the CPU an out-major bf16 ``w``
    above ``amx.FEW_ROWS`` rows runs on the packed kernel where present
    (``amx.out_major_matmul``: AMX tiles or AVX512-BF16), else the C++ kernel (up to
    ``CPU_FLOAT_KERNEL_MAX_ROWS`` rows) or XLA's dot with f32 results; elsewhere
    ``default(x, w)`` (XLA's dot in ``out_dtype`` when None)."""
    from jaxkv.pallas_kernels import amx, cpu_backend  # build their C++ only when asked

    w_in = 1 if out_major else 0
    rows = int(np.prod(x.shape[:-1]))

    def on_xla(x, w):
        x = x.astype(w.dtype)
        if transposed:  # [out, R]: w's output axis first
            y = jax.lax.dot_general(
                w, x, (((w_in,), (x.ndim - 1,)), ((), ())), preferred_element_type=jnp.float32
            )
        else:
            y = jax.lax.dot_general(
                x, w, (((x.ndim - 1,), (w_in,)), ((), ())), preferred_element_type=jnp.float32
            )
        return y.astype(out_dtype)

    def on_cpu(x, w):
        if out_major and amx.out_major_applies(rows, w):  # the LM head on the packed kernel
            return amx.out_major_matmul(x, w, out_dtype, transposed)
        if rows > CPU_FLOAT_KERNEL_MAX_ROWS or not cpu_backend.use_cpu_kernels():
            return on_xla(x, w)
        n_out = w.shape[0] if out_major else w.shape[1]
        y = cpu_backend.quantized_matmul(x.reshape(rows, x.shape[-1]), w, None, out_major=out_major)
        y = y.T if transposed else y.reshape(*x.shape[:-1], n_out)
        return y.astype(out_dtype)

    return jax.lax.platform_dependent(x, w, cpu=on_cpu, default=default or on_xla)


def _q4_on_xla(x, packed, scale, offset, dtype, out_major: bool) -> jax.Array:
    """``x [..., in] @ dequantize_q4(...)`` as XLA ops, ``[..., out]`` f32, in a form the
    compilers fuse: no interleaving of the nibbles (``x`` is split instead: each block's first
    16 inputs meet the low nibbles, its last 16 the high ones), the scales multiply the nibbles
    inside each dot's operand, and the offsets enter as one small dot of ``x``'s block sums
    (``sum_k x_k offset_b(k) = sum_b (sum_{k in b} x_k) offset_b``)."""
    lead, n_in = x.shape[:-1], x.shape[-1]
    nb, half = n_in // Q4_BLOCK, Q4_BLOCK // 2
    xb = x.astype(dtype).reshape(*lead, nb, 2, half)
    x_low = xb[..., 0, :].reshape(*lead, nb * half)  # [..., in / 2]
    x_high = xb[..., 1, :].reshape(*lead, nb * half)
    x_sums = xb.astype(jnp.float32).sum(axis=(-2, -1))  # [..., in / 32]
    k_axis = 1 if out_major else 0
    # nibbles [nb, 16, out] (out_major [out, nb, 16]) times their block's scale
    if out_major:
        p = packed.reshape(packed.shape[0], nb, half)
        s = scale.astype(dtype)[:, :, None]
    else:
        p = packed.reshape(nb, half, packed.shape[1])
        s = scale.astype(dtype)[:, None, :]
    low = ((p & np.uint8(15)).astype(dtype) * s).reshape(packed.shape)
    high = ((p >> np.uint8(4)).astype(dtype) * s).reshape(packed.shape)
    contract = (((x.ndim - 1,), (k_axis,)), ((), ()))

    def dot(a, b):
        return jax.lax.dot_general(a, b, contract, preferred_element_type=jnp.float32)

    return dot(x_low, low) + dot(x_high, high) + dot(x_sums, offset.astype(jnp.float32))


class LayerQuant(NamedTuple):
    """How one layer is quantized (``quantize_model``'s ``blocks`` values): ``mode``
    (``QUANTIZATION_MODES``), ``block`` (inputs per scale; None: per output channel; "q4":
    32), ``scale_dtype`` (float16 or float32; None: the mode's default, float16 for "q4"'s
    scales and offsets, float32 for int8 / fp8 scales; int8 blocks of a GGUF are float16,
    as Q8_0 stores them)."""

    mode: str
    block: int | None = None
    scale_dtype: str | None = None


def _default_scale_dtype(mode: str) -> str:
    return "float16" if mode == "q4" else "float32"


def quantize_layer(w, quant: LayerQuant) -> tuple:
    """``w [in, out]`` -> ``(q, scale)`` (int8 / fp8) or ``(packed, scale, offset)`` (q4)."""
    scale_dtype = np.dtype(quant.scale_dtype or _default_scale_dtype(quant.mode))
    if quant.mode == "q4":
        return quantize_q4(w, scale_dtype)
    return quantize(w, quant.mode, quant.block, scale_dtype)


def _layer_quant(mode: str, block: int | None, n_in: int, scale_dtype=None) -> LayerQuant:
    """The layout of a layer with ``n_in`` inputs: "q4" always blocks of 32 (ValueError when
    they do not divide), int8 / fp8 per block of ``block`` where it divides (scales in
    ``scale_dtype``), else per output channel (float32 scales)."""
    if mode == "q4":
        if n_in % Q4_BLOCK:
            raise ValueError(f"q4 needs a multiple of {Q4_BLOCK} inputs, a layer has {n_in}")
        return LayerQuant("q4", Q4_BLOCK, scale_dtype or "float16")
    if block is None or n_in % block:
        return LayerQuant(mode, None, "float32")
    return LayerQuant(mode, block, scale_dtype or "float32")


class QuantizedLinear(nnx.Module):
    """``y = x @ dequantize(kernel, scale) + bias``; weight-only quantized ``nnx.Linear``.

    Parameters (all ``nnx.Param``): ``kernel [in, out]`` int8 / float8_e4m3fn; per output
    channel ``scale [out]`` float32, or per block ``block_scale [in // block, out]`` float32;
    "q4": ``kernel [in / 2, out]`` uint8 (``pack_q4``), ``block_scale`` and ``block_offset``
    ``[in / 32, out]`` (float16 or float32); ``bias [out]`` in ``dtype`` (or None). ``dtype`` is
    the compute dtype: the activations and the dequantized kernel are cast to it.
    """

    def __init__(self, kernel, scale, bias=None, *, mode: str, dtype=jnp.float32, offset=None):
        check_quantization(mode)
        if (mode == "q4") != (offset is not None):
            raise ValueError(f"an offset goes with mode 'q4' only, got mode {mode!r}")
        n_in = kernel.shape[0] * (2 if mode == "q4" else 1)
        n_out = kernel.shape[1]
        if scale.shape not in ((n_out,),) and (
            len(scale.shape) != 2 or scale.shape[1] != n_out or n_in % scale.shape[0]
        ):
            raise ValueError(f"scale {scale.shape} does not fit kernel {kernel.shape}")
        if offset is not None and offset.shape != scale.shape:
            raise ValueError(f"offset {offset.shape} does not match scale {scale.shape}")
        self.in_features, self.out_features = int(n_in), int(n_out)
        self.mode = mode
        self.block = None if len(scale.shape) == 1 else n_in // scale.shape[0]
        self.dtype = np.dtype(dtype).name
        self.kernel = nnx.Param(kernel)  # [in, out] int8 | float8_e4m3fn; [in / 2, out] uint8
        if self.block is None:
            self.scale = nnx.Param(scale)  # [out] float32
        else:
            self.block_scale = nnx.Param(scale)  # [in // block, out]
        if offset is not None:
            self.block_offset = nnx.Param(offset)  # [in // 32, out]
        self.bias = None if bias is None else nnx.Param(bias)  # [out]

    @classmethod
    def from_linear(cls, linear: nnx.Linear, mode: str, block: int | None = None, scale_dtype=None):
        """``linear``'s kernel quantized (int8 / fp8: per ``block`` inputs when it divides
        them, else per output channel; "q4": blocks of 32, scales in ``scale_dtype``,
        default float16); its bias and compute dtype kept."""
        w = linear.kernel[...]  # [in, out]
        parts = quantize_layer(w, _layer_quant(mode, block, w.shape[0], scale_dtype))
        bias = None if linear.bias is None else linear.bias[...]
        dtype = linear.dtype if linear.dtype is not None else w.dtype
        return cls(*parts[:2], bias, mode=mode, dtype=dtype, offset=_offset_of(parts))

    def scales(self) -> jax.Array:  # [out] | [in // block, out]
        return (self.scale if self.block is None else self.block_scale)[...]

    def offsets(self) -> jax.Array | None:  # [in // 32, out] ("q4") or None
        return self.block_offset[...] if self.mode == "q4" else None

    def dequantized(self) -> jax.Array:  # [in, out] dtype
        if self.mode == "q4":
            return dequantize_q4(self.kernel[...], self.scales(), self.offsets(), self.dtype)
        return dequantize(self.kernel[...], self.scales(), self.dtype)

    def __call__(self, x: jax.Array) -> jax.Array:  # [..., in] -> [..., out] dtype
        y = quantized_matmul(
            x, self.kernel[...], self.scales(), self.dtype, offset=self.offsets()
        )  # [..., out]
        if self.bias is not None:
            y = y + self.bias[...].astype(self.dtype)
        return y


def _offset_of(parts: tuple):
    return parts[2] if len(parts) == 3 else None


class QuantizedLMHead(nnx.Module):
    """The LM head, vocab-major as ``LMHead``: ``weight [V, hidden]`` int8 / float8_e4m3fn,
    ``scale [V]`` (per vocabulary row) or ``block_scale [V, hidden // block]`` float32; "q4":
    ``weight [V, hidden / 2]`` uint8 (each row packed as ``pack_q4`` packs a column),
    ``block_scale`` and ``block_offset [V, hidden / 32]``.

    Built from an untied head's weight or, when tied, from the embedding (a quantized copy:
    the embedding lookup keeps the float table)."""

    def __init__(self, weight, scale, *, mode: str, dtype=jnp.float32, offset=None):
        check_quantization(mode)
        if (mode == "q4") != (offset is not None):
            raise ValueError(f"an offset goes with mode 'q4' only, got mode {mode!r}")
        self.mode = mode
        self.dtype = np.dtype(dtype).name
        hidden = weight.shape[1] * (2 if mode == "q4" else 1)
        self.block = None if len(scale.shape) == 1 else hidden // scale.shape[1]
        self.weight = nnx.Param(weight)  # [V, hidden] | [V, hidden / 2] uint8
        if self.block is None:
            self.scale = nnx.Param(scale)  # [V]
        else:
            self.block_scale = nnx.Param(scale)  # [V, hidden // block]
        if offset is not None:
            self.block_offset = nnx.Param(offset)  # [V, hidden // 32]

    @classmethod
    def from_weight(cls, weight, mode: str, block: int | None = None, dtype=None, scale_dtype=None):
        """``weight [V, hidden]`` quantized along hidden (int8 / fp8: per row, or per block of
        ``block`` when it divides hidden; "q4": blocks of 32)."""
        quant = _layer_quant(mode, block, weight.shape[1], scale_dtype)
        parts = tuple(a.T for a in quantize_layer(weight.T, quant))  # [V, ...] each
        dtype = weight.dtype if dtype is None else dtype
        return cls(*parts[:2], mode=mode, dtype=dtype, offset=_offset_of(parts))

    def scales(self) -> jax.Array:  # [V] | [V, hidden // block]
        return (self.scale if self.block is None else self.block_scale)[...]

    def offsets(self) -> jax.Array | None:  # [V, hidden // 32] ("q4") or None
        return self.block_offset[...] if self.mode == "q4" else None

    def dequantized(self) -> jax.Array:  # [V, hidden] dtype
        if self.mode == "q4":
            w = dequantize_q4(self.weight[...].T, self.scales().T, self.offsets().T, self.dtype)
            return w.T
        return dequantize(self.weight[...].T, self.scales().T, self.dtype).T

    def logits(self, hidden: jax.Array, *, vocab_major: bool = False) -> jax.Array:
        """``hidden [..., hidden]`` -> ``[..., V]`` f32 (``[V, R]`` when ``vocab_major``,
        ``hidden [R, hidden]``), through ``quantized_matmul`` on the vocabulary-major weight."""
        logits = quantized_matmul(
            hidden,
            self.weight[...],
            self.scales(),
            self.dtype,
            offset=self.offsets(),
            out_major=True,
            out_dtype=jnp.float32,
        )  # [..., V] f32
        return logits.T if vocab_major else logits


def quantized_modules(model) -> dict[tuple, nnx.Module]:
    """nnx path -> module of every ``QuantizedLinear`` / ``QuantizedLMHead`` of ``model``."""
    return {
        tuple(path): node
        for path, node in nnx.iter_graph(model)
        if isinstance(node, (QuantizedLinear, QuantizedLMHead))
    }


def _get_child(parent, key):
    return parent[int(key)] if isinstance(parent, (nnx.List, list)) else getattr(parent, str(key))


def _set_child(parent, key, value) -> None:
    if isinstance(parent, (nnx.List, list)):
        parent[int(key)] = value
    else:
        setattr(parent, str(key), value)


def replace_module(model, path: tuple, make) -> None:
    """Sets the module at nnx ``path`` of ``model`` to ``make(the module there)``, in place."""
    parent = model
    for key in path[:-1]:
        parent = _get_child(parent, key)
    _set_child(parent, path[-1], make(_get_child(parent, path[-1])))


def quantize_model(model, mode: str | None, block: int | None = None, *, blocks=None):
    """Replaces, in place, every ``nnx.Linear`` of ``model`` by a ``QuantizedLinear`` of its
    kernel, and its LM head (``model.lm_head``, or the tied embedding) by a
    ``QuantizedLMHead``; returns ``model``. ``mode`` None returns it unchanged.

    ``block``: per block of that many inputs where it divides a layer's inputs, else per
    output channel ("q4": always blocks of 32). ``blocks``: HF weight name
    (``"model.layers.0.mlp.up_proj.weight"``, ``"lm_head.weight"``, also for a tied head) ->
    that layer's block (over ``block``) or its whole ``LayerQuant`` (over ``mode`` too): a
    checkpoint's own layout. Works inside ``nnx.eval_shape`` and ``jax.jit`` (what
    ``build_model`` does); on a concrete model it quantizes on the model's devices.
    """
    if check_quantization(mode) is None:
        return model
    blocks = {} if blocks is None else blocks

    def layout(name: str) -> tuple:  # (mode, block, scale_dtype) of HF weight ``name``
        value = blocks.get(name, block)
        if isinstance(value, LayerQuant):
            return value.mode, value.block, value.scale_dtype
        return mode, value, None

    linears = [
        path for path, node in nnx.iter_graph(model) if isinstance(node, nnx.Linear) and path
    ]
    for path in linears:
        quant = layout(".".join(str(p) for p in path) + ".weight")
        replace_module(model, path, lambda child, q=quant: QuantizedLinear.from_linear(child, *q))
    if hasattr(model, "lm_head") and not isinstance(model.lm_head, QuantizedLMHead):
        if model.lm_head is None:
            weight = model.model.embed_tokens.embedding[...]  # [V, hidden]
        else:
            weight = model.lm_head.weight[...]  # [V, hidden]
        head_mode, head_block, scale_dtype = layout("lm_head.weight")
        model.lm_head = nnx.data(
            QuantizedLMHead.from_weight(weight, head_mode, head_block, scale_dtype=scale_dtype)
        )
    return model
