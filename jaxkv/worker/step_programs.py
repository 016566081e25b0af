"""The runner's programs: which exist for its configuration, and how each is built.

:func:`buckets_for` fixes the sizes programs are keyed by (a function of the engine's limits
only); :func:`build_program` turns a ``ProgramKey`` into the function, the arguments it donates
and abstract arguments to compile it with (``jaxkv.worker.program_set``). The same builders
serve the engine's warm-up and its memory profile, and the deviceless GPU tier compiles them
for a GPU this machine does not have (``jaxkv.gpu_aot``).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import numpy as np
from flax import nnx

from jaxkv.worker import kv_memory
from jaxkv.worker.block_table import apply_block_table_ops
from jaxkv.worker.buckets import pow2_buckets, token_buckets
from jaxkv.worker.collect import StepOutputs
from jaxkv.worker.forward import ForwardDims, build_forward_fn
from jaxkv.worker.heads import (
    PromptLogprobsInputs,
    SampleInputs,
    VerifyInputs,
    build_greedy_fn,
    build_prompt_logprobs_fn,
    build_sample_fn,
    build_verify_fn,
    spec_of,
)
from jaxkv.worker.packing import pack_record, unpack_record
from jaxkv.worker.program_set import (
    FORWARD,
    GREEDY,
    PROMPT_LOGPROBS,
    SAMPLE,
    SAMPLING_UPDATE,
    TABLE_OPS,
    VERIFY,
    ZERO_PAGES,
    Program,
    ProgramKey,
)
from jaxkv.worker.sampling_state import SamplingStateUpdate, apply_update
from jaxkv.worker.sampling_updates import empty_update


@dataclasses.dataclass(frozen=True)
class Buckets:
    """The sizes programs are keyed by.

    ``tokens`` (F): every power of two up to ``max_num_seqs`` (a decode step of n rows has n
    tokens) and ``token_buckets(min_token_bucket, max_num_batched_tokens)`` (powers of two and
    their 1.5x midpoints: a step wastes at most a third of its tokens on padding).
    ``seqs`` (Q): powers of two up to ``max_num_seqs``, plus it. ``spec`` (V): scored positions
    of a step with drafts, powers of two up to ``min(max_num_seqs (k + 1), max_num_batched_tokens)``
    (empty without speculative decoding).
    """

    tokens: tuple[int, ...]
    seqs: tuple[int, ...]
    spec: tuple[int, ...] = ()

    @property
    def num_sampled(self) -> int:
        """P: hidden rows the forward hands the sampling programs (the largest S or P)."""
        return max(self.seqs[-1], self.spec[-1] if self.spec else 0)


def buckets_for(
    *,
    max_num_seqs: int,
    max_num_batched_tokens: int,
    num_speculative_tokens: int = 0,
    min_token_bucket: int = 16,
) -> Buckets:
    seqs = pow2_buckets(1, max_num_seqs)
    tokens = sorted(
        set(seqs)
        | set(token_buckets(min(min_token_bucket, max_num_batched_tokens), max_num_batched_tokens))
    )
    spec = ()
    if num_speculative_tokens:
        spec = pow2_buckets(
            1, min(max_num_seqs * (num_speculative_tokens + 1), max_num_batched_tokens)
        )
    return Buckets(tokens=tuple(tokens), seqs=tuple(seqs), spec=tuple(spec))


def abstract(tree):
    """Every array leaf as a ShapeDtypeStruct with its sharding if it is committed to one
    (an uncommitted array, ``jnp.zeros`` on the default device, follows the others as in the
    engine's own call); abstract leaves stay."""

    def leaf(x):
        if isinstance(x, jax.ShapeDtypeStruct):
            return x
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding if x.committed else None)

    return jax.tree.map(leaf, tree)


def _packed(record) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct((spec_of(record).size,), np.int32)


