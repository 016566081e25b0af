"""User-facing outputs, shaped like vLLM's ``RequestOutput`` / ``CompletionOutput`` and its pooling
outputs (``PoolingRequestOutput``, ``EmbeddingRequestOutput``, ``ScoringRequestOutput``)."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class Logprob:
    """One candidate token's log-probability and its rank (1 = most likely)."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


#: Per position: token id -> Logprob (the chosen token plus the top-n).
PositionLogprobs = dict[int, Logprob]


@dataclasses.dataclass
class RequestMetrics:
    """Wall-clock timestamps (seconds, ``time.perf_counter``) and derived latencies."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    num_prefix_hit_tokens: int = 0
    num_preemptions: int = 0

    @property
    def time_to_first_token(self) -> float | None:
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time

    @property
    def decode_time(self) -> float | None:
        """Time from the first to the last generated token."""
        if self.first_token_time is None or self.last_token_time is None:
            return None
        return self.last_token_time - self.first_token_time


@dataclasses.dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: list[PositionLogprobs] | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: int | str | None = None  # the stop token id or stop string that matched

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclasses.dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: list[PositionLogprobs | None] | None
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics | None = None
    num_cached_tokens: int = 0
    #: The KV connector's parameters for the next hop (a prefill instance's finished
    #: output: where a decode instance pulls the KV from), as vLLM's.
    kv_transfer_params: dict | None = None


@dataclasses.dataclass
class PoolingOutput:
    """Pooled hidden states: ``data`` is a float32 numpy array, ``[dims]`` for ``"embed"`` or
    ``[num_prompt_tokens, dims]`` for ``"token_embed"`` (vLLM returns a torch tensor)."""

    data: object


@dataclasses.dataclass
class PoolingRequestOutput:
    request_id: str
    outputs: PoolingOutput
    prompt_token_ids: list[int]
    finished: bool
    prompt: str | None = None
    metrics: RequestMetrics | None = None
    num_cached_tokens: int = 0


@dataclasses.dataclass
class EmbeddingOutput:
    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclasses.dataclass
class EmbeddingRequestOutput:
    request_id: str
    outputs: EmbeddingOutput
    prompt_token_ids: list[int]
    finished: bool

    @classmethod
    def from_base(cls, out: PoolingRequestOutput) -> EmbeddingRequestOutput:
        data = out.outputs.data
        if getattr(data, "ndim", 1) != 1:
            raise ValueError(f"an embedding is one vector, got data of shape {data.shape}")
        return cls(
            out.request_id,
            EmbeddingOutput([float(v) for v in data]),
            out.prompt_token_ids,
            out.finished,
        )


@dataclasses.dataclass
class ScoringOutput:
    score: float


@dataclasses.dataclass
class ScoringRequestOutput:
    """``LLM.score``: the cosine similarity of two texts' embeddings (vLLM's embedding-model
    scoring); ``prompt_token_ids`` are the two prompts' ids concatenated, as vLLM reports."""

    request_id: str
    outputs: ScoringOutput
    prompt_token_ids: list[int]
    finished: bool
