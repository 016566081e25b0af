"""The "cpu" attention backend: the XLA backend's prefill tiles plus a C++ decode kernel.

Decode rows (every sequence's last query row) go to ``cpu_kernels/paged_decode.cc``, an XLA FFI
custom call that reads each page once, straight from the cache, and reduces it in registers;
prefill tiles stay on the XLA path (big batched dots, which XLA:CPU runs near peak). On XLA:CPU
the decode q.k / p.v of a small GQA group run as YNNPACK reductions at ~10-20 GFLOP/s after a
gather of every page into a buffer; the kernel is 2-3x faster on the engine's decode shapes
(``benchmarks/attention_ab.py``, numbers in benchmarks/RESULTS.md). vLLM's CPU backend has its
own C++ paged attention for the same reason.

The kernel is compiled on first use with the system C++ compiler (``$CXX``, else ``c++`` /
``g++``; ``-O3 -march=native``) into ``$JAXKV_CACHE_DIR/cpu_kernels`` (default
``~/.cache/jaxkv``), keyed by the source, the compiler, jaxlib and this CPU's flags, and
registered with XLA once per process. Without a compiler (or with ``JAXKV_CPU_KERNELS=0``)
:func:`available` is False and "auto" keeps the pure-XLA backend; :func:`build_error` says why.

Supported: f32 / bf16 / f16 caches (typed or as bytes), head_size <= 256, GQA group <= 16,
block_size <= 256, sliding window, soft-cap. Anything else (fp8 caches) decodes on the XLA path.
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

from pallas_kernels import tiles as tiles_lib
from pallas_kernels import xla_backend

SOURCE = pathlib.Path(__file__).parent / "cpu_kernels" / "paged_decode.cc"
TARGET = "jaxkv_paged_decode_cpu"
FLAGS = ("-O3", "-march=native", "-fopenmp-simd", "-ffast-math", "-fno-finite-math-only",
         "-std=c++17", "-shared", "-fPIC", "-pthread")
#: Cache storage dtypes of the kernel (its ``storage`` attribute).
STORAGE = {jnp.dtype(jnp.float32): 0, jnp.dtype(jnp.bfloat16): 1, jnp.dtype(jnp.float16): 2}
MAX_HEAD_SIZE, MAX_GROUP, MAX_BLOCK_SIZE = 256, 16, 256


def _cache_dir() -> pathlib.Path:
    root = os.environ.get("JAXKV_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "jaxkv")
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
        version = subprocess.run([cxx, "--version"], capture_output=True, text=True,
                                 timeout=30).stdout.splitlines()[:1]
    except (OSError, subprocess.SubprocessError) as e:
        return None, f"{cxx} --version failed: {e}"
    key = hashlib.sha256("\n".join([
        SOURCE.read_text(), cxx, *version, " ".join(FLAGS), jax.__version__, _jaxlib_version(),
        include, platform.machine(), _cpu_flags()]).encode()).hexdigest()[:16]
    out = _cache_dir() / f"paged_decode_{key}.so"
    if not out.exists():
        try:
            out.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
            os.close(fd)
            res = subprocess.run([cxx, *FLAGS, f"-I{include}", str(SOURCE), "-o", tmp],
                                 capture_output=True, text=True, timeout=300)
            if res.returncode != 0:
                os.unlink(tmp)
                return None, f"compiling {SOURCE.name} failed: {res.stderr.strip()[-2000:]}"
            os.replace(tmp, out)  # atomic: concurrent builders write the same bytes
        except (OSError, subprocess.SubprocessError) as e:
            return None, f"building {SOURCE.name} failed: {e}"
    try:
        lib = ctypes.CDLL(str(out))
        jax.ffi.register_ffi_target(TARGET, jax.ffi.pycapsule(lib.JaxkvPagedDecodeCpu),
                                    platform="cpu")
    except (OSError, AttributeError, ValueError) as e:
        return None, f"loading {out} failed: {e}"
    return str(out), None


def available() -> bool:
    """True when the decode kernel is built and registered (builds it on the first call)."""
    return _build()[0] is not None


def build_error() -> str | None:
    """Why the kernel is unavailable (None when it is available)."""
    return _build()[1]


def supports(*, head_size: int, num_q_heads: int, num_kv_heads: int, block_size: int,
             cache_dtype) -> bool:
    """Whether the kernel covers these shapes and cache dtype (else decode stays on XLA)."""
    return (jnp.dtype(cache_dtype) in STORAGE and head_size <= MAX_HEAD_SIZE
            and num_q_heads % num_kv_heads == 0 and num_q_heads // num_kv_heads <= MAX_GROUP
            and block_size <= MAX_BLOCK_SIZE)


def _num_threads() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def decode_rows(q_rows,        # [S, Hq, D] the rows' queries
                kv_cache,      # [N, 2, Hkv, bs, D] typed, or [.., D * itemsize] uint8 bytes
                block_tables,  # [S, B] int32
                lo, hi,        # [S] int32 key range [lo, hi) of each row (hi <= lo: zeros)
                *, scale, soft_cap=None, kv_dtype=None):
    """The FFI decode: softmax(scale * q.k (soft-capped)) . v over each row's keys, [S, Hq, D] f32.

    ``scale`` and ``soft_cap`` are compile-time attributes (Python floats).
    """
    storage = STORAGE[jnp.dtype(kv_cache.dtype if kv_dtype is None else kv_dtype)]
    if not available():
        raise RuntimeError(f"the CPU decode kernel is unavailable: {build_error()}")
    call = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct(q_rows.shape, jnp.float32))
    return call(q_rows.astype(jnp.float32), kv_cache, block_tables.astype(jnp.int32),
                lo.astype(jnp.int32), hi.astype(jnp.int32), scale=np.float32(scale),
                soft_cap=np.float32(0.0 if soft_cap is None else soft_cap),
                storage=np.int32(storage), num_threads=np.int32(_num_threads()))


def _decode_attention(q, kv_rows, block_tables, t: tiles_lib.Tiles, *, kv_cache, scale: float,
                      block_size, num_kv_heads, kv_dtype, logit_scale, sliding_window, soft_cap):
    """Drop-in for ``xla_backend._decode_attention`` (same arguments, plus the cache in its own
    layout and the logit scale as a Python float): [S, Hkv, G, D] f32."""
    del kv_rows, logit_scale  # the kernel reads [N, 2, Hkv, bs, D'] pages; scale is static
    num_q_heads, head_size = q.shape[1:]
    _, end, _ = tiles_lib.kv_block_range(t, block_size=block_size,
                                         max_blocks=block_tables.shape[1],
                                         sliding_window=sliding_window)
    lo, hi = tiles_lib.key_range(t, sliding_window=sliding_window)
    hi = jnp.minimum(hi, end * block_size)  # the table's width; empty tiles: end = first, hi <= lo
    rows = q[jnp.clip(t.row0, 0, q.shape[0] - 1)]                          # [S, Hq, D]
    out = decode_rows(rows, kv_cache, block_tables[t.seq], lo, hi, scale=scale,
                      soft_cap=soft_cap, kv_dtype=kv_dtype)
    return out.reshape(out.shape[0], num_kv_heads, num_q_heads // num_kv_heads, head_size)


def _static_scale(sm_scale, k_scale) -> float | None:
    """sm_scale * k_scale as a Python float, or None when k_scale is traced."""
    try:
        return float(sm_scale) * (1.0 if k_scale is None else float(np.asarray(k_scale)))
    except (TypeError, jax.errors.ConcretizationTypeError, jax.errors.TracerArrayConversionError):
        return None


def paged_attention_cpu(q, kv_cache, seq_lens, query_start_loc, block_tables, num_seqs, *,
                        sm_scale, sliding_window=None, soft_cap=None, k_scale=None, v_scale=None,
                        max_q_len=None, kv_dtype=None):
    """``paged_attention_xla`` with the decode rows on the C++ kernel (same arguments/result).

    Falls back to the pure-XLA decode when the kernel is unavailable or does not cover the
    cache dtype / shapes, when ``k_scale`` is traced (the kernel takes the scale as a
    compile-time attribute), or off the CPU platform (the custom call is registered for CPU).
    """
    num_kv_heads, block_size = kv_cache.shape[2], kv_cache.shape[3]
    cache_dtype = kv_cache.dtype if kv_dtype is None else kv_dtype
    scale = _static_scale(sm_scale, k_scale)
    use = (scale is not None and jax.default_backend() == "cpu" and available()
           and supports(head_size=q.shape[2], num_q_heads=q.shape[1], num_kv_heads=num_kv_heads,
                        block_size=block_size, cache_dtype=cache_dtype))
    decode = functools.partial(_decode_attention, kv_cache=kv_cache, scale=scale) if use else None
    return xla_backend.paged_attention_xla(
        q, kv_cache, seq_lens, query_start_loc, block_tables, num_seqs, sm_scale=sm_scale,
        sliding_window=sliding_window, soft_cap=soft_cap, k_scale=k_scale, v_scale=v_scale,
        max_q_len=max_q_len, kv_dtype=kv_dtype, decode_attention=decode)
