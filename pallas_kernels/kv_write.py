"""Writing new K/V into a paged KV buffer, in place, as a scatter on the raw uint8 bytes.

Why bytes: on XLA:CPU a typed ``.at[].set`` on a bitcast view upcast the whole cache (measured:
1 GiB temp for a 256 MiB bf16 cache, ~1.2 s a step). Converting only the new K/V to the cache
dtype, bitcasting *them* to bytes and scattering rows of bytes into the donated uint8 buffer
runs in place (temp ~ the size of the update).

``backend="pallas"`` does the same byte scatter as a Pallas kernel (``kv_write_pallas.py``:
Triton on GPU, Mosaic on TPU) with the buffer as an aliased output; ``"xla"`` is the default.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxkv.pallas_kernels.layout import (
    page_bytes,
    quantize_to_cache,
    resolve_kv_dtype,
    typed_to_bytes,
)
from jaxkv.pallas_kernels.validation import check_scales, check_write_inputs, validate_lowering

#: Implementations of ``write_kv``.
WRITE_BACKENDS = ("xla", "cpu", "pallas")


def write_kv(
    buffer: jax.Array,  # [N * page_bytes] uint8
    k: jax.Array,  # [T, Hkv, D] model dtype
    v: jax.Array,  # [T, Hkv, D] model dtype
    slot_mapping: jax.Array,  # [T] int32, block * bs + offset; < 0 (PAD_SLOT_ID) = no write
    *,
    block_size: int,
    dtype,
    k_scale=None,
    v_scale=None,
    backend: str = "xla",
    interpret: bool = False,
    lowering: str | None = None,
) -> jax.Array:
    """Writes token t's K/V (every KV head) at slot ``slot_mapping[t]``; returns the new buffer.

    backend: "xla" (a ``mode="drop"`` scatter on the bytes), "cpu" (a C++ FFI call that copies
    the rows in place, ``cpu_backend.write_rows``; the "xla" scatter where the C++ kernels do not
    run) or "pallas" (``kv_write_pallas``; ``interpret=True`` runs it anywhere, ``lowering``
    "triton" | "mosaic" | None = by platform). All write nothing for slots < 0 (PAD_SLOT_ID) or
    >= N * bs and give the same bytes.

    Donate ``buffer`` in the enclosing ``jit`` so the scatter is in place. Byte rows are
    ``D * itemsize`` long; the row of (block b, K|V c, head h, offset o) in the page-major layout
    ``[N, 2, Hkv, bs, D]`` is ``((b * 2 + c) * Hkv + h) * bs + o``.

    Example (bs 4, Hkv 2): slot 13 = block 3, offset 1 -> K head 1 is row ((3*2+0)*2+1)*4+1 = 29,
    V head 1 is row ((3*2+1)*2+1)*4+1 = 33.
    """
    if backend not in WRITE_BACKENDS:
        raise ValueError(f"backend must be one of {WRITE_BACKENDS}, got {backend!r}")
    if not isinstance(interpret, bool):
        raise ValueError(f"interpret must be a bool, got {interpret!r}")
    validate_lowering(lowering, backend)
    dt = resolve_kv_dtype(dtype)
    check_scales(dt, k_scale, v_scale)
    num_tokens, num_kv_heads, head_size = check_write_inputs(k, v, slot_mapping, interpret)
    pb = page_bytes(block_size, num_kv_heads, head_size, dt)
    if buffer.ndim != 1 or buffer.dtype != jnp.uint8 or buffer.shape[0] % pb:
        raise ValueError(
            f"buffer must be flat uint8 with a multiple of page_bytes={pb} bytes, got "
            f"shape {buffer.shape} dtype {buffer.dtype}"
        )
    if backend == "cpu":
        from jaxkv.pallas_kernels import cpu_backend

        if cpu_backend.use_cpu_kernels():  # the rows' bytes as they are: no byte view needed
            return cpu_backend.write_rows(
                buffer,
                quantize_to_cache(k, dt, k_scale),
                quantize_to_cache(v, dt, v_scale),
                slot_mapping,
                block_size=block_size,
            )
        backend = "xla"
    num_blocks = buffer.shape[0] // pb
    row_bytes = head_size * dt.itemsize
    num_rows = num_blocks * 2 * num_kv_heads * block_size

    kb = typed_to_bytes(quantize_to_cache(k, dt, k_scale))  # [T, Hkv, D * itemsize]
    vb = typed_to_bytes(quantize_to_cache(v, dt, v_scale))
    slot = slot_mapping.astype(jnp.int32)
    if backend == "pallas":
        from jaxkv.pallas_kernels.kv_write_pallas import write_kv_pallas

        return write_kv_pallas(
            buffer, kb, vb, slot, block_size=block_size, interpret=interpret, lowering=lowering
        )
    updates = jnp.stack([kb, vb], axis=1).reshape(num_tokens * 2 * num_kv_heads, row_bytes)

    block, offset = slot // block_size, slot % block_size
    c = jnp.arange(2, dtype=jnp.int32)[None, :, None]
    h = jnp.arange(num_kv_heads, dtype=jnp.int32)[None, None, :]
    rows = ((block[:, None, None] * 2 + c) * num_kv_heads + h) * block_size + offset[:, None, None]
    # Padding (slot < 0) goes out of range and is dropped; a raw -1 would wrap to the last row.
    rows = jnp.where((slot >= 0)[:, None, None], rows, num_rows).reshape(-1)

    table = buffer.reshape(num_rows, row_bytes)
    table = table.at[rows].set(updates, mode="drop")
    return table.reshape(-1)
