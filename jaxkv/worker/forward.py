"""The forward program: block-table diff -> zero new blocks -> slot mapping -> model -> hidden states.

One compiled program per token bucket T, whatever the step holds: per-request metadata is
padded to a fixed capacity (``S = min(T, max_num_seqs)`` rows: a step of T tokens never has
more), the block-table width is the full width, the block-table diff and the pages to zero
have fixed capacities (counts are data: padding entries are -1). It returns the final-normed
hidden states of every token (for prompt logprobs and pooling) and those of the positions the
step samples (``sample_index``, a fixed ``P`` of them), which the sampling program reads next,
on the device (``jaxkv.worker.heads``).

A forward of T <= ``max_num_seqs`` tokens also holds the greedy head over its first T sampled
positions, behind a ``lax.cond`` on the ``greedy`` input: a greedy decode step is then one
program instead of two (on a 2-core CPU the second dispatch cost ~1.3 ms of a 21 ms batch-64
decode step), with no program added to the set. A step whose sampled rows' bucket S is
smaller than T still runs ``greedy[S]`` after the forward (fewer LM-head rows).

Everything the host sends arrives packed in one int32 array (:class:`ForwardInputs`); KV
buffers and block tables are donated (updated in place). ``last_sampled`` [R] is read: the
previous step's sampled token of each batch row, for tokens the host does not have yet (async
scheduling: ``prev_rows``).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from jaxkv.pallas_kernels import PAD_SLOT_ID, AttentionMetadata
from jaxkv.worker import kv_memory
from jaxkv.worker.block_table import BlockTableOpsLayout, apply_block_table_ops
from jaxkv.worker.heads import build_greedy_fn
from jaxkv.worker.packing import PackSpec, pack_record, unpack_record


@dataclasses.dataclass(frozen=True)
class ForwardInputs:
    """What the host sends the forward program (numpy on the host, jax arrays inside)."""

    input_ids: np.ndarray  # [T] int32 (padding: 0)
    prev_rows: np.ndarray  # [T] int32: the ``last_sampled`` row holding this token, -1: input_ids
    query_start_loc: np.ndarray  # [S + 1] int32
    num_computed: np.ndarray  # [S] int32: tokens cached before this step, per row
    num_seqs: np.ndarray  # [1] int32: real rows
    block_ops: np.ndarray  # [ops.size] int32: the block-table diff (BlockTableStager.encode)
    zero_blocks: np.ndarray  # [Z] int32: pages to zero, -1 padded
    sample_index: np.ndarray  # [P] int32: the token of each sampled position (padding: 0)
    greedy: np.ndarray  # [1] int32: 1 = run the greedy head here (dims.greedy_rows > 0)


@dataclasses.dataclass(frozen=True)
class ForwardDims:
    """The fixed sizes of one forward program: every field but ``num_tokens`` follows from it
    and the engine's limits (``ForwardDims.for_tokens``)."""

    num_tokens: int  # T: the token bucket
    num_seqs: int  # S = min(T, max_num_seqs)
    num_zero: int  # Z: pages the step zeroes itself (more are zeroed before it)
    num_sampled: int  # P: hidden rows handed to the sampling program
    ops: BlockTableOpsLayout  # the block-table diff's capacities
    greedy_rows: int = 0  # G: rows of the greedy head inside the program (0: none)

    @classmethod
    def for_tokens(
        cls,
        num_tokens: int,
        *,
        max_num_seqs: int,
        block_size: int,
        num_groups: int,
        num_sampled: int,
        ops: BlockTableOpsLayout,
        greedy: bool = True,
    ) -> ForwardDims:
        """A step of T tokens runs at most S = min(T, max_num_seqs) rows, and a row's q new
        tokens need at most ceil(q / bs) new blocks per group: Z = groups * min(T, T // bs + S)
        pages to zero (Z = groups x S for a decode step). With ``greedy``, a bucket of
        T <= max_num_seqs tokens holds the greedy head over G = T rows."""
        s = min(num_tokens, max_num_seqs)
        return cls(
            num_tokens=num_tokens,
            num_seqs=s,
            num_zero=num_groups * min(num_tokens, num_tokens // block_size + s),
            num_sampled=num_sampled,
            ops=ops,
            greedy_rows=num_tokens
            if greedy and num_tokens <= min(max_num_seqs, num_sampled)
            else 0,
        )

    def empty(self) -> ForwardInputs:
        """Inputs of a step with no request in it (every entry padding); the host fills a copy."""
        t, s = self.num_tokens, self.num_seqs
        return ForwardInputs(
            input_ids=np.zeros(t, np.int32),
            prev_rows=np.full(t, -1, np.int32),
            query_start_loc=np.zeros(s + 1, np.int32),
            num_computed=np.zeros(s, np.int32),
            num_seqs=np.zeros(1, np.int32),
            block_ops=_no_ops(self.ops),
            zero_blocks=np.full(self.num_zero, -1, np.int32),
            sample_index=np.zeros(self.num_sampled, np.int32),
            greedy=np.zeros(1, np.int32),
        )

    @property
    def spec(self) -> PackSpec:
        return pack_record(self.empty())[1]


def _no_ops(layout: BlockTableOpsLayout) -> np.ndarray:
    """An encoded block-table diff that changes nothing (every entry PAD_ROW)."""
    moves = np.full(2 * layout.num_moves, -1, np.int32)
    clears = np.full(layout.num_clears, -1, np.int32)
    writes = np.zeros((layout.num_writes, 4), np.int32)
    writes[:, 1] = -1
    return np.concatenate([moves, clears, writes.ravel()])


def token_positions(query_start_loc, num_computed, num_seqs, num_tokens):
    """Per token: its sequence row, position and validity.

    query_start_loc: [S + 1] int32; num_computed: [S] int32 (tokens cached before this step).
    Returns seq [T] int32, positions [T] int32, valid [T] bool.
    Example: query_start_loc [0, 2, 5], num_computed [5, 0] -> seq [0, 0, 1, 1, 1],
    positions [5, 6, 0, 1, 2].
    """
    t = jnp.arange(num_tokens, dtype=jnp.int32)
    seq = jnp.searchsorted(query_start_loc[1:], t, side="right").astype(jnp.int32)
    seq = jnp.minimum(seq, num_computed.shape[0] - 1)
    valid = t < query_start_loc[num_seqs]
    positions = num_computed[seq] + t - query_start_loc[seq]
    return seq, jnp.where(valid, positions, 0), valid


def slot_mapping(block_table, seq, positions, valid, block_size):
    """slot = block_table[seq, pos // bs] * bs + pos % bs; padding tokens get PAD_SLOT_ID.

    block_table: [S, B] int32; seq, positions: [T] int32; valid: [T] bool -> [T] int32.
    """
    col = jnp.minimum(positions // block_size, block_table.shape[1] - 1)
    slots = block_table[seq, col] * block_size + positions % block_size
    return jnp.where(valid, slots, PAD_SLOT_ID).astype(jnp.int32)


def replicated(x: jax.Array, mesh) -> jax.Array:
    """``x`` whole on every device of ``mesh`` (every process reads results from its own shard)."""
    if mesh is None:
        return x
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, PartitionSpec()))


