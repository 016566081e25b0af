"""The programs that follow the forward: sampling, draft verification, prompt logprobs.

Each is compiled once per size it is keyed by and reads the forward's outputs on the device
(no host round trip):

* ``greedy[S]``: the argmax of the raw logits of the first S sampled positions, for steps where
  no sampling row needs more (a forward of T <= S tokens runs the same function itself:
  ``jaxkv.worker.forward``). On the CPU a bf16 head's argmax is taken inside its product
  (``LogitsHead.greedy_tokens``); elsewhere from vocab-major logits, the faster orientation on
  XLA:CPU;
* ``sample[S]``: the general sampler (``jaxkv.worker.sampler``) over the rows' slots of the
  device ``SamplingState``; it appends each sampled token to its slot's history;
* ``verify[P]``: the same over P scored positions against n-gram drafts (speculative decoding);
  it appends each row's accepted tokens;
* ``prompt_logprobs[T]``: logprob, rank and top-K of every token's next prompt token.

Every sampling program writes its rows' tokens into ``last_sampled`` [R] (donated), which the
next forward reads for tokens the host does not have yet (async scheduling).

The LM head is the model's own ``compute_logits``; a program is handed only the parameters it
reads (:class:`LogitsHead`), not the whole model: each argument costs dispatch time.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from jaxkv.models.sharding import TP_AXIS
from jaxkv.pallas_kernels import amx
from jaxkv.worker.logits_ops import compute_logprobs
from jaxkv.worker.packing import PackSpec, pack_record, unpack_record
from jaxkv.worker.sampler import (
    SamplerOutput,
    SamplingRows,
    sample,
    sample_and_verify,
    sample_greedy_vocab_major,
)
from jaxkv.worker.sampling_state import PAD_TOKEN_ID, SamplingState


class LogitsHead:
    """The model's ``compute_logits`` with only the parameters it reads.

    At start-up ``compute_logits`` is traced once over the whole state; the leaves its jaxpr
    never reads are left out of the programs' arguments (in place of them the programs see
    their shapes only). If the trace fails, every leaf is passed.
    """

    def __init__(self, graphdef, state, hidden_size: int, mesh=None):
        self.graphdef = graphdef
        self.mesh = mesh
        leaves, self.treedef = jax.tree_util.tree_flatten(state)
        self.abstract = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in leaves]
        try:
            self.used = self._used_leaves(leaves, hidden_size)
        except Exception:  # noqa: BLE001 - any failure: pass everything, still correct
            self.used = list(range(len(leaves)))

    def _used_leaves(self, leaves, hidden_size: int) -> list[int]:
        h = jax.ShapeDtypeStruct((2, hidden_size), jnp.float32)
        closed = jax.make_jaxpr(lambda ls, x: self._merge(ls, range(len(ls))).compute_logits(x))(
            leaves, h
        )
        jaxpr = closed.jaxpr
        read = {id(v) for eqn in jaxpr.eqns for v in eqn.invars} | {id(v) for v in jaxpr.outvars}
        return [i for i, v in enumerate(jaxpr.invars[: len(leaves)]) if id(v) in read]

    def _merge(self, leaves, indices):
        full = list(self.abstract)
        for i, x in zip(indices, leaves):
            full[i] = x
        return nnx.merge(self.graphdef, jax.tree_util.tree_unflatten(self.treedef, full))

    def params(self, state) -> list:
        """The leaves of ``state`` the LM head reads (the programs' ``head`` argument)."""
        leaves = jax.tree_util.tree_leaves(state)
        return [leaves[i] for i in self.used]

    def logits(self, head: list, hidden: jax.Array, *, vocab_major: bool = False) -> jax.Array:
        """hidden [R, hidden] -> logits [R, V] float32 ([V, R] when ``vocab_major``)."""
        logits = self._merge(head, self.used).compute_logits(hidden, vocab_major=vocab_major)
        if self.mesh is not None:
            # Tensor parallel: the LM head is split by vocabulary, so each device computes its
            # slice of the logits, gathered once here (as vLLM does) so the sampler runs whole.
            # Both constraints: with the second alone XLA may gather the weight instead.
            split = PartitionSpec(TP_AXIS, None) if vocab_major else PartitionSpec(None, TP_AXIS)
            for spec in (split, PartitionSpec()):
                logits = jax.lax.with_sharding_constraint(logits, NamedSharding(self.mesh, spec))
        return logits

    def greedy_tokens(self, head: list, hidden: jax.Array) -> jax.Array:
        """hidden [R, hidden] -> [R] int32: the first maximum of each row's raw logits (the
        first NaN if any). On a one-device CPU engine whose bf16 LM head is a plain matrix
        (``float_lm_head``), one kernel keeps each row's first maximum as it sums
        (``amx.out_major_first_max``): the same f32 sums, no ``[V, R]`` logits written and
        read back. Else the vocab-major logits, then their argmax."""

        def from_logits(h, w=None):  # [R, hidden] -> [R]; w: platform_dependent's operand
            return _replicated(
                sample_greedy_vocab_major(self.logits(head, h, vocab_major=True)), self.mesh
            )

        float_lm_head = getattr(self._merge(head, self.used), "float_lm_head", None)
        w = None if self.mesh is not None or float_lm_head is None else float_lm_head()
        if w is None or hidden.ndim != 2 or not amx.out_major_applies(hidden.shape[0], w):
            return from_logits(hidden)
        return jax.lax.platform_dependent(
            hidden,
            w,
            cpu=lambda h, w: amx.out_major_first_max(h.astype(w.dtype), w),
            default=from_logits,
        )


def _replicated(x, mesh):
    return (
        x
        if mesh is None
        else jax.lax.with_sharding_constraint(x, NamedSharding(mesh, PartitionSpec()))
    )


# ---- inputs ------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class SampleInputs:
    """Per sampled row of a ``sample[S]`` step (numpy on the host, jax arrays inside)."""

    slots: np.ndarray  # [S] int32 sampling-state slot (padding: the neutral slot)
    num_output_tokens: np.ndarray  # [S] int32 outputs so far (those of the step in flight included)
    num_history_tokens: np.ndarray  # [S] int32 prompt + outputs so far (the same)
    num_logprobs: np.ndarray  # [S] int32 logprobs asked for, -1: none
    samples: np.ndarray  # [S] bool: the row keeps its token (not a partial prefill)

    @classmethod
    def empty(cls, num_rows: int, neutral_slot: int) -> SampleInputs:
        return cls(
            slots=np.full(num_rows, neutral_slot, np.int32),
            num_output_tokens=np.zeros(num_rows, np.int32),
            num_history_tokens=np.zeros(num_rows, np.int32),
            num_logprobs=np.full(num_rows, -1, np.int32),
            samples=np.zeros(num_rows, bool),
        )


@dataclasses.dataclass(frozen=True)
class VerifyInputs:
    """Per scored position of a ``verify[P]`` step: a row's last confirmed token, then its drafts."""

    slots: np.ndarray  # [P] int32 its request's slot (padding: the neutral slot)
    num_output_tokens: np.ndarray  # [P] int32 the row's outputs + the position's offset
    num_history_tokens: np.ndarray  # [P] int32 the row's tokens so far (without its drafts)
    num_logprobs: np.ndarray  # [P] int32, -1: none
    drafts: np.ndarray  # [P] int32 the draft the position checks, PAD: none
    prior_drafts: np.ndarray  # [P, k] int32 the row's drafts before the position, PAD
    offsets: np.ndarray  # [P] int32 the position's offset in its row (0: first)
    samples: np.ndarray  # [P] bool: a real position of a sampling row
    row_last: np.ndarray  # [R] int32 each batch row's last (bonus) position, -1: none

    @classmethod
    def empty(
        cls, num_positions: int, num_drafts: int, num_rows: int, neutral_slot: int
    ) -> VerifyInputs:
        p = num_positions
        return cls(
            slots=np.full(p, neutral_slot, np.int32),
            num_output_tokens=np.zeros(p, np.int32),
            num_history_tokens=np.zeros(p, np.int32),
            num_logprobs=np.full(p, -1, np.int32),
            drafts=np.full(p, PAD_TOKEN_ID, np.int32),
            prior_drafts=np.full((p, num_drafts), PAD_TOKEN_ID, np.int32),
            offsets=np.zeros(p, np.int32),
            samples=np.zeros(p, bool),
            row_last=np.full(num_rows, -1, np.int32),
        )


@dataclasses.dataclass(frozen=True)
class PromptLogprobsInputs:
    targets: np.ndarray  # [T] int32 the next prompt token of each token, -1: none


@dataclasses.dataclass(frozen=True)
class PromptLogprobs:
    """What ``prompt_logprobs[T]`` returns (device arrays; fetched when a row asked)."""

    logprob: jax.Array  # [T] float32 of each token's target
    rank: jax.Array  # [T] int32 the target's rank
    topk_ids: jax.Array  # [T, K] int32
    topk_logprobs: jax.Array  # [T, K] float32


jax.tree_util.register_dataclass(
    PromptLogprobs, data_fields=["logprob", "rank", "topk_ids", "topk_logprobs"], meta_fields=[]
)


def spec_of(record) -> PackSpec:
    return pack_record(record)[1]


# ---- the programs ------------------------------------------------------------------------------


def _append_history(state: SamplingState, slots, positions, tokens, keep) -> SamplingState:
    """history[slot, position] = token where ``keep`` (the sampled tokens, in place)."""
    rows = jnp.where(keep, slots, state.num_slots)
    return dataclasses.replace(
        state, history=state.history.at[rows, positions].set(tokens, mode="drop")
    )


def first_rows(selected: jax.Array, n: int) -> jax.Array:
    """selected [P, hidden] -> its first n rows. One row of several goes through an
    optimization barrier: XLA:GPU in jaxlib 0.10.2 fails to compile a slice of one row fused
    into the LM head's dot ("Reshape input and output shapes must be the same, got 1x16 ->
    16x8", deviceless H200; jaxlib 0.12 compiles it). The barrier costs a copy of one row."""
    rows = selected[:n]
    return jax.lax.optimization_barrier(rows) if n == 1 and selected.shape[0] > 1 else rows


def build_greedy_fn(head: LogitsHead, *, num_rows: int):
    """``greedy(head_params, selected [P, hidden], last_sampled [R]) -> (last_sampled, tokens [S])``."""

    def greedy(head_params, selected, last_sampled):
        tokens = head.greedy_tokens(head_params, first_rows(selected, num_rows))  # [S]
        rows = min(num_rows, last_sampled.shape[0])
        return jax.lax.dynamic_update_slice(last_sampled, tokens[:rows], (0,)), tokens

    return greedy


def build_sample_fn(
    head: LogitsHead, *, num_rows: int, num_logprobs: int, logprobs_mode: str, neutral_slot: int
):
    """``sample(head_params, selected, state, last_sampled, packed) -> (state, last_sampled,
    SamplerOutput)`` over S = ``num_rows`` rows."""
    spec = spec_of(SampleInputs.empty(num_rows, neutral_slot))

    def sample_rows(head_params, selected, state, last_sampled, packed):
        x = unpack_record(packed, spec, SampleInputs)
        logits = head.logits(head_params, first_rows(selected, num_rows))  # [S, V]
        rows = SamplingRows(
            state=state,
            slots=x.slots,
            num_output_tokens=x.num_output_tokens,
            num_history_tokens=x.num_history_tokens,
            num_logprobs=x.num_logprobs,
            prior_drafts=jnp.zeros((num_rows, 0), jnp.int32),
        )
        out = jax.tree.map(
            lambda a: _replicated(a, head.mesh),
            sample(logits, rows, num_logprobs=num_logprobs, logprobs_mode=logprobs_mode),
        )
        state = _append_history(
            state, x.slots, x.num_history_tokens, out.sampled_token_ids, x.samples
        )
        rows_ = min(num_rows, last_sampled.shape[0])
        last_sampled = jax.lax.dynamic_update_slice(
            last_sampled, out.sampled_token_ids[:rows_], (0,)
        )
        return state, last_sampled, out

    return sample_rows


def build_verify_fn(
    head: LogitsHead,
    *,
    num_positions: int,
    num_drafts: int,
    num_rows: int,
    num_logprobs: int,
    logprobs_mode: str,
    neutral_slot: int,
):
    """``verify(head_params, selected, state, last_sampled, packed) -> (state, last_sampled,
    SamplerOutput, accepted [P] bool)`` over P = ``num_positions`` scored positions.

    A position's token is kept when every draft before it in its row was accepted (its
    predecessors' ``accepted``); kept tokens are appended to the slot's history, and each
    row's last position's token goes to ``last_sampled``.
    """
    spec = spec_of(VerifyInputs.empty(num_positions, num_drafts, num_rows, neutral_slot))

    def verify(head_params, selected, state, last_sampled, packed):
        x = unpack_record(packed, spec, VerifyInputs)
        logits = head.logits(head_params, first_rows(selected, num_positions))  # [P, V]
        rows = SamplingRows(
            state=state,
            slots=x.slots,
            num_output_tokens=x.num_output_tokens,
            num_history_tokens=x.num_history_tokens,
            num_logprobs=x.num_logprobs,
            prior_drafts=x.prior_drafts,
        )
        out, accepted = sample_and_verify(
            logits, rows, x.drafts, num_logprobs=num_logprobs, logprobs_mode=logprobs_mode
        )
        out = jax.tree.map(lambda a: _replicated(a, head.mesh), out)
        accepted = _replicated(accepted, head.mesh)
        # kept: no rejection among the row's earlier positions (they are contiguous)
        rejected = (~accepted).astype(jnp.int32)
        before = jnp.cumsum(rejected) - rejected  # exclusive
        first = jnp.arange(num_positions, dtype=jnp.int32) - x.offsets
        kept = x.samples & (before == before[jnp.clip(first, 0, num_positions - 1)])
        state = _append_history(
            state, x.slots, x.num_history_tokens + x.offsets, out.sampled_token_ids, kept
        )
        last = jnp.where(
            x.row_last >= 0, out.sampled_token_ids[jnp.maximum(x.row_last, 0)], last_sampled
        )
        return state, last, out, accepted

    return verify


def build_prompt_logprobs_fn(head: LogitsHead, *, num_tokens: int, num_logprobs: int):
    """``prompt_logprobs(head_params, hidden [T, hidden], packed) -> PromptLogprobs``: raw
    logprobs (vLLM's prompt logprobs are always raw) of each token's target."""
    spec = spec_of(PromptLogprobsInputs(targets=np.zeros(num_tokens, np.int32)))

    def prompt_logprobs(head_params, hidden, packed):
        x = unpack_record(packed, spec, PromptLogprobsInputs)
        logits = head.logits(head_params, hidden)  # [T, V]
        k = min(num_logprobs, logits.shape[1])
        lp, rank, ids, lps = compute_logprobs(logits, jnp.maximum(x.targets, 0), k)
        return jax.tree.map(lambda a: _replicated(a, head.mesh), PromptLogprobs(lp, rank, ids, lps))

    return prompt_logprobs


# ---- host side: logprobs of the fetched results -----------------------------------------------


def row_logprobs(out: SamplerOutput, row: int, k: int) -> tuple[list[int], list[float], list[int]]:
    """A sampled token's TokenLogprobs from the fetched ``SamplerOutput`` (numpy arrays): (ids,
    logprobs, ranks), the sampled token first, then the top k."""
    ids = out.logprob_token_ids[row, : k + 1].tolist()
    lps = out.logprobs[row, : k + 1].tolist()
    ranks = [int(out.sampled_rank[row])] + list(range(1, k + 1))
    return ids, lps, ranks


def prompt_row(
    out: PromptLogprobs, token: int, target: int, k: int
) -> tuple[list[int], list[float], list[int]]:
    """TokenLogprobs of one prompt position (``out``: the fetched ``PromptLogprobs``, numpy
    arrays): its target (the next prompt token), then top k."""
    ids = [int(target)] + out.topk_ids[token, :k].tolist()
    lps = [float(out.logprob[token])] + out.topk_logprobs[token, :k].tolist()
    ranks = [int(out.rank[token])] + list(range(1, k + 1))
    return ids, lps, ranks


__all__ = [
    "LogitsHead",
    "SampleInputs",
    "VerifyInputs",
    "PromptLogprobsInputs",
    "PromptLogprobs",
    "SamplerOutput",
    "build_greedy_fn",
    "build_sample_fn",
    "build_verify_fn",
    "build_prompt_logprobs_fn",
    "row_logprobs",
    "prompt_row",
]
