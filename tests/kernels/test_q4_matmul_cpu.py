"""The C++ 4-bit block matmul (``cpu_backend.q4_matmul``) against numpy: the nibbles unpacked
per the documented layout, dequantized in float64 and multiplied, for both layouts (input-major
``[K / 2, N]`` and the LM head's out-major ``[N, K / 2]``), f32 and f16 scales / offsets, and
row counts that give each size of the kernel's row groups (it widens the nibbles once for up to
4 rows of x): 1, 2, 3, 6 (4 + 2), 32 and 64 rows."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from jaxkv.pallas_kernels import cpu_backend

BLOCK = 32


@pytest.fixture(autouse=True)
def _kernel():
    if jax.default_backend() != "cpu":
        pytest.skip("the C++ kernels run on the CPU platform")
    if not cpu_backend.available():
        pytest.skip(f"CPU kernels unavailable: {cpu_backend.build_error()}")


def _pack(q):
    """q [K, N] (0..15) -> [K / 2, N] uint8, written out per byte as the layout states: byte
    ``16 b + j`` holds ``q[32 b + j]`` low and ``q[32 b + 16 + j]`` high."""
    n_in, n_out = q.shape
    packed = np.zeros((n_in // 2, n_out), np.uint8)
    for b in range(n_in // BLOCK):
        for j in range(BLOCK // 2):
            lo, hi = q[BLOCK * b + j], q[BLOCK * b + BLOCK // 2 + j]
            packed[BLOCK // 2 * b + j] = lo | (hi << 4)
    return packed


def _unpack(packed):
    """The reference's reading of the layout: [K / 2, N] uint8 -> q [K, N]."""
    half, n_out = packed.shape
    q = np.zeros((2 * half, n_out), np.uint8)
    for b in range(half // (BLOCK // 2)):
        for j in range(BLOCK // 2):
            byte = packed[BLOCK // 2 * b + j]
            q[BLOCK * b + j] = byte & 15
            q[BLOCK * b + BLOCK // 2 + j] = byte >> 4
    return q


def _case(rows, n_in, n_out, param_dtype=np.float32, seed=0):
    """x, packed [K / 2, N], scale and offset [K / 32, N], and the dequantized w [K, N] float64
    (from the stored, possibly f16, scales). Scales of either sign with some exactly zero (a
    constant block), offsets around -8 scale (GGUF Q4_0's form) and random."""
    rng = np.random.default_rng(seed)
    q = rng.integers(0, 16, (n_in, n_out), dtype=np.uint8)
    nb = n_in // BLOCK
    scale = rng.standard_normal((nb, n_out)) * 0.1
    scale[rng.random((nb, n_out)) < 0.1] = 0.0
    offset = np.where(rng.random((nb, n_out)) < 0.5, -8.0 * scale, rng.standard_normal((nb, n_out)))
    scale, offset = scale.astype(param_dtype), offset.astype(param_dtype)
    packed = _pack(q)
    assert np.array_equal(_unpack(packed), q)
    w = _unpack(packed) * np.repeat(scale.astype(np.float64), BLOCK, axis=0)
    w += np.repeat(offset.astype(np.float64), BLOCK, axis=0)
    x = rng.standard_normal((rows, n_in)).astype(np.float32)
    return x, packed, scale, offset, w


def _check(got, x, w):
    """Each entry within 1e-5 of sum_k |x_k| |w_k| (f32 summation of up to 4096 terms) of the
    float64 product."""
    x64 = x.astype(np.float64)
    want = x64 @ w
    bound = 1e-5 * (np.abs(x64) @ np.abs(w)) + 1e-30
    assert got.shape == want.shape and got.dtype == np.float32
    err = np.abs(got.astype(np.float64) - want)
    assert np.all(err <= bound), f"worst error / bound {np.max(err / bound):.3g}"


SHAPES = [
    (32, 64),  # one block
    (64, 200),  # N not a multiple of 64: a ragged last column range
    (576, 1536),  # SmolLM2's up projection
    (1536, 576),  # its down projection
    (4096, 130),  # a long reduction, few columns
    (256, 4097),  # more columns than the widest range
]


@pytest.mark.parametrize("param_dtype", [np.float32, np.float16])
@pytest.mark.parametrize("rows", [1, 2, 3, 6, 32])
@pytest.mark.parametrize("n_in,n_out", SHAPES)
def test_input_major_equals_numpy(n_in, n_out, rows, param_dtype):
    x, packed, scale, offset, w = _case(rows, n_in, n_out, param_dtype)
    got = np.asarray(jax.jit(cpu_backend.q4_matmul)(x, packed, scale, offset))
    _check(got, x, w)


@pytest.mark.parametrize("param_dtype", [np.float32, np.float16])
@pytest.mark.parametrize("rows", [1, 2, 3, 6, 32])
@pytest.mark.parametrize("n_in,n_out", [(32, 70), (576, 1536), (4096, 130), (64, 4099)])
def test_out_major_equals_numpy(n_in, n_out, rows, param_dtype):
    """The LM head's layout: packed [N, K / 2] (each output's bytes as the input-major column),
    scale / offset [N, K / 32]; y = x @ w^T of w [N, K]."""
    x, packed, scale, offset, w = _case(rows, n_in, n_out, param_dtype, seed=1)
    got = cpu_backend.q4_matmul(x, packed.T.copy(), scale.T.copy(), offset.T.copy(), out_major=True)
    _check(np.asarray(got), x, w)


def test_most_rows_and_other_scale_dtypes():
    """QMATMUL_MAX_ROWS rows; bf16 scales (converted to f32) give the same as their f32 values."""
    x, packed, scale, offset, w = _case(cpu_backend.QMATMUL_MAX_ROWS, 128, 96, seed=2)
    _check(np.asarray(cpu_backend.q4_matmul(x, packed, scale, offset)), x, w)
    s16, o16 = scale.astype(jax.numpy.bfloat16), offset.astype(jax.numpy.bfloat16)
    got = np.asarray(cpu_backend.q4_matmul(x, packed, s16, o16))
    want = np.asarray(
        cpu_backend.q4_matmul(x, packed, s16.astype(np.float32), o16.astype(np.float32))
    )
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("out_major", [False, True])
@pytest.mark.parametrize("rows", [1, 3])
def test_every_f16_code_reads_as_numpy_does(rows, out_major):
    """All 65536 float16 bit patterns (subnormals, +-0, +-inf, the NaNs) as offsets of an
    all-zero q, then as scales of an all-one q: y = x_sum * offset, then y = x_sum * scale, with
    x_sum = 1 exactly (one block of 1/32). Input-major converts a range's scales 8 at a time
    where the CPU has F16C; out-major (one block) one by one."""
    codes = np.arange(65536, dtype=np.uint16).view(np.float16).reshape(1, 65536)
    x = np.full((rows, BLOCK), 1 / BLOCK, np.float32)
    zeros = np.zeros((1, 65536), np.float16)
    want = np.broadcast_to(codes.astype(np.float32), (rows, 65536))
    for byte, scale, offset in ((0x00, zeros, codes), (0x11, codes, zeros)):
        packed = np.full((BLOCK // 2, 65536), byte, np.uint8)
        if out_major:
            packed, scale, offset = packed.T.copy(), scale.T.copy(), offset.T.copy()
        got = cpu_backend.q4_matmul(x, packed, scale, offset, out_major=out_major)
        np.testing.assert_array_equal(np.asarray(got), want)


@pytest.mark.parametrize("out_major", [False, True])
def test_swapped_nibbles_are_caught(out_major):
    """The reference tells the layout from its mirror: the same bytes with low and high nibbles
    swapped (or the 16-byte halves of a block read as inputs 2j, 2j + 1) give another product,
    well outside the tolerance, so a kernel reading them so would fail the tests above."""
    x, packed, scale, offset, w = _case(1, 256, 96, seed=3)
    swapped = (packed >> 4) | (packed << 4)
    got = cpu_backend.q4_matmul(
        x,
        swapped.T.copy() if out_major else swapped,
        *((a.T.copy() if out_major else a) for a in (scale, offset)),
        out_major=out_major,
    )
    with pytest.raises(AssertionError, match="worst error"):
        _check(np.asarray(got), x, w)
    interleaved = np.stack([packed & 15, packed >> 4], axis=1).reshape(w.shape)  # 2j, 2j + 1
    w_wrong = interleaved * np.repeat(scale.astype(np.float64), BLOCK, axis=0)
    w_wrong += np.repeat(offset.astype(np.float64), BLOCK, axis=0)
    right = np.asarray(cpu_backend.q4_matmul(x, packed, scale, offset))
    _check(right, x, w)
    with pytest.raises(AssertionError, match="worst error"):
        _check(right, x, w_wrong)


def test_bad_arguments_are_refused():
    """Each refusal names what was expected and the shapes / dtypes it got."""
    x, packed, scale, offset, _ = _case(2, 64, 32)
    too_many, k48 = np.zeros((65, 64), np.float32), np.zeros((2, 48), np.float32)
    cases = [
        ((too_many, packed, scale, offset), {}, r"takes x \[M <= 64, K\].*got x \(65, 64\)"),
        ((k48, packed[:24], scale, offset), {}, r"K a multiple of 32, got x \(2, 48\)"),
        ((x, packed.astype(np.int8), scale, offset), {}, r"2-d uint8 packed, got .* int8"),
        ((x, packed[:16], scale, offset), {}, r"packed \(32, 32\) for this x, got .*\(16, 32\)"),
        ((x, packed, scale[:1], offset), {}, r"offset \(2, 32\), got .*scale \(1, 32\)"),
        ((x, packed, scale, offset[:, :16]), {}, r"offset \(2, 32\), got .*offset \(2, 16\)"),
        ((x, packed, scale, offset), {"out_major": True}, r"scale and offset \(32, 2\)"),
    ]
    for args, kw, match in cases:
        with pytest.raises(ValueError, match=match):
            cpu_backend.q4_matmul(*args, **kw)
