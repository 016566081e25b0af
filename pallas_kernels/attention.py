"""``paged_attention``: argument checks and the choice of backend
("reference" | "xla" | "cpu" | "pallas")."""

from __future__ import annotations

import jax

from jaxkv.pallas_kernels.cpu_backend import paged_attention_cpu
from jaxkv.pallas_kernels.layout import resolve_kv_dtype, typed_view_of_bytes
from jaxkv.pallas_kernels.reference import paged_attention_reference
from jaxkv.pallas_kernels.validation import validate_attention_args, validate_lowering
from jaxkv.pallas_kernels.xla_backend import paged_attention_xla

BACKENDS = ("reference", "xla", "cpu", "pallas")


def paged_attention(
    q: jax.Array,  # [T, Hq, D]
    kv_cache: jax.Array,  # [N, 2, Hkv, bs, D] cache dtype (kv_cache_view)
    seq_lens: jax.Array,  # [S] int32, KV length including this step's tokens; 0 = padding
    query_start_loc: jax.Array,  # [S + 1] int32
    block_tables: jax.Array,  # [S, B] int32 (B may be a bucket narrower than the max)
    num_seqs: jax.Array,  # [] int32
    *,
    sm_scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    k_scale=None,
    v_scale=None,
    max_q_len: int | None = None,
    backend: str = "xla",
    interpret: bool = False,
    kv_dtype=None,
    lowering: str | None = None,
) -> jax.Array:  # [T, Hq, D] q.dtype
    """Ragged paged attention over a packed batch of prefill chunks and decodes.

    Sequence i owns query rows ``[query_start_loc[i], query_start_loc[i+1])``: the LAST q_len_i
    of its ``seq_lens[i]`` tokens. The query at position p attends keys at positions
    ``max(0, p - W + 1) .. p`` (causal; W = sliding_window keys including itself, HF
    Mistral/Gemma2). Logits are ``soft_cap * tanh(sm_scale * q.k / soft_cap)`` when soft-capped.
    fp8 caches hold ``x / scale`` and are read as ``stored * scale``. GQA: query head h uses
    KV head ``h // (Hq // Hkv)``. Rows past ``query_start_loc[num_seqs]`` give zeros.

    Example: bs 4, query_start_loc [0, 2, 5], seq_lens [7, 3] -> rows 0, 1 are positions 5, 6 of
    sequence 0 (keys 0..5 and 0..6), rows 2..4 are positions 0..2 of sequence 1.

    Args:
      max_q_len: static upper bound on any q_len (1 = pure decode); None or 0 = up to T.
      backend: "reference" (the spec, slow), "xla" (pure jnp), "cpu" (one C++ FFI kernel for
        prefill and decode rows, ``cpu_backend``; CPU only; fp8 caches run the XLA backend), "pallas" (Triton on GPU,
        Mosaic on TPU; ``interpret=True`` runs it anywhere).
      interpret: run the Pallas kernel in interpret mode (only with backend="pallas"); the
        Mosaic kernel then runs in TPU interpret mode.
      lowering: backend="pallas" only: "triton" | "mosaic" | None (by platform: Mosaic on TPU,
        Triton elsewhere). Choosing the other platform's lowering needs ``interpret=True``.
      kv_dtype: when set, ``kv_cache`` is the byte view ``[N, 2, Hkv, bs, D * itemsize]`` uint8
        (``kv_cache_byte_view``) of a cache of this dtype. The XLA backend then gathers bytes
        and bitcasts only what it gathered (a whole-buffer bitcast is a full copy on XLA:CPU).
        Use it for bf16/fp16/fp8 caches on CPU: with the typed view XLA:CPU moves the widening
        convert out of the page loop and converts the whole cache each call (measured: bf16,
        64 MiB cache, 137 MiB temp and 50 ms vs 7 MiB and 9 ms with the byte view).
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    validate_lowering(lowering, backend)
    kv_bytes = None
    if kv_dtype is not None:
        kv_bytes, kv_dtype = kv_cache, resolve_kv_dtype(kv_dtype)
        kv_cache = typed_view_of_bytes(kv_bytes, kv_dtype, abstract=True)
    validate_attention_args(
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
        interpret=interpret,
    )
    if max_q_len == 0:  # AttentionMetadata.max_q_len's "unknown"
        max_q_len = None
    kw = dict(
        sm_scale=float(sm_scale),
        sliding_window=sliding_window,
        soft_cap=None if soft_cap is None else float(soft_cap),
        k_scale=k_scale,
        v_scale=v_scale,
    )
    if backend in ("xla", "cpu"):
        fn = paged_attention_xla if backend == "xla" else paged_attention_cpu
        return fn(
            q,
            kv_cache if kv_bytes is None else kv_bytes,
            seq_lens,
            query_start_loc,
            block_tables,
            num_seqs,
            max_q_len=max_q_len,
            kv_dtype=kv_dtype,
            **kw,
        )
    if kv_bytes is not None:
        kv_cache = typed_view_of_bytes(kv_bytes, kv_dtype)
    if backend == "reference":
        return paged_attention_reference(
            q, kv_cache, seq_lens, query_start_loc, block_tables, num_seqs, **kw
        )  # validates again: cheap, shapes only
    from jaxkv.pallas_kernels.pallas_attention import paged_attention_pallas

    return paged_attention_pallas(
        q,
        kv_cache,
        seq_lens,
        query_start_loc,
        block_tables,
        num_seqs,
        max_q_len=max_q_len,
        interpret=interpret,
        lowering=lowering,
        **kw,
    )
