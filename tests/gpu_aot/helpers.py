"""Shared by the deviceless H200 tests: small engines on the Pallas backend, compiled steps."""

from jaxkv import gpu_aot
from tests.engine.helpers import make_llm, small_model


def pallas_runner(family, **kw):
    """The model runner of a small engine with ``attention_backend="pallas"``."""
    kw.setdefault("max_num_seqs", 4)
    kw.setdefault("max_num_batched_tokens", 64)
    kw.setdefault("max_model_len", 256)
    return make_llm(small_model(family), attention_backend="pallas", **kw).llm_engine.runner


def compile_step(runner, dev, T, S, q, **kw):
    """The runner's step (T tokens, S rows, max_q_len q) compiled for ``dev``; it must launch
    at least one Pallas Triton kernel."""
    compiled = gpu_aot.compile_runner_step(runner, dev, T, S, max_q_len=q, **kw)
    assert gpu_aot.triton_kernels(compiled), "the step launches no Pallas Triton kernel"
    return compiled
