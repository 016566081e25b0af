"""The "cpu" attention backend: ragged paged attention as one C++ XLA FFI call per layer.

``cpu_kernels/paged_attention.cc`` takes the packed batch as the engine gives it (queries,
cache, seq_lens, query_start_loc, block tables, num_seqs) and reads each page once, straight
from the cache: decode rows score 16 keys at a time with one transposing sum, prefill tiles of
32 rows score 64-key chunks against a transposed K; online softmax in f32; work split over
XLA's intra-op threads. On XLA:CPU the decode q.k / p.v of small GQA groups run as YNNPACK
reductions at ~10-20 GFLOP/s after a gather of every page, and the prefill tiles compute whole
causal squares (``benchmarks/attention_ab.py``, numbers in benchmarks/RESULTS.md). vLLM's CPU
backend has its own C++ paged attention for the same reason.

The kernel is compiled on first use with the system C++ compiler (``$CXX``, else ``c++`` /
``g++``; ``-O3 -march=native``, or ``-mcpu=native`` / no arch flag where the compiler rejects
it) into ``$JAXKV_CACHE_DIR/cpu_kernels`` (default ``~/.cache/jaxkv``), keyed by the source,
the compiler, jaxlib and this CPU's flags, and registered with XLA once per process. Without a
compiler (or with ``JAXKV_CPU_KERNELS=0``)
:func:`available` is False and "auto" keeps the pure-XLA backend; :func:`build_error` says why.

The same library holds the KV write / page zeroing (``cpu_kernels/kv_write.cc``) and the
weight-only matmuls of decode steps, used by ``jaxkv.models.quant.quantized_matmul``: int8 /
fp8 (``cpu_kernels/quantized_matmul.cc``, :func:`quantized_matmul`) and 4-bit blocks of 32
inputs with a scale and an offset each (``cpu_kernels/q4_matmul.cc``, :func:`q4_matmul`); and the
bf16 matmul on AMX tiles of weights packed at load (``cpu_kernels/amx_matmul.cc``, used through
``jaxkv.pallas_kernels.amx``).

Supported: f32 / bf16 / f16 caches (typed or as bytes), head_size <= 256, GQA group <= 16,
block_size <= 256, sliding window, soft-cap, a static k_scale. Anything else (fp8 caches, a
traced k_scale) runs the XLA backend.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import importlib.metadata
import os
import pathlib
import platform
import shutil
import subprocess
import tempfile

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv.pallas_kernels import xla_backend
from jaxkv.pallas_kernels.quant_formats import Q4_BLOCK, SCALE_DTYPES

#: C++ sources, built into one library; custom-call target -> exported handler symbol.
SOURCES = tuple(
    pathlib.Path(__file__).parent / "cpu_kernels" / n
    for n in (
        "paged_attention.cc",
        "kv_write.cc",
        "quantized_matmul.cc",
        "q4_matmul.cc",
        "amx_matmul.cc",
    )
)
#: Headers the sources include (part of the build's cache key).
HEADERS = (pathlib.Path(__file__).parent / "cpu_kernels" / "kernel_common.h",)
TARGET = "jaxkv_paged_attention_cpu"
WRITE_TARGET = "jaxkv_write_kv_cpu"
ZERO_TARGET = "jaxkv_zero_pages_cpu"
QMATMUL_TARGET = "jaxkv_quantized_matmul_cpu"
Q4_TARGET = "jaxkv_q4_matmul_cpu"
AMX_TARGET = "jaxkv_amx_matmul_cpu"
FIRST_MAX_TARGET = "jaxkv_bf16_first_max_cpu"
GATED_TARGET = "jaxkv_bf16_gated_cpu"
HANDLERS = {
    TARGET: "JaxkvPagedAttentionCpu",
    WRITE_TARGET: "JaxkvWriteKvCpu",
    ZERO_TARGET: "JaxkvZeroPagesCpu",
    QMATMUL_TARGET: "JaxkvQuantizedMatmulCpu",
    Q4_TARGET: "JaxkvQ4MatmulCpu",
    AMX_TARGET: "JaxkvAmxMatmulCpu",
    FIRST_MAX_TARGET: "JaxkvBf16FirstMaxCpu",
    GATED_TARGET: "JaxkvBf16GatedCpu",
}
#: Kernel dtypes of ``quantized_matmul`` (its ``qtype`` attribute): quantized (with scales),
#: then float (``FLOAT_QTYPES``: no scales).
QTYPES = {
    jnp.dtype(jnp.int8): 0,
    jnp.dtype(jnp.float8_e4m3fn): 1,
    jnp.dtype(jnp.bfloat16): 2,
    jnp.dtype(jnp.float32): 3,
}
FLOAT_QTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32))
#: Most rows of x ``quantized_matmul`` and ``q4_matmul`` take (the C++ kernels' limit).
QMATMUL_MAX_ROWS = 64
#: Flags of every build, then the first of ARCH_FLAGS the compiler accepts: -march=native (GCC,
#: Clang on x86), -mcpu=native (AArch64 compilers that reject -march=native), none (portable,
#: slower); then -fopenmp-simd when accepted (it only enables ``#pragma omp simd``).
FLAGS = (
    "-O3",
    "-ffast-math",
    "-fno-finite-math-only",
    "-std=c++17",
    "-shared",
    "-fPIC",
    "-pthread",
)
ARCH_FLAGS = (("-march=native",), ("-mcpu=native",), ())
SIMD_FLAGS = (("-fopenmp-simd",), ())
#: Cache storage dtypes of the kernel (its ``storage`` attribute).
STORAGE = {jnp.dtype(jnp.float32): 0, jnp.dtype(jnp.bfloat16): 1, jnp.dtype(jnp.float16): 2}
MAX_HEAD_SIZE, MAX_GROUP, MAX_BLOCK_SIZE = 256, 16, 256


def _cache_dir() -> pathlib.Path:
    root = os.environ.get("JAXKV_CACHE_DIR") or os.path.join(
        os.path.expanduser("~"), ".cache", "jaxkv"
    )
    return pathlib.Path(root) / "cpu_kernels"


def _compiler() -> str | None:
    for name in (os.environ.get("CXX"), "c++", "g++", "clang++"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


def _cpu_flags() -> str:
    """This CPU's feature flags (``-march=native`` builds are only valid on a matching CPU)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return line
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _jaxlib_version() -> str:
    try:
        return importlib.metadata.version("jaxlib")
    except importlib.metadata.PackageNotFoundError:
        return ""


