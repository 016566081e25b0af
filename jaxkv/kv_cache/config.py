"""Planning the KV cache: group layers, size the buffers, pick num_blocks (vLLM V1 semantics).

No jax import: the worker turns the resulting ``KVCacheConfig`` into device buffers.

Worked example (the seed): layers L0, L2 full attention and L1, L3 sliding window, page P bytes,
M bytes available. Specs differ but page sizes match, so layers are grouped by type with
group_size = 2: Group0 = [L0, L2], Group1 = [L1, L3]. Two tensors of ``num_blocks * P`` bytes
with ``num_blocks = M // P // 2``: Tensor0 shared by [L0, L1], Tensor1 by [L2, L3]. A block id
belongs to one group at a time, so L0 and L1 never see each other's data in Tensor0.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

from jaxkv.kv_cache.specs import (
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheSpec,
    KVCacheTensor,
    cdiv,
)


def _check_specs(kv_cache_specs: Mapping[str, KVCacheSpec]) -> None:
    if not isinstance(kv_cache_specs, Mapping):
        raise TypeError(
            f"kv_cache_specs must map layer names to specs, got {type(kv_cache_specs).__name__}"
        )
    for name, spec in kv_cache_specs.items():
        if not hasattr(spec, "page_size_bytes"):
            raise TypeError(f"layer {name!r}: {spec!r} is not a KV-cache spec")


def _max_memory(
    specs: Mapping[str, KVCacheSpec], max_model_len: int, max_num_batched_tokens: int
) -> int:
    return sum(
        s.max_memory_usage_bytes(max_model_len, max_num_batched_tokens) for s in specs.values()
    )


def estimate_max_model_len(
    kv_cache_specs: Mapping[str, KVCacheSpec],
    available_memory: int,
    *,
    max_model_len: int,
    max_num_batched_tokens: int | None = None,
) -> int:
    """Largest model length in [0, max_model_len] whose one request fits in ``available_memory``."""
    lo, hi = 0, max_model_len
    while lo < hi:
        mid = (lo + hi + 1) // 2
        mnbt = mid if max_num_batched_tokens is None else max_num_batched_tokens
        if _max_memory(kv_cache_specs, mid, mnbt) <= available_memory:
            lo = mid
        else:
            hi = mid - 1
    return lo


def check_enough_kv_cache_memory(
    kv_cache_specs: Mapping[str, KVCacheSpec],
    available_memory: int,
    *,
    max_model_len: int,
    max_num_batched_tokens: int | None = None,
) -> None:
    """Raises ValueError unless one request of ``max_model_len`` tokens fits."""
    if not kv_cache_specs:
        return
    if available_memory <= 0:
        raise ValueError(
            f"No available memory for the KV cache ({available_memory} bytes). "
            "Raise gpu_memory_utilization or pass kv_cache_memory_bytes."
        )
    mnbt = max_model_len if max_num_batched_tokens is None else max_num_batched_tokens
    needed = _max_memory(kv_cache_specs, max_model_len, mnbt)
    if needed > available_memory:
        fits = estimate_max_model_len(
            kv_cache_specs,
            available_memory,
            max_model_len=max_model_len,
            max_num_batched_tokens=max_num_batched_tokens,
        )
        raise ValueError(
            f"To serve one request of max_model_len={max_model_len} the KV cache needs "
            f"{needed} bytes ({needed / 2**20:.2f} MiB), but only {available_memory} bytes "
            f"({available_memory / 2**20:.2f} MiB) are available. The largest max_model_len "
            f"that fits is {fits}: lower max_model_len or give the KV cache more memory."
        )


def get_kv_cache_groups(kv_cache_specs: Mapping[str, KVCacheSpec]) -> list[KVCacheGroupSpec]:
    """Splits layers into groups that share a block table.

    All specs equal -> one group. Equal page sizes -> layers grouped by spec, each type split
    into strided groups of ``group_size = min(layers per type)`` layers (vLLM's example: full
    [1, 2, 3] and sliding [4..10] give [1, 2, 3], [4, 7, 10], [5, 8], [6, 9]).
    """
    _check_specs(kv_cache_specs)
    if not kv_cache_specs:
        return []
    specs = list(kv_cache_specs.values())
    if all(s == specs[0] for s in specs):
        return [KVCacheGroupSpec(tuple(kv_cache_specs), specs[0])]
    page_sizes = {s.page_size_bytes for s in specs}
    if len(page_sizes) != 1:
        detail = ", ".join(f"{n}={s.page_size_bytes}" for n, s in kv_cache_specs.items())
        raise ValueError(
            "KV-cache specs cannot be grouped: hybrid layers need one page size, got "
            f"page_size_bytes {detail}"
        )
    same_type: dict[KVCacheSpec, list[str]] = {}
    for name, spec in kv_cache_specs.items():
        same_type.setdefault(spec, []).append(name)
    group_size = min(len(v) for v in same_type.values())
    groups = []
    for spec, layers in same_type.items():
        num_groups = cdiv(len(layers), group_size)
        for i in range(num_groups):
            groups.append(KVCacheGroupSpec(tuple(layers[i::num_groups]), spec))
    return groups


def _config_from_groups(
    groups: Sequence[KVCacheGroupSpec], available_memory: int, num_gpu_blocks_override: int | None
) -> KVCacheConfig:
    if not groups:
        return KVCacheConfig(num_blocks=1, kv_cache_tensors=(), kv_cache_groups=())
    page = groups[0].kv_cache_spec.page_size_bytes
    group_size = max(len(g.layer_names) for g in groups)
    num_blocks = max(available_memory // page // group_size, 0)
    if num_gpu_blocks_override is not None:
        num_blocks = num_gpu_blocks_override
    return _with_num_blocks(groups, num_blocks)


def _with_num_blocks(groups: Sequence[KVCacheGroupSpec], num_blocks: int) -> KVCacheConfig:
    page = groups[0].kv_cache_spec.page_size_bytes
    group_size = max(len(g.layer_names) for g in groups)
    tensors = [
        KVCacheTensor(
            size=page * num_blocks,
            shared_by=tuple(g.layer_names[i] for g in groups if i < len(g.layer_names)),
        )
        for i in range(group_size)
    ]
    return KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=tensors, kv_cache_groups=groups)


def get_kv_cache_configs(
    specs_per_worker: Sequence[Mapping[str, KVCacheSpec]],
    available_memory_per_worker: Sequence[int],
    *,
    max_model_len: int,
    max_num_batched_tokens: int | None = None,
    num_gpu_blocks_override: int | None = None,
) -> list[KVCacheConfig]:
    """One ``KVCacheConfig`` per worker rank, all with the same (smallest) ``num_blocks``.

    Unlike vLLM, tensors are sized to the common ``num_blocks``: a jax array cannot be used in
    part for free, so memory a rank cannot use is not allocated at all.
    """
    if len(specs_per_worker) != len(available_memory_per_worker):
        raise ValueError(
            f"{len(specs_per_worker)} spec dicts but {len(available_memory_per_worker)} memory sizes"
        )
    if not specs_per_worker:
        raise ValueError("get_kv_cache_configs needs at least one worker")
    if num_gpu_blocks_override is not None and num_gpu_blocks_override < 1:
        raise ValueError(f"num_gpu_blocks_override must be >= 1, got {num_gpu_blocks_override}")
    for rank, (specs, mem) in enumerate(zip(specs_per_worker, available_memory_per_worker)):
        _check_specs(specs)
        try:
            check_enough_kv_cache_memory(
                specs,
                mem,
                max_model_len=max_model_len,
                max_num_batched_tokens=max_num_batched_tokens,
            )
        except ValueError as e:
            if len(specs_per_worker) == 1:
                raise
            raise ValueError(f"worker rank {rank}: {e}") from None
    merged: dict[str, KVCacheSpec] = {}
    for specs in specs_per_worker:
        for name, spec in specs.items():
            if name in merged and merged[name] != spec:
                raise ValueError(
                    f"layer {name!r} has different specs on two workers: {merged[name]} vs {spec}"
                )
            merged.setdefault(name, spec)
    global_groups = get_kv_cache_groups(merged)
    configs = []
    for specs, mem in zip(specs_per_worker, available_memory_per_worker):
        local = [
            dataclasses.replace(g, layer_names=tuple(n for n in g.layer_names if n in specs))
            for g in global_groups
        ]
        local = [g for g in local if g.layer_names]
        configs.append(_config_from_groups(local, mem, num_gpu_blocks_override))
    num_blocks = min(c.num_blocks for c in configs)
    if num_blocks < 2 and any(c.kv_cache_groups for c in configs):
        raise ValueError(
            f"The KV cache has room for {num_blocks} blocks; at least 2 are needed (block 0 is "
            "the null block). Give the KV cache more memory."
        )
    return [
        _with_num_blocks(c.kv_cache_groups, num_blocks) if c.kv_cache_groups else c for c in configs
    ]


def get_kv_cache_config(
    kv_cache_specs: Mapping[str, KVCacheSpec],
    available_memory: int,
    *,
    max_model_len: int,
    max_num_batched_tokens: int | None = None,
    num_gpu_blocks_override: int | None = None,
) -> KVCacheConfig:
    """The single-worker case of :func:`get_kv_cache_configs`."""
    return get_kv_cache_configs(
        [kv_cache_specs],
        [available_memory],
        max_model_len=max_model_len,
        max_num_batched_tokens=max_num_batched_tokens,
        num_gpu_blocks_override=num_gpu_blocks_override,
    )[0]


def blocks_per_request(
    config: KVCacheConfig, *, max_model_len: int, max_num_batched_tokens: int
) -> int:
    """Blocks one request of ``max_model_len`` tokens needs across all groups."""
    return sum(
        cdiv(
            g.kv_cache_spec.max_memory_usage_bytes(max_model_len, max_num_batched_tokens),
            g.kv_cache_spec.page_size_bytes,
        )
        for g in config.kv_cache_groups
    )


def get_max_concurrency(
    config: KVCacheConfig, *, max_model_len: int, max_num_batched_tokens: int
) -> float:
    """How many requests of ``max_model_len`` tokens fit at once (vLLM's formula).

    Example: max_model_len 16384, block_size 16, max_num_batched_tokens 1024: a full-attention
    request needs 1024 blocks, a window-1024 one cdiv(2047, 16) + 1 = 129; with both groups
    1153, so 3459 blocks serve 3.0 requests.
    """
    if not config.kv_cache_groups:
        return float("inf")
    return config.num_blocks / blocks_per_request(
        config, max_model_len=max_model_len, max_num_batched_tokens=max_num_batched_tokens
    )


def num_tokens_in_cache(config: KVCacheConfig) -> int:
    """Tokens the cache holds per group (vLLM's log line: blocks // groups * block_size)."""
    if not config.kv_cache_groups:
        return 0
    return config.num_blocks // len(config.kv_cache_groups) * config.block_size


def available_kv_cache_memory(
    memory_stats: Mapping[str, int] | None,
    *,
    gpu_memory_utilization: float = 0.9,
    kv_cache_memory_bytes: int | None = None,
) -> int:
    """Bytes the KV cache may take on one device.

    ``kv_cache_memory_bytes`` wins when given. Otherwise ``memory_stats`` (jax's
    ``device.memory_stats()``: ``bytes_limit``, ``bytes_in_use``) gives
    ``bytes_limit * utilization - bytes_in_use`` (weights and everything else already
    allocated count as in use). CPU devices report no stats: an explicit budget is required.
    """
    if kv_cache_memory_bytes is not None:
        if isinstance(kv_cache_memory_bytes, bool) or not isinstance(kv_cache_memory_bytes, int):
            raise TypeError(f"kv_cache_memory_bytes must be an int, got {kv_cache_memory_bytes!r}")
        if kv_cache_memory_bytes <= 0:
            raise ValueError(f"kv_cache_memory_bytes must be positive, got {kv_cache_memory_bytes}")
        return kv_cache_memory_bytes
    if not 0.0 < gpu_memory_utilization <= 1.0:
        raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization}")
    if not memory_stats or "bytes_limit" not in memory_stats:
        raise ValueError(
            "this device reports no memory stats (CPU devices do not): pass kv_cache_memory_bytes"
        )
    limit = int(memory_stats["bytes_limit"])
    in_use = int(memory_stats.get("bytes_in_use", 0))
    return int(limit * gpu_memory_utilization) - in_use