def forward_dims(runner, num_tokens: int, *, greedy: bool = True) -> ForwardDims:
    return ForwardDims.for_tokens(
        num_tokens,
        max_num_seqs=runner.max_num_seqs,
        block_size=runner.block_size,
        num_groups=runner.num_groups,
        num_sampled=runner.buckets.num_sampled,
        ops=runner.ops_layout,
        greedy=greedy,
    )


def forward_program(
    runner, num_tokens: int, *, binding=None, buffers=None, greedy: bool = True, model=None
) -> Program:
    """``forward[T]`` of ``runner`` (``greedy=False``: without the greedy head, which needs
    ``runner.head``). ``model``: a ``(graphdef, state)`` pair instead of the runner's own
    (:func:`portable_model`)."""
    graphdef, state = model or (runner.graphdef, runner.state)
    binding = binding or runner.binding
    buffers = abstract(runner.buffers if buffers is None else buffers)
    dims = forward_dims(runner, num_tokens, greedy=greedy)
    fn = build_forward_fn(
        graphdef,
        binding=binding,
        page_bytes=runner.page_bytes,
        dims=dims,
        head=runner.head if dims.greedy_rows else None,
    )
    # The weights go in as a flat tuple of arrays (``state_leaves``), not as the nnx.State:
    # flattening a State calls Python for each of its Variables on every call (a few hundred
    # for a small model, ~1 ms of a decode step's dispatch); a tuple flattens in C++.
    leaves, treedef = jax.tree.flatten(state)

    def flat_fn(state_leaves, *rest):
        return fn(jax.tree.unflatten(treedef, state_leaves), *rest)

    state, tables, last = (
        abstract(tuple(leaves)),
        abstract(runner.tables),
        abstract(runner.last_sampled),
    )
    return Program(
        flat_fn, (1, 2, 3), lambda: (state, buffers, tables, last, _packed(dims.empty()))
    )


def state_leaves(state) -> tuple:
    """The weights as ``forward[T]`` takes them: the State's array leaves, in order."""
    return tuple(jax.tree.leaves(state))


def portable_model(runner) -> tuple:
    """``(graphdef, state)`` of ``runner``'s model as a GPU or TPU would load it: a CPU
    engine's packed bf16 linears (``jaxkv.models.cpu_layout``) unpacked again."""
    from jaxkv.models.cpu_layout import unpack_linears  # lazy: the engine depends on models

    model = nnx.merge(runner.graphdef, runner.state)
    portable = unpack_linears(model)
    if portable is model:
        return runner.graphdef, runner.state
    return nnx.split(portable)


