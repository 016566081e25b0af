"""SchedulerConfig: the scheduler's knobs, validated once."""

from __future__ import annotations

import dataclasses

from jaxkv.core.block_hash import HASH_ALGOS
from jaxkv.core.block_pool import EvictionPolicy
from jaxkv.core.request_queue import SchedulingPolicy


def _check_int(name: str, value, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")


@dataclasses.dataclass(frozen=True)
class SchedulerConfig:
    """Scheduler settings (vLLM names).

    Attributes:
        max_num_seqs: Most requests in the running list.
        max_num_batched_tokens: Token budget of one step.
        max_model_len: Longest sequence (prompt + output) in tokens.
        enable_prefix_caching: Automatic prefix caching.
        enable_chunked_prefill: Split prompts over steps; when off, a prompt is scheduled
            whole or not at all, which needs ``max_num_batched_tokens >= max_model_len``.
        long_prefill_token_threshold: If > 0, at most this many tokens of one request per
            step (lets decodes through beside long prompts).
        policy: ``"fcfs"`` or ``"priority"``.
        eos_token_id: Default EOS for requests built without one (None: no EOS check).
        hash_algo: ``"sha256"`` or ``"builtin"`` (see ``jaxkv.core.block_hash``).
        eviction_policy: ``"lru"`` (vLLM v0.11) or ``"lru_unhashed_first"``.
        num_lookahead_tokens: Extra slots per running request for draft-model KV (EAGLE).
        enable_kv_cache_events: Collect ``KVEventBatch`` es (``Scheduler.take_kv_events``).
        log_stats: Collect prefix-cache statistics.
        async_scheduling: Schedule step N+1 before step N's sampled tokens are known (vLLM's
            ``--async-scheduling``): a request whose step samples gets an output placeholder,
            and the next step feeds it the token straight from the device. No speculative
            tokens with it (``num_lookahead_tokens`` must be 0).
    """

    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    long_prefill_token_threshold: int = 0
    policy: SchedulingPolicy | str = SchedulingPolicy.FCFS
    eos_token_id: int | None = None
    hash_algo: str = "sha256"
    eviction_policy: EvictionPolicy | str = EvictionPolicy.LRU
    num_lookahead_tokens: int = 0
    enable_kv_cache_events: bool = False
    log_stats: bool = True
    async_scheduling: bool = False

    def __post_init__(self):
        _check_int("max_num_seqs", self.max_num_seqs, 1)
        _check_int("max_num_batched_tokens", self.max_num_batched_tokens, 1)
        _check_int("max_model_len", self.max_model_len, 2)
        _check_int("long_prefill_token_threshold", self.long_prefill_token_threshold, 0)
        _check_int("num_lookahead_tokens", self.num_lookahead_tokens, 0)
        for name in (
            "enable_prefix_caching",
            "enable_chunked_prefill",
            "enable_kv_cache_events",
            "log_stats",
            "async_scheduling",
        ):
            if not isinstance(getattr(self, name), bool):  # "no" would be truthy
                raise TypeError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if self.eos_token_id is not None and (
            isinstance(self.eos_token_id, bool) or not isinstance(self.eos_token_id, int)
        ):
            raise TypeError(f"eos_token_id must be an int or None, got {self.eos_token_id!r}")
        if self.async_scheduling and self.num_lookahead_tokens:
            raise ValueError(
                f"async_scheduling does not support speculative tokens "
                f"(num_lookahead_tokens={self.num_lookahead_tokens})"
            )
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                f"without chunked prefill max_num_batched_tokens ({self.max_num_batched_tokens}) "
                f"must be >= max_model_len ({self.max_model_len}), or long prompts never fit a step"
            )
        try:
            object.__setattr__(self, "policy", SchedulingPolicy(self.policy))
        except ValueError:
            raise ValueError(
                f"policy must be one of {[p.value for p in SchedulingPolicy]}, got {self.policy!r}"
            ) from None
        try:
            object.__setattr__(self, "eviction_policy", EvictionPolicy(self.eviction_policy))
        except ValueError:
            raise ValueError(
                f"eviction_policy must be one of {[p.value for p in EvictionPolicy]}, got {self.eviction_policy!r}"
            ) from None
        if self.hash_algo not in HASH_ALGOS:
            raise ValueError(f"hash_algo must be one of {HASH_ALGOS}, got {self.hash_algo!r}")
