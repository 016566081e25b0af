"""``SharedStorageConnector`` (vLLM's shared-storage / example connector), for jaxkv.

A producer saves the KV of each prompt's full blocks, ``N = (len(prompt) - 1) // block_size *
block_size`` tokens (the last prompt token is always computed, to sample), under
``<shared_storage_path>/<key>/`` with ``key = md5(int64 token ids[:N] + this engine's KV
layout)``: one ``rank<r>.npz`` per worker rank (``t<tensor>_s<shard>``: ``[K, page_bytes]``
uint8 pages of that tensor on that device shard), plus ``rank<r>.json`` (positions and layout),
written to a temporary name and renamed, so a reader never sees half a file. A consumer whose
prompt's key exists on disk loads those blocks instead of computing them.

Differences from vLLM's: one file per rank with every layer's pages (jaxkv's flat buffers hold
all layers of a page), not one safetensors file per layer; loads are asynchronous by default
(the request waits in ``WAITING_FOR_REMOTE_KVS`` for one step), so a file that is missing,
damaged or of another layout fails the load and the request recomputes, never reading
garbage (``"load_async": false`` loads inside the step that computes the rest of the prompt,
as vLLM's does; a failed load then recomputes from its first bad block); saves happen
after the step that computes the N-th token (with chunked prefill, a later chunk's step).
Models with identical KV layouts (same layer names, page size, block size) must not share a
path: the key cannot tell them apart.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import tempfile
import time

import numpy as np

from jaxkv.distributed.kv_transfer import blocks
from jaxkv.distributed.kv_transfer.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

DEFAULT_PATH = os.path.join(tempfile.gettempdir(), "jaxkv_kv_storage")


@dataclasses.dataclass
class _Load:
    req_id: str
    key: str
    block_ids: tuple[list[int], ...]  # the request's blocks, per group
    first_index: int  # its local prefix hit, in blocks (not written)
    external_ids: list[int]  # blocks the load fills (reported on failure)


@dataclasses.dataclass
class _Save:
    req_id: str
    key: str
    block_ids: tuple[list[int], ...]  # the request's blocks, per group
    num_blocks: int  # N // block_size


@dataclasses.dataclass
class StorageMetadata(KVConnectorMetadata):
    loads: list[_Load] = dataclasses.field(default_factory=list)
    saves: list[_Save] = dataclasses.field(default_factory=list)


def layout_fingerprint(kv_cache_config) -> str:
    """What two engines must share for pages to mean the same: layers, pages, blocks."""
    groups = [
        (type(g.kv_cache_spec).__name__, g.kv_cache_spec.page_size_bytes, list(g.layer_names))
        for g in kv_cache_config.kv_cache_groups
    ]
    tensors = [list(t.shared_by) for t in kv_cache_config.kv_cache_tensors]
    return json.dumps(
        {"block_size": kv_cache_config.block_size, "groups": groups, "tensors": tensors}
    )


class SharedStorageConnector(KVConnectorBase_V1):
    """``kv_connector_extra_config``: ``shared_storage_path`` (default: a directory under the
    system's temporary directory); ``load_async`` (default true)."""

    def __init__(self, config, role, kv_cache_config=None, *, rank: int = 0, world_size: int = 1):
        super().__init__(config, role, kv_cache_config, rank=rank, world_size=world_size)
        self.path = str(self.extra.get("shared_storage_path", DEFAULT_PATH))
        self.load_async = self.extra.get("load_async", True)
        if not isinstance(self.load_async, bool):
            raise TypeError(
                f"kv_connector_extra_config load_async must be true or false, got {self.load_async!r}"
            )
        self.block_size = kv_cache_config.block_size
        self._fingerprint = layout_fingerprint(kv_cache_config).encode()
        # scheduler side
        self._pending_loads: dict[str, _Load] = {}
        self._to_save: dict[str, tuple[str, int]] = {}  # producer: req id -> (key, N // block_size)
        self._tracker = blocks.RequestBlockTracker()
        # worker side
        self._kv = None
        self._loaded: set[str] = set()
        self._failed_blocks: set[int] = set()
        self.num_saved = self.num_loaded = self.num_failed_loads = self.bytes_loaded = 0
        self.load_seconds = 0.0

    # ---- keys ---------------------------------------------------------------------------------

    def _num_blocks(self, prompt: list[int]) -> int:
        return (len(prompt) - 1) // self.block_size

    def _key(self, tokens: list[int]) -> str:
        h = hashlib.md5(np.asarray(tokens, np.int64).tobytes())
        h.update(self._fingerprint)
        return h.hexdigest()

    def _stored(self, key: str) -> bool:
        folder = os.path.join(self.path, key)
        return all(
            os.path.exists(os.path.join(folder, f"rank{r}.json")) for r in range(self.world_size)
        )

    # ---- scheduler side -----------------------------------------------------------------------

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        if not self.config.is_kv_consumer:
            return 0, False
        n = self._num_blocks(request.prompt_token_ids) * self.block_size
        if n <= num_computed_tokens or not self._stored(self._key(request.prompt_token_ids[:n])):
            return 0, False
        return n - num_computed_tokens, self.load_async

    def update_state_after_alloc(self, request, blocks_, num_external_tokens):
        req_id = request.request_id
        block_ids = blocks_.get_block_ids()
        if num_external_tokens > 0:
            n = self._num_blocks(request.prompt_token_ids)
            first = (n * self.block_size - num_external_tokens) // self.block_size  # local hit
            self._pending_loads[req_id] = _Load(
                req_id,
                self._key(request.prompt_token_ids[: n * self.block_size]),
                tuple(list(ids) for ids in block_ids),
                first,
                [ids[i] for ids in block_ids for i in range(first, min(n, len(ids))) if ids[i]],
            )
        elif self.config.is_kv_producer and req_id not in self._to_save:
            n = self._num_blocks(request.prompt_token_ids)
            key = self._key(request.prompt_token_ids[: n * self.block_size]) if n else None
            if n and not self._stored(key):
                self._to_save[req_id] = (key, n)
                self._tracker.track(req_id)

    def build_connector_meta(self, scheduler_output):
        meta = StorageMetadata(loads=list(self._pending_loads.values()))
        self._pending_loads.clear()
        tracker = self._tracker
        for req_id in tracker.update(scheduler_output):
            key, n = self._to_save[req_id]
            if tracker.num_computed[req_id] >= n * self.block_size:  # its N tokens are computed
                meta.saves.append(_Save(req_id, key, tuple(tracker.block_ids[req_id]), n))
                del self._to_save[req_id]
                tracker.forget(req_id)
        return meta

    def request_finished(self, request, block_ids):
        self._to_save.pop(request.request_id, None)
        self._tracker.forget(request.request_id)
        self._pending_loads.pop(request.request_id, None)
        return False, None

    # ---- worker side --------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches) -> None:
        self._kv = kv_caches

    def start_load_kv(self) -> None:
        meta = self._get_connector_metadata()
        if not isinstance(meta, StorageMetadata):
            return
        for load in meta.loads:
            t0 = time.perf_counter()
            try:
                self.bytes_loaded += self._load(load)
                self.num_loaded += 1
                self.load_seconds += time.perf_counter() - t0
            except Exception:  # noqa: BLE001 - any unreadable file: the request recomputes
                self._failed_blocks.update(load.external_ids)
                self.num_failed_loads += 1
            self._loaded.add(load.req_id)

    def _load(self, load: _Load) -> int:
        """Loads one request's pages; returns the bytes read."""
        folder = os.path.join(self.path, load.key)
        with open(os.path.join(folder, f"rank{self.rank}.json")) as f:
            info = json.load(f)
        if info["layout"] != self._kv.layout():
            raise ValueError(
                f"stored KV layout {info['layout']} is not this engine's {self._kv.layout()}"
            )
        where = [tuple(p) for p in info["positions"]]
        with np.load(os.path.join(folder, f"rank{self.rank}.npz")) as data:
            pages = self._kv.pages_from_host(dict(data), len(where))
        self._kv.write_pages(blocks.receiver_ids(where, load.block_ids, load.first_index), pages)
        return sum(p.nbytes for p in pages)

    def wait_for_save(self) -> None:
        meta = self._get_connector_metadata()
        if not isinstance(meta, StorageMetadata):
            return
        for save in meta.saves:
            where = blocks.positions(save.block_ids, save.num_blocks)
            pages = self._kv.read_pages(blocks.ids_at(save.block_ids, where))
            self._write(save.key, where, self._kv.pages_to_host(pages))
            self.num_saved += 1

    def _write(self, key: str, where, host: dict) -> None:
        folder = os.path.join(self.path, key)
        os.makedirs(folder, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=folder, suffix=".npz.tmp")
        with os.fdopen(fd, "wb") as f:
            np.savez(f, **host)
        os.replace(tmp, os.path.join(folder, f"rank{self.rank}.npz"))
        fd, tmp = tempfile.mkstemp(dir=folder, suffix=".json.tmp")
        with os.fdopen(fd, "w") as f:
            json.dump({"positions": where, "layout": self._kv.layout()}, f)
        os.replace(tmp, os.path.join(folder, f"rank{self.rank}.json"))  # last: marks it complete

    def get_finished(self, finished_req_ids):
        done, self._loaded = self._loaded, set()
        return None, done

    def get_block_ids_with_load_errors(self) -> set[int]:
        bad, self._failed_blocks = self._failed_blocks, set()
        return bad

    def get_kv_connector_stats(self) -> dict | None:
        if self.role is KVConnectorRole.WORKER:
            return {
                "num_saved": self.num_saved,
                "num_loaded": self.num_loaded,
                "num_failed_loads": self.num_failed_loads,
                "bytes_loaded": self.bytes_loaded,
                "load_seconds": self.load_seconds,
            }
        return None
