"""KV-cache planning: grouping, tensor sharing and block arithmetic (vLLM V1 examples)."""

import pytest

from jaxkv.kv_cache import (
    FullAttentionSpec,
    KVCacheTensor,
    SlidingWindowSpec,
    available_kv_cache_memory,
    estimate_max_model_len,
    get_kv_cache_config,
    get_kv_cache_configs,
    get_kv_cache_groups,
    get_max_concurrency,
    num_tokens_in_cache,
)

BS = 16
FULL = FullAttentionSpec(block_size=BS, num_kv_heads=2, head_size=64, dtype="bfloat16")
SW = SlidingWindowSpec(
    block_size=BS, num_kv_heads=2, head_size=64, dtype="bfloat16", sliding_window=128
)
PAGE = 2 * BS * 2 * 64 * 2  # 8192 bytes


def test_page_size_and_max_memory():
    assert FULL.page_size_bytes == PAGE
    assert FullAttentionSpec(16, 2, 64, "fp8").page_size_bytes == PAGE // 2
    assert FullAttentionSpec(16, 2, 64, "float32").page_size_bytes == PAGE * 2
    # full: cdiv(1000, 16) = 63 blocks
    assert FULL.max_memory_usage_bytes(1000, 256) == 63 * PAGE
    # window 128 + 256 new tokens - 1 = 383 tokens -> cdiv(383, 16) = 24, +1 unaligned window
    assert SW.max_memory_usage_bytes(4096, 256) == 25 * PAGE
    # capped by max_model_len: min(383, 100) = 100 -> 7 + 1
    assert SW.max_memory_usage_bytes(100, 256) == 8 * PAGE


@pytest.mark.parametrize(
    "kwargs, err",
    [
        (dict(block_size=12), "power of two"),
        (dict(block_size=0), "positive"),
        (dict(num_kv_heads=0), "num_kv_heads"),
        (dict(dtype="int4"), "int4"),
    ],
)
def test_spec_validation(kwargs, err):
    args = dict(block_size=16, num_kv_heads=2, head_size=64, dtype="bfloat16") | kwargs
    with pytest.raises(ValueError, match=err):
        FullAttentionSpec(**args)


def test_sliding_window_spec_requires_window():
    with pytest.raises(ValueError, match="sliding_window"):
        SlidingWindowSpec(16, 2, 64, "bfloat16")
    with pytest.raises(TypeError, match="block_size"):
        FullAttentionSpec(16.0, 2, 64, "bfloat16")


def test_dtype_aliases():
    assert FullAttentionSpec(16, 2, 64, "bf16").dtype == "bfloat16"
    assert FullAttentionSpec(16, 2, 64, "float8_e4m3fn").dtype == "fp8"


def test_seed_example_hybrid_groups_and_shared_tensors():
    specs = {"L0": FULL, "L1": SW, "L2": FULL, "L3": SW}
    mem = 100 * PAGE
    cfg = get_kv_cache_config(specs, mem, max_model_len=512, max_num_batched_tokens=64)
    assert [g.layer_names for g in cfg.kv_cache_groups] == [("L0", "L2"), ("L1", "L3")]
    assert [g.kv_cache_spec for g in cfg.kv_cache_groups] == [FULL, SW]
    assert [t.shared_by for t in cfg.kv_cache_tensors] == [("L0", "L1"), ("L2", "L3")]
    # num_blocks = mem // page // group_size = 100 // 2
    assert cfg.num_blocks == 50
    assert all(t.size == 50 * PAGE for t in cfg.kv_cache_tensors)
    assert cfg.layer_binding() == {"L0": (0, 0), "L2": (0, 1), "L1": (1, 0), "L3": (1, 1)}


def test_vllm_example_strided_groups():
    specs = {str(i): FULL for i in (1, 2, 3)} | {str(i): SW for i in range(4, 11)}
    groups = get_kv_cache_groups(specs)
    assert [list(g.layer_names) for g in groups] == [
        ["1", "2", "3"],
        ["4", "7", "10"],
        ["5", "8"],
        ["6", "9"],
    ]
    cfg = get_kv_cache_config(specs, 3 * 60 * PAGE, max_model_len=256, max_num_batched_tokens=64)
    assert [list(t.shared_by) for t in cfg.kv_cache_tensors] == [
        ["1", "4", "5", "6"],
        ["2", "7", "8", "9"],
        ["3", "10"],
    ]
    assert cfg.num_blocks == 60


