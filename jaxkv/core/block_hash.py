"""Chained hashes of full token blocks, the keys of the prefix cache.

``hash(block i) = H((hash(block i-1) or NONE_HASH, tuple(tokens of block i), extra_keys))``
where ``extra_keys`` is ``None`` or a tuple; the request's ``cache_salt`` goes into the
extra keys of block 0 only. Only full blocks are hashed. Worked example, block_size 2,
tokens ``[5, 6, 7, 8, 9]``: ``h0 = H((NONE_HASH, (5, 6), None))``,
``h1 = H((h0, (7, 8), None))``; token 9 is a partial block and has no hash yet.

Hash functions (``hash_algo``):
  * ``"sha256"`` (default, as vLLM): sha256 of the pickled tuple, 32 bytes. Collisions
    are practically impossible, so tenants cannot read each other's cache by accident.
  * ``"builtin"``: Python's ``hash()`` of the tuple, a 64-bit int. About 5x faster, but
    not collision resistant and only stable within one process (string salts are
    randomised by PYTHONHASHSEED); fine for single-tenant research runs.

``NONE_HASH`` (the parent of block 0) is fixed: derived from ``PYTHONHASHSEED`` when that
is set, else from the constant string ``"jaxkv-none-hash"``, so runs are reproducible.

The prefix-cache key is ``BlockHashWithGroupId = (block_hash, group_id)``, a tuple: one
request hash is looked up once per KV-cache group.
"""

from __future__ import annotations

import hashlib
import os
import pickle
from collections.abc import Callable
from typing import Any

BlockHash = bytes | int
#: ``(block_hash, kv_cache_group_id)``: the key in the prefix-cache map.
BlockHashWithGroupId = tuple[BlockHash, int]

HASH_ALGOS = ("sha256", "builtin")


def sha256(obj: Any) -> bytes:
    """sha256 digest of ``pickle.dumps(obj)`` (deterministic for tuples of ints/bytes/str)."""
    return hashlib.sha256(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)).digest()


def builtin_hash(obj: Any) -> int:
    """Python's ``hash()``: fast, 64-bit, process-local."""
    return hash(obj)


def get_hash_fn(hash_algo: str) -> Callable[[Any], BlockHash]:
    """Returns the hash function named ``hash_algo`` (one of ``HASH_ALGOS``)."""
    if hash_algo == "sha256":
        return sha256
    if hash_algo == "builtin":
        return builtin_hash
    raise ValueError(f"unknown hash_algo {hash_algo!r}; expected one of {HASH_ALGOS}")


def _none_hash_seed() -> str:
    return os.environ.get("PYTHONHASHSEED") or "jaxkv-none-hash"


def init_none_hash(hash_fn: Callable[[Any], BlockHash]) -> BlockHash:
    """The parent hash of block 0 for ``hash_fn`` (see module docstring)."""
    digest = sha256(_none_hash_seed())
    if hash_fn is sha256:
        return digest
    return int.from_bytes(digest[:8], "big")


_NONE_HASHES: dict[Callable, BlockHash] = {}


def get_none_hash(hash_fn: Callable[[Any], BlockHash]) -> BlockHash:
    if hash_fn not in _NONE_HASHES:
        _NONE_HASHES[hash_fn] = init_none_hash(hash_fn)
    return _NONE_HASHES[hash_fn]


def hash_block_tokens(
    hash_fn: Callable[[Any], BlockHash],
    parent_block_hash: BlockHash | None,
    curr_block_token_ids: tuple[int, ...] | list[int],
    extra_keys: tuple[Any, ...] | None = None,
) -> BlockHash:
    """Hash of one full block chained on its parent (``None`` parent = first block)."""
    if parent_block_hash is None:
        parent_block_hash = get_none_hash(hash_fn)
    return hash_fn((parent_block_hash, tuple(curr_block_token_ids), extra_keys))


def get_request_block_hasher(
    block_size: int, hash_fn: Callable[[Any], BlockHash]
) -> Callable[[Any], list[BlockHash]]:
    """Returns ``hasher(request) -> new block hashes`` for a request's newly full blocks.

    The hasher starts at ``len(request.block_hashes) * block_size`` and hashes every full
    block after it; ``Request`` calls it on construction and after appending tokens.
    """
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    none_hash = get_none_hash(hash_fn)

    def request_block_hasher(request) -> list[BlockHash]:
        block_hashes = request.block_hashes
        start = len(block_hashes) * block_size
        num_tokens = request.num_tokens
        if start + block_size > num_tokens:
            return []
        token_ids = request.all_token_ids
        prev = block_hashes[-1] if block_hashes else none_hash
        salt_keys = (request.cache_salt,) if request.cache_salt is not None else None
        new_hashes = []
        while start + block_size <= num_tokens:
            extra_keys = salt_keys if start == 0 else None
            prev = hash_fn((prev, tuple(token_ids[start : start + block_size]), extra_keys))
            new_hashes.append(prev)
            start += block_size
        return new_hashes

    request_block_hasher.block_size = block_size  # type: ignore[attr-defined]
    return request_block_hasher