def build_forward_fn(graphdef, *, binding, page_bytes: int, dims: ForwardDims, head=None):
    """``forward(state, buffers, tables, last_sampled, packed) -> (buffers, tables, hidden
    [T, hidden], selected [P, hidden], last_sampled [R], tokens [G])`` for the sizes ``dims``
    (to be compiled by the caller, with ``buffers``, ``tables`` and ``last_sampled`` donated).

    With ``dims.greedy_rows`` = G > 0 (``head``: the ``jaxkv.worker.heads.LogitsHead``), a step
    whose ``greedy`` input is 1 also takes the argmax of its first G sampled positions (as
    ``greedy[G]``): ``tokens`` holds them and ``last_sampled`` is updated; otherwise both come
    back unchanged (``tokens`` zeros).
    """
    spec = dims.spec
    T, S, G = dims.num_tokens, dims.num_seqs, dims.greedy_rows
    if G and head is None:
        raise ValueError(f"a forward with greedy_rows={G} needs the LM head (head=None)")
    greedy = build_greedy_fn(head, num_rows=G) if G else None

    def forward(state, buffers, tables, last_sampled, packed):
        # last_sampled: [R] int32, the previous step's sampled token of each of its rows
        x = unpack_record(packed, spec, ForwardInputs)
        tables = apply_block_table_ops(tables, x.block_ops, layout=dims.ops)
        if dims.num_zero:
            buffers = kv_memory.zero_blocks_all(
                buffers,
                x.zero_blocks,
                page_bytes=page_bytes,
                cpu_kernel=binding.cpu_kernels,
                mesh=binding.mesh,
            )
        num_seqs = x.num_seqs[0]
        qsl = x.query_start_loc  # [S + 1]
        q_len = qsl[1:] - qsl[:-1]
        seq_lens = jnp.where(q_len > 0, x.num_computed + q_len, 0)
        seq, positions, valid = token_positions(qsl, x.num_computed, num_seqs, T)
        mds = []
        for table in tables:
            bt = table[:S]  # [S, B]
            mds.append(
                AttentionMetadata(
                    seq_lens=seq_lens,
                    query_start_loc=qsl,
                    block_tables=bt,
                    slot_mapping=slot_mapping(bt, seq, positions, valid, binding.block_size),
                    num_seqs=num_seqs,
                    max_q_len=T,
                )
            )
        model = nnx.merge(graphdef, state)
        prev = x.prev_rows  # [T] row of last_sampled, or -1
        input_ids = jnp.where(prev >= 0, last_sampled[jnp.maximum(prev, 0)], x.input_ids)
        hidden, buffers = model(input_ids, positions, tuple(buffers), tuple(mds), binding)
        hidden = replicated(hidden, binding.mesh)  # [T, hidden]
        selected = hidden[jnp.clip(x.sample_index, 0, T - 1)]  # [P, hidden]
        tokens = jnp.zeros((G,), jnp.int32)
        if G:
            last_sampled, tokens = jax.lax.cond(
                x.greedy[0] > 0,
                lambda: greedy(head.params(state), selected, last_sampled),
                lambda: (last_sampled, tokens),
            )
        return buffers, tables, hidden, selected, last_sampled, tokens

    return forward
