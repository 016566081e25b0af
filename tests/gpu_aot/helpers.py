"""Shared by the deviceless H200 tests: small engines on the Pallas backend, compiled programs."""

from jaxkv import gpu_aot
from jaxkv.worker.program_set import FORWARD, ProgramKey
from tests.engine.helpers import make_llm, small_model


def pallas_runner(family, **kw):
    """The model runner of a small engine with ``attention_backend="pallas"``."""
    kw.setdefault("max_num_seqs", 4)
    kw.setdefault("max_num_batched_tokens", 64)
    kw.setdefault("max_model_len", 256)
    return make_llm(small_model(family), attention_backend="pallas", **kw).llm_engine.runner


def compile_program(runner, dev, key, **kw):
    """The runner's program ``key`` compiled for ``dev``; a forward must launch at least one
    Pallas Triton kernel."""
    compiled = gpu_aot.compile_runner_program(runner, dev, key, **kw)
    if key.kind == FORWARD:
        assert gpu_aot.triton_kernels(compiled), f"{key} launches no Pallas Triton kernel"
    return compiled


def compile_forward(runner, dev, num_tokens, **kw):
    """The forward of the token bucket ``num_tokens`` compiled for ``dev``."""
    return compile_program(runner, dev, ProgramKey(FORWARD, num_tokens), **kw)