def _flag_candidates() -> list[tuple[str, ...]]:
    return [(*FLAGS, *arch, *simd) for arch in ARCH_FLAGS for simd in SIMD_FLAGS]


def _compile(cxx: str, include: str, out: pathlib.Path) -> tuple[tuple[str, ...] | None, str]:
    """Builds SOURCES into ``out`` with the first flag set ``cxx`` accepts (atomic replace).

    Returns (the flags used, "") or (None, the last compiler error)."""
    error = ""
    for flags in _flag_candidates():
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
        os.close(fd)
        try:
            res = subprocess.run(
                [cxx, *flags, f"-I{include}", *map(str, SOURCES), "-o", tmp],
                capture_output=True,
                text=True,
                timeout=300,
            )
        except (OSError, subprocess.SubprocessError) as e:
            os.unlink(tmp)
            return None, str(e)
        if res.returncode == 0:
            os.replace(tmp, out)  # atomic: concurrent builders write the same bytes
            return flags, ""
        os.unlink(tmp)
        error = f"{' '.join(flags)}: {res.stderr.strip()[-1500:]}"
    return None, error


@functools.cache
def _build() -> tuple[str | None, str | None]:
    """(path of the shared library, None) or (None, why it is unavailable). Once per process."""
    if os.environ.get("JAXKV_CPU_KERNELS", "1") == "0":
        return None, "disabled by JAXKV_CPU_KERNELS=0"
    cxx = _compiler()
    if cxx is None:
        return None, "no C++ compiler found ($CXX, c++, g++, clang++)"
    include = jax.ffi.include_dir()
    try:
        version = subprocess.run(
            [cxx, "--version"], capture_output=True, text=True, timeout=30
        ).stdout.splitlines()[:1]
    except (OSError, subprocess.SubprocessError) as e:
        return None, f"{cxx} --version failed: {e}"
    key = hashlib.sha256(
        "\n".join(
            [
                *(src.read_text() for src in (*SOURCES, *HEADERS)),
                cxx,
                *version,
                repr(_flag_candidates()),
                jax.__version__,
                _jaxlib_version(),
                include,
                platform.machine(),
                _cpu_flags(),
            ]
        ).encode()
    ).hexdigest()[:16]
    out = _cache_dir() / f"jaxkv_cpu_{key}.so"
    if not out.exists():
        try:
            out.parent.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            return None, f"building the CPU kernels failed: {e}"
        flags, error = _compile(cxx, include, out)
        if flags is None:
            return None, f"compiling the CPU kernels failed: {error}"
    try:
        lib = ctypes.CDLL(str(out))
        for target, symbol in HANDLERS.items():
            jax.ffi.register_ffi_target(
                target, jax.ffi.pycapsule(getattr(lib, symbol)), platform="cpu"
            )
    except (OSError, AttributeError, ValueError) as e:
        return None, f"loading {out} failed: {e}"
    return str(out), None


