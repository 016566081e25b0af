"""The engine's programs compile for TPU v5e, v6e and v7x, deviceless (see jaxkv.tpu_aot).

The forwards run the Pallas Mosaic kernels (``attention_backend="pallas"``, not interpreted),
compiled by the real TPU compiler on this CPU-only machine, for tiny-llama and tiny-hybrid
(sliding windows, soft-caps) in bf16 with heads of 128, on the KV layout the engine has on a
TPU: the word layout (flat uint32 buffers of TPU-packed tiles, ``jaxkv.worker.kv_memory``),
whose per-layer views are free under TPU tiling. The KV buffers stay aliased in place and the
step's temp memory does not grow with the cache (the test of record); the byte layout's does
(the negative control: its bf16 view of a uint8 buffer is a relayout under TPU tiling).
"""

from __future__ import annotations

import jax.numpy as jnp
import pytest

from jaxkv import tpu_aot
from jaxkv.worker.program_set import FORWARD, num_programs
from tests.tpu_aot.helpers import ENGINE_GENERATIONS, compile_forward, compile_program, tpu_runner

pytestmark = pytest.mark.tpu_aot

#: CI's oldest-jax leg compiles v5e; the other generations run in the newest-jax leg.
GEN_PARAMS = [
    pytest.param(g, marks=[] if g == "v5e" else [pytest.mark.tpu_aot_full])
    for g in ENGINE_GENERATIONS
]


@pytest.mark.parametrize("family", ["tiny-llama", "tiny-hybrid"])
@pytest.mark.parametrize("generation", GEN_PARAMS)
def test_forwards_compile_in_place(tpu, generation, family):
    """A decode and a mixed forward compile for the TPU, on the word layout with its Mosaic
    write and attention, and keep the KV buffers aliased."""
    runner = tpu_runner(family, kv_cache_memory_bytes=4 << 20)
    assert runner.kv_layout == "words" and runner.buffers[0].dtype == jnp.uint32
    cache = sum(b.nbytes for b in runner.buffers)
    for T in (4, 64):
        compiled = compile_forward(runner, tpu(generation), T)
        names = {k.name for k in tpu_aot.mosaic_kernels(compiled)}
        assert "write_kv_mosaic_words_bfloat16" in names, names
        assert any(n.startswith("ragged_paged_attention_mosaic_words") for n in names), names
        assert compiled.memory_analysis().alias_size_in_bytes >= cache, (
            T,
            compiled.memory_analysis(),
        )


def step_temps(generation_device, *, kv_layout="tpu", kv_cache_dtype="bfloat16", sizes_mib=(4, 16)):
    """The temp bytes of tiny-llama's 4-token decode forward for caches of ``sizes_mib``,
    each checked to keep the KV buffers aliased."""
    temps = []
    for mib in sizes_mib:
        runner = tpu_runner(
            "tiny-llama",
            kv_layout=kv_layout,
            kv_cache_dtype=kv_cache_dtype,
            block_size=32 if kv_cache_dtype == "fp8" else 16,
            kv_cache_memory_bytes=mib << 20,
        )
        ma = compile_forward(runner, generation_device, 4).memory_analysis()
        assert ma.alias_size_in_bytes >= sum(b.nbytes for b in runner.buffers), (mib, ma)
        temps.append(ma.temp_size_in_bytes)
    return temps


#: bf16 on v5e in CI's oldest-jax leg; the other generations and f32 / fp8 caches in the newest.
TEMP_CASES = [
    pytest.param(
        g,
        dt,
        id=f"{g}-{dt}",
        marks=[] if (g, dt) == ("v5e", "bfloat16") else [pytest.mark.tpu_aot_full],
    )
    for g in ENGINE_GENERATIONS
    for dt in ("bfloat16", "float32", "fp8")
]


@pytest.mark.parametrize("generation,kv_cache_dtype", TEMP_CASES)
def test_step_temp_does_not_grow_with_the_cache(tpu, generation, kv_cache_dtype):
    """The test of record (tests/engine/test_step_memory.py) on the TPU executable: with the
    word layout a 4x larger cache (4 -> 16 MiB) moves the step's temp by less than 1 MiB (it
    shrinks a little: XLA's memory-space choices for the small arrays; measured 2.5 -> 1.7 MiB
    on v5e, 2.2 -> 2.0 MiB on v6e, 2.1 -> 1.9 MiB on v7x, jax 0.10.2), where the byte layout's
    relayout adds 128 MiB (below)."""
    temps = step_temps(tpu(generation), kv_cache_dtype=kv_cache_dtype)
    assert temps[1] - temps[0] < 1 << 20 and max(temps) < 8 << 20, temps


def test_byte_layout_step_temp_grows_with_the_cache(tpu):
    """The negative control: the same engine on byte buffers (what it ran on a TPU before the
    word layout) copies the cache to view it: 2.3 -> 130 MiB temp for 4 -> 16 MiB on v5e with
    libtpu 0.0.42.1 (jax 0.10.2). libtpu 0.0.50.1 (jax 0.12) views this small model's byte
    cache without the copy on v5e and v6e (2.7 -> 2.2 MiB; v7x 2.3 -> 6.0 MiB): checked with
    the older one only."""
    import importlib.metadata as md

    dev = tpu("v5e")
    if md.version("libtpu") != "0.0.42.1":
        pytest.skip(
            f"the byte layout's relayout is measured with libtpu 0.0.42.1, not {tpu_aot.versions()}"
        )
    temps = step_temps(dev, kv_layout="bytes")
    assert temps[1] - temps[0] > 12 << 20, temps


