"""``GET /metrics``: vLLM's Prometheus metrics with a ``jaxkv:`` prefix (one registry per server).

Gauges come from the core's scheduler stats after each step; counters and histograms from
the front end's per-message ``IterationStats`` (``AsyncLLM.stat_loggers``)."""

from __future__ import annotations

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
)

disable_created_metrics()  # no *_created series (vLLM turns them off too)

# vLLM's buckets (seconds)
TTFT_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
    2560.0,
)
ITL_BUCKETS = (
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
E2E_BUCKETS = (
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
    1920.0,
    7680.0,
)


class PrometheusStatLogger:
    """Records ``(CoreStats, IterationStats)`` into a private registry; ``render()`` is the
    ``/metrics`` body."""

    def __init__(self, model_name: str):
        self.registry = r = CollectorRegistry()
        labels = ["model_name"]
        self._gauges = {
            "num_running_reqs": Gauge(
                "jaxkv:num_requests_running", "Requests in the running batch.", labels, registry=r
            ),
            "num_waiting_reqs": Gauge(
                "jaxkv:num_requests_waiting",
                "Requests waiting to be scheduled.",
                labels,
                registry=r,
            ),
            "kv_cache_usage": Gauge(
                "jaxkv:kv_cache_usage_perc",
                "KV-cache usage (1 = every block in use).",
                labels,
                registry=r,
            ),
            "prefix_cache_hit_rate": Gauge(
                "jaxkv:prefix_cache_hit_rate",
                "Prefix-cache hit rate (tokens) over the recent requests.",
                labels,
                registry=r,
            ),
        }
        c = lambda name, doc, extra=(): Counter(name, doc, labels + list(extra), registry=r)  # noqa: E731
        self.prefix_queries = c("jaxkv:prefix_cache_queries", "Prefix-cache lookups (tokens).")
        self.prefix_hits = c("jaxkv:prefix_cache_hits", "Prefix-cache hits (tokens).")
        self.preemptions = c("jaxkv:num_preemptions", "Preemptions.")
        self.kv_bytes = c(
            "jaxkv:kv_transfer_bytes", "KV bytes loaded from another instance (KV connector)."
        )
        self.kv_seconds = c(
            "jaxkv:kv_transfer_seconds", "Seconds of those loads, from start to data."
        )
        self.kv_external = c(
            "jaxkv:kv_transfer_external_tokens", "Prompt tokens loaded instead of computed."
        )
        self.kv_failed = c(
            "jaxkv:kv_transfer_failed_loads", "Loads that failed (their requests recomputed)."
        )
        self.prompt_tokens = c("jaxkv:prompt_tokens", "Prompt tokens of the requests started.")
        self.generation_tokens = c("jaxkv:generation_tokens", "Generated tokens.")
        self.compiles = c(
            "jaxkv:compiles",
            "Programs compiled since start, warm-up included (a compile "
            "after warm-up is a bug: the engine logs it).",
        )
        self.request_success = c("jaxkv:request_success", "Finished requests.", ["finished_reason"])
        h = lambda name, doc, buckets: Histogram(name, doc, labels, buckets=buckets, registry=r)  # noqa: E731
        self.ttft = h("jaxkv:time_to_first_token_seconds", "Time to first token.", TTFT_BUCKETS)
        self.itl = h(
            "jaxkv:inter_token_latency_seconds",
            "Time between two outputs of a request.",
            ITL_BUCKETS,
        )
        self.e2e = h("jaxkv:e2e_request_latency_seconds", "Arrival to finish.", E2E_BUCKETS)
        self.model_name = model_name
        self._counters = {
            "prefix_cache_queries": self.prefix_queries,
            "prefix_cache_hits": self.prefix_hits,
            "num_preemptions": self.preemptions,
            "kv_transfer_bytes": self.kv_bytes,
            "kv_transfer_seconds": self.kv_seconds,
            "kv_external_tokens": self.kv_external,
            "kv_failed_loads": self.kv_failed,
            "num_compiles": self.compiles,
        }
        self._seen = dict.fromkeys(self._counters, 0)
        for g in self._gauges.values():
            g.labels(model_name).set(0)
        for metric in (
            *self._counters.values(),
            self.prompt_tokens,
            self.generation_tokens,
            self.ttft,
            self.itl,
            self.e2e,
        ):
            metric.labels(model_name)  # exported at 0 from the start, as vLLM's are

    def start(self, *, num_compiles: int = 0) -> None:
        """The engine's state at start-up (before its first step): programs warm-up compiled."""
        if num_compiles > self._seen["num_compiles"]:
            self.compiles.labels(self.model_name).inc(num_compiles - self._seen["num_compiles"])
            self._seen["num_compiles"] = num_compiles

    def record(self, stats, it) -> None:
        m = self.model_name
        if stats is not None:
            for field, gauge in self._gauges.items():
                gauge.labels(m).set(getattr(stats, field))
            for field, counter in self._counters.items():  # the core's totals since start
                total = getattr(stats, field)
                if total > self._seen[field]:
                    counter.labels(m).inc(total - self._seen[field])
                    self._seen[field] = total
        if it.num_prompt_tokens:
            self.prompt_tokens.labels(m).inc(it.num_prompt_tokens)
        if it.num_generation_tokens:
            self.generation_tokens.labels(m).inc(it.num_generation_tokens)
        for v in it.time_to_first_tokens:
            self.ttft.labels(m).observe(v)
        for v in it.inter_token_latencies:
            self.itl.labels(m).observe(v)
        for reason, e2e in it.finished:
            self.request_success.labels(m, reason).inc()
            self.e2e.labels(m).observe(e2e)

    def render(self) -> bytes:
        return generate_latest(self.registry)
