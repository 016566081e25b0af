"""The kernel tests' Pallas shapes compiled for an NVIDIA H200, deviceless (jaxkv.gpu_aot).

On a GPU, tests/kernels compiles and runs the Pallas kernels over the whole grid of
``TestPallas``; on a CPU it runs a subset in interpret mode. Here every one of those GPU cases,
the Triton lowering cases of test_pallas_kernel.py and the KV-write kernel are compiled to
sm_90a machine code instead: nothing runs (no numerics), but every shape must lower, pass
Triton's and ptxas' checks and fit the H200's shared memory without spilling. This is what
``benchmarks/gpu_check.sh`` runs in its dry-run mode in place of the GPU run of tests/kernels.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import pytest

import jaxkv.pallas_kernels as pk
import tests.kernels.test_attention as kernel_tests  # a module: its classes are not collected here
from jaxkv import gpu_aot
from tests.kernels.test_pallas_kernel import LOWERING_CASES

pytestmark = [pytest.mark.gpu_aot, pytest.mark.gpu_aot_full]


def check_launches(launches, *, uses_shared_memory=True):
    """Triton kernels launched; shared memory within the H200's limit (and some, for the
    attention kernels' dots; the KV write is a copy and jax 0.12 reports 0 B); no spill."""
    assert launches, "no Triton kernel"
    limit = gpu_aot.shared_memory_limit("h200")
    for k in launches:
        assert 0 <= k.shared_mem_bytes <= limit, k
        assert k.shared_mem_bytes > 0 or not uses_shared_memory, k
        assert k.spill_bytes == 0, k  # ptxas -v: no spill stores or loads


class TestPallasOnH200(kernel_tests.TestXla):
    """TestXla's cases (the grid ``TestPallas`` runs on a GPU), compiled instead of run."""

    @pytest.fixture(autouse=True)
    def _device(self, h200):
        self.dev = h200

    def check(self, **case):
        b, kw, mq = kernel_tests.build_case(**case)
        fn = jax.jit(
            functools.partial(
                pk.paged_attention, backend="pallas", interpret=False, max_q_len=mq, **kw
            )
        )
        check_launches(gpu_aot.compile_with_report(fn, self.dev, *b.attention_args())[1])


@pytest.mark.parametrize("case", LOWERING_CASES)
def test_lowering_cases_compile(h200, case):
    t, s, b, bs, hq, hkv, d, cdt, qdt, mq, w, cap, scale = case
    sds = jax.ShapeDtypeStruct
    args = (
        sds((t, hq, d), qdt),
        sds((3 * s * b, 2, hkv, bs, d), cdt),
        sds((s,), jnp.int32),
        sds((s + 1,), jnp.int32),
        sds((s, b), jnp.int32),
        sds((), jnp.int32),
    )
    fn = jax.jit(
        functools.partial(
            pk.paged_attention,
            backend="pallas",
            interpret=False,
            sm_scale=0.1,
            max_q_len=mq,
            sliding_window=w,
            soft_cap=cap,
            k_scale=scale,
            v_scale=scale,
        )
    )
    check_launches(gpu_aot.compile_with_report(fn, h200, *args)[1])


@pytest.mark.parametrize(
    "dtype,bs,hkv,d,t",
    [
        ("float32", 8, 2, 64, 21),
        ("bfloat16", 8, 2, 64, 21),
        ("fp8", 8, 2, 64, 21),
        ("bfloat16", 16, 8, 128, 64),
    ],
)
def test_kv_write_kernel_compiles_in_place(h200, dtype, bs, hkv, d, t):
    """write_kv(backend="pallas") on a donated buffer: the Triton kernel writes it in place."""
    sds = jax.ShapeDtypeStruct
    pages = 6
    scale = 0.5 if dtype == "fp8" else None
    args = (
        sds((pages * pk.page_bytes(bs, hkv, d, dtype),), jnp.uint8),
        sds((t, hkv, d), jnp.float32),
        sds((t, hkv, d), jnp.float32),
        sds((t,), jnp.int32),
    )
    fn = jax.jit(
        functools.partial(
            pk.write_kv,
            block_size=bs,
            dtype=dtype,
            k_scale=scale,
            v_scale=scale,
            backend="pallas",
            interpret=False,
        ),
        donate_argnums=0,
    )
    compiled, launches = gpu_aot.compile_with_report(fn, h200, *args)
    check_launches(launches, uses_shared_memory=False)
    assert compiled.memory_analysis().alias_size_in_bytes >= args[0].shape[0]
