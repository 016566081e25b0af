"""The GPU block-dequantizing matmul (``pallas_kernels/block_dequant_matmul.py``) in Pallas
interpret mode against numpy on the dequantized weights, for every layout it takes: q4, int8
and fp8 in blocks, input-major and vocabulary-major, with and without split K. Its Triton
compile is checked by tests/gpu_aot/test_h200_quantized.py."""

import jax.numpy as jnp
import numpy as np
import pytest

from jaxkv.models.quant import dequantize, dequantize_q4, quantize, quantize_q4
from jaxkv.pallas_kernels import block_dequant_matmul as bdm


def _layout(mode: str, w: np.ndarray, block: int) -> tuple[tuple, np.ndarray]:
    """``(kernel arrays, dequantized w)`` of ``w [K, N]``."""
    if mode == "q4":
        parts = quantize_q4(w)
        return parts, dequantize_q4(*parts)
    q, scale = quantize(w, mode, block)
    return (q, scale), dequantize(q, scale)


@pytest.mark.parametrize("mode, block", [("q4", 32), ("int8", 32), ("int8", 128), ("fp8", 32)])
@pytest.mark.parametrize("out_major", [False, True])
@pytest.mark.parametrize("rows, n_in, n_out", [(1, 256, 128), (20, 128, 64)])
def test_equals_numpy_on_the_dequantized_kernel(mode, block, out_major, rows, n_in, n_out):
    rng = np.random.default_rng(rows + n_in)
    w = rng.normal(size=(n_in, n_out)).astype(np.float32)
    x = rng.normal(size=(rows, n_in)).astype(np.float32)
    parts, dense = _layout(mode, w, block)
    if out_major:
        parts = tuple(a.T for a in parts)
    got = bdm.block_dequant_matmul(
        jnp.asarray(x),
        *(jnp.asarray(a) for a in parts),
        out_major=out_major,
        dtype=jnp.float32,
        interpret=True,
    )
    want = x.astype(np.float64) @ dense.astype(np.float64)
    tol = 1e-5 * (np.abs(x) @ np.abs(dense)).max()
    assert got.shape == (rows, n_out) and got.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(got), want, atol=tol, rtol=0)


def test_split_k_is_used_at_decode_sizes():
    bm, m_tiles, splits = bdm._tiles(rows=1, n_out=1024, blocks=128)
    assert (bm, m_tiles) == (16, 1) and splits > 1
    assert bdm._tiles(rows=512, n_out=14336, blocks=128)[2] == 1  # prefill: enough tiles


def test_bf16_compute_is_close():
    rng = np.random.default_rng(1)
    w = rng.normal(size=(128, 64)).astype(np.float32)
    x = rng.normal(size=(4, 128)).astype(np.float32)
    parts = quantize_q4(w)
    got = bdm.block_dequant_matmul(
        jnp.asarray(x), *(jnp.asarray(a) for a in parts), dtype=jnp.bfloat16, interpret=True
    )
    want = x @ dequantize_q4(*parts)
    np.testing.assert_allclose(np.asarray(got), want, atol=0.05 * np.abs(want).max())


def test_bad_layouts_are_refused():
    q, scale = quantize(np.ones((64, 64), np.float32), "int8", 32)
    x = jnp.ones((2, 64), jnp.float32)
    with pytest.raises(ValueError, match="block_dequant_matmul takes"):
        bdm.block_dequant_matmul(x[:, :32], q, scale, interpret=True)  # K mismatch
    with pytest.raises(ValueError, match="N a multiple of 64"):
        bdm.block_dequant_matmul(x, q[:, :48], scale[:, :48], interpret=True)
    assert not bdm.supports(64, 64, 48) and not bdm.supports(64, 96, 32)
    assert bdm.supports(4096, 128256, 32) and bdm.supports(4096, 14336, 128)
