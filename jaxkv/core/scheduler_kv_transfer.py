"""The scheduler's KV-connector bookkeeping (``kv_connector``: the scheduler side of a
``jaxkv.distributed.kv_transfer`` connector).

A waiting request may get tokens from outside the engine beyond its local prefix hit:
loaded before the step (synchronous) or while it waits in ``WAITING_FOR_REMOTE_KVS`` holding
its blocks (asynchronous; a failed load frees them and the request recomputes, never asking
the connector again; a failed synchronous load recomputes from its first invalid block, see
``failed_loads``). Loaded blocks are never listed for zeroing. A finished request's blocks
may be kept until the workers report them sent.
"""

from __future__ import annotations

from jaxkv.core.request import Request, RequestStatus

_WAITING = RequestStatus.WAITING


class KVTransferMixin:
    """``Scheduler``'s state of loads and sends in flight (it reads and changes its state)."""

    def forget_kv_transfers(self, req_id: str | None = None) -> None:
        """Drops the KV-connector state of one request (None: of every request)."""
        for state in (self._remote_loads, self._sending, self._sync_loads):
            if req_id is None:
                state.clear()
            else:
                state.pop(req_id, None)
        for state in (
            self._recved,
            self._failed_loads,
            self._no_connector,
            self._recomputing,
            self._recomputing_news,
            self._sent_early,
        ):
            if req_id is None:
                state.clear()
            else:
                state.discard(req_id)

    def has_pending_kv_sends(self) -> bool:
        """Finished requests whose blocks are kept until the connector reports them sent."""
        return bool(self._sending)

    def num_waiting_for_remote_kvs(self) -> int:
        return len(self._remote_loads)

    def _loaded_block_ids(
        self, request: Request, num_local: int, num_external: int, out: set[int]
    ) -> None:
        """Adds to ``out`` the request's blocks that hold any of its external tokens."""
        span = range(
            num_local // self.block_size, -(-(num_local + num_external) // self.block_size)
        )
        for ids in self.kv_cache_manager.get_block_ids(request.request_id):
            out.update(ids[i] for i in span if i < len(ids) and ids[i])

    def _finish_remote_load(self, request: Request) -> bool | None:
        """A request in WAITING_FOR_REMOTE_KVS whose load ended becomes WAITING: loaded (True),
        with its loaded blocks computed (the last prompt token is always recomputed, to sample)
        and cached; failed (False), with its blocks freed, to recompute from scratch. None:
        still in flight."""
        req_id = request.request_id
        if req_id not in self._recved:
            return None
        self._recved.discard(req_id)
        num_local, num_loaded = self._remote_loads.pop(req_id)
        request.status = _WAITING
        if req_id in self._failed_loads:
            self._failed_loads.discard(req_id)
            self._no_connector.add(req_id)
            self.num_failed_kv_loads += 1
            self.kv_cache_manager.free(request)  # not cached: nothing stale is shared
            request.num_computed_tokens = 0
            return False
        num_computed = min(num_loaded, request.num_tokens)
        if num_computed == request.num_tokens:
            num_computed -= 1
        self.kv_cache_manager.cache_blocks(request, num_computed)
        self.num_external_computed_tokens += num_computed - num_local
        request.num_computed_tokens = num_computed
        return True

    def _update_from_kv_xfer(self, out) -> None:
        """A step's ``KVConnectorOutput``: loads ended (failed ones by their blocks), sends done."""
        self.connector.update_connector_output(out)
        if out.stats:
            self.kv_connector_stats = out.stats
        self._recved |= out.finished_recving & self._remote_loads.keys()
        if out.invalid_block_ids:
            bad = out.invalid_block_ids
            for req_id in self._remote_loads:
                if any(
                    b in bad for ids in self.kv_cache_manager.get_block_ids(req_id) for b in ids
                ):
                    self._failed_loads.add(req_id)
        for req_id in out.finished_sending:
            request = self._sending.pop(req_id, None)
            if request is not None:
                self.kv_cache_manager.free(request)
                del self.requests[req_id]
            elif req_id in self.requests:  # its offer ended before the step finished it
                self._sent_early.add(req_id)

    def _in_flight(self, req_id: str) -> bool:
        return any(req_id in so.num_scheduled_tokens for so, _ in self._uncommitted)

    def _take_recomputing(self) -> set[str]:
        """Requests sent back to recompute since the last schedule (for ``preempted_req_ids``)."""
        if not self._recomputing_news:
            return set()
        news, self._recomputing_news = self._recomputing_news, set()
        return news
