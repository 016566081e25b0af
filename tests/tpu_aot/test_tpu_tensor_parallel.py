"""The engine's forward tensor-parallel over a 2x2 TPU v5e slice (4 chips), deviceless.

``tpu_aot.compile_tp_forward`` splits a one-device runner as ``tensor_parallel_size=4`` does
(``jaxkv.models.sharding``: q/k/v/gate/up by columns, o/down by rows, embedding by vocabulary;
each KV buffer by KV heads, in the word layout) and compiles it for the slice. The compiled HLO
must hold only the collectives Megatron's split needs: one all-reduce of the [T, hidden]
activations after each layer's attention output (o_proj) and MLP down projection, and one for
the vocabulary-split embedding lookup; no all-gather of the cache or the weights.
"""

from __future__ import annotations

import collections
import re

import pytest

from jaxkv import tpu_aot
from tests.engine.helpers import make_llm, small_model

pytestmark = pytest.mark.tpu_aot

COLLECTIVES = (
    "all-reduce",
    "all-gather",
    "all-to-all",
    "reduce-scatter",
    "collective-permute",
    "ragged-all-to-all",
    "collective-broadcast",
)


def collectives(hlo: str) -> collections.Counter:
    """``(op, dims)`` of every collective in optimized HLO text (async ``-start`` halves
    counted as their op)."""
    ops = "|".join(re.escape(o) for o in COLLECTIVES)
    found = re.findall(rf"= \(?\w+\[([\d,]*)\][^=\n]*? ({ops})(?:-start)?\(", hlo)
    return collections.Counter(
        (op, tuple(int(d) for d in dims.split(",") if d)) for dims, op in found
    )


@pytest.mark.slow
def test_forward_on_a_2x2_slice_has_only_the_megatron_all_reduces(tpu_slice):
    """A decode (T=4) and a mixed (T=64) forward of a 2-layer model with 8 / 4 heads of 128."""
    slice_devices = tpu_slice("v5e")
    assert len(slice_devices) == 4
    layers, hidden = 2, 128
    model = small_model(
        "tiny-llama", head_dim=128, dtype="bfloat16", num_attention_heads=8, num_key_value_heads=4
    )
    runner = make_llm(
        model,
        attention_backend="pallas",
        kv_cache_dtype="bfloat16",
        max_num_seqs=4,
        max_model_len=256,
        kv_cache_memory_bytes=4 << 20,
    ).llm_engine.runner
    assert tpu_aot.use_tpu_kv_layout(runner) == "words"
    cache_per_chip = sum(b.nbytes for b in runner.buffers) // 4
    for T in (4, 64):
        compiled = tpu_aot.compile_tp_forward(runner, slice_devices, T)
        assert collectives(compiled.as_text()) == {("all-reduce", (T, hidden)): 2 * layers + 1}, T
        names = {k.name for k in tpu_aot.mosaic_kernels(compiled)}
        assert "write_kv_mosaic_words_bfloat16" in names, names
        assert any(n.startswith("ragged_paged_attention_mosaic_words") for n in names), names
        ma = compiled.memory_analysis()  # per chip: its own KV heads' pages, in place
        assert ma.alias_size_in_bytes >= cache_per_chip and ma.temp_size_in_bytes < 8 << 20, ma


def test_the_collective_count_sees_async_and_tuple_forms():
    hlo = (
        "%a = bf16[4,128]{1,0} all-reduce(%x)\n"
        "%b = (bf16[4,128]{1,0}, bf16[4,128]{1,0}) all-gather-start(%y)\n"
        "%c = f32[8]{0} collective-permute-start(%z)\n"
    )
    assert collectives(hlo) == {
        ("all-reduce", (4, 128)): 1,
        ("all-gather", (4, 128)): 1,
        ("collective-permute", (8,)): 1,
    }
