"""Random ragged batches for tests and benchmarks (host-side numpy; not used by the kernels),
and ``abstract_gpu()`` for lowering the Triton kernels on a machine without a GPU.

Pages are filled so that stray reads show: every page nobody may read (the null block, free
pages, the tails of last blocks, blocks wholly before a sliding window) holds NaN, and table
entries past a sequence's blocks hold random (garbage) block ids.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv.pallas_kernels.layout import kv_cache_shape, quantize_to_cache, resolve_kv_dtype


def abstract_gpu(device_kind: str = "NVIDIA H200"):
    """A context in which Pallas' Triton lowering targets ``device_kind`` with no GPU present.

    From jax 0.11 the Triton lowering reads the GPU's compute capability from the default
    device or from the abstract mesh's device (without either it raises "No supported GPU
    devices found"); jax 0.10.2 assumed 9.0. For lowering to text only
    (``.lower(lowering_platforms=("cuda",))``); compiling needs a compile-only device
    (``jaxkv.gpu_aot``)."""
    dev = jax.sharding.AbstractDevice(device_kind=device_kind, num_cores=None, platform="cuda")
    return jax.sharding.use_abstract_mesh(
        jax.sharding.AbstractMesh((1,), ("gpu",), abstract_device=dev)
    )


@dataclasses.dataclass
class Batch:
    q: np.ndarray  # [T, Hq, D] model dtype
    kv_cache: np.ndarray  # [N, 2, Hkv, bs, D] cache dtype (typed view contents)
    buffer: np.ndarray  # [N * page_bytes] uint8 (same contents as kv_cache)
    seq_lens: np.ndarray  # [S] int32
    query_start_loc: np.ndarray  # [S + 1] int32
    block_tables: np.ndarray  # [S, B] int32
    num_seqs: np.ndarray  # [] int32
    slot_mapping: np.ndarray  # [T] int32 (PAD_SLOT_ID for padding rows)
    k_dense: np.ndarray  # [S, B * bs, Hkv, D] float32, dequantised keys (0 past seq_len)
    v_dense: np.ndarray  # [S, B * bs, Hkv, D] float32
    max_q_len: int

    def attention_args(self):
        return (
            jnp.asarray(self.q),
            jnp.asarray(self.kv_cache),
            jnp.asarray(self.seq_lens),
            jnp.asarray(self.query_start_loc),
            jnp.asarray(self.block_tables),
            jnp.asarray(self.num_seqs),
        )


def make_batch(
    rng: np.random.Generator,
    *,
    q_lens,
    kv_lens,
    block_size: int,
    num_q_heads: int,
    num_kv_heads: int,
    head_size: int,
    cache_dtype="float32",
    q_dtype=jnp.float32,
    num_seq_rows: int | None = None,
    num_tokens: int | None = None,
    max_blocks: int | None = None,
    extra_blocks: int = 3,
    sliding_window=None,
    kv_scale: float | None = None,
    fill=np.nan,
) -> Batch:
    """A packed batch: sequence i has ``kv_lens[i]`` tokens of which the last ``q_lens[i]`` query.

    Padding: ``num_seq_rows`` > len(q_lens) adds empty sequences, ``num_tokens`` > sum(q_lens)
    adds padding rows. Blocks get a random permutation of ids >= 1 (0 is the null block).
    """
    q_lens, kv_lens = list(q_lens), list(kv_lens)
    assert len(q_lens) == len(kv_lens) and all(0 < ql <= kl for ql, kl in zip(q_lens, kv_lens))
    dt = resolve_kv_dtype(cache_dtype)
    bs = block_size
    n_real = len(q_lens)
    s_rows = num_seq_rows or n_real
    need = [-(-kl // bs) for kl in kv_lens]
    width = max_blocks or max(need)
    assert width >= max(need)
    t_real = sum(q_lens)
    t_rows = num_tokens or t_real
    num_blocks = 1 + sum(need) + extra_blocks
    ids = rng.permutation(np.arange(1, num_blocks)).astype(np.int32)

    tables = rng.integers(0, num_blocks, size=(s_rows, width)).astype(np.int32)  # garbage
    k_dense = np.zeros((s_rows, width * bs, num_kv_heads, head_size), np.float32)
    v_dense = np.zeros_like(k_dense)
    cache = np.full(kv_cache_shape(num_blocks, bs, num_kv_heads, head_size, dt), fill, np.float32)
    scale = 1.0 if kv_scale is None else kv_scale
    nxt = 0
    for i, (ql, kl) in enumerate(zip(q_lens, kv_lens)):
        blocks = ids[nxt : nxt + need[i]]
        nxt += need[i]
        tables[i, : need[i]] = blocks
        kv = rng.standard_normal((2, kl, num_kv_heads, head_size)).astype(np.float32)
        stored = np.asarray(quantize_to_cache(jnp.asarray(kv), dt, kv_scale).astype(jnp.float32))
        k_dense[i, :kl], v_dense[i, :kl] = stored[0] * scale, stored[1] * scale
        padded = np.full((2, need[i] * bs, num_kv_heads, head_size), fill, np.float32)
        padded[:, :kl] = stored  # tail of the last block keeps ``fill``
        cache[blocks] = padded.reshape(2, need[i], bs, num_kv_heads, head_size).transpose(
            1, 0, 3, 2, 4
        )
        if sliding_window is not None:  # blocks wholly before the first query's window
            first_needed = max(0, kl - ql - sliding_window + 1) // bs
            cache[blocks[:first_needed]] = fill
            k_dense[i, : first_needed * bs] = v_dense[i, : first_needed * bs] = 0.0
    typed = np.asarray(jnp.asarray(cache).astype(dt))
    buffer = typed.reshape(-1).view(np.uint8).copy()

    qsl = np.zeros(s_rows + 1, np.int32)
    qsl[1 : n_real + 1] = np.cumsum(q_lens)
    qsl[n_real + 1 :] = t_real
    seq_lens = np.zeros(s_rows, np.int32)
    seq_lens[:n_real] = kv_lens
    slots = np.full(t_rows, -1, np.int32)
    for i, (ql, kl) in enumerate(zip(q_lens, kv_lens)):
        for j in range(ql):
            p = kl - ql + j
            slots[qsl[i] + j] = tables[i, p // bs] * bs + p % bs
    q = np.asarray(
        jnp.asarray(rng.standard_normal((t_rows, num_q_heads, head_size)), jnp.float32).astype(
            q_dtype
        )
    )
    return Batch(
        q=q,
        kv_cache=typed,
        buffer=buffer,
        seq_lens=seq_lens,
        query_start_loc=qsl,
        block_tables=tables,
        num_seqs=np.int32(n_real),
        slot_mapping=slots,
        k_dense=k_dense,
        v_dense=v_dense,
        max_q_len=max(q_lens),
    )
