"""bf16 matmuls with weights packed once, at load (``cpu_kernels/amx_matmul.cc``): Intel AMX
tiles, or AVX512-BF16 dot products on CPUs without AMX.

A ``[K, N]`` bf16 kernel is stored as ``[ceil(N / 32), ceil(K / 32), 2, 16, 32]`` bf16
(:func:`pack`): per block of 32 output columns and 32 inputs, the two 16 x 32 tiles TDPBF16PS
reads, pairs of consecutive inputs side by side ("VNNI" order), zero-padded; each tile row is
also the 16 columns' input pairs that one VDPBF16PS takes. :func:`matmul` is the FFI call
(``x [M, K] @ w -> [M, N]`` f32 or bf16, any M); :func:`unpack` restores ``[K, N]``.

Used by ``jaxkv.models.cpu_layout`` for every bf16 linear layer of a one-device CPU engine on
machines with AMX (Sapphire Rapids and later) or AVX512-BF16 (AMD Zen 4 and later, Intel
Cooper Lake). 64 x 576 x 1536: Intel Xeon, tiles 0.14-0.17 ms against 0.22-0.25 ms for
XLA:CPU's bf16 dot with f32 results; AMD EPYC (Zen 4), dot products 0.26 against 0.38 ms
(numbers in benchmarks/RESULTS.md). ``JAXKV_CPU_AMX=0`` turns it off. :func:`available` says
whether this process can run it (the C++ library built with AVX512-BF16 and, for the tiles,
AMX-BF16 with the tile state granted by Linux).
"""

from __future__ import annotations

import ctypes
import functools
import os

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv.pallas_kernels import cpu_backend

#: Rows, columns and inputs of one packed block (two 16-row tiles of each operand).
BLOCK = 32
#: Rows up to which the kernel runs AVX512-BF16 dot products on AMX machines (``kFewRows``);
#: without AMX it runs them at every row count.
FEW_ROWS = 4


@functools.cache
def _library_ready() -> bool:
    path = cpu_backend._build()[0]
    # AVX512-BF16 is the kernel's floor: a build with AMX tiles has it too.
    return path is not None and ctypes.CDLL(path).JaxkvBf16DotReady() == 1


def available() -> bool:
    """Whether bf16 linears may run packed here: the default platform is CPU, the C++ kernels
    built with AVX512-BF16 (AMX tiles too where the build has AMX-BF16 and Linux grants this
    process the tile state), and ``JAXKV_CPU_AMX`` is not ``0``."""
    return (
        os.environ.get("JAXKV_CPU_AMX", "1") != "0"
        and jax.default_backend() == "cpu"
        and cpu_backend.available()
        and _library_ready()
    )


