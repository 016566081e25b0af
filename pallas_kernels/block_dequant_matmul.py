"""``x @ w`` for GPUs with ``w`` kept in blocks of inputs and dequantized in registers (a
Pallas kernel, Triton lowering).

The layouts are ``jaxkv.models.quant``'s per-block ones: int8 / float8_e4m3fn ``q [K, N]``
with ``scale [K / block, N]`` (GGUF Q8_0's blocks of 32, an fp8 checkpoint's of 128), and
"q4": ``pack_q4``'s ``[K / 2, N]`` uint8 (in block ``b``, byte ``16 b + j`` holds input
``32 b + j`` in its low nibble and ``32 b + 16 + j`` in its high one) with ``scale`` and
``offset [K / 32, N]``, ``w = q * scale + offset``. With ``out_major`` every array is
transposed (``q [N, K]`` / ``[N, K / 2]``, scales ``[N, K / block]``: the LM head's
vocabulary-major layout).

Why a kernel: XLA:GPU fuses the int8 -> bf16 convert of a per-output-channel kernel into its
GEMM, but no per-block scale: it writes the whole dequantized kernel to HBM first (a
Llama-3-8B-sized LM head, 128256 x 4096, is 1002 MiB of bf16 temp) and reads it back. Here each
weight byte is read from HBM once and nothing weight-sized is written.

Work: grid ``(M tiles of BM rows, N tiles of BN columns, S splits of K)``. A program walks its
split one block of inputs at a time: it loads the block's weights (``[block, BN]`` int8 / fp8,
or for q4 ``[16, BN]`` bytes holding both halves of a block of 32), their ``[1, BN]`` scales (and offsets),
widens and scales them in registers to the compute dtype, and accumulates ``x[BM, 32] @ w``
(q4: ``x``'s first and second 16 inputs of the block against the low and high nibbles) in an f32 ``[BM, BN]``
accumulator. Splits (chosen so a decode step's few M tiles still fill the GPU) write partial
sums ``[S, M, N]`` f32, summed after (``S * M * N * 4`` bytes of temp: small at decode sizes).

Checked in interpret mode against numpy (tests/kernels/test_block_dequant_matmul.py) and
compiled for an H200 without one (tests/gpu_aot/test_h200_quantized.py); not yet timed on a GPU.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jaxkv.pallas_kernels.quant_formats import Q4_BLOCK

#: columns per program; N must be a multiple (else the caller uses XLA)
BLOCK_N = 64
#: most rows per program (M tiles: 16 rows at least, Triton's smallest dot)
MAX_BLOCK_M = 64
#: programs a call aims for (splitting K when M and N tiles are fewer): a few per SM of an H200
TARGET_PROGRAMS = 512


def supports(n_in: int, n_out: int, block: int) -> bool:
    """Whether ``block_dequant_matmul`` takes a ``[n_in, n_out]`` kernel with one scale per
    ``block`` inputs (a power of two from 16 to 256 that divides ``n_in``; "q4": 32)."""
    return (
        16 <= block <= 256
        and block & (block - 1) == 0
        and n_in % block == 0
        and n_out % BLOCK_N == 0
    )


def _tiles(rows: int, n_out: int, blocks: int) -> tuple[int, int, int]:
    """``(BM, M tiles, splits)``: BM a power of two in [16, 64]; splits a power of two that
    divides ``blocks``, raising the program count towards ``TARGET_PROGRAMS``."""
    bm = min(MAX_BLOCK_M, max(16, 1 << (max(rows, 1) - 1).bit_length()))
    m_tiles = -(-rows // bm)
    splits = 1
    while (
        m_tiles * (n_out // BLOCK_N) * splits * 2 <= TARGET_PROGRAMS
        and blocks % (splits * 2) == 0
        and blocks // (splits * 2) >= 4
    ):
        splits *= 2
    return bm, m_tiles, splits


def _kernel(*refs, q4, out_major, block, bm, blocks_per_split, dtype, precision):
    if q4:
        x_ref, q_ref, s_ref, o_ref, y_ref = refs
    else:
        (x_ref, q_ref, s_ref, y_ref), o_ref = refs, None
    i, j, split = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    rows = pl.ds(i * bm, bm)
    cols = pl.ds(j * BLOCK_N, BLOCK_N)

    def weights(ref, start, size):  # [size, BN] (out_major: [BN, size]) of inputs start..
        return ref[cols, pl.ds(start, size)] if out_major else ref[pl.ds(start, size), cols]

    def dot(x, w):  # [BM, k] x ([k, BN] | [BN, k]) -> [BM, BN] f32
        contract = (((1,), (1 if out_major else 0,)), ((), ()))
        return lax.dot_general(
            x, w, contract, precision=precision, preferred_element_type=jnp.float32
        )

    def body(t, acc):
        b = split * blocks_per_split + t
        scale = weights(s_ref, b, 1).astype(jnp.float32)  # [1, BN] | [BN, 1]
        if q4:
            half = block // 2
            packed = weights(q_ref, b * half, half)  # [16, BN] uint8
            offset = weights(o_ref, b, 1).astype(jnp.float32)
            low = ((packed & 15).astype(jnp.float32) * scale + offset).astype(dtype)
            high = ((packed >> 4).astype(jnp.float32) * scale + offset).astype(dtype)
            x_low = x_ref[rows, pl.ds(b * block, half)].astype(dtype)  # [BM, 16]
            x_high = x_ref[rows, pl.ds(b * block + half, half)].astype(dtype)
            return acc + dot(x_low, low) + dot(x_high, high)
        w = (weights(q_ref, b * block, block).astype(jnp.float32) * scale).astype(dtype)
        return acc + dot(x_ref[rows, pl.ds(b * block, block)].astype(dtype), w)

    acc = lax.fori_loop(0, blocks_per_split, body, jnp.zeros((bm, BLOCK_N), jnp.float32))
    y_ref[...] = acc


def block_dequant_matmul(
    x,  # [M, K]
    q,  # [K, N] int8 | float8_e4m3fn, or [K / 2, N] uint8 (q4); [N, K] / [N, K / 2] out_major
    scale,  # [K / block, N] ([N, K / block] out_major)
    offset=None,  # q4: [K / 32, N] ([N, K / 32] out_major); else None
    *,
    out_major: bool = False,
    dtype=jnp.bfloat16,
    interpret: bool = False,
) -> jax.Array:  # [M, N] f32
    """``x @ dequantize(q, scale[, offset])`` as ``[M, N]`` f32, the weights dequantized in
    registers to ``dtype`` (the compute dtype: ``x`` is cast to it; f32 dots run at full
    precision). ``interpret=True`` runs the kernel anywhere (tests). ValueError for shapes
    ``supports`` refuses."""
    q4 = offset is not None
    rows, n_in = x.shape
    n_out = q.shape[0] if out_major else q.shape[1]
    stored = (q.shape[1] if out_major else q.shape[0]) * (2 if q4 else 1)
    groups = scale.shape[1] if out_major else scale.shape[0]
    block = n_in // max(groups, 1)
    if (
        stored != n_in
        or groups * block != n_in
        or (q4 and block != Q4_BLOCK)
        or not supports(n_in, n_out, block)
    ):
        raise ValueError(
            f"block_dequant_matmul takes x [M, K] and a kernel of K inputs, N a multiple of "
            f"{BLOCK_N} outputs, one scale per block of 16..256 inputs (a power of two; q4: "
            f"{Q4_BLOCK}); got x {x.shape}, q {q.shape}, scale {scale.shape}, q4={q4}, "
            f"out_major={out_major}"
        )
    blocks = groups
    bm, m_tiles, splits = _tiles(rows, n_out, blocks)
    x = jnp.pad(x, ((0, m_tiles * bm - rows), (0, 0)))
    dtype = jnp.dtype(dtype)
    kernel = functools.partial(
        _kernel,
        q4=q4,
        out_major=out_major,
        block=block,
        bm=bm,
        blocks_per_split=blocks // splits,
        dtype=dtype,
        precision=lax.Precision.HIGHEST if dtype == jnp.float32 else None,
    )
    whole = pl.BlockSpec()  # the kernel indexes whole arrays itself
    operands = (x, q, scale) if offset is None else (x, q, scale, offset)
    partial = pl.pallas_call(
        kernel,
        grid=(m_tiles, n_out // BLOCK_N, splits),
        in_specs=[whole] * len(operands),
        out_specs=pl.BlockSpec((None, bm, BLOCK_N), lambda i, j, s: (s, i, j)),
        out_shape=jax.ShapeDtypeStruct((splits, m_tiles * bm, n_out), jnp.float32),
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=3),
        interpret=interpret,
        name=f"block_dequant_matmul_{'q4' if q4 else jnp.dtype(q.dtype).name}",
    )(*operands)
    return (partial[0] if splits == 1 else partial.sum(axis=0))[:rows]
