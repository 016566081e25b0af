"""The step's last phase: its results fetched from the device and turned into a
``ModelRunnerOutput`` (sampled and accepted tokens, logprobs, prompt logprobs, pooled vectors).

``ModelRunner.dispatch`` leaves a :class:`StepHandle` with the :class:`StepOutputs` the step's
programs return (device arrays); ``ModelRunner.collect`` calls :func:`fetch_results` (the one
wait for the device: the same ``StepOutputs`` of numpy arrays) and :func:`collect_rows`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import numpy as np

from jaxkv.core import ModelRunnerOutput
from jaxkv.core.errors import blame
from jaxkv.worker import prompt_logprobs
from jaxkv.worker.heads import PromptLogprobs, row_logprobs
from jaxkv.worker.input_prep import StepPlan
from jaxkv.worker.pooler import PoolAccumulator
from jaxkv.worker.program_set import VERIFY
from jaxkv.worker.sampler import SamplerOutput
from jaxkv.worker.spec_decode import accepted_tokens


@dataclasses.dataclass
class CachedRequestState:
    """What the worker remembers of a request between steps."""

    req_id: str
    token_ids: list[int]  # prompt + generated tokens
    num_prompt_tokens: int
    sampling_params: object
    block_ids: list[list[int]]  # per KV-cache group
    num_computed_tokens: int
    pooling: PoolAccumulator | None = None  # pooling requests only

    @property
    def pools_now(self) -> bool:
        """A pooling request still in its prompt (its rows return hidden states, no token)."""
        return self.pooling is not None and self.num_computed_tokens < self.num_prompt_tokens

    @property
    def num_generated(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens


@dataclasses.dataclass(frozen=True)
class StepOutputs:
    """The device -> host boundary of a step: what its programs return, device arrays after
    ``dispatch`` and numpy arrays after :func:`fetch_results` (a pytree: None fields, which the
    step's plan did not ask for, hold nothing)."""

    tokens: jax.Array | None = None  # [S] int32 sampled tokens ([P], one a position, with drafts)
    accepted: jax.Array | None = None  # [P] bool: each draft position accepted (drafts only)
    logprobs: SamplerOutput | None = None  # when a row asks for logprobs
    prompt: PromptLogprobs | None = None  # [T, ...] when a row asks for prompt logprobs
    hidden: jax.Array | None = None  # [T, hidden] the forward's hidden states (pooling rows)


jax.tree_util.register_dataclass(
    StepOutputs, data_fields=[f.name for f in dataclasses.fields(StepOutputs)], meta_fields=[]
)


@dataclasses.dataclass
class StepHandle:
    """A dispatched step whose results are still on the device (``ModelRunner.collect``)."""

    plan: StepPlan
    states: list[CachedRequestState]  # the step's rows, in row order
    sample_rows: dict[str, int]  # req id -> its row, for rows that sample
    results: StepOutputs  # device arrays, fetched by ``ModelRunner.collect``

    @property
    def req_ids(self) -> list[str]:
        return [s.req_id for s in self.states]


def fetch_results(results: StepOutputs, to_host: Callable) -> StepOutputs:
    """The step's results on the host (waits for the device): each array through ``to_host``."""
    return jax.tree.map(to_host, results)


@dataclasses.dataclass
class Collected:
    """:func:`collect_rows`'s answer: the output, and per batch row the tokens to append."""

    output: ModelRunnerOutput
    rows: list[int]  # persistent-batch rows still holding their request
    row_tokens: list[list[int]]  # ... and each one's new tokens
    num_drafts: int = 0  # drafts scored and, of those, accepted
    num_accepted: int = 0


def collect_rows(
    handle: StepHandle, results: StepOutputs, *, row_of: dict[str, int], propose: Callable | None
) -> Collected:
    """Per row of the step: its new tokens (appended to the request's state), logprobs,
    prompt logprobs and pooled vector. ``row_of``: the persistent batch's ``req_id -> row``
    now (a request that left it gets no row); ``propose``: ``state -> drafts`` for the next
    step (speculative decoding; None without it). An error is blamed on the request at hand."""
    plan, states = handle.plan, handle.states
    accepted = results.accepted  # [P] bool with drafts
    start = plan.spec_start if plan.spec_start is not None else np.arange(len(states))
    want_lp = results.logprobs is not None
    toks = results.tokens.tolist() if results.tokens is not None else []
    samples = plan.samples.tolist()
    out_tokens: list[list[int]] = []
    logprobs_out: list | None = [] if want_lp else None
    spec_out: list | None = [] if propose is not None else None
    got = Collected(output=None, rows=[], row_tokens=[])
    prompt_lp, pooled = {}, {}
    current = None
    try:
        for i in plan.prompt_rows:
            s = states[i]
            current = s.req_id
            prompt_lp[s.req_id] = prompt_logprobs.collect(
                s, results.prompt, int(plan.qsl[i]), int(plan.q_lens[i]), int(plan.computed[i])
            )
        if plan.pool_rows:
            hidden = np.asarray(results.hidden, np.float32)
        for i in plan.pool_rows:
            s = states[i]
            current = s.req_id
            first = int(plan.qsl[i])
            vec = s.pooling.add(hidden[first : first + int(plan.q_lens[i])], int(plan.computed[i]))
            if vec is not None:
                pooled[s.req_id] = vec
        for i, s in enumerate(states):
            current = s.req_id
            if samples[i]:
                drafts = plan.drafts[i] if plan.head == VERIFY else ()
                new = accepted_tokens(toks, accepted, int(start[i]), drafts)
                if drafts:
                    got.num_drafts += len(drafts)
                    got.num_accepted += len(new) - 1
                s.token_ids.extend(new)
                row = row_of.get(s.req_id)
                if row is not None:
                    got.rows.append(row)
                    got.row_tokens.append(new)
                out_tokens.append(new)
                if want_lp:  # one entry per new token: its position's logprobs
                    k = s.sampling_params.logprobs
                    logprobs_out.append(
                        [
                            row_logprobs(results.logprobs, int(start[i]) + j, k)
                            for j in range(len(new))
                        ]
                        if k is not None
                        else []
                    )
            else:  # a partial prefill chunk: nothing sampled
                out_tokens.append([])
                if want_lp:
                    logprobs_out.append([])
            if spec_out is not None:
                spec_out.append(propose(s) if samples[i] else [])
    except BaseException as exc:
        blame(exc, current)
        raise
    req_ids = handle.req_ids
    got.output = ModelRunnerOutput(
        req_ids=req_ids,
        req_id_to_index={r: i for i, r in enumerate(req_ids)},
        sampled_token_ids=out_tokens,
        logprobs=logprobs_out,
        prompt_logprobs_dict=prompt_lp,
        spec_token_ids=spec_out,
        pooler_output=pooled,
    )
    return got


def append_tokens(batch, got: Collected) -> None:
    """Appends a collected step's new tokens to the rows of ``batch`` (the persistent
    ``InputBatch``) still holding their request: each row's r-th new token in round r."""
    for r in range(max(map(len, got.row_tokens), default=0)):
        sel = [j for j, t in enumerate(got.row_tokens) if len(t) > r]
        batch.append_one_token_per_row(
            np.asarray([got.rows[j] for j in sel]),
            np.asarray([got.row_tokens[j][r] for j in sel], np.int32),
        )
