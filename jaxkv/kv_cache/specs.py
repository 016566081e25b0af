"""KV-cache specs: what one attention layer needs from the cache (no jax import).

Mirrors vLLM V1's ``kv_cache_interface``: a spec describes one layer's per-block
storage; layers with equal specs can share one block table (a KV-cache group).
"""

from __future__ import annotations

import dataclasses

#: KV-cache dtype names -> bytes per element. "fp8" is float8_e4m3fn (one byte).
KV_DTYPE_BYTES: dict[str, int] = {
    "float32": 4,
    "bfloat16": 2,
    "float16": 2,
    "fp8": 1,
}
#: Accepted aliases, normalised to the names above.
_DTYPE_ALIASES = {
    "fp32": "float32",
    "f32": "float32",
    "bf16": "bfloat16",
    "fp16": "float16",
    "half": "float16",
    "float8_e4m3fn": "fp8",
    "fp8_e4m3": "fp8",
}
#: Page sizes must be multiples of this many bytes (so every page is aligned).
PAGE_ALIGN_BYTES = 256


def normalize_kv_dtype(dtype: str) -> str:
    """Returns the canonical KV dtype name for ``dtype`` (a name, or an object with ``.name``)."""
    name = getattr(dtype, "name", dtype)
    if not isinstance(name, str):
        raise TypeError(f"KV-cache dtype must be a name like 'bfloat16', got {dtype!r}")
    name = _DTYPE_ALIASES.get(name, name)
    if name not in KV_DTYPE_BYTES:
        raise ValueError(
            f"unsupported KV-cache dtype {dtype!r}; expected one of {sorted(KV_DTYPE_BYTES)}"
        )
    return name


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _check_positive_int(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {value!r}")
    if value <= 0:
        raise ValueError(f"{name} must be positive, got {value}")


@dataclasses.dataclass(frozen=True)
class FullAttentionSpec:
    """Causal attention over the whole sequence.

    ``page_size_bytes = 2 * block_size * num_kv_heads * head_size * itemsize`` (K and V).
    ``sliding_window`` is only recorded here (vLLM merges a window into a Full spec when
    hybrid management is disabled); the manager still keeps every block.
    """

    block_size: int
    num_kv_heads: int
    head_size: int
    dtype: str
    sliding_window: int | None = None

    def __post_init__(self):
        _check_positive_int("block_size", self.block_size)
        if self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        _check_positive_int("num_kv_heads", self.num_kv_heads)
        _check_positive_int("head_size", self.head_size)
        object.__setattr__(self, "dtype", normalize_kv_dtype(self.dtype))
        if self.sliding_window is not None:
            _check_positive_int("sliding_window", self.sliding_window)

    @property
    def dtype_bytes(self) -> int:
        return KV_DTYPE_BYTES[self.dtype]

    @property
    def page_size_bytes(self) -> int:
        return 2 * self.block_size * self.num_kv_heads * self.head_size * self.dtype_bytes

    @property
    def page_aligned(self) -> bool:
        return self.page_size_bytes % PAGE_ALIGN_BYTES == 0

    def max_memory_usage_bytes(self, max_model_len: int, max_num_batched_tokens: int) -> int:
        """Bytes one request of ``max_model_len`` tokens may hold in this layer."""
        del max_num_batched_tokens  # a full-attention request keeps every block
        return cdiv(max_model_len, self.block_size) * self.page_size_bytes


@dataclasses.dataclass(frozen=True)
class SlidingWindowSpec(FullAttentionSpec):
    """Attention over the last ``sliding_window`` tokens (the query's own token included).

    Worked example: window 4, block_size 2, a query at position 9 reads positions 6..9,
    i.e. blocks 3 and 4; blocks 0..2 are no longer needed and the manager frees them.
    """

    sliding_window: int = 0  # required; 0 is rejected below

    def __post_init__(self):
        super().__post_init__()
        if self.sliding_window is None or self.sliding_window <= 0:
            raise ValueError(
                f"SlidingWindowSpec needs sliding_window > 0, got {self.sliding_window}"
            )

    def max_memory_usage_bytes(self, max_model_len: int, max_num_batched_tokens: int) -> int:
        # The window plus one step's new tokens, plus one block for a window that does not
        # start on a block boundary (vLLM V1).
        num_tokens = min(self.sliding_window - 1 + max_num_batched_tokens, max_model_len)
        return (cdiv(num_tokens, self.block_size) + 1) * self.page_size_bytes


KVCacheSpec = FullAttentionSpec | SlidingWindowSpec


@dataclasses.dataclass(frozen=True)
class KVCacheGroupSpec:
    """Layers that share one block table (and so one set of block ids per request)."""

    layer_names: tuple[str, ...]
    kv_cache_spec: KVCacheSpec

    def __post_init__(self):
        object.__setattr__(self, "layer_names", tuple(self.layer_names))


@dataclasses.dataclass(frozen=True)
class KVCacheTensor:
    """One flat byte buffer of ``size`` bytes; ``shared_by`` layers all view the same bytes."""

    size: int
    shared_by: tuple[str, ...]

    def __post_init__(self):
        object.__setattr__(self, "shared_by", tuple(self.shared_by))


@dataclasses.dataclass(frozen=True)
class KVCacheConfig:
    """The whole plan: how many blocks, which buffers, which groups."""

    num_blocks: int
    kv_cache_tensors: tuple[KVCacheTensor, ...]
    kv_cache_groups: tuple[KVCacheGroupSpec, ...]

    def __post_init__(self):
        object.__setattr__(self, "kv_cache_tensors", tuple(self.kv_cache_tensors))
        object.__setattr__(self, "kv_cache_groups", tuple(self.kv_cache_groups))

    @property
    def block_size(self) -> int:
        """The (uniform) block size of the groups; 0 for an attention-free model."""
        sizes = {g.kv_cache_spec.block_size for g in self.kv_cache_groups}
        if len(sizes) > 1:
            raise ValueError(f"groups have different block sizes: {sorted(sizes)}")
        return sizes.pop() if sizes else 0

    def layer_binding(self) -> dict[str, tuple[int, int]]:
        """``layer_name -> (group index, tensor index)``, built once at start-up."""
        tensor_of = {
            name: t for t, tensor in enumerate(self.kv_cache_tensors) for name in tensor.shared_by
        }
        binding = {}
        for g, group in enumerate(self.kv_cache_groups):
            for name in group.layer_names:
                if name not in tensor_of:
                    raise ValueError(f"layer {name!r} of group {g} has no KV-cache tensor")
                binding[name] = (g, tensor_of[name])
        return binding
