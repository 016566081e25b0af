"""A request as the scheduler sees it: tokens, progress, status and block hashes."""

from __future__ import annotations

import enum
import time
from collections.abc import Callable, Sequence

from jaxkv.core.block_hash import BlockHash
from jaxkv.pooling_params import PoolingParams
from jaxkv.sampling_params import SamplingParams


class RequestStatus(enum.IntEnum):
    """Request states, ordered so that ``status > PREEMPTED`` means finished (as vLLM)."""

    WAITING = enum.auto()
    WAITING_FOR_FSM = enum.auto()
    WAITING_FOR_REMOTE_KVS = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    # Finished states (keep them after PREEMPTED).
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH_CAPPED = enum.auto()
    FINISHED_ABORTED = enum.auto()
    FINISHED_IGNORED = enum.auto()

    @staticmethod
    def is_finished(status: RequestStatus) -> bool:
        return status > RequestStatus.PREEMPTED

    @staticmethod
    def get_finished_reason(status: RequestStatus) -> str | None:
        """``"stop"``, ``"length"``, ``"abort"`` or None (not finished)."""
        return _FINISHED_REASONS.get(status)


_FINISHED_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH_CAPPED: "length",
    RequestStatus.FINISHED_IGNORED: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
}


class Request:
    """One generation request.

    ``num_tokens = len(prompt) + len(outputs)``; ``num_tokens_with_spec`` adds the draft
    (speculative) tokens. The scheduler advances ``num_computed_tokens`` toward
    ``num_tokens_with_spec``. ``block_hashes`` holds the chained hash of every full block of
    ``all_token_ids`` (empty when no hasher is attached, i.e. prefix caching is off); it is
    computed here on construction and extended by ``append_output_token_ids``.

    Args:
        request_id: Unique among live requests.
        prompt_token_ids: Non-empty list of token ids.
        sampling_params: Sampling parameters (``None`` means ``SamplingParams()``).
        eos_token_id: Token id that stops generation unless ``ignore_eos`` (a model's
            further EOS ids are among ``sampling_params.stop_token_ids``:
            ``stop_check.with_eos_stop_ids``).
        arrival_time: Seconds (defaults to ``time.time()``); FCFS tie-break for priority.
        priority: Lower value is served first under the priority policy.
        cache_salt: Mixed into block 0's hash so that only requests with the same salt
            share cached prefixes.
        block_hasher: From ``get_request_block_hasher``; the scheduler attaches its own
            when it is ``None`` and prefix caching is on.
        pooling_params: Set for a pooling (embedding) request: it runs its prompt only and
            finishes when the worker returns its pooled output (``max_tokens`` is 1, as in
            vLLM, so that async scheduling never schedules it past its prompt).
    """

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        sampling_params: SamplingParams | None = None,
        eos_token_id: int | None = None,
        arrival_time: float | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
        block_hasher: Callable[[Request], list[BlockHash]] | None = None,
        pooling_params: PoolingParams | None = None,
    ):
        if not isinstance(request_id, str):
            raise TypeError(f"request_id must be a str, got {request_id!r}")
        if len(prompt_token_ids) == 0:
            raise ValueError(f"request {request_id!r} has an empty prompt")
        self.request_id = request_id
        self.sampling_params = sampling_params if sampling_params is not None else SamplingParams()
        self.pooling_params = pooling_params
        self.eos_token_id = eos_token_id
        self.arrival_time = time.time() if arrival_time is None else arrival_time
        self.priority = priority
        self.cache_salt = cache_salt

        self.status = RequestStatus.WAITING
        self.stop_reason: int | str | None = None
        self.prompt_token_ids: list[int] = list(prompt_token_ids)
        self.num_prompt_tokens = len(self.prompt_token_ids)
        self._output_token_ids: list[int] = []
        self._all_token_ids: list[int] = list(self.prompt_token_ids)
        self.spec_token_ids: list[int] = []
        self.num_computed_tokens = 0
        #: Async scheduling: sampled tokens of scheduled steps not yet appended (0 or 1).
        self.num_output_placeholders = 0
        #: Prefix-cache hit (in tokens) at the first scheduling; -1 before that.
        self.num_cached_tokens = -1
        self.num_preemptions = 0
        max_tokens = self.sampling_params.max_tokens
        self.max_tokens: float = float("inf") if max_tokens is None else max_tokens
        if pooling_params is not None:
            self.max_tokens = 1

        #: A KV connector's parameters (``sampling_params.extra_args["kv_transfer_params"]``,
        #: as vLLM): e.g. ``{"do_remote_decode": True}`` on a prefill instance.
        extra = self.sampling_params.extra_args
        self.kv_transfer_params: dict | None = extra.get("kv_transfer_params") if extra else None
        self.block_hashes: list[BlockHash] = []
        self._block_hasher = None
        if block_hasher is not None:
            self.attach_block_hasher(block_hasher)

    # ---- hashing -------------------------------------------------------------------
    def attach_block_hasher(self, block_hasher: Callable[[Request], list[BlockHash]]) -> None:
        """Sets the hasher (once) and hashes every full block present now."""
        if self._block_hasher is not None:
            raise ValueError(f"request {self.request_id!r} already has a block hasher")
        self._block_hasher = block_hasher
        self.block_hashes.extend(block_hasher(self))

    @property
    def block_hasher(self):
        return self._block_hasher

    # ---- tokens --------------------------------------------------------------------
    def append_output_token_ids(self, token_ids: int | Sequence[int]) -> None:
        """Appends sampled tokens and hashes any block they complete."""
        if isinstance(token_ids, int):
            self._output_token_ids.append(token_ids)
            self._all_token_ids.append(token_ids)
        else:
            self._output_token_ids.extend(token_ids)
            self._all_token_ids.extend(token_ids)
        if self._block_hasher is not None:
            new_hashes = self._block_hasher(self)
            if new_hashes:
                self.block_hashes.extend(new_hashes)

    @property
    def output_token_ids(self) -> list[int]:
        """The generated tokens (a live list: do not mutate)."""
        return self._output_token_ids

    @property
    def all_token_ids(self) -> list[int]:
        """Prompt + generated tokens (a live list: do not mutate)."""
        return self._all_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self._all_token_ids)

    @property
    def num_tokens_with_spec(self) -> int:
        return len(self._all_token_ids) + len(self.spec_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self._output_token_ids)

    # ---- status --------------------------------------------------------------------
    def is_finished(self) -> bool:
        return self.status > RequestStatus.PREEMPTED

    def get_finished_reason(self) -> str | None:
        return _FINISHED_REASONS.get(self.status)

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, status={self.status.name}, "
            f"num_tokens={self.num_tokens}, num_computed_tokens={self.num_computed_tokens})"
        )
