"""Argument checks shared by every paged-attention entry point (shapes only, before tracing)."""

from __future__ import annotations

import numbers

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv.pallas_kernels.layout import is_fp8, resolve_kv_dtype


def _is_int(x) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, bool)


#: Values of ``lowering`` (backend="pallas" only; None picks by platform) -> the platform each
#: compiles for.
LOWERINGS = {"triton": "gpu", "mosaic": "tpu"}


def check_write_inputs(k, v, slot_mapping, interpret) -> tuple[int, int, int]:
    """A KV write's arguments (``k``, ``v``: [T, Hkv, D]; ``slot_mapping``: int [T]);
    returns ``(T, Hkv, D)``."""
    if not isinstance(interpret, bool):
        raise ValueError(f"interpret must be a bool, got {interpret!r}")
    if k.ndim != 3 or k.shape != v.shape:
        raise ValueError(f"k and v must both be [T, Hkv, D], got {k.shape} and {v.shape}")
    num_tokens, num_kv_heads, head_size = k.shape
    if slot_mapping.shape != (num_tokens,) or not jnp.issubdtype(slot_mapping.dtype, jnp.integer):
        raise ValueError(
            f"slot_mapping must be int [T={num_tokens}], got {slot_mapping.shape} "
            f"{slot_mapping.dtype}"
        )
    return num_tokens, num_kv_heads, head_size


def check_scales(dtype, k_scale, v_scale) -> None:
    """Scales are only meaningful for fp8 caches; anything else is an error, not a silent no-op."""
    if not is_fp8(dtype) and (k_scale is not None or v_scale is not None):
        raise ValueError(
            f"k_scale/v_scale are only supported for an fp8 KV cache, got dtype "
            f"{resolve_kv_dtype(dtype).name} with k_scale={k_scale!r}, v_scale={v_scale!r}"
        )
    for name, s in (("k_scale", k_scale), ("v_scale", v_scale)):
        if s is not None and jnp.ndim(s) != 0:
            raise ValueError(
                f"{name} must be a scalar (per-tensor scale), got shape {jnp.shape(s)}"
            )


def validate_lowering(lowering, backend: str) -> None:
    """``lowering`` must be None, "triton" or "mosaic", and only set with backend="pallas"."""
    if lowering is not None and lowering not in tuple(LOWERINGS):
        raise ValueError(f"lowering must be None or one of {tuple(LOWERINGS)}, got {lowering!r}")
    if lowering is not None and backend != "pallas":
        raise ValueError(
            f"lowering={lowering!r} applies to backend='pallas' only, got backend={backend!r}"
        )


def target_platform() -> str:
    """The platform being compiled for: the default device's (``with jax.default_device(d)``,
    e.g. a compile-only GPU device, see ``jaxkv.gpu_aot``), else the default backend's;
    "cuda" / "rocm" as "gpu"."""
    dev = jax.config.jax_default_device
    platform = (
        dev.platform if dev is not None and not isinstance(dev, str) else jax.default_backend()
    )
    return "gpu" if platform in ("cuda", "rocm") else platform


def resolve_lowering(lowering: str | None, interpret: bool) -> str:
    """ "triton" | "mosaic" for ``lowering`` (None = by platform: Mosaic on TPU, else Triton).
    Compiling (``interpret=False``) needs the lowering's own platform."""
    platform = target_platform()
    if lowering is None:
        lowering = "mosaic" if platform == "tpu" else "triton"
    if lowering not in tuple(LOWERINGS):
        raise ValueError(f"lowering must be None or one of {tuple(LOWERINGS)}, got {lowering!r}")
    if not interpret and platform != LOWERINGS[lowering]:
        raise ValueError(
            f"backend='pallas' with lowering={lowering!r} compiles for "
            f"{LOWERINGS[lowering].upper()} only; platform is {platform!r}: pass "
            f"interpret=True or use backend='xla'"
        )
    return lowering


def validate_attention_args(
    q,
    kv_cache,
    seq_lens,
    query_start_loc,
    block_tables,
    num_seqs,
    *,
    sm_scale,
    sliding_window,
    soft_cap,
    k_scale,
    v_scale,
    max_q_len=None,
    interpret=False,
) -> None:
    """Raises ValueError naming the bad value; runs on shapes only (before tracing the kernel)."""
    if q.ndim != 3:
        raise ValueError(f"q must be [T, Hq, D], got shape {q.shape}")
    if kv_cache.ndim != 5 or kv_cache.shape[1] != 2:
        raise ValueError(
            f"kv_cache must be the typed view [N, 2, Hkv, bs, D], got shape {kv_cache.shape}"
        )
    num_tokens, num_q_heads, head_size = q.shape
    _, _, num_kv_heads, _, kv_head_size = kv_cache.shape
    if kv_head_size != head_size:
        raise ValueError(f"head size of q ({head_size}) != head size of kv_cache ({kv_head_size})")
    if num_q_heads % num_kv_heads:
        raise ValueError(
            f"num_q_heads={num_q_heads} is not a multiple of num_kv_heads={num_kv_heads}"
        )
    if seq_lens.ndim != 1:
        raise ValueError(f"seq_lens must be [S], got shape {seq_lens.shape}")
    num_seq_rows = seq_lens.shape[0]
    if query_start_loc.shape != (num_seq_rows + 1,):
        raise ValueError(
            f"query_start_loc must be [S + 1] = [{num_seq_rows + 1}], got {query_start_loc.shape}"
        )
    if block_tables.ndim != 2 or block_tables.shape[0] != num_seq_rows or block_tables.shape[1] < 1:
        raise ValueError(f"block_tables must be [S={num_seq_rows}, B>=1], got {block_tables.shape}")
    if jnp.ndim(num_seqs) != 0:
        raise ValueError(f"num_seqs must be a scalar, got shape {jnp.shape(num_seqs)}")
    for name, a in (
        ("seq_lens", seq_lens),
        ("query_start_loc", query_start_loc),
        ("block_tables", block_tables),
    ):
        if not jnp.issubdtype(a.dtype, jnp.integer):
            raise ValueError(f"{name} must be an integer array, got dtype {a.dtype}")
    if (
        not isinstance(sm_scale, numbers.Real)
        or isinstance(sm_scale, bool)
        or not np.isfinite(sm_scale)
        or sm_scale <= 0
    ):
        raise ValueError(f"sm_scale must be a positive finite Python float, got {sm_scale!r}")
    if sliding_window is not None and (not _is_int(sliding_window) or sliding_window < 1):
        raise ValueError(f"sliding_window must be None or an int >= 1, got {sliding_window!r}")
    if soft_cap is not None and (
        not isinstance(soft_cap, numbers.Real) or isinstance(soft_cap, bool) or not soft_cap > 0
    ):
        raise ValueError(f"soft_cap must be None or a positive float, got {soft_cap!r}")
    check_scales(kv_cache.dtype, k_scale, v_scale)
    if max_q_len is not None and (not _is_int(max_q_len) or max_q_len < 0):
        raise ValueError(
            f"max_q_len must be None, 0 (unknown, AttentionMetadata's default) or an "
            f"int >= 1, got {max_q_len!r}"
        )
    if not isinstance(interpret, bool):
        raise ValueError(f"interpret must be a bool, got {interpret!r}")
    if num_tokens == 0:
        raise ValueError("q has no tokens (T = 0)")
