"""``LLMEngine.get_stats()``'s record: the engine's counters at one moment. No jax import."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True, slots=True)
class SpecDecodeStats:
    """Speculative decoding's counters since start (vLLM's spec-decode metrics).

    Attributes:
        num_draft_tokens: Draft tokens proposed and verified.
        num_accepted_tokens: Of those, accepted by the verifier.
        acceptance_rate: ``num_accepted_tokens / num_draft_tokens`` (0.0 before any draft).
    """

    num_draft_tokens: int
    num_accepted_tokens: int
    acceptance_rate: float


@dataclasses.dataclass(frozen=True, slots=True)
class EngineStats:
    """``LLMEngine.get_stats()``: the scheduler's state after the last step (or now, before
    any step and after a recovery) with the engine's and the driver worker's counters.

    Attributes:
        kv_cache_usage: Fraction of the KV pool's blocks in use (0.0 to 1.0).
        num_running_reqs: Requests in the running queue.
        num_waiting_reqs: Requests waiting (new, preempted or loading remote KV).
        prefix_cache_hit_rate: Prefix-cache hit rate over the scheduler's recent requests.
        num_preemptions: Preemptions since start.
        peak_kv_cache_usage: Highest ``kv_cache_usage`` seen after a step.
        prefix_hit_tokens: Prompt tokens found in the prefix cache since start (all requests).
        num_compiles: Programs the driver worker has compiled, warm-up included.
        compile_seconds: Seconds those compiles took (rounded to ms).
        num_programs: Distinct programs the driver worker holds.
        late_compiles: Compiles after warm-up (each is logged; should be 0).
        num_steps: Steps run.
        generated_tokens: Output tokens produced since start.
        scheduled_tokens: Tokens scheduled (computed) since start, prompts included.
        output_tokens_per_s: ``generated_tokens`` over the seconds spent in steps.
        spec_decode: The speculative-decoding counters; None without speculative decoding.
    """

    kv_cache_usage: float
    num_running_reqs: int
    num_waiting_reqs: int
    prefix_cache_hit_rate: float
    num_preemptions: int
    peak_kv_cache_usage: float
    prefix_hit_tokens: int
    num_compiles: int
    compile_seconds: float
    num_programs: int
    late_compiles: int
    num_steps: int
    generated_tokens: int
    scheduled_tokens: int
    output_tokens_per_s: float
    spec_decode: SpecDecodeStats | None = None

    def to_dict(self) -> dict:
        """The fields as a plain (JSON-ready) dict; ``spec_decode`` as a nested dict or None."""
        return dataclasses.asdict(self)
