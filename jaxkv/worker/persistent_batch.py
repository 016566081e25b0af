"""The runner's persistent batch (vLLM's ``InputBatch`` kept across steps): which request holds
which row and which sampling-state slot, and what the worker remembers of each request.

``PersistentBatch.update`` applies a ``SchedulerOutput`` to it before a step: requests that
finished, were preempted or are not scheduled leave their row (and slot); new and resumed ones
take a free row and slot (their slot's sampling state is written by the step,
``take_slot_inits``); running ones get their new blocks.
"""

from __future__ import annotations

from jaxkv.core import SchedulerOutput
from jaxkv.core.errors import blame
from jaxkv.worker.collect import CachedRequestState
from jaxkv.worker.input_batch import InputBatch
from jaxkv.worker.pooler import PoolAccumulator
from jaxkv.worker.sampling_updates import SlotAllocator, SlotInit


class PersistentBatch:
    """Rows and sampling slots of the requests in the batch.

    Attributes:
      input_batch: the rows (token ids, block tables, per-row state).
      requests: ``req id -> CachedRequestState`` of every request the worker knows (running
        or not).
      slots: ``req id <-> slot`` of the device sampling state (``max_num_seqs`` slots).
      slot_inits: the slots to write this step (requests that entered the batch).
      handling: the request being set up (named by an error it raises).
    """

    def __init__(self, input_batch: InputBatch):
        self.input_batch = input_batch
        self.requests: dict[str, CachedRequestState] = {}
        self.slots = SlotAllocator(input_batch.max_num_reqs)
        self.slot_inits: dict[str, SlotInit] = {}
        self.handling: str | None = None

    def take_slot_inits(self) -> list[SlotInit]:
        """The slots to write for this step's entering requests (then forgotten)."""
        inits = list(self.slot_inits.values())
        self.slot_inits = {}
        return inits

    def clear(self, *, forget=()) -> None:
        """Every row and slot freed (after a failed step); the requests ``forget`` forgotten,
        the others keep their state and take rows again when next scheduled."""
        self.handling = None
        self.slot_inits = {}
        for req_id in forget:
            self.requests.pop(req_id, None)
        self.input_batch.clear()
        self.slots.clear()

    def _join(self, s: CachedRequestState, released: dict[str, int]) -> None:
        """Puts a request in a batch row and a sampling slot, to be written this step. A
        request that left its slot earlier in this step takes the same one back: a token the
        step in flight samples for it lands in that slot's history."""
        row = self.input_batch.add_request(
            s.req_id,
            s.token_ids[: s.num_prompt_tokens],
            s.block_ids,
            s.sampling_params,
            output_token_ids=s.token_ids[s.num_prompt_tokens :],
            num_computed_tokens=s.num_computed_tokens,
        )
        slot = self.slots.take(s.req_id, prefer=released.pop(s.req_id, None))
        self.slot_inits[s.req_id] = SlotInit(
            slot=slot,
            params=s.sampling_params,
            key_data=self.input_batch.request_keys[row],
            token_ids=s.token_ids,
            num_prompt_tokens=s.num_prompt_tokens,
        )

    def _leave(self, req_id: str, released: dict[str, int]) -> None:
        if self.input_batch.remove_request(req_id) is not None:
            self.slot_inits.pop(req_id, None)
            slot = self.slots.release(req_id)
            if slot is not None:
                released[req_id] = slot

    def update(self, so: SchedulerOutput) -> list[int]:
        """Applies the scheduler's decisions to the persistent batch; returns block ids to zero.

        As vLLM: finished requests are forgotten; preempted and unscheduled ones leave the
        batch (and their sampling slot) but keep their state; new and resumed ones take free
        rows and slots (a resumed request's block lists are replaced); running ones get their
        new blocks appended; then the batch is condensed so rows 0..n-1 are exactly this
        step's requests.
        """
        batch, released = self.input_batch, {}
        for req_id in so.finished_req_ids:
            self.requests.pop(req_id, None)
            self._leave(req_id, released)
        for req_id in so.preempted_req_ids:
            self._leave(req_id, released)
        for req_id in batch.req_ids:
            if req_id not in so.num_scheduled_tokens:
                self._leave(req_id, released)
        try:
            self._add_new_and_cached(so, released)
        except BaseException as exc:
            blame(exc, self.handling)
            raise
        batch.condense()
        return list(so.new_block_ids_to_zero)

    def _add_new_and_cached(self, so: SchedulerOutput, released: dict[str, int]) -> None:
        """``update`` for the scheduled requests (``_handling``: the one at hand)."""
        batch = self.input_batch
        for new in so.scheduled_new_reqs:
            self.handling = new.req_id
            s = CachedRequestState(
                req_id=new.req_id,
                token_ids=list(new.prompt_token_ids),
                num_prompt_tokens=len(new.prompt_token_ids),
                sampling_params=new.sampling_params,
                block_ids=[list(ids) for ids in new.block_ids],
                num_computed_tokens=new.num_computed_tokens,
            )
            if new.pooling_params is not None:
                s.pooling = PoolAccumulator(new.pooling_params, len(new.prompt_token_ids))
            self.requests[new.req_id] = s
            self._join(s, released)
        cached = so.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            self.handling = req_id
            s = self.requests[req_id]
            s.num_computed_tokens = cached.num_computed_tokens[i]
            new_ids = cached.new_block_ids[i]
            resumed = cached.resumed_from_preemption[i]
            if resumed:
                s.block_ids = [list(ids) for ids in new_ids]
                if req_id in cached.all_token_ids:  # the core's tokens: a token sampled by a
                    s.token_ids = list(cached.all_token_ids[req_id])  # step in flight at the
                    # preemption was dropped there, and is sampled again
            elif new_ids is not None:
                for g, ids in enumerate(new_ids):
                    s.block_ids[g].extend(ids)
            row = batch.req_id_to_index.get(req_id)
            if row is not None and not resumed:
                batch.num_computed_tokens_cpu[row] = s.num_computed_tokens
                if new_ids is not None and any(new_ids):
                    batch.append_block_ids(req_id, new_ids)
            else:
                self._leave(req_id, released)
                self._join(s, released)
        self.handling = None
