"""Distributed pieces beyond one engine: KV transfer between instances (``kv_transfer``)."""
