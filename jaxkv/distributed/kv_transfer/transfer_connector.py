"""``JaxTransferConnector``: prefill/decode disaggregation device to device over
``jax.experimental.transfer`` (what tpu-inference's P/D uses), with a pyzmq note back.

Flow (vLLM's P/D flow, as its NIXL and TPU connectors run it):

* The prefill instance (P, ``kv_role="kv_producer"``) gets a request with
  ``kv_transfer_params={"do_remote_decode": True}`` and ``max_tokens=1`` (what the proxy sends).
  The step that completes its prompt also gathers the request's pages (every KV-cache group's
  real blocks; one ``[K, page_bytes]`` array per KV tensor and device shard) and offers them to
  the worker's ``TransferAgent`` under a uuid. The request finishes with ``kv_transfer_params``
  naming P's agents (one per worker rank), the uuid, the block positions and the KV layout;
  P keeps the request's blocks until D has pulled the pages or ``hold_timeout_s`` passes
  (``request_finished -> (True, params)``; the worker reports ``finished_sending``).
* The decode instance (D, ``kv_role="kv_consumer"``) gets the same prompt with P's parameters
  (``do_remote_prefill``). It allocates blocks for the prompt beyond its own prefix hit and
  waits in ``WAITING_FOR_REMOTE_KVS``; its workers pull from the same rank of P (the head split
  must match: same layout and tensor parallelism) into fresh arrays with a deadline
  (``load_timeout_s``) and, once the data is there, scatter it into its blocks (never
  earlier: a stale or late pull only fills its own arrays), then note P. The request then
  computes only its last prompt token and decodes.
* Failures never hang and never leak: a pull that fails or passes its deadline (P gone, the
  uuid never registered, P's hold timeout passed) fails the load and D recomputes the prompt
  (vLLM's ``kv_load_failure_policy="recompute"``); an aborted request's pull in flight is
  cancelled and its data never written; P's hold timeout frees P's blocks.

Where jaxkv differs: the offered pages are a copy (``await_pull`` registers whole arrays, not
byte ranges of the cache), so P holds its blocks and that copy until the pull or the hold
timeout. The copies are device memory outside the KV cache: ``max_offered_bytes`` bounds
them (per worker rank; default a quarter of the rank's KV cache), a request whose copy
would pass the bound is not offered (it finishes without ``kv_transfer_params``: the proxy
lets D compute its prompt; counted in ``num_refused_offers``; one offer is always allowed),
and on a device with memory stats P sizes its KV cache so that the bound fits beside it
(``kv_bytes_beside_offers``). Loads and saves run at whole-step
granularity (see ``base``). An offline prefill batch (``LLM.generate`` on P) larger than P's
pool stalls until offers expire, since its blocks are only freed by pulls that follow the
batch: give P a pool for the batch, or serve (each answer leaves as its request finishes).
``kv_connector_extra_config``: ``host`` (the address peers reach
this process at, default 127.0.0.1), ``hold_timeout_s`` (P, default 120), ``load_timeout_s``
(D, default 30), ``max_offered_bytes`` (P, see above).
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import time

from jaxkv.core.request import RequestStatus
from jaxkv.distributed.kv_transfer import blocks
from jaxkv.distributed.kv_transfer.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

logger = logging.getLogger(__name__)


#: P's default bound on its offered copies, as a fraction of its KV cache.
DEFAULT_OFFER_FRACTION = 0.25


def kv_bytes_beside_offers(available: int, kv_transfer_config) -> int:
    """Of ``available`` device bytes, those a prefill instance gives its KV cache so that its
    offered copies (``max_offered_bytes``, or ``DEFAULT_OFFER_FRACTION`` of the cache) fit
    beside it; ``available`` itself for any other instance."""
    if (
        kv_transfer_config is None
        or kv_transfer_config.kv_connector != "JaxTransferConnector"
        or not kv_transfer_config.is_kv_producer
    ):
        return available
    explicit = kv_transfer_config.kv_connector_extra_config.get("max_offered_bytes")
    if explicit is not None:
        return available - int(explicit)
    return int(available / (1 + DEFAULT_OFFER_FRACTION))


@dataclasses.dataclass
class _Send:
    req_id: str
    uuid: int
    block_ids: tuple[list[int], ...]
    where: list[tuple[int, int]]


@dataclasses.dataclass
class _Recv:
    req_id: str
    uuid: int
    agents: list[dict]  # P's agents, by rank
    where: list[tuple[int, int]]  # P's positions, in the order its pages come
    block_ids: tuple[list[int], ...]  # D's blocks, per group
    first_index: int  # D's own prefix hit, in blocks (not written)
    started: float = 0.0  # perf_counter() when the worker started the pull


@dataclasses.dataclass
class TransferMetadata(KVConnectorMetadata):
    sends: list[_Send] = dataclasses.field(default_factory=list)
    recvs: list[_Recv] = dataclasses.field(default_factory=list)


def _check_remote_params(params: dict) -> str | None:
    """What is wrong with a prefill instance's parameters, or None."""
    agents, where = params.get("remote_agents"), params.get("remote_positions")
    if not isinstance(params.get("remote_uuid"), int) or isinstance(
        params.get("remote_uuid"), bool
    ):
        return f"remote_uuid must be an int, got {params.get('remote_uuid')!r}"
    if not (
        isinstance(agents, list)
        and agents
        and all(isinstance(a, dict) and "transfer" in a and "notify" in a for a in agents)
    ):
        return "remote_agents must be a non-empty list of agent addresses"
    if not (
        isinstance(where, list)
        and all(
            isinstance(p, list) and len(p) == 2 and all(isinstance(x, int) for x in p)
            for p in where
        )
    ):
        return "remote_positions must be a list of [group, index] pairs"
    if not isinstance(params.get("remote_layout"), dict):
        return "remote_layout is missing"
    return None


