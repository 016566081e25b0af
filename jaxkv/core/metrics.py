"""Prefix-cache and scheduler statistics (vLLM's ``PrefixCacheStats`` and friends)."""

from __future__ import annotations

import dataclasses
from collections import deque


@dataclasses.dataclass
class PrefixCacheStats:
    """Prefix-cache lookups since the last ``make_prefix_cache_stats``.

    Attributes:
        reset: The cache was reset in this interval.
        requests: Number of lookups (``get_computed_blocks`` calls that searched).
        queries: Tokens looked up (each request's ``num_tokens``).
        hits: Tokens found.
    """

    reset: bool = False
    requests: int = 0
    queries: int = 0
    hits: int = 0


class PrefixCachingMetrics:
    """Hit rate over the most recent ``max_recent_requests`` requests (a sliding window).

    Each ``observe`` adds one interval; the oldest intervals are dropped while more than
    ``max_recent_requests`` requests are aggregated (the newest interval always stays).
    """

    def __init__(self, max_recent_requests: int = 1000):
        self.max_recent_requests = max_recent_requests
        self.aggregated_requests = 0
        self.aggregated_query_total = 0
        self.aggregated_query_hit = 0
        self.query_queue: deque[tuple[int, int, int]] = deque()
        # Since start, never reset (the Prometheus counters jaxkv serve exports).
        self.total_queries = 0
        self.total_hits = 0

    def observe(self, stats: PrefixCacheStats) -> None:
        if stats.reset:
            self.reset()
        if stats.requests == 0:
            return
        self.total_queries += stats.queries
        self.total_hits += stats.hits
        self.query_queue.append((stats.requests, stats.queries, stats.hits))
        self.aggregated_requests += stats.requests
        self.aggregated_query_total += stats.queries
        self.aggregated_query_hit += stats.hits
        while len(self.query_queue) > 1 and self.aggregated_requests > self.max_recent_requests:
            requests, queries, hits = self.query_queue.popleft()
            self.aggregated_requests -= requests
            self.aggregated_query_total -= queries
            self.aggregated_query_hit -= hits

    def reset(self) -> None:
        self.aggregated_requests = 0
        self.aggregated_query_total = 0
        self.aggregated_query_hit = 0
        self.query_queue.clear()

    @property
    def hit_rate(self) -> float:
        if self.aggregated_query_total == 0:
            return 0.0
        return self.aggregated_query_hit / self.aggregated_query_total


@dataclasses.dataclass(frozen=True)
class SchedulerStats:
    """A snapshot of the scheduler for logging.

    Attributes:
        num_running_reqs: Requests in the running list.
        num_waiting_reqs: Requests waiting (new or preempted).
        kv_cache_usage: Fraction of usable blocks in use (0..1).
        prefix_cache_stats: Lookups since the previous snapshot.
        prefix_cache_hit_rate: Hit rate (tokens) over the recent requests.
        num_preemptions: Preemptions since the scheduler was built.
    """

    num_running_reqs: int
    num_waiting_reqs: int
    kv_cache_usage: float
    prefix_cache_stats: PrefixCacheStats
    prefix_cache_hit_rate: float
    num_preemptions: int