def available() -> bool:
    """True when the kernels are built and registered (builds them on the first call)."""
    return _build()[0] is not None


def build_error() -> str | None:
    """Why the kernel is unavailable (None when it is available)."""
    return _build()[1]


def supports(
    *, head_size: int, num_q_heads: int, num_kv_heads: int, block_size: int, cache_dtype
) -> bool:
    """Whether the kernel covers these shapes and cache dtype (else the XLA backend runs)."""
    return (
        jnp.dtype(cache_dtype) in STORAGE
        and head_size <= MAX_HEAD_SIZE
        and num_q_heads % num_kv_heads == 0
        and num_q_heads // num_kv_heads <= MAX_GROUP
        and block_size <= MAX_BLOCK_SIZE
    )


def _num_threads() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def _ffi_call(target: str, result: jax.ShapeDtypeStruct, **kw):
    """``jax.ffi.ffi_call`` of one of this module's targets (building the library if needed)."""
    if not available():
        raise RuntimeError(f"the CPU kernels are unavailable: {build_error()}")
    return jax.ffi.ffi_call(target, result, **kw)


def ragged_attention(
    q,  # [T, Hq, D]
    kv_cache,  # [N, 2, Hkv, bs, D] typed, or [.., D * itemsize] uint8
    seq_lens,  # [S] int32
    query_start_loc,  # [S + 1] int32
    block_tables,  # [S, B] int32
    num_seqs,  # [] int32
    *,
    scale: float,
    soft_cap=None,
    sliding_window=None,
    kv_dtype=None,
):
    """The FFI call: [T, Hq, D] f32, ``softmax(scale * q.k (soft-capped)) . v`` per query row
    over its causal (windowed) keys; rows past ``query_start_loc[num_seqs]`` are zero.

    ``scale``, ``soft_cap`` and ``sliding_window`` are compile-time attributes (Python numbers).
    """
    storage = STORAGE[jnp.dtype(kv_cache.dtype if kv_dtype is None else kv_dtype)]
    q32 = q.astype(jnp.float32)
    if jnp.dtype(q.dtype) == jnp.bfloat16:
        # XLA:CPU computes a bf16 fusion (RoPE) in f32 and may skip its rounding to bf16 before
        # this convert (excess precision): the kernel would see f32 values and leave its bf16
        # q.k path. The explicit rounding gives it q's bf16 values.
        q32 = jax.lax.reduce_precision(q32, exponent_bits=8, mantissa_bits=7)
    call = _ffi_call(TARGET, jax.ShapeDtypeStruct(q.shape, jnp.float32))
    return call(
        q32,
        kv_cache,
        seq_lens.astype(jnp.int32),
        query_start_loc.astype(jnp.int32),
        block_tables.astype(jnp.int32),
        jnp.asarray(num_seqs, jnp.int32),
        scale=np.float32(scale),
        soft_cap=np.float32(0.0 if soft_cap is None else soft_cap),
        sliding_window=np.int32(0 if sliding_window is None else sliding_window),
        storage=np.int32(storage),
        num_threads=np.int32(_num_threads()),
    )


def write_rows(
    buffer,  # [N * page_bytes] uint8
    k,
    v,  # [T, Hkv, D] each, already in the cache dtype
    slot_mapping,  # [T] int32; < 0 or >= N * bs: no write
    *,
    block_size: int,
):
    """The FFI KV write: token t's K / V rows copied to slot ``slot_mapping[t]`` of the
    page-major cache, in place (the buffer is aliased to the result; donate it in the jit)."""
    call = _ffi_call(
        WRITE_TARGET, jax.ShapeDtypeStruct(buffer.shape, buffer.dtype), input_output_aliases={0: 0}
    )
    return call(buffer, k, v, slot_mapping.astype(jnp.int32), block_size=np.int32(block_size))


