"""Input preparation: a scheduled step's rows -> the records its programs take (host side).

:func:`plan_step` reads the condensed persistent batch (rows ``0..n-1`` are this step's
requests) and the scheduler's token counts, and returns a :class:`StepPlan`: the token bucket
T, the forward's inputs, which sampling program runs (``greedy[S]``, ``sample[S]`` or
``verify[P]``, or none when no row samples) with its inputs, prompt-logprob targets, and the
bookkeeping ``collect`` needs. Every array has the fixed shape of its program's key.

A token sampled by the step in flight (async scheduling: dispatched, not collected) is not on
the host yet: such an input token is read on the device from that step's ``last_sampled`` row
(``prev_rows``), and the row's counters include it (``pending``).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from jaxkv.worker import prompt_logprobs
from jaxkv.worker.buckets import pick_bucket
from jaxkv.worker.forward import ForwardDims, ForwardInputs
from jaxkv.worker.heads import SampleInputs, VerifyInputs
from jaxkv.worker.program_set import GREEDY, SAMPLE, VERIFY
from jaxkv.worker.sampling_updates import needs_processing
from jaxkv.worker.spec_decode import verify_inputs


@dataclasses.dataclass
class StepPlan:
    """One step's program inputs and host bookkeeping (rows in batch order)."""

    num_tokens: int  # T: the forward's token bucket
    forward: ForwardInputs  # block_ops and zero_blocks filled in by the runner
    head: str  # GREEDY / SAMPLE / VERIFY, or "" when no row samples
    head_size: int  # S or P
    head_inputs: SampleInputs | VerifyInputs | None
    prompt_targets: np.ndarray | None  # [T] int32 when a row wants prompt logprobs
    q_lens: np.ndarray  # [n] int32 tokens scheduled per row
    qsl: np.ndarray  # [S_T + 1] int32 query start of each row
    computed: np.ndarray  # [n] int32 tokens cached before the step
    samples: np.ndarray  # [n] bool: the row keeps a sampled token
    want_logprobs: bool  # a sampling row asks for logprobs
    prompt_rows: list[int]  # rows that compute prompt logprobs this step
    pool_rows: list[int]  # rows of pooling requests in their prompt
    drafts: list[list[int]]  # per row, the drafts scored
    spec_start: np.ndarray | None  # [n] int32 each row's first scored position

    @property
    def greedy_in_forward(self) -> bool:
        """The forward program itself takes the greedy tokens (no ``greedy[S]`` after it)."""
        return bool(self.forward.greedy[0])