class JaxTransferConnector(KVConnectorBase_V1):
    def __init__(self, config, role, kv_cache_config=None, *, rank: int = 0, world_size: int = 1):
        super().__init__(config, role, kv_cache_config, rank=rank, world_size=world_size)
        self.block_size = kv_cache_config.block_size
        self.hold_timeout_s = float(self.extra.get("hold_timeout_s", 120.0))
        self.load_timeout_s = float(self.extra.get("load_timeout_s", 30.0))
        cache_bytes = sum(t.size for t in kv_cache_config.kv_cache_tensors)  # this rank's
        #: Bytes one block id's pages take over every KV tensor of a rank (what an offer copies).
        self._block_bytes = cache_bytes // max(kv_cache_config.num_blocks, 1)
        limit = self.extra.get("max_offered_bytes", int(cache_bytes * DEFAULT_OFFER_FRACTION))
        if isinstance(limit, bool) or not isinstance(limit, int) or limit < 0:
            raise ValueError(
                f"kv_connector_extra_config max_offered_bytes must be an int >= 0, got {limit!r}"
            )
        self.max_offered_bytes = limit
        self._offered: dict[str, int] = {}  # P: req id -> bytes of its copy, until sent or expired
        self.num_refused_offers = 0
        # scheduler side
        self._agents: list[dict] = []
        self._layout: dict | None = None
        self._tracker = blocks.RequestBlockTracker()
        self._to_send: dict[
            str, tuple[int, int]
        ] = {}  # P: req id -> (uuid, prompt length) until sent
        self._sent: dict[str, _Send] = {}  # P: offered this run
        self._pending_recvs: dict[str, _Recv] = {}
        # worker side
        self._agent = None
        self._kv = None
        self._recving: dict[
            int, tuple[_Recv, list[int], list[int]]
        ] = {}  # uuid -> (recv, dst ids, external ids)
        self._dropped: set[int] = set()
        self._failed_starts: set[str] = set()
        self._sending: dict[int, str] = {}
        self._failed_blocks: set[int] = set()
        self.stats = {
            "bytes_pulled": 0,
            "pull_seconds": 0.0,
            "num_pulls": 0,
            "num_failed_pulls": 0,
            "bytes_offered": 0,
            "num_offers": 0,
            "num_expired_offers": 0,
        }
        if role is KVConnectorRole.WORKER:
            from jaxkv.distributed.kv_transfer.transfer_agent import TransferAgent

            self._agent = TransferAgent(host=str(self.extra.get("host", "127.0.0.1")))

    def _uuid(self, req_id: str) -> int:
        digest = hashlib.sha256(f"{self.config.engine_id}/{req_id}".encode()).digest()
        return int.from_bytes(digest[:7], "big")

    # ---- scheduler side -----------------------------------------------------------------------

    def set_xfer_handshake_metadata(self, metadata):
        self._agents = [metadata[r]["agent"] for r in sorted(metadata)]
        self._layout = metadata[min(metadata)]["layout"]

    def _remote_prefill(self, request) -> dict | None:
        """The request's parameters when it is to load from a prefill instance, else None
        (malformed or foreign parameters are logged and the prompt is computed here)."""
        params = request.kv_transfer_params
        if not params or not params.get("do_remote_prefill") or not self.config.is_kv_consumer:
            return None
        problem = _check_remote_params(params)
        if problem:
            logger.warning(
                "request %s: bad kv_transfer_params (%s): computing the prompt here",
                request.request_id,
                problem,
            )
            return None
        if params.get("remote_layout") != self._layout or len(
            params.get("remote_agents", ())
        ) != len(self._agents):
            logger.warning(
                "request %s: remote KV layout %s over %d workers does not match this engine's %s "
                "over %d: computing the prompt here",
                request.request_id,
                params.get("remote_layout"),
                len(params.get("remote_agents", ())),
                self._layout,
                len(self._agents),
            )
            return None
        return params

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        if self._remote_prefill(request) is None:
            return 0, False
        n = request.num_prompt_tokens - num_computed_tokens
        return (n, True) if n > 0 else (0, False)

    def update_state_after_alloc(self, request, blocks_, num_external_tokens):
        req_id = request.request_id
        params = request.kv_transfer_params or {}
        if num_external_tokens > 0 and self._remote_prefill(request) is not None:
            local = request.num_prompt_tokens - num_external_tokens
            self._pending_recvs[req_id] = _Recv(
                req_id,
                int(params["remote_uuid"]),
                list(params["remote_agents"]),
                [tuple(p) for p in params["remote_positions"]],
                tuple(list(ids) for ids in blocks_.get_block_ids()),
                local // self.block_size,
            )
            request.kv_transfer_params = dict(params, do_remote_prefill=False)  # once only
        elif (
            params.get("do_remote_decode")
            and self.config.is_kv_producer
            and req_id not in self._to_send
            and req_id not in self._sent
        ):
            if request.max_tokens != 1:
                logger.warning(
                    "request %s: do_remote_decode with max_tokens=%s; only max_tokens=1 (what the "
                    "proxy sends) is sent to a decode instance",
                    req_id,
                    request.max_tokens,
                )
                return
            self._to_send[req_id] = (self._uuid(req_id), request.num_prompt_tokens)
            self._tracker.track(req_id)

    def build_connector_meta(self, scheduler_output):
        meta = TransferMetadata(recvs=list(self._pending_recvs.values()))
        self._pending_recvs.clear()
        for req_id in self._tracker.update(scheduler_output):
            uuid, prompt_len = self._to_send[req_id]
            if self._tracker.num_computed[req_id] < prompt_len:  # the prompt is not done this step
                continue
            del self._to_send[req_id]
            ids = tuple(self._tracker.block_ids[req_id])
            self._tracker.forget(req_id)
            nbytes = sum(1 for group in ids for b in group if b) * self._block_bytes
            held = sum(self._offered.values())
            if held and held + nbytes > self.max_offered_bytes:
                self.num_refused_offers += 1
                logger.warning(
                    "request %s: not offered to a decode instance: its %d-byte copy would pass "
                    "max_offered_bytes=%d (%d held); it decodes without it",
                    req_id,
                    nbytes,
                    self.max_offered_bytes,
                    held,
                )
                continue
            self._offered[req_id] = nbytes
            send = _Send(req_id, uuid, ids, blocks.positions(ids))
            meta.sends.append(send)
            self._sent[req_id] = send
        return meta

    def update_connector_output(self, connector_output) -> None:
        for req_id in connector_output.finished_sending:  # pulled or expired: the copy is gone
            self._offered.pop(req_id, None)

    def request_finished(self, request, block_ids):
        req_id = request.request_id
        self._to_send.pop(req_id, None)
        self._tracker.forget(req_id)
        self._pending_recvs.pop(req_id, None)
        send = self._sent.pop(req_id, None)
        if send is None:
            return False, None
        if request.status != RequestStatus.FINISHED_LENGTH_CAPPED:  # stopped or aborted: no decode
            return False, None  # the worker's offer (a copy) just expires
        return True, {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_engine_id": self.config.engine_id,
            "remote_agents": self._agents,
            "remote_uuid": send.uuid,
            "remote_positions": [list(p) for p in send.where],
            "remote_layout": self._layout,
            "remote_num_tokens": request.num_prompt_tokens,
        }

    # ---- worker side --------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches) -> None:
        self._kv = kv_caches

    def get_handshake_metadata(self) -> dict:
        return {"agent": self._agent.address, "layout": self._kv.layout()}

    def start_load_kv(self) -> None:
        meta = self._get_connector_metadata()
        if not isinstance(meta, TransferMetadata):
            return
        for recv in meta.recvs:
            dst = blocks.receiver_ids(recv.where, recv.block_ids, recv.first_index)
            external = [b for b in dst if b >= 0]
            try:
                self._agent.start_pull(
                    recv.agents[self.rank],
                    recv.uuid,
                    self._kv.shard_specs(len(recv.where)),
                    deadline_s=self.load_timeout_s,
                )
            except Exception:
                logger.exception(
                    "request %s: pull of uuid %s did not start", recv.req_id, recv.uuid
                )
                self._failed_blocks.update(external)
                self._failed_starts.add(recv.req_id)  # reported by get_finished
                continue
            recv.started = time.perf_counter()
            self._recving[recv.uuid] = (recv, dst, external)

    def wait_for_save(self) -> None:
        meta = self._get_connector_metadata()
        if not isinstance(meta, TransferMetadata):
            return
        for send in meta.sends:
            pages = self._kv.read_pages(blocks.ids_at(send.block_ids, send.where))
            shards = self._kv.local_shards(pages)
            self._agent.offer(send.uuid, shards, hold_timeout_s=self.hold_timeout_s)
            self._sending[send.uuid] = send.req_id
            self.stats["bytes_offered"] += sum(s.nbytes for s in shards)
            self.stats["num_offers"] += 1

    def get_finished(self, finished_req_ids):
        recving_done, self._failed_starts = self._failed_starts - finished_req_ids, set()
        for uuid, (recv, _, _) in list(self._recving.items()):
            if recv.req_id in finished_req_ids:  # aborted while loading: never written
                self._agent.cancel(uuid)
                self._dropped.add(uuid)
                del self._recving[uuid]
        for uuid, result in self._agent.poll_pulled():
            if uuid in self._dropped:
                self._dropped.discard(uuid)
                continue
            entry = self._recving.pop(uuid, None)
            if entry is None:
                continue
            recv, dst, external = entry
            recving_done.add(recv.req_id)
            if isinstance(result, BaseException):
                logger.warning("request %s: KV pull failed (%s); recomputing", recv.req_id, result)
                self._failed_blocks.update(external)
                self.stats["num_failed_pulls"] += 1
                continue
            try:
                self._kv.write_pages(dst, self._kv.from_local_shards(result, len(recv.where)))
            except Exception:
                logger.exception("request %s: pulled KV does not fit; recomputing", recv.req_id)
                self._failed_blocks.update(external)
                self.stats["num_failed_pulls"] += 1
                continue
            self.stats["num_pulls"] += 1
            self.stats["bytes_pulled"] += sum(a.nbytes for a in result)
            self.stats["pull_seconds"] += time.perf_counter() - recv.started
        sending_done = set()
        if self._sending:
            done, expired = self._agent.poll_sent()
            self.stats["num_expired_offers"] += len(expired)
            for uuid in done | expired:
                req_id = self._sending.pop(uuid, None)
                if req_id is not None:
                    sending_done.add(req_id)
        return sending_done, recving_done

    def get_block_ids_with_load_errors(self) -> set[int]:
        bad, self._failed_blocks = self._failed_blocks, set()
        return bad

    def get_kv_connector_stats(self) -> dict | None:
        return dict(self.stats) if self.role is KVConnectorRole.WORKER else None

    def shutdown(self) -> None:
        if self._agent is not None:
            self._agent.close()
            self._agent = None
