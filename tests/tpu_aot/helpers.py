"""Shared by the deviceless TPU tests: small engines on the Pallas backend with TPU-sized heads."""

from jaxkv import tpu_aot
from jaxkv.worker.program_set import FORWARD, ProgramKey
from tests.engine.helpers import make_llm, small_model

#: The tier's generations: the engine's programs compile for these; the kernels alone for all.
ENGINE_GENERATIONS = ("v5e", "v6e", "v7x")
ALL_GENERATIONS = tuple(tpu_aot.GENERATIONS)


def tpu_runner(family, *, kv_layout: str = "tpu", **kw):
    """The model runner of a small bf16 engine with ``attention_backend="pallas"`` and heads of
    128 (the Mosaic kernel's lane width; the CPU tests' small models use 32), with the KV layout
    it has on a TPU (``kv_layout="tpu"``: ``tpu_aot.use_tpu_kv_layout``) or the given one
    ("bytes" | "words")."""
    kw.setdefault("max_num_seqs", 4)
    kw.setdefault("max_num_batched_tokens", 64)
    kw.setdefault("max_model_len", 256)
    kw.setdefault("kv_cache_dtype", "bfloat16")
    model = small_model(family, head_dim=128, dtype="bfloat16")
    runner = make_llm(model, attention_backend="pallas", **kw).llm_engine.runner
    if kv_layout == "tpu":
        tpu_aot.use_tpu_kv_layout(runner)
    elif kv_layout != runner.kv_layout:
        runner.use_kv_layout(kv_layout)
    return runner


def compile_program(runner, dev, key, **kw):
    """The runner's program ``key`` compiled for ``dev``; a forward must run the Mosaic
    attention kernel."""
    compiled = tpu_aot.compile_runner_program(runner, dev, key, **kw)
    if key.kind == FORWARD:
        names = [k.name for k in tpu_aot.mosaic_kernels(compiled)]
        assert any(n.startswith("ragged_paged_attention_mosaic") for n in names), (key, names)
    return compiled


def compile_forward(runner, dev, num_tokens, **kw):
    return compile_program(runner, dev, ProgramKey(FORWARD, num_tokens), **kw)