def zero_pages(
    buffer,  # [N * page_bytes] uint8
    page_ids,  # [K] int32; < 0 or >= N: skipped
    *,
    page_bytes: int,
):
    """The FFI page zeroing, in place (the buffer is aliased to the result)."""
    call = _ffi_call(
        ZERO_TARGET, jax.ShapeDtypeStruct(buffer.shape, buffer.dtype), input_output_aliases={0: 0}
    )
    return call(buffer, page_ids.astype(jnp.int32), page_bytes=np.int64(page_bytes))


def quantized_matmul(
    x,  # [M, K], M <= QMATMUL_MAX_ROWS
    q,  # [K, N] int8 | float8_e4m3fn | bfloat16 | float32; [N, K] when out_major
    scale,  # [N] | [K // block, N] f32 | f16 ([N] | [N, K // block] out-major); None for floats
    *,
    out_major: bool = False,
):
    """The FFI weight-only matmul: ``x @ dequantize(q, scale)`` (``x @ (q * scale)^T`` when
    ``out_major``) as [M, N] f32, reading each weight once as stored
    (``cpu_kernels/quantized_matmul.cc``); block scales' block size follows from the shapes.
    bfloat16 / float32 ``q`` (``FLOAT_QTYPES``) take no scale: ``x @ q``."""
    qdtype = jnp.dtype(q.dtype)
    if x.ndim != 2 or x.shape[0] > QMATMUL_MAX_ROWS or qdtype not in QTYPES:
        raise ValueError(
            f"quantized_matmul takes x [M <= {QMATMUL_MAX_ROWS}, K] and an int8 / fp8 / bf16 / "
            f"f32 q, got x {x.shape}, q {q.dtype}"
        )
    if (scale is None) != (qdtype in FLOAT_QTYPES):
        raise ValueError(
            f"quantized_matmul takes a scale with an int8 / fp8 q and none with a float q, got "
            f"q {q.dtype} and scale {None if scale is None else scale.shape}"
        )
    n_in, n_out = (q.shape[1], q.shape[0]) if out_major else q.shape
    if scale is None:
        scale = jnp.zeros((0,), jnp.float32)  # no scales (the kernel's float weights)
    groups = 0 if scale.ndim == 1 else scale.shape[1 if out_major else 0]
    block = 0 if groups == 0 else n_in // groups
    call = _ffi_call(QMATMUL_TARGET, jax.ShapeDtypeStruct((x.shape[0], n_out), jnp.float32))
    return call(
        x.astype(jnp.float32),
        q,
        scale if jnp.dtype(scale.dtype) in SCALE_DTYPES else scale.astype(jnp.float32),
        block=np.int64(block),
        qtype=np.int32(QTYPES[jnp.dtype(q.dtype)]),
        out_major=bool(out_major),
        num_threads=np.int32(_num_threads()),
    )