def plan_step(
    batch,
    states,
    so,
    prev_sample_rows: dict[str, int] | None,
    *,
    dims_for,
    seq_buckets,
    spec_buckets,
    slots: dict[str, int],
    neutral_slot: int,
    num_speculative_tokens: int,
    max_num_seqs: int,
    token_buckets,
) -> StepPlan:
    """The plan of a step with n = ``batch.num_reqs`` > 0 rows.

    Args:
      batch: the condensed ``InputBatch``; ``states``: its rows' ``CachedRequestState``.
      so: the ``SchedulerOutput``; ``prev_sample_rows``: the step in flight's ``{req id: row}``
        of rows that sampled (None: no step in flight).
      dims_for: ``T -> ForwardDims``; ``slots``: each request's sampling-state slot.
    """
    req_ids = batch.req_ids
    n = len(req_ids)
    q_lens = np.array([so.num_scheduled_tokens[r] for r in req_ids], np.int32)
    total = int(q_lens.sum())
    T = pick_bucket(total, token_buckets)
    dims: ForwardDims = dims_for(T)
    x = dims.empty()
    c = batch.num_computed_tokens_cpu[:n].astype(np.int32)
    x.num_computed[:n] = c
    qsl = x.query_start_loc
    qsl[1 : n + 1] = np.cumsum(q_lens)
    qsl[n + 1 :] = total
    x.num_seqs[0] = n
    # Each row's tokens [c, c + q) from its host row; drafts follow the row's known tokens.
    known = batch.num_tokens[:n]  # tokens on the host per row
    rows = np.repeat(np.arange(n), q_lens)  # [total] row of each token
    offset = np.arange(total) - np.repeat(qsl[:n], q_lens)
    spec = so.scheduled_spec_decode_tokens
    drafts = [list(spec.get(r, ())) for r in req_ids]
    num_drafts = np.array([len(d) for d in drafts], np.int32)
    for i in np.flatnonzero(num_drafts).tolist():
        batch.token_ids_cpu[i, known[i] : known[i] + num_drafts[i]] = drafts[i]
    x.input_ids[:total] = batch.token_ids_cpu[rows, np.repeat(c, q_lens) + offset]
    pending = np.zeros(n, np.int32)
    if prev_sample_rows is not None:
        src = np.array([prev_sample_rows.get(r, -1) for r in req_ids], np.int32)
        pending = (src >= 0).astype(np.int32)
        reads = np.flatnonzero((src >= 0) & (c + q_lens > known))  # input at position `known`
        x.prev_rows[qsl[reads] + known[reads] - c[reads]] = src[reads]
    ends = c + q_lens
    if np.any(ends > known + pending + num_drafts):
        i = int(np.argmax(ends > known + pending + num_drafts))
        raise RuntimeError(f"request {req_ids[i]!r}: {ends[i]} tokens scheduled, {known[i]} known")
    samples = ends >= known + pending
    pool_rows = [i for i, st in enumerate(states) if st.pools_now]
    samples[pool_rows] = False  # pooling rows return hidden states and never a token

    num_outputs = (known - batch.num_prompt_tokens[:n] + pending).astype(np.int32)
    row_data = {
        "slots": np.array([slots[r] for r in req_ids], np.int32),
        "num_output_tokens": num_outputs,
        "num_history_tokens": (known + pending).astype(np.int32),
        "num_logprobs": np.array(
            [
                -1 if st.sampling_params.logprobs is None else st.sampling_params.logprobs
                for st in states
            ],
            np.int32,
        ),
        "samples": samples,
    }
    sampling = np.flatnonzero(samples)
    want_logprobs = bool(np.any(row_data["num_logprobs"][sampling] >= 0))
    head, size, head_inputs, spec_start = "", 0, None, None
    if num_drafts.any():
        head = VERIFY
        head_inputs, index, spec_start = verify_inputs(
            qsl,
            drafts,
            row_data,
            buckets=spec_buckets,
            num_drafts=num_speculative_tokens,
            num_batch_rows=max_num_seqs,
            neutral_slot=neutral_slot,
        )
        size = head_inputs.slots.shape[0]
        x.sample_index[:size] = index
    elif sampling.size:
        size = pick_bucket(n, seq_buckets)
        x.sample_index[:n] = np.maximum(qsl[1 : n + 1] - 1, 0)
        if want_logprobs or any(
            needs_processing(states[i].sampling_params, int(num_outputs[i]))
            for i in sampling.tolist()
        ):
            head = SAMPLE
            head_inputs = SampleInputs.empty(size, neutral_slot)
            for name, values in row_data.items():
                getattr(head_inputs, name)[:n] = values
        else:
            head = GREEDY
            # T sampled positions at most: the forward's own greedy head does no more rows
            # than greedy[S] would
            x.greedy[0] = int(0 < dims.greedy_rows and T <= size)
    prompt_rows = [i for i, st in enumerate(states) if prompt_logprobs.wants(st)]
    targets = prompt_logprobs.targets(states, qsl, q_lens, T) if prompt_rows else None
    return StepPlan(
        num_tokens=T,
        forward=x,
        head=head,
        head_size=size,
        head_inputs=head_inputs,
        prompt_targets=targets,
        q_lens=q_lens,
        qsl=qsl.copy(),
        computed=c,
        samples=samples,
        want_logprobs=want_logprobs,
        prompt_rows=prompt_rows,
        pool_rows=pool_rows,
        drafts=drafts,
        spec_start=spec_start,
    )
