"""Bringing the device side of the runner's persistent batch up to date before a step: the
sampling slots of requests that entered the batch, the block-table diff, and pages to zero.

Each runs a fixed-size program of the runner (``jaxkv.worker.step_programs``): what does not
fit the step's own forward inputs runs before it, in chunks of the same capacity.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from jaxkv.worker.program_set import SAMPLING_UPDATE, TABLE_OPS, ZERO_PAGES
from jaxkv.worker.sampling_state import SamplingStateUpdate
from jaxkv.worker.sampling_updates import build_updates


def write_slots(runner) -> None:
    """Writes the sampling slots of the requests that entered the batch this step."""
    inits = runner.persistent.take_slot_inits()
    for update in build_updates(
        inits,
        num_updates=runner.update_slots,
        num_entries=runner.update_entries,
        eos_token_id=runner.eos_token_id,
    ):
        packed = runner._to_device(SamplingStateUpdate(**update))
        runner.sampling_state = runner._run(SAMPLING_UPDATE, 0, runner.sampling_state, packed)


def apply_table_ops(runner, chunks: Sequence[np.ndarray]) -> None:
    """Applies encoded block-table op chunks to the device tables, one program call each."""
    for ops in chunks:
        runner.tables = runner._run(TABLE_OPS, 0, runner.tables, runner.placement.to_device(ops))


def zero_pages(runner, zero_ids: Sequence[int]) -> None:
    """Zeroes pages outside a step, ``runner.zero_chunk`` at a time."""
    for i in range(0, len(zero_ids), runner.zero_chunk):
        ids = np.full(runner.zero_chunk, -1, np.int32)
        part = zero_ids[i : i + runner.zero_chunk]
        ids[: len(part)] = part
        runner.buffers = runner._run(ZERO_PAGES, 0, runner.buffers, runner.placement.to_device(ids))


def sync_without_step(runner, zero_ids: Sequence[int]) -> None:
    """A step with nothing scheduled still applies its block-table ops and zeroes the pages it
    hands out (remote KV loads)."""
    if runner.stager.has_pending_ops():
        apply_table_ops(runner, runner.stager.encode_chunks(runner.ops_layout))
    if zero_ids:
        zero_pages(runner, zero_ids)


def stage_block_changes(runner, x, zero_ids: Sequence[int]) -> None:
    """Puts the step's block-table diff and pages to zero into its forward inputs ``x``
    (``ForwardInputs``); what does not fit runs first, on its own."""
    chunks = runner.stager.encode_chunks(runner.ops_layout)
    apply_table_ops(runner, chunks[:-1])
    x.block_ops[:] = chunks[-1]
    room = x.zero_blocks.shape[0]
    if len(zero_ids) > room:
        zero_pages(runner, zero_ids[room:])
        zero_ids = zero_ids[:room]
    x.zero_blocks[: len(zero_ids)] = zero_ids