def test_uniform_specs_single_group_one_tensor_per_layer():
    specs = {f"l{i}": FULL for i in range(4)}
    cfg = get_kv_cache_config(specs, 4 * 10 * PAGE + PAGE - 1, max_model_len=64)
    assert len(cfg.kv_cache_groups) == 1
    assert cfg.kv_cache_groups[0].layer_names == ("l0", "l1", "l2", "l3")
    assert [t.shared_by for t in cfg.kv_cache_tensors] == [("l0",), ("l1",), ("l2",), ("l3",)]
    assert cfg.num_blocks == 10  # floor((40 pages + almost one) / 4 layers)
    assert num_tokens_in_cache(cfg) == 10 * BS


def test_num_gpu_blocks_override():
    specs = {"a": FULL}
    cfg = get_kv_cache_config(specs, 100 * PAGE, max_model_len=64, num_gpu_blocks_override=7)
    assert cfg.num_blocks == 7
    assert cfg.kv_cache_tensors == (KVCacheTensor(7 * PAGE, ("a",)),)


def test_not_enough_memory_names_fitting_max_model_len():
    specs = {"a": FULL, "b": FULL}
    # 2 layers * 4 blocks = 8 pages -> max_model_len 64 fits, 1000 does not
    with pytest.raises(ValueError, match="largest max_model_len that fits is 64"):
        get_kv_cache_config(specs, 8 * PAGE, max_model_len=1000)
    assert estimate_max_model_len(specs, 8 * PAGE, max_model_len=1000) == 64
    with pytest.raises(ValueError, match="No available memory"):
        get_kv_cache_config(specs, 0, max_model_len=16)


def test_ungroupable_specs():
    other = FullAttentionSpec(BS, 4, 64, "bfloat16")  # different page size
    with pytest.raises(ValueError, match="cannot be grouped"):
        get_kv_cache_groups({"a": FULL, "b": other})


def test_too_few_blocks():
    with pytest.raises(ValueError, match="at least 2"):
        get_kv_cache_config({"a": FULL}, 64 * PAGE, max_model_len=16, num_gpu_blocks_override=1)


def test_configs_per_rank_take_min_blocks_and_rank_picks_its_own():
    # Two pipeline-style ranks: rank 0 owns L0, L1; rank 1 owns L2, L3.
    specs0 = {"L0": FULL, "L1": SW}
    specs1 = {"L2": FULL, "L3": SW}
    cfgs = get_kv_cache_configs(
        [specs0, specs1], [60 * PAGE, 40 * PAGE], max_model_len=256, max_num_batched_tokens=64
    )
    assert [c.num_blocks for c in cfgs] == [40, 40]  # min over ranks (group_size 1 per rank)
    rank = 1
    mine = cfgs[rank]
    assert [g.layer_names for g in mine.kv_cache_groups] == [("L2",), ("L3",)]
    assert [t.shared_by for t in mine.kv_cache_tensors] == [("L2", "L3")]
    assert mine.kv_cache_tensors[0].size == 40 * PAGE
    with pytest.raises(ValueError, match="different specs"):
        get_kv_cache_configs([{"a": FULL}, {"a": SW}], [PAGE * 64] * 2, max_model_len=16)


def test_max_concurrency_vllm_numbers():
    full = FullAttentionSpec(16, 1, 64, "float32")
    sw = SlidingWindowSpec(16, 1, 64, "float32", sliding_window=1024)
    kw = dict(max_model_len=16384, max_num_batched_tokens=1024)
    page = full.page_size_bytes
    cfg = get_kv_cache_config({"f": full}, 1536 * page, num_gpu_blocks_override=1536, **kw)
    assert get_max_concurrency(cfg, **kw) == 1.5
    cfg = get_kv_cache_config({"s": sw}, 387 * page, num_gpu_blocks_override=387, **kw)
    assert get_max_concurrency(cfg, **kw) == 3.0
    cfg = get_kv_cache_config(
        {"f": full, "s": sw}, 3459 * 2 * page, num_gpu_blocks_override=3459, **kw
    )
    assert get_max_concurrency(cfg, **kw) == 3.0


def test_available_memory():
    assert available_kv_cache_memory(None, kv_cache_memory_bytes=123) == 123
    stats = {"bytes_limit": 1000, "bytes_in_use": 100}
    assert available_kv_cache_memory(stats, gpu_memory_utilization=0.5) == 400
    with pytest.raises(ValueError, match="kv_cache_memory_bytes"):
        available_kv_cache_memory(None)
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        available_kv_cache_memory(stats, gpu_memory_utilization=1.5)
    with pytest.raises(ValueError, match="positive"):
        available_kv_cache_memory(None, kv_cache_memory_bytes=-1)
