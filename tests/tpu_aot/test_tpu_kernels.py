"""The Mosaic attention kernel alone at realistic shapes, on every TPU generation, deviceless.

Llama-3-8B-like (32 / 8 heads of 128) and Gemma-2-9B-like (16 / 8 heads of 256, window 4096,
soft-cap 50) at 64 sequences of 4k context, decoding or 4 prefill chunks of 512 among 60
decodes; block size 16. Each kernel's VMEM, as Mosaic allocated it, fits the generation's
default scoped-VMEM budget and is within 2x of the estimate from its block sizes (v7x: at least)
(``mosaic_backend.kernel_memory_estimate``); the typed cache and the TPU word layout compile
with no copy of the cache.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import pytest

import jaxkv.pallas_kernels as pk
from jaxkv import tpu_aot
from jaxkv.pallas_kernels import layout, mosaic_backend, pallas_attention
from jaxkv.pallas_kernels import tiles as tiles_lib
from tests.tpu_aot.helpers import ALL_GENERATIONS

pytestmark = pytest.mark.tpu_aot

#: (name, Hq, Hkv, D, window, soft_cap, cache dtype, block size)
SHAPES = [
    ("llama3-8b", 32, 8, 128, None, None, "bfloat16", 16),
    ("llama3-8b-fp8", 32, 8, 128, None, None, "fp8", 32),
    ("gemma2-9b-local", 16, 8, 256, 4096, 50.0, "bfloat16", 16),
]


def compile_attention(
    dev, Hq, Hkv, D, window, soft_cap, cache_dtype, bs, *, decode, words, blocks=None, pages=None
):
    """64 sequences of 4k context (``blocks`` per sequence: the block tables' width), decoding
    or 4 prefill chunks of 512 among 60 decodes, over ``pages`` pages (default: every block)."""
    S, ctx = 64, 4096
    T = S if decode else 4 * 512 + 60
    blocks = blocks or ctx // bs
    N = pages or 1 + S * blocks
    dt = layout.resolve_kv_dtype(cache_dtype)
    if words:
        cache = jax.ShapeDtypeStruct(layout.kv_cache_words_shape(N, bs, Hkv, D, dt), jnp.uint32)
    else:
        cache = jax.ShapeDtypeStruct(layout.kv_cache_shape(N, bs, Hkv, D, dt), dt)
    args = (
        jax.ShapeDtypeStruct((T, Hq, D), jnp.bfloat16),
        cache,
        jax.ShapeDtypeStruct((S,), jnp.int32),
        jax.ShapeDtypeStruct((S + 1,), jnp.int32),
        jax.ShapeDtypeStruct((S, blocks), jnp.int32),
        jax.ShapeDtypeStruct((), jnp.int32),
    )
    kw = dict(
        sm_scale=D**-0.5, sliding_window=window, soft_cap=soft_cap, max_q_len=1 if decode else 512
    )
    if cache_dtype == "fp8":
        kw.update(k_scale=0.5, v_scale=0.5)
    if words:
        fn = jax.jit(
            lambda q, c, *r: pallas_attention.paged_attention_words(q, c, *r, dtype=dt, **kw)
        )
    else:
        fn = jax.jit(lambda *a: pk.paged_attention(*a, backend="pallas", **kw))
    cache_bytes = N * layout.page_bytes(bs, Hkv, D, dt)
    return tpu_aot.aot_compile(fn, dev, *args), S * blocks, cache_bytes


#: Every generation compiles the bf16 Llama shape; the rest run in the newest-jax leg.
CASES = [
    pytest.param(
        g, s, marks=[] if s[0] == "llama3-8b" else [pytest.mark.tpu_aot_full], id=f"{g}-{s[0]}"
    )
    for g in ALL_GENERATIONS
    for s in SHAPES
]


@pytest.mark.parametrize("words", [False, True], ids=["typed", "words"])
@pytest.mark.parametrize("decode", [True, False], ids=["decode", "mixed"])
@pytest.mark.parametrize("generation,shape", CASES)
def test_attention_kernels_fit_the_tpu(tpu, generation, shape, decode, words):
    compiled, table_entries, cache_bytes = compile_attention(
        tpu(generation), *shape[1:], decode=decode, words=words
    )
    kernels = tpu_aot.mosaic_kernels(compiled)
    assert kernels, "no Mosaic kernel"
    limit = tpu_aot.GENERATIONS[generation].scoped_vmem_bytes
    _, Hq, Hkv, D, _, _, cache_dtype, bs = shape
    for k in kernels:
        m = re.search(r"_m(\d+)_bk(\d+)$", k.name)
        vmem, smem = mosaic_backend.kernel_memory_estimate(
            rows=int(m.group(1)),
            block_k=int(m.group(2)),
            head_size=D,
            q_dtype=jnp.bfloat16,
            cache_dtype=layout.resolve_kv_dtype(cache_dtype),
            num_tiles=64,
            table_entries=table_entries,
        )
        assert 0 < k.vmem_bytes <= limit, (k, limit)
        # at least the blocks' own bytes; v4 / v5e / v5p / v6e allocate 0.8-1.1x the estimate,
        # v7x adds its own scoped scratch (2.2 MiB at decode, 16.7 MiB in the mixed program)
        assert k.vmem_bytes >= vmem / 2, (k, vmem)
        if generation != "v7x":
            assert k.vmem_bytes <= 2 * vmem, (k, vmem)
        assert smem < 1 << 20, smem  # block tables of 64 x 256 pages: 64 KiB
    # no copy of the cache (0.5 GiB fp8, 1 GiB bf16): the temp is the packed q tiles and
    # outputs of the 2108-token mixed batch, the same for every cache dtype (up to 131 MiB on
    # jax 0.10.2, 195 MiB on v5p with jax 0.12)
    assert compiled.memory_analysis().temp_size_in_bytes < min(cache_bytes // 2, 256 << 20)


SMEM_PROBE = """
import json, os, sys
from jaxkv import tpu_aot
tpu_aot.prepare_environment(mosaic_dump_dir=sys.argv[1])
from tests.tpu_aot.test_tpu_kernels import compile_attention
out = {}
for label in ("decode", "mixed"):
    for name in os.listdir(sys.argv[1]):
        os.remove(os.path.join(sys.argv[1], name))
    compile_attention(tpu_aot.aot_device("v5e"), 32, 8, 128, None, None, "bfloat16", 16,
                      decode=label == "decode", words=True)
    out[label] = tpu_aot.mosaic_smem(sys.argv[1])
print(json.dumps(out))
"""


def test_smem_is_what_mosaic_lays_out(tpu, tmp_path):
    """The SMEM of the Llama-3-8B-like kernels (64 sequences x 256 blocks of tables) as Mosaic
    lays it out in the kernel it compiled (its LLO dump, read in a fresh process: libtpu reads
    the dump flag once) equals ``smem_bytes`` of the tile counts ``choose_tiles`` gives the
    call, for the decode kernel and the mixed program's two: 68096 B (decode, 64 tiles), 72704
    B (m64, 208 tiles) on v5e, jax 0.10.2."""
    import json
    import os
    import subprocess
    import sys

    tpu("v5e")  # skips (fails in CI) without libtpu
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {**os.environ, "PYTHONPATH": root, "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run(
        [sys.executable, "-c", SMEM_PROBE, str(tmp_path)],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
        cwd=root,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    smem = json.loads(proc.stdout.strip().splitlines()[-1])

    def expected(decode: bool) -> dict:
        """Each kernel's smem_bytes from the tile sizes the call chooses (choose_tiles)."""
        cfg = tiles_lib.choose_tiles(
            "mosaic",
            num_tokens=64 if decode else 4 * 512 + 60,
            num_seq_rows=64,
            max_blocks=4096 // 16,
            num_q_heads=32,
            num_kv_heads=8,
            head_size=128,
            block_size=16,
            max_q_len=1 if decode else 512,
            compute_dtype=jnp.bfloat16,
        )
        launches = [cfg.decode] + ([cfg.prefill] if cfg.prefill else [])
        return {
            f"ragged_paged_attention_mosaic_words_m{t.rows}_bk{cfg.block_k}": (
                mosaic_backend.smem_bytes(num_tiles=t.num_tiles, table_entries=64 * cfg.table_width)
            )
            for t in launches
        }

    assert smem["decode"] == expected(True), smem
    assert smem["mixed"] == expected(False), smem
    for used in smem["mixed"].values():
        assert used <= mosaic_backend.SMEM_BYTES - mosaic_backend.SMEM_RESERVE


def test_block_tables_beyond_smem_are_refused_by_name(tpu):
    """The block tables live in the core's 1 MiB of SMEM: 64 x 4016 blocks (0.98 MiB)
    compile; 64 x 4096 (1 MiB, where the TPU compiler fails with RESOURCE_EXHAUSTED, "Used 1.00M
    of 1.00M smem" on every generation) is a ValueError naming the sizes and the flags."""
    dev = tpu("v5e")
    llama = dict(decode=True, words=True, pages=1 + 1024)
    compiled, _, _ = compile_attention(dev, *SHAPES[0][1:], blocks=4016, **llama)
    assert tpu_aot.mosaic_kernels(compiled)
    with pytest.raises(ValueError, match=r"64 sequences x 4096 blocks.*max_num_seqs"):
        compile_attention(dev, *SHAPES[0][1:], blocks=4096, **llama)
