"""The jitted step: block-table diff -> zero new blocks -> slot mapping -> model -> sampler.

Everything the host sends arrives packed in one int32 array (``packing``); everything the
host needs comes back packed in one int32 array. KV buffers and block tables are donated, and
so is ``last_sampled`` [R]: each step's sampled tokens by batch row, which the next step reads
(``prev_rows``) for tokens the host does not have yet (async scheduling).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from jaxkv.worker import kv_memory
from jaxkv.worker.block_table import BlockTableOpsLayout, apply_block_table_ops
from jaxkv.worker.packing import PackSpec, pack_device, unpack
from jaxkv.worker.pooler import pool_outputs
from jaxkv.worker.sampling_metadata import PAD_TOKEN_ID
from jaxkv.models.sharding import TP_AXIS
from jaxkv.pallas_kernels import PAD_SLOT_ID, AttentionMetadata


@dataclasses.dataclass(frozen=True)
class StepShape:
    """Static shape of one step; every distinct value is one compile."""

    num_tokens: int          # T
    num_seqs: int            # S
    width: int               # B: block-table columns (the full width; attention loops to seq_len)
    max_q_len: int           # 1 for a pure-decode step, else T
    inputs: PackSpec         # layout of the packed host->device buffer
    ops: BlockTableOpsLayout # layout of the block-table diff inside it
    sampling_treedef: object # pytree structure of the sampling metadata (its static flags)
    prompt_logprobs: int     # top-k of prompt logprobs (-1: none requested this step)
    spec_positions: int = 0  # P: positions scored against drafts (0: no speculative decoding)
    pooling: int = 0         # pooler.POOL_NONE / POOL_ROWS / POOL_ALL: pooling requests' outputs


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


def build_step_fn(graphdef, *, binding, page_bytes: int, sample_fn, prompt_logprobs_fn,
                  out_specs: dict, spec_sample_fn=None, gather_rows=None):
    """Returns ``step(state, buffers, tables, last_sampled, packed, *, shape)`` to be jitted by
    the caller; it returns ``(buffers, tables, last_sampled, packed_out)``.

    The packed output's layout is recorded in ``out_specs[shape]`` when a shape is traced
    (it depends only on the static shape), so the host can unpack the one array it fetches.
    """

    def step(state, buffers, tables, last_sampled, packed, *, shape: StepShape):
        # last_sampled: [R] int32, the previous step's sampled token of each of its rows
        x = unpack(packed, shape.inputs)
        tables = apply_block_table_ops(tables, x["block_ops"], layout=shape.ops)
        if x["zero_blocks"].shape[0]:
            buffers = kv_memory.zero_blocks_all(buffers, x["zero_blocks"], page_bytes=page_bytes,
                                                cpu_kernel=binding.cpu_kernels, mesh=binding.mesh)
        num_seqs = x["num_seqs"][0]
        qsl = x["query_start_loc"]                        # [S + 1]
        num_computed = x["num_computed"]                  # [S]
        q_len = qsl[1:] - qsl[:-1]
        seq_lens = jnp.where(q_len > 0, num_computed + q_len, 0)
        seq, positions, valid = token_positions(qsl, num_computed, num_seqs, shape.num_tokens)
        mds = []
        for table in tables:
            bt = table[: shape.num_seqs, : shape.width]   # [S, B]
            mds.append(AttentionMetadata(
                seq_lens=seq_lens, query_start_loc=qsl, block_tables=bt,
                slot_mapping=slot_mapping(bt, seq, positions, valid, binding.block_size),
                num_seqs=num_seqs, max_q_len=shape.max_q_len))
        model = nnx.merge(graphdef, state)

        def logits_of(h, vocab_major):   # h [R, hidden] -> [R, V] float32, or [V, R] vocab-major
            logits = model.compute_logits(h, vocab_major=vocab_major)
            if binding.mesh is not None:
                # Tensor parallel: the LM head is split by vocabulary, so each device computes
                # its slice of the logits, gathered once here (as vLLM does) so the sampler runs
                # whole. Both constraints: with the second alone XLA may gather the weight instead.
                split = PartitionSpec(TP_AXIS, None) if vocab_major else PartitionSpec(None, TP_AXIS)
                for spec in (split, PartitionSpec()):
                    logits = jax.lax.with_sharding_constraint(logits, NamedSharding(binding.mesh, spec))
            return logits
        prev_rows = x["prev_rows"]                        # [T] row of last_sampled, or -1
        input_ids = jnp.where(prev_rows >= 0, last_sampled[jnp.maximum(prev_rows, 0)], x["input_ids"])
        hidden, buffers = model(input_ids, positions, tuple(buffers), tuple(mds), binding)
        last = jnp.maximum(qsl[1:] - 1, 0)                # [S] last scheduled token of each seq
        h_last = hidden[last]                             # [S, hidden]
        sampling = jax.tree_util.tree_unflatten(
            shape.sampling_treedef, [x[f"sampling_{i}"] for i in range(shape.sampling_treedef.num_leaves)])
        if sampling.reads_pending:
            # A row's token sampled by the step in flight is not in its host history yet; it
            # is this step's input read from last_sampled, so the penalties count it (and bad
            # words match it) here.
            from_prev = jnp.where(valid & (prev_rows >= 0), input_ids, PAD_TOKEN_ID)          # [T]
            pending = jax.ops.segment_max(from_prev, seq, num_segments=shape.num_seqs)        # [S]
            sampling = dataclasses.replace(
                sampling, pending_token_ids=jnp.maximum(pending, PAD_TOKEN_ID).astype(jnp.int32))
        if shape.spec_positions:
            # Speculative decoding: P scored positions, each row's last confirmed token then
            # its drafts ("spec_index" [P]: the token; "spec_row" / "spec_offset" [P]: its row
            # and output offset; "spec_drafts" [P]: the draft it checks, -1 for none).
            h_pos = hidden[x["spec_index"]]                          # [P, hidden]
            md_pos = gather_rows(sampling, x["spec_row"], x["spec_offset"], x["spec_drafts"])
            out = spec_sample_fn(functools.partial(logits_of, h_pos), md_pos, x["spec_drafts"])
            last_token = out["sampled_token_ids"][x["spec_last"]]    # [S] each row's last position
        else:
            # logits [S, V] float32, or [V, S] when the sampler asks for them vocab-major
            out = sample_fn(functools.partial(logits_of, h_last), sampling)
            last_token = out["sampled_token_ids"]
        if shape.prompt_logprobs >= 0:
            all_logits = logits_of(hidden, False)         # [T, V]
            out.update(prompt_logprobs_fn(all_logits, x["prompt_targets"], shape.prompt_logprobs))
        if shape.pooling:
            out.update(pool_outputs(hidden, seq, valid, qsl, shape.pooling))
        packed_out, out_specs[shape] = pack_device(out)
        if binding.mesh is not None and binding.mesh.is_multi_process:
            # every process reads the results from its own shard: they must be whole there
            packed_out = jax.lax.with_sharding_constraint(
                packed_out, NamedSharding(binding.mesh, PartitionSpec()))
        rows = min(shape.num_seqs, last_sampled.shape[0])
        last_sampled = jax.lax.dynamic_update_slice(last_sampled, last_token[:rows], (0,))
        return buffers, tables, last_sampled, packed_out

    return step
