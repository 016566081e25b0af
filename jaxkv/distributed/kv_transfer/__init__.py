"""KV transfer between engine instances: vLLM V1's KV-connector API and jaxkv's connectors.

``base`` (the API), ``config`` (``KVTransferConfig``), ``factory`` (names -> classes),
``storage_connector`` (save / load full prompt blocks through files),
``transfer_connector`` (device to device over ``jax.experimental.transfer``, through
``transfer_agent``) and ``proxy`` (``jaxkv proxy``: prefill then decode instances over HTTP).
"""

from jaxkv.distributed.kv_transfer.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)
from jaxkv.distributed.kv_transfer.config import KVTransferConfig
from jaxkv.distributed.kv_transfer.factory import KVConnectorFactory

__all__ = [
    "KVConnectorBase_V1",
    "KVConnectorFactory",
    "KVConnectorMetadata",
    "KVConnectorRole",
    "KVTransferConfig",
]