def build_program(runner, key: ProgramKey, *, binding=None, buffers=None, model=None) -> Program:
    """The program ``key`` of ``runner`` (a ``ModelRunner``). ``binding`` / ``buffers``
    (abstract) / ``model`` (``(graphdef, state)``) replace the runner's own: the deviceless
    GPU tier compiles the Pallas kernels' variant for KV buffers of a real GPU's size, and
    the model as the GPU would load it (:func:`portable_model`)."""
    kind, size = key.kind, key.size
    if kind == FORWARD:
        return forward_program(runner, size, binding=binding, buffers=buffers, model=model)
    binding = binding or runner.binding
    buffers = abstract(runner.buffers if buffers is None else buffers)
    if kind == TABLE_OPS:
        fn = functools.partial(apply_block_table_ops, layout=runner.ops_layout)
        ops = jax.ShapeDtypeStruct((runner.ops_layout.size,), np.int32)
        return Program(fn, (0,), lambda: (abstract(runner.tables), ops))
    if kind == ZERO_PAGES:
        fn = functools.partial(
            kv_memory.zero_blocks_all,
            page_bytes=runner.page_bytes,
            cpu_kernel=binding.cpu_kernels,
            mesh=runner.mesh,
        )
        ids = jax.ShapeDtypeStruct((runner.zero_chunk,), np.int32)
        return Program(fn, (0,), lambda: (buffers, ids))
    sampling = abstract(runner.sampling_state)
    if kind == SAMPLING_UPDATE:
        spec = update_spec(runner)

        def update(state_, packed):
            return apply_update(state_, unpack_record(packed, spec, SamplingStateUpdate))

        return Program(
            update, (0,), lambda: (sampling, jax.ShapeDtypeStruct((spec.size,), np.int32))
        )
    # the programs after the forward: the LM head's parameters and the forward's hidden states
    head = abstract(runner.head_params)
    last = abstract(runner.last_sampled)
    selected = jax.ShapeDtypeStruct(
        (runner.buckets.num_sampled, runner.hidden_size), runner.hidden_dtype
    )
    common = dict(
        num_logprobs=runner.num_logprobs,
        logprobs_mode=runner.logprobs_mode,
        neutral_slot=runner.neutral_slot,
    )
    if kind == GREEDY:
        return Program(
            build_greedy_fn(runner.head, num_rows=size), (2,), lambda: (head, selected, last)
        )
    if kind == SAMPLE:
        fn = build_sample_fn(runner.head, num_rows=size, **common)
        packed = _packed(SampleInputs.empty(size, runner.neutral_slot))
        return Program(fn, (2, 3), lambda: (head, selected, sampling, last, packed))
    if kind == VERIFY:
        fn = build_verify_fn(
            runner.head,
            num_positions=size,
            num_drafts=runner.num_speculative_tokens,
            num_rows=runner.max_num_seqs,
            **common,
        )
        packed = _packed(
            VerifyInputs.empty(
                size, runner.num_speculative_tokens, runner.max_num_seqs, runner.neutral_slot
            )
        )
        return Program(fn, (2, 3), lambda: (head, selected, sampling, last, packed))
    if kind == PROMPT_LOGPROBS:
        fn = build_prompt_logprobs_fn(
            runner.head, num_tokens=size, num_logprobs=runner.num_logprobs
        )
        h = jax.ShapeDtypeStruct((size, runner.hidden_size), runner.hidden_dtype)
        packed = _packed(PromptLogprobsInputs(targets=np.zeros(size, np.int32)))
        return Program(fn, (), lambda: (head, h, packed))
    raise ValueError(f"unknown program {key}")


def update_spec(runner):
    """The packed layout of one ``SamplingStateUpdate`` of the runner's capacities."""
    return pack_record(
        SamplingStateUpdate(**empty_update(runner.update_slots, runner.update_entries))
    )[1]


def dispatch_heads(runner, plan, hidden, selected, forward_tokens) -> StepOutputs:
    """Starts the head programs a step's ``plan`` needs after its forward (sampling or
    verification, prompt logprobs) on ``hidden`` [T, hidden] and ``selected`` (the rows the
    head reads); returns the device arrays to fetch (``forward_tokens``: the forward's own
    greedy tokens, used when it took them). The runner's sampling state and last sampled
    tokens are replaced as each program returns them."""
    head = runner.head_params
    tokens = accepted = logprobs = prompt = None
    if plan.head in (SAMPLE, VERIFY):
        runner.sampling_state, runner.last_sampled, *out = runner._run(
            plan.head,
            plan.head_size,
            head,
            selected,
            runner.sampling_state,
            runner.last_sampled,
            runner._to_device(plan.head_inputs),
        )
        tokens = out[0].sampled_token_ids
        logprobs = out[0] if plan.want_logprobs else None
        accepted = out[1] if plan.head == VERIFY else None
    elif plan.greedy_in_forward:
        tokens = forward_tokens
    elif plan.head:
        runner.last_sampled, tokens = runner._run(
            plan.head, plan.head_size, head, selected, runner.last_sampled
        )
    if plan.prompt_targets is not None:
        targets = runner.placement.to_device(plan.prompt_targets)
        prompt = runner._run(PROMPT_LOGPROBS, plan.num_tokens, head, hidden, targets)
    return StepOutputs(
        tokens=tokens,
        accepted=accepted,
        logprobs=logprobs,
        prompt=prompt,
        hidden=hidden if plan.pool_rows else None,
    )
