"""The engine on the TPU word layout (``jaxkv.worker.kv_memory``), checked on CPU.

On a TPU with the Pallas backend the runner keeps each KV tensor as a flat uint32 buffer of
TPU-packed word tiles; here it is chosen by hand (``ModelRunner.use_kv_layout``) and the Mosaic
kernels run in TPU interpret mode. No libtpu needed: the page ops, the layout choice, the
connector's page transfer and the engine's greedy tokens (equal to the byte layout's).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxkv import SamplingParams
from jaxkv.kv_cache import FullAttentionSpec, get_kv_cache_config
from jaxkv.worker import kv_memory
from jaxkv.worker.backends import check_kv_layout, resolve_kv_layout
from jaxkv.worker.kv_connector import PagedKVCaches
from tests.engine.helpers import make_llm, small_model

BS, H, D = 16, 2, 128


def word_config(blocks=6):
    spec = FullAttentionSpec(BS, H, D, "bfloat16")
    return get_kv_cache_config(
        {"L0": spec, "L1": spec}, 10**9, max_model_len=64, num_gpu_blocks_override=blocks
    )


def test_word_buffers_page_ops_in_place_and_padding_ids_touch_nothing():
    """uint32 buffers of the same bytes; zeroing, reading and writing pages work on them like
    on the byte buffers: pages read as their little-endian bytes, ids < 0 or >= N touch nothing."""
    cfg = word_config()
    page = kv_memory.page_size_bytes(cfg)
    bufs = kv_memory.allocate_kv_buffers(cfg, layout="words")
    assert [(b.dtype, b.shape) for b in bufs] == [(jnp.uint32, (6 * page // 4,))] * 2
    assert all(not b.any() for b in bufs)
    buf = jnp.arange(6 * page // 4, dtype=jnp.uint32) * jnp.uint32(2654435761)
    before = np.asarray(buf)
    zero = jax.jit(lambda b, ids: kv_memory.zero_blocks(b, ids, page_bytes=page), donate_argnums=0)
    out = np.asarray(zero(buf, jnp.array([2, -1, 6], jnp.int32)))
    words = page // 4
    expect = before.copy()
    expect[2 * words : 3 * words] = 0
    np.testing.assert_array_equal(out, expect)  # block 5 (where -1 would wrap) is intact
    got = kv_memory.read_blocks(jnp.asarray(out), jnp.array([1, -1]), page_bytes=page)
    assert got.dtype == jnp.uint8 and got.shape == (2, page)
    np.testing.assert_array_equal(np.asarray(got[0]), expect[words : 2 * words].view(np.uint8))
    assert not np.asarray(got[1]).any()
    back = kv_memory.write_blocks(jnp.zeros_like(buf), jnp.array([4, -1]), got, page_bytes=page)
    back = np.asarray(back)
    np.testing.assert_array_equal(back[4 * words : 5 * words], expect[words : 2 * words])
    assert not back[: 4 * words].any() and not back[5 * words :].any()


def test_kv_layout_choice_and_checks():
    """The word layout is the compiled Pallas backend's on a TPU, for sizes it can pack."""
    kw = dict(head_size=128, block_size=16, cache_dtype="bfloat16")
    assert resolve_kv_layout("pallas", False, "tpu", **kw) == "words"
    assert (
        resolve_kv_layout("pallas", False, "tpu", head_size=128, block_size=32, cache_dtype="fp8")
        == "words"
    )
    assert (
        resolve_kv_layout("pallas", False, "tpu", head_size=128, block_size=16, cache_dtype="fp8")
        == "bytes"
    )
    assert (
        resolve_kv_layout(
            "pallas", False, "tpu", head_size=64, block_size=16, cache_dtype="bfloat16"
        )
        == "bytes"
    )
    assert resolve_kv_layout("xla", False, "tpu", **kw) == "bytes"
    assert resolve_kv_layout("pallas", True, "cpu", **kw) == "bytes"
    assert resolve_kv_layout("pallas", False, "gpu", **kw) == "bytes"
    with pytest.raises(ValueError, match="attention_backend='pallas' only, not 'xla'"):
        check_kv_layout("words", "xla", **kw)
    with pytest.raises(ValueError, match="block_size to be a multiple of 16"):
        check_kv_layout("words", "pallas", head_size=128, block_size=8, cache_dtype="bfloat16")
    with pytest.raises(ValueError, match="kv layout must be one of .* got 'tiles'"):
        kv_memory.allocate_kv_buffers(word_config(), layout="tiles")


def engine(model, layout):
    llm = make_llm(
        model,
        attention_backend="pallas",
        kv_cache_dtype="bfloat16",
        max_num_seqs=2,
        max_num_batched_tokens=32,
        max_model_len=64,
        kv_cache_memory_bytes=1 << 20,
    )
    runner = llm.llm_engine.runner
    if layout != runner.kv_layout:
        runner.use_kv_layout(layout)
    return llm, runner


@pytest.mark.slow
def test_engine_greedy_tokens_on_the_word_layout_equal_the_byte_layout():
    """A bf16 engine with heads of 128 and blocks of 16 on the word layout (Mosaic write and
    attention in TPU interpret mode) samples the greedy tokens of the same engine on the byte
    layout, for a prompt over two blocks and a short one in one batch; its pages then move
    through the KV connector's page transfer into another word-layout engine unchanged."""
    model = small_model("tiny-llama", head_dim=128, dtype="bfloat16")
    prompts = [
        [(7 * i + 3) % 500 + 1 for i in range(20)],
        [(11 * i + 5) % 500 + 1 for i in range(9)],
    ]
    params = SamplingParams(max_tokens=5, temperature=0)
    tokens = {}
    for layout in ("bytes", "words"):
        llm, runner = engine(model, layout)
        tokens[layout] = [
            o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)
        ]
    assert runner.kv_layout == "words" and runner.buffers[0].dtype == jnp.uint32
    assert runner.buffers[0].any()
    assert tokens["words"] == tokens["bytes"] and all(len(t) == 5 for t in tokens["words"])

    src = PagedKVCaches(runner)
    assert src.layout()["kv_layout"] == "words"
    ids = [1, 2, 3]
    pages = src.read_pages(ids)
    assert pages[0].dtype == jnp.uint8 and pages[0].shape == src.page_shape(len(ids))
    _, other = engine(model, "words")
    PagedKVCaches(other).write_pages(ids, pages)
    words = src.page_bytes // 4
    for a, b in zip(runner.buffers, other.buffers):
        np.testing.assert_array_equal(
            np.asarray(b)[words : 4 * words], np.asarray(a)[words : 4 * words]
        )
