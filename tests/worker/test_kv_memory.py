"""Flat uint8 KV buffers: allocation, page ops in place, views sharing bytes, padding writes nothing."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxkv.kv_cache import FullAttentionSpec, SlidingWindowSpec, get_kv_cache_config
from jaxkv.pallas_kernels import PAD_SLOT_ID, kv_cache_view, write_kv
from jaxkv.worker import (
    allocate_kv_buffers,
    page_size_bytes,
    read_blocks,
    write_blocks,
    zero_blocks,
)
from jaxkv.worker.forward import slot_mapping, token_positions

BS, H, D = 16, 2, 64


def _hybrid_config(dtype="float32", blocks=8):
    full = FullAttentionSpec(BS, H, D, dtype)
    sw = SlidingWindowSpec(BS, H, D, dtype, sliding_window=32)
    specs = {"L0": full, "L1": sw, "L2": full, "L3": sw}
    return get_kv_cache_config(specs, 10**9, max_model_len=64, num_gpu_blocks_override=blocks)


def test_allocation_one_zeroed_buffer_per_tensor():
    cfg = _hybrid_config()
    bufs = allocate_kv_buffers(cfg)
    page = page_size_bytes(cfg)
    assert page == 2 * BS * H * D * 4
    assert [b.shape for b in bufs] == [(8 * page,), (8 * page,)]
    assert all(b.dtype == jnp.uint8 and not b.any() for b in bufs)


def test_misaligned_page_is_rejected():
    spec = FullAttentionSpec(1, 1, 8, "fp8")  # 16-byte pages
    cfg = get_kv_cache_config({"a": spec}, 10**6, max_model_len=8, num_gpu_blocks_override=4)
    with pytest.raises(ValueError, match="not a multiple of 256"):
        allocate_kv_buffers(cfg)


@pytest.mark.parametrize("cpu_kernel", [False, True], ids=["xla", "cpu-kernel"])
def test_page_ops_in_place_and_padding_ids_touch_nothing(cpu_kernel):
    """cpu_kernel: the C++ FFI zeroing (where it runs; elsewhere the same XLA scatter)."""
    page = 256
    buf = jnp.arange(4 * page, dtype=jnp.uint32).astype(jnp.uint8)
    before = np.asarray(buf)
    f = jax.jit(
        lambda b, ids: zero_blocks(b, ids, page_bytes=page, cpu_kernel=cpu_kernel), donate_argnums=0
    )
    out = np.asarray(f(buf, jnp.array([2, -1, 7], jnp.int32)))  # -1 and 7 are padding
    expect = before.copy()
    expect[2 * page : 3 * page] = 0
    np.testing.assert_array_equal(out, expect)  # block 3 (what -1 would wrap to) is intact
    got = read_blocks(jnp.asarray(out), jnp.array([0, 2, -1]), page_bytes=page)
    np.testing.assert_array_equal(np.asarray(got[0]), before[:page])
    assert not np.asarray(got[1:]).any()
    data = jnp.full((2, page), 9, jnp.uint8)
    out2 = np.asarray(write_blocks(jnp.asarray(out), jnp.array([1, -1]), data, page_bytes=page))
    assert (out2[page : 2 * page] == 9).all() and (out2[3 * page :] == expect[3 * page :]).all()


def test_layers_sharing_a_tensor_see_the_same_bytes():
    """L0 (group 0) and L1 (group 1) share tensor 0: a write through L0's block is visible in
    the same page of L1's view, and a block belongs to one group at a time."""
    cfg = _hybrid_config()
    assert cfg.kv_cache_tensors[0].shared_by == ("L0", "L1")
    (buf, _) = allocate_kv_buffers(cfg)
    k = jnp.ones((1, H, D), jnp.float32) * 3.0
    buf = write_kv(buf, k, -k, jnp.array([5 * BS + 2], jnp.int32), block_size=BS, dtype="float32")
    view_l0 = kv_cache_view(buf, block_size=BS, num_kv_heads=H, head_size=D, dtype="float32")
    view_l1 = kv_cache_view(buf, block_size=BS, num_kv_heads=H, head_size=D, dtype="float32")
    assert float(view_l1[5].sum()) == float(view_l0[5].sum()) == 0.0  # K and V cancel
    assert float(jnp.abs(view_l1[5]).sum()) == 2 * H * D * 3.0
    assert not np.asarray(view_l0[:5]).any() and not np.asarray(view_l0[6:]).any()


def test_pad_slot_writes_nothing_and_last_slot_intact():
    cfg = _hybrid_config()
    (buf, _) = allocate_kv_buffers(cfg)
    k = jnp.full((3, H, D), 7.0, jnp.float32)
    slots = jnp.array([PAD_SLOT_ID, PAD_SLOT_ID, PAD_SLOT_ID], jnp.int32)
    out = jax.jit(
        lambda b: write_kv(b, k, k, slots, block_size=BS, dtype="float32"), donate_argnums=0
    )(buf)
    assert not np.asarray(out).any()  # in particular the last slot (where -1 would wrap)


def test_slot_mapping_worked_example():
    """vLLM's example: bs 4; row 0 = [7, 3] with 5 cached + 2 new; row 1 = [2] new with 3."""
    qsl = jnp.array([0, 2, 5, 5], jnp.int32)  # a padding row at the end
    num_computed = jnp.array([5, 0, 0], jnp.int32)
    seq, pos, valid = token_positions(qsl, num_computed, jnp.int32(2), 8)
    np.testing.assert_array_equal(np.asarray(pos)[:5], [5, 6, 0, 1, 2])
    np.testing.assert_array_equal(np.asarray(seq)[:5], [0, 0, 1, 1, 1])
    table = jnp.array([[7, 3], [2, 0], [0, 0]], jnp.int32)
    slots = np.asarray(slot_mapping(table, seq, pos, valid, 4))
    np.testing.assert_array_equal(slots, [13, 14, 8, 9, 10, -1, -1, -1])
