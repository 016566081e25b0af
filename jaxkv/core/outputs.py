"""What the worker returns (``ModelRunnerOutput``) and what the core emits (``EngineCoreOutput``)."""

from __future__ import annotations

import dataclasses

#: Logprobs of one sampled (or prompt) token: ``(token_ids, logprobs, ranks)``, three
#: aligned lists. Entry 0 is the sampled token itself, then the top-k tokens (so up to
#: k + 1 entries, as vLLM). ``ranks`` are 1-based ranks in the vocabulary (1 = most likely).
TokenLogprobs = tuple[list[int], list[float], list[int]]


@dataclasses.dataclass
class KVConnectorOutput:
    """What the workers' KV connector reports with a step (vLLM V1's ``KVConnectorOutput``).

    Attributes:
        finished_sending: Requests whose blocks were sent (or given up): the scheduler may
            free the blocks it kept for them (``request_finished`` returned True).
        finished_recving: Requests whose asynchronous load has ended (loaded or failed).
        invalid_block_ids: Blocks whose load failed: their requests recompute those tokens
            (vLLM's ``kv_load_failure_policy="recompute"``).
        stats: Connector counters (bytes moved, seconds), free-form.
    """

    finished_sending: set[str] = dataclasses.field(default_factory=set)
    finished_recving: set[str] = dataclasses.field(default_factory=set)
    invalid_block_ids: set[int] = dataclasses.field(default_factory=set)
    stats: dict = dataclasses.field(default_factory=dict)

    def is_empty(self) -> bool:
        return not (self.finished_sending or self.finished_recving or self.invalid_block_ids)


def merge_connector_stats(per_rank: list[dict]) -> dict:
    """Every worker rank's connector counters as one: numbers summed over ranks (bytes and
    counts moved by the whole instance; seconds are rank-seconds), the ranks' own dicts under
    ``"per_rank"``, in rank order."""
    merged: dict = {}
    for stats in per_rank:
        for key, value in stats.items():
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                merged[key] = merged.get(key, 0) + value
    merged["per_rank"] = [dict(s) for s in per_rank]
    return merged


@dataclasses.dataclass
class ModelRunnerOutput:
    """One step's results from the worker.

    Attributes:
        req_ids: Requests of the batch, in row order.
        req_id_to_index: ``req_id -> row``.
        sampled_token_ids: Per row, the accepted tokens as Python ints: one for a normal
            step, ``1 + accepted drafts`` with speculative decoding, and ``[]`` for a step
            that was a partial prefill chunk (its sample is meaningless).
        logprobs: None, or per row one ``TokenLogprobs`` per sampled token.
        prompt_logprobs_dict: ``req_id -> prompt TokenLogprobs`` of the positions computed
            this step (requests that asked for them).
        spec_token_ids: None, or per row the draft tokens proposed for the next step.
        pooler_output: ``req_id -> pooled hidden states`` (a float32 array: ``[dims]``, or
            ``[num_prompt_tokens, dims]`` for ``token_embed``) of pooling requests whose
            prompt finished this step.
        kv_connector_output: The KV connector's report (None without a connector).
        num_compiles: Programs the worker has compiled since it started, warm-up included
            (``/metrics`` ``jaxkv:compiles_total``; after warm-up it should never change).
    """

    req_ids: list[str]
    req_id_to_index: dict[str, int]
    sampled_token_ids: list[list[int]]
    logprobs: list[list[TokenLogprobs]] | None = None
    prompt_logprobs_dict: dict[str, list[TokenLogprobs] | None] = dataclasses.field(
        default_factory=dict
    )
    spec_token_ids: list[list[int]] | None = None
    pooler_output: dict[str, object] = dataclasses.field(default_factory=dict)
    kv_connector_output: KVConnectorOutput | None = None
    num_compiles: int = 0

    @classmethod
    def from_sampled(cls, sampled: dict[str, list[int]]) -> ModelRunnerOutput:
        """Convenience builder from ``req_id -> sampled tokens`` (tests, simple engines)."""
        req_ids = list(sampled)
        return cls(req_ids, {r: i for i, r in enumerate(req_ids)}, [sampled[r] for r in req_ids])


@dataclasses.dataclass(kw_only=True)
class EngineCoreOutput:
    """Per-request result of ``Scheduler.update_from_output`` (and of aborts); built by
    keyword only.

    Attributes:
        request_id: The request.
        new_token_ids: Tokens appended this step (after stop trimming).
        finish_reason: ``"stop"``, ``"length"``, ``"abort"`` or None (still running).
        stop_reason: The stop token id that finished it, else None (EOS, length, abort).
        new_logprobs: ``TokenLogprobs`` of the new tokens, when requested.
        new_prompt_logprobs: Prompt logprobs computed this step, when requested.
        num_cached_tokens: Prefix-cache hit (tokens) at the request's first scheduling.
        pooling_output: A pooling request's pooled hidden states (it finishes with them).
        kv_transfer_params: What the KV connector returns with a finished request (a
            prefill instance's: where the decode instance pulls its KV from), else None.
    """

    request_id: str
    new_token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    new_logprobs: list[TokenLogprobs] | None = None
    new_prompt_logprobs: list[TokenLogprobs] | None = None
    num_cached_tokens: int = 0
    pooling_output: object = None
    kv_transfer_params: dict | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