def q4_matmul(
    x,  # [M, K] f32 (other floats are converted), M <= QMATMUL_MAX_ROWS, K a multiple of Q4_BLOCK
    packed,  # [K // 2, N] uint8; [N, K // 2] when out_major
    scale,  # [K // 32, N] f32 | f16; [N, K // 32] when out_major
    offset,  # as scale (its own dtype)
    *,
    out_major: bool = False,
):
    """The FFI 4-bit matmul: ``x @ w`` (``x @ w^T`` when ``out_major``) as [M, N] f32, where
    ``w[k, n] = q[k, n] * scale[k // 32, n] + offset[k // 32, n]`` and ``q`` (0..15) is packed
    two to a byte per block of 32 inputs: ``packed[16 b + j, n]`` holds ``q[32 b + j, n]`` in
    its low nibble and ``q[32 b + 16 + j, n]`` in its high one (out-major: ``packed[n, 16 b +
    j]``, ``scale[n, b]``). Each weight byte is read once (``cpu_kernels/q4_matmul.cc``); f32
    and f16 scales / offsets are read as stored, other dtypes converted to f32."""
    shapes = (
        f"x {tuple(x.shape)} {jnp.dtype(x.dtype)}, packed {tuple(packed.shape)} "
        f"{jnp.dtype(packed.dtype)}, scale {tuple(scale.shape)}, offset {tuple(offset.shape)}"
    )
    if x.ndim != 2 or x.shape[0] > QMATMUL_MAX_ROWS or x.shape[1] % Q4_BLOCK:
        raise ValueError(
            f"q4_matmul takes x [M <= {QMATMUL_MAX_ROWS}, K] with K a multiple of {Q4_BLOCK}, "
            f"got {shapes}"
        )
    n_in = x.shape[1]
    if jnp.dtype(packed.dtype) != jnp.uint8 or packed.ndim != 2:
        raise ValueError(f"q4_matmul takes a 2-d uint8 packed, got {shapes}")
    n_out = packed.shape[0] if out_major else packed.shape[1]
    want_packed = (n_out, n_in // 2) if out_major else (n_in // 2, n_out)
    want_params = (n_out, n_in // Q4_BLOCK) if out_major else (n_in // Q4_BLOCK, n_out)
    if tuple(packed.shape) != want_packed:
        raise ValueError(f"q4_matmul takes packed {want_packed} for this x, got {shapes}")
    if tuple(scale.shape) != want_params or tuple(offset.shape) != want_params:
        raise ValueError(f"q4_matmul takes scale and offset {want_params}, got {shapes}")

    def params(a):
        return a if jnp.dtype(a.dtype) in SCALE_DTYPES else a.astype(jnp.float32)

    call = _ffi_call(Q4_TARGET, jax.ShapeDtypeStruct((x.shape[0], n_out), jnp.float32))
    return call(
        x.astype(jnp.float32),
        packed,
        params(scale),
        params(offset),
        out_major=bool(out_major),
        num_threads=np.int32(_num_threads()),
    )


def use_cpu_kernels() -> bool:
    """Whether the C++ kernels run here: the default platform is CPU and they build."""
    return jax.default_backend() == "cpu" and available()


def _static_scale(sm_scale, k_scale) -> float | None:
    """sm_scale * k_scale as a Python float, or None when k_scale is traced."""
    try:
        return float(sm_scale) * (1.0 if k_scale is None else float(np.asarray(k_scale)))
    except (TypeError, jax.errors.ConcretizationTypeError, jax.errors.TracerArrayConversionError):
        return None


def paged_attention_cpu(
    q,
    kv_cache,
    seq_lens,
    query_start_loc,
    block_tables,
    num_seqs,
    *,
    sm_scale,
    sliding_window=None,
    soft_cap=None,
    k_scale=None,
    v_scale=None,
    max_q_len=None,
    kv_dtype=None,
):
    """``paged_attention`` on the C++ kernel (same arguments and result).

    Runs ``paged_attention_xla`` instead when the kernel is unavailable or does not cover the
    cache dtype / shapes, when ``k_scale`` is traced (the kernel takes the scale as a
    compile-time attribute), or off the CPU platform (the custom call is registered for CPU).
    """
    num_kv_heads, block_size = kv_cache.shape[2], kv_cache.shape[3]
    cache_dtype = kv_cache.dtype if kv_dtype is None else kv_dtype
    scale = _static_scale(sm_scale, k_scale)
    use = (
        scale is not None
        and use_cpu_kernels()
        and supports(
            head_size=q.shape[2],
            num_q_heads=q.shape[1],
            num_kv_heads=num_kv_heads,
            block_size=block_size,
            cache_dtype=cache_dtype,
        )
    )
    if not use:
        return xla_backend.paged_attention_xla(
            q,
            kv_cache,
            seq_lens,
            query_start_loc,
            block_tables,
            num_seqs,
            sm_scale=sm_scale,
            sliding_window=sliding_window,
            soft_cap=soft_cap,
            k_scale=k_scale,
            v_scale=v_scale,
            max_q_len=max_q_len,
            kv_dtype=kv_dtype,
        )
    out = ragged_attention(
        q,
        kv_cache,
        seq_lens,
        query_start_loc,
        block_tables,
        num_seqs,
        scale=scale,
        soft_cap=soft_cap,
        sliding_window=sliding_window,
        kv_dtype=kv_dtype,
    )
    if v_scale is not None:
        out = out * jnp.asarray(v_scale, jnp.float32)
    return out.astype(q.dtype)
