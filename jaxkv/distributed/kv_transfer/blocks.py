"""Which pages a transfer moves, as ``(group, index)`` positions of a request's block table.

A sender lists the positions it has pages for (``positions``: real blocks only; a sliding-window
group's blocks out of the window are the null block 0 and are skipped); the pages travel in
that order. The receiver maps each position to its own block id (``receiver_ids``), -1 where it
must not write: a local prefix-cache hit (shared with other requests, already valid), or a
position it has no block for. No jax here.
"""

from __future__ import annotations

from collections.abc import Sequence


def positions(
    block_ids: Sequence[Sequence[int]], num_blocks: int | None = None
) -> list[tuple[int, int]]:
    """``(group, index)`` of every real block among each group's first ``num_blocks`` (all
    when None), group by group."""
    out = []
    for g, ids in enumerate(block_ids):
        stop = len(ids) if num_blocks is None else min(num_blocks, len(ids))
        out.extend((g, i) for i in range(stop) if ids[i])
    return out


def ids_at(block_ids: Sequence[Sequence[int]], where: Sequence[tuple[int, int]]) -> list[int]:
    """The block ids at these positions."""
    return [block_ids[g][i] for g, i in where]


def receiver_ids(
    where: Sequence[Sequence[int]], block_ids: Sequence[Sequence[int]], first_index: int = 0
) -> list[int]:
    """For each sent position, the receiver's block there, or -1: before ``first_index`` (its
    own prefix hit), beyond its table, or its null block."""
    out = []
    for g, i in where:
        ids = block_ids[g] if g < len(block_ids) else ()
        out.append(ids[i] if first_index <= i < len(ids) and ids[i] else -1)
    return out


class RequestBlockTracker:
    """The scheduler side's view of some requests' block tables, kept from each step's
    ``SchedulerOutput`` as the worker keeps its own (new requests' block lists, running ones'
    appended blocks, resumed ones' replaced lists). A sliding-window group's blocks that left
    the window stay listed here (as on the worker): their pages are never read.
    """

    def __init__(self):
        self.block_ids: dict[str, list[list[int]]] = {}
        self.num_computed: dict[str, int] = {}  # tokens computed once the step has run

    def track(self, req_id: str) -> None:
        self.block_ids.setdefault(req_id, None)

    def forget(self, req_id: str) -> None:
        self.block_ids.pop(req_id, None)
        self.num_computed.pop(req_id, None)

    def update(self, so) -> list[str]:
        """Applies a step's schedule; returns the tracked requests scheduled in it."""
        if not self.block_ids:
            return []
        scheduled = []
        for new in so.scheduled_new_reqs:
            if new.req_id in self.block_ids:
                self.block_ids[new.req_id] = [list(ids) for ids in new.block_ids]
                self.num_computed[new.req_id] = (
                    new.num_computed_tokens + so.num_scheduled_tokens[new.req_id]
                )
                scheduled.append(new.req_id)
        cached = so.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            ids = self.block_ids.get(req_id)
            new_ids = cached.new_block_ids[i]
            if req_id not in self.block_ids or (
                ids is None and not cached.resumed_from_preemption[i]
            ):
                continue
            if cached.resumed_from_preemption[i]:
                self.block_ids[req_id] = [list(g) for g in new_ids]
            elif new_ids is not None:
                for g, more in enumerate(new_ids):
                    ids[g].extend(more)
            self.num_computed[req_id] = (
                cached.num_computed_tokens[i] + so.num_scheduled_tokens[req_id]
            )
            scheduled.append(req_id)
        return scheduled