def packed_shape(k: int, n: int) -> tuple[int, int, int, int, int]:
    """The packed layout's shape for a ``[k, n]`` kernel."""
    return (-(-n // BLOCK), -(-k // BLOCK), 2, 16, 2 * 16)


@jax.jit
def pack(w) -> jax.Array:
    """``w [K, N]`` (cast to bf16) in the tile layout ``[NB, KB, 2, 16, 32]``: element
    ``[j, kb, t, r, 2 c + e]`` is ``w[32 kb + 2 r + e, 32 j + 16 t + c]`` (0 past ``w``)."""
    k, n = w.shape
    nb, kb = packed_shape(k, n)[:2]
    w = jnp.pad(jnp.asarray(w, jnp.bfloat16), ((0, kb * BLOCK - k), (0, nb * BLOCK - n)))
    w = w.reshape(kb, 16, 2, nb, 2, 16)  # [kb, r, e, j, t, c]
    return w.transpose(3, 0, 4, 1, 5, 2).reshape(nb, kb, 2, 16, 32)


@functools.partial(jax.jit, static_argnums=(1, 2))
def unpack(packed, k: int, n: int) -> jax.Array:
    """The ``[k, n]`` bf16 kernel of :func:`pack`'s layout."""
    nb, kb = packed.shape[:2]
    w = packed.reshape(nb, kb, 2, 16, 16, 2).transpose(1, 3, 5, 0, 2, 4)  # [kb, r, e, j, t, c]
    return w.reshape(kb * BLOCK, nb * BLOCK)[:k, :n]


def matmul(
    x,  # [M, K] (cast to bf16)
    packed,  # [ceil(N / 32), ceil(K / 32), 2, 16, 32] bf16
    n: int,
    out_dtype=jnp.float32,
    *,
    tiles: bool = True,
) -> jax.Array:
    """``x @ unpack(packed, K, n)`` as ``[M, n]``, summed in f32, in ``out_dtype`` (float32, or
    bfloat16 rounded to nearest even in the kernel: half the bytes written); the FFI call, CPU
    only. Above :data:`FEW_ROWS` rows the sums run on AMX tiles where this process has them,
    else (and with ``tiles=False``, which checks that path on any machine) on AVX512-BF16 dot
    products."""
    out_dtype = jnp.dtype(out_dtype)
    if out_dtype not in (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16)):
        raise ValueError(f"amx.matmul writes float32 or bfloat16, not {out_dtype}")
    if x.ndim != 2 or packed.shape != packed_shape(x.shape[1], n):
        raise ValueError(
            f"amx.matmul takes x [M, K] and w packed as {packed_shape(x.shape[-1], n)} for "
            f"n={n}, got x {x.shape} and w {packed.shape}"
        )
    call = cpu_backend._ffi_call(
        cpu_backend.AMX_TARGET, jax.ShapeDtypeStruct((x.shape[0], n), out_dtype)
    )
    return call(
        x.astype(jnp.bfloat16),
        packed.astype(jnp.bfloat16),
        n=np.int64(n),
        num_threads=np.int32(cpu_backend._num_threads()),
        tiles=np.int32(tiles),
    )


def silu_gated_matmul(
    x,  # [M, K] (cast to bf16)
    gate,  # packed [ceil(N / 32), ceil(K / 32), 2, 16, 32] bf16
    up,  # packed, the same shape
    n: int,
    *,
    tiles: bool = True,
) -> jax.Array:
    """``silu(x @ gate) * (x @ up)`` as ``[M, n]`` bf16, rounded as ``models.layers.GatedMLP``
    rounds on bf16 layers (each projection to bf16, the SiLU of the gate in f32 to bf16, the
    product in f32 to bf16): a SwiGLU MLP's hidden layer in one kernel, x read once for both
    projections and neither ``[M, n]`` projection written. Equal to XLA's ``jax.nn.silu``
    path on every value tried (``tests/kernels/test_amx_matmul_cpu.py``)."""
    shape = packed_shape(x.shape[-1], n) if x.ndim == 2 else None
    if shape is None or gate.shape != shape or up.shape != shape:
        raise ValueError(
            f"amx.silu_gated_matmul takes x [M, K] and gate / up packed as {shape} for n={n}, "
            f"got x {x.shape}, gate {gate.shape} and up {up.shape}"
        )
    call = cpu_backend._ffi_call(
        cpu_backend.GATED_TARGET, jax.ShapeDtypeStruct((x.shape[0], n), jnp.bfloat16)
    )
    return call(
        x.astype(jnp.bfloat16),
        gate.astype(jnp.bfloat16),
        up.astype(jnp.bfloat16),
        n=np.int64(n),
        num_threads=np.int32(cpu_backend._num_threads()),
        tiles=np.int32(tiles),
    )


def out_major_applies(rows: int, w) -> bool:
    """Whether ``x [rows, in] @ w [out, in]^T`` (an LM head, ``models.quant.float_matmul``)
    runs on this kernel (:func:`out_major_matmul`): more than :data:`FEW_ROWS` rows, a bf16
    ``w`` whose rows are whole blocks, the kernel :func:`available`."""
    return (
        rows > FEW_ROWS
        and jnp.dtype(w.dtype) == jnp.bfloat16
        and w.shape[1] % BLOCK == 0
        and available()
    )


def out_major_first_max(x, w, *, tiles: bool = True) -> jax.Array:
    """``argmax(x [R, in] @ w [out, in]^T, axis=-1)`` as ``[R]`` int32 (the first maximum; the
    first NaN if any, as ``jnp.argmax``) of the same f32 sums as :func:`out_major_matmul`,
    without storing the ``[R, out]`` product: the greedy LM head. Each work item of the kernel
    keeps its rows' first maxima per column; the items' are merged in order. SmolLM2-135M's
    49152 x 576 head at 64 rows: 9.0 against 13.5 ms for the product then
    ``jaxkv.worker.logits_ops.argmax`` (AMD EPYC VM, 2 cores, 2026-12-05; the f32 logits,
    12.5 MB, were a fresh temporary of every step, written page by page)."""
    if x.ndim != 2 or w.ndim != 2 or x.shape[1] != w.shape[1] or x.shape[1] % BLOCK:
        raise ValueError(
            f"amx.out_major_first_max takes x [R, in] and w [out, in] with in a multiple of "
            f"{BLOCK}, got x {x.shape} and w {w.shape}"
        )
    if w.shape[0] == 0:
        raise ValueError(f"amx.out_major_first_max needs a vocabulary, got w {w.shape}")
    x2 = x.astype(jnp.bfloat16)  # [R, in]
    call = cpu_backend._ffi_call(
        cpu_backend.FIRST_MAX_TARGET, jax.ShapeDtypeStruct((x2.shape[0],), jnp.int32)
    )
    return call(
        w.astype(jnp.bfloat16),
        pack(x2.T),
        n=np.int64(x2.shape[0]),
        num_threads=np.int32(cpu_backend._num_threads()),
        tiles=np.int32(tiles),
    )


def out_major_matmul(x, w, out_dtype, transposed: bool) -> jax.Array:
    """``x [..., in] @ w [out, in]^T`` on this kernel with the roles swapped: ``w`` (an LM head
    or tied embedding, read in place, no packed copy) is the tiles' row operand and ``x^T``,
    packed on each call (``in x rows`` values), the column operand. The result comes
    ``[out, R]`` (``transposed``: vocabulary-major, as the greedy head takes it), else
    transposed back to ``[..., out]``. SmolLM2-135M's 49152 x 576 head with the greedy argmax:
    3.15 against 11.14 ms at 16 rows, 9.27 against 11.44 ms at 64 (Intel Xeon VM, 2 cores,
    2026-12-05)."""
    lead, n_in = x.shape[:-1], x.shape[-1]
    x2 = x.reshape(-1, n_in).astype(jnp.bfloat16)  # [R, in]
    y_t = matmul(w, pack(x2.T), x2.shape[0], jnp.float32)  # [out, R]
    if transposed:
        return y_t.astype(out_dtype)
    return y_t.T.reshape(*lead, w.shape[0]).astype(out_dtype)