@pytest.mark.slow
@pytest.mark.tpu_aot_full
@pytest.mark.parametrize(
    "generation,family",
    [(g, f) for g in ENGINE_GENERATIONS for f in ("tiny-llama", "tiny-hybrid")],
)
def test_every_program_compiles(tpu, generation, family):
    """Every program warm-up compiles (``ModelRunner.program_keys()``), compiled for each
    engine generation; each forward keeps the KV buffers aliased."""
    runner = tpu_runner(family, max_num_seqs=2, max_num_batched_tokens=48)
    keys = runner.program_keys()
    b = runner.buckets
    assert len(keys) == num_programs(num_token_buckets=len(b.tokens), num_seq_buckets=len(b.seqs))
    cache = sum(x.nbytes for x in runner.buffers)
    for key in keys:
        compiled = compile_program(runner, tpu(generation), key)
        if key.kind == FORWARD:
            assert compiled.memory_analysis().alias_size_in_bytes >= cache, key


@pytest.mark.tpu_aot_full
def test_llama3_8b_layer_compiles_in_place_with_flat_temp(tpu):
    """One Llama-3-8B-sized layer (hidden 4096, MLP 14336, 32 / 8 heads of 128, vocabulary
    128256) in bf16 on v6e, weights abstract: a 64-token forward keeps the KV buffers aliased
    with a 256 MiB, a 1 GiB and a 2 GiB cache (abstract buffers), with a small temp (the byte
    layout needed 9.2 GiB of temp for 256 MiB).

    The temp is flat from 1 GiB on (33.8 MiB at 1, 2 and 4 GiB) but smaller below (2.2 MiB at
    256 MiB, 2.6 MiB at 512 MiB; jax 0.10.2 + libtpu 0.0.42.1 and jax 0.12 + libtpu 0.0.50.1
    alike). The step is not a copy of the cache: the 31.3 MiB difference is the f32 logits
    ``[128256, 64]``, which XLA's memory-space assignment keeps in VMEM (``S(1)`` in the
    optimized HLO) for the smaller programs and leaves one copy of in HBM for the larger ones
    (its buffer assignment: the logits and a 9 MiB f32 ``[576, 32, 128]`` are the HBM temp)."""
    from tests.engine.helpers import llama3_8b_layer, llama3_8b_layer_runner

    runner = llama3_8b_layer_runner(llama3_8b_layer(), kv_cache_dtype="bfloat16")
    tpu_aot.use_tpu_kv_layout(runner)
    assert runner.kv_layout == "words"
    blocks, cache = runner.config.num_blocks, sum(b.nbytes for b in runner.buffers)
    T, vocab = 64, runner.model_config.vocab_size
    temps = []
    for mult in (1, 4, 8):
        ma = compile_forward(runner, tpu("v6e"), T, num_blocks=mult * blocks).memory_analysis()
        assert ma.alias_size_in_bytes >= mult * cache - (1 << 20), (mult, ma)
        temps.append(ma.temp_size_in_bytes)
    print(
        f"llama3-8b layer v6e T={T}: temp MiB at 256 MiB / 1 GiB / 2 GiB of cache: "
        + " / ".join(f"{t / 2**20:.1f}" for t in temps)
    )
    assert temps[0] < 16 << 20, temps
    assert temps[1] == temps[2], temps  # flat: 2x the cache, the same temp
    assert temps[1] - temps[0] <= vocab * T * 4 + (4 << 20), temps  # at most the logits moved


@pytest.mark.slow
@pytest.mark.tpu_aot_full
def test_llama3_8b_layer_every_program_kind_compiles(tpu):
    """Each kind of program of the Llama-3-8B-sized layer's engine (64 sequences, 512-token
    budget, 4k context, 256 MiB cache) compiles for v6e at its largest size, where its temp is
    largest: the forward keeps the cache aliased. The whole set (38 programs) takes 298 s to
    compile here (the 7 sampling programs 24-36 s each: the 128256-entry vocabulary's top-k /
    top-p), so CI compiles one of each kind. Temps measured, jax 0.10.2 + libtpu 0.0.42.1:
    forward[512] 5.0 MiB, sample[64] 162 MiB, prompt_logprobs[512] 501 MiB (f32 logits and
    log-probabilities of 512 rows), sampling_update 33 MiB."""
    from tests.engine.helpers import llama3_8b_layer, llama3_8b_layer_runner

    runner = llama3_8b_layer_runner(llama3_8b_layer(), kv_cache_dtype="bfloat16")
    tpu_aot.use_tpu_kv_layout(runner)
    largest = {}
    for key in runner.program_keys():
        if key.size >= largest.get(key.kind, key).size:
            largest[key.kind] = key
    cache = sum(b.nbytes for b in runner.buffers)
    for key in largest.values():
        ma = compile_program(runner, tpu("v6e"), key).memory_analysis()
        print(f"llama3-8b layer v6e {key}: temp {ma.temp_size_in_bytes / 2**20:.1f} MiB")
        if key.kind == FORWARD:
            assert ma.alias_size_in_bytes >= cache, (key, ma)
        assert ma.temp_size_in_bytes < 1 << 30, (key, ma)
