"""vLLM V1's KV-connector API (``KVConnectorBase_V1``, v0.11 semantics), for jaxkv. No jax import.

One class serves two roles, in two instances: the scheduler-side one lives in the engine core
(``Scheduler(..., kv_connector=...)``) and decides which requests load KV from outside the
engine and which send theirs; the worker-side one lives next to the ``ModelRunner`` and moves
pages. Per step the scheduler-side ``build_connector_meta`` returns an opaque, picklable
``KVConnectorMetadata`` carried by ``SchedulerOutput.kv_connector_metadata`` to the workers.

Where JAX makes jaxkv differ from vLLM: vLLM's per-layer hooks (``wait_for_layer_load`` inside
each attention layer, ``save_kv_layer`` after it) cannot run inside the jitted step. So the
worker side works at whole-step granularity, as tpu-inference's connectors do:
``start_load_kv`` runs before the step is dispatched, ``wait_for_save`` right after (its reads
of the KV buffers are ordered after the step by data dependence), and the per-layer hooks are
no-ops kept for the API's shape. The worker side sees the KV cache as ``PagedKVCaches``
(``jaxkv.worker.kv_connector``): the flat uint8 buffers, where a block is one contiguous
``page_bytes`` range in each buffer, with page gather / scatter.

jaxkv extensions of the API: ``request_finished`` gets every KV-cache group's block ids
(vLLM's later ``request_finished_all_groups``), so hybrid models move every group's blocks;
``get_block_ids_with_load_errors`` (vLLM's later addition) reports failed loads, whose
requests recompute (``kv_load_failure_policy="recompute"``); ``get_handshake_metadata`` /
``set_xfer_handshake_metadata`` carry each worker's transfer address to the scheduler side.
"""

from __future__ import annotations

import enum
from typing import TYPE_CHECKING, Any

from jaxkv.core.outputs import KVConnectorOutput

if TYPE_CHECKING:  # pragma: no cover
    from jaxkv.core.kv_cache_manager import KVCacheBlocks
    from jaxkv.core.request import Request
    from jaxkv.core.sched_output import SchedulerOutput
    from jaxkv.distributed.kv_transfer.config import KVTransferConfig
    from jaxkv.kv_cache import KVCacheConfig


class KVConnectorRole(enum.Enum):
    SCHEDULER = 0
    WORKER = 1


class KVConnectorMetadata:
    """Base of a connector's per-step metadata (picklable: it crosses to worker processes)."""


class KVConnectorBase_V1:  # noqa: N801 - vLLM's name
    """Base class: every hook is a no-op, so a connector overrides what it uses.

    Args:
      config: the engine's ``KVTransferConfig``.
      role: which side this instance is.
      kv_cache_config: this engine's plan (rank 0's on the scheduler side, the worker's own
        on the worker side).
      rank, world_size: the worker's global rank and the number of workers (worker side).
    """

    def __init__(
        self,
        config: KVTransferConfig,
        role: KVConnectorRole,
        kv_cache_config: KVCacheConfig | None = None,
        *,
        rank: int = 0,
        world_size: int = 1,
    ):
        self.config = config
        self.role = role
        self.kv_cache_config = kv_cache_config
        self.rank = rank
        self.world_size = world_size
        self._metadata: KVConnectorMetadata | None = None

    @property
    def extra(self) -> dict:
        return self.config.kv_connector_extra_config

    # ---- worker side --------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches) -> None:
        """``kv_caches``: the runner's ``PagedKVCaches`` (after the buffers are allocated)."""

    def bind_connector_metadata(self, metadata: KVConnectorMetadata | None) -> None:
        self._metadata = metadata

    def clear_connector_metadata(self) -> None:
        self._metadata = None

    def _get_connector_metadata(self) -> KVConnectorMetadata | None:
        return self._metadata

    def start_load_kv(self) -> None:
        """Before the step is dispatched: start (or do) the loads of this step's metadata."""

    def wait_for_layer_load(self, layer_name: str) -> None:
        """A no-op: loads are whole-step in jaxkv (see the module docstring)."""

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any) -> None:
        """A no-op: saves are whole-step in jaxkv (``wait_for_save``)."""

    def wait_for_save(self) -> None:
        """Right after the step is dispatched: save (or start sending) this step's KV."""

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """``(done sending, done receiving)`` request ids since the last call. Called once
        per step after the step; ``finished_req_ids`` finished or were aborted since the
        previous step (a load in flight for one of them must be dropped, never written)."""
        return None, None

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Blocks whose load failed since the last call (their requests recompute)."""
        return set()

    def get_handshake_metadata(self) -> dict | None:
        """What the scheduler side needs of this worker (e.g. its transfer address)."""
        return None

    # ---- scheduler side -----------------------------------------------------------------------

    def set_xfer_handshake_metadata(self, metadata: dict[int, dict]) -> None:
        """Every worker's ``get_handshake_metadata()``, by rank (once, at start-up)."""

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        """Tokens beyond the local prefix hit (``num_computed_tokens``) that can be loaded from
        outside, and whether the load is asynchronous (then the request waits in
        ``WAITING_FOR_REMOTE_KVS``). ``(None, _)``: ask again later. Side-effect free."""
        return 0, False

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        """After ``allocate_slots`` succeeded for a request (``blocks``: all its blocks)."""

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        """This step's metadata (must not modify the output); resets per-step state."""
        return KVConnectorMetadata()

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        """The workers' report of a step."""

    def request_finished(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict | None]:
        """Before a finished request's blocks are freed: ``(keep the blocks until reported in
        finished_sending, kv_transfer_params for the request's output)``."""
        return False, None

    def take_events(self) -> list:
        return []

    # ---- both ---------------------------------------------------------------------------------

    def get_kv_connector_stats(self) -> dict | None:
        return None

    def shutdown(self) -> None:
        pass
