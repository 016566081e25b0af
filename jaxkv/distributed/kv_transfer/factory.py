"""``KVConnectorFactory`` (vLLM's): connector names -> classes, imported when first used."""

from __future__ import annotations

import importlib

from jaxkv.distributed.kv_transfer.base import KVConnectorBase_V1, KVConnectorRole

#: name -> "module:Class". vLLM's names where jaxkv has the same connector.
CONNECTORS = {
    "SharedStorageConnector": "jaxkv.distributed.kv_transfer.storage_connector:SharedStorageConnector",
    "ExampleConnector": "jaxkv.distributed.kv_transfer.storage_connector:SharedStorageConnector",
    "JaxTransferConnector": "jaxkv.distributed.kv_transfer.transfer_connector:JaxTransferConnector",
    "TPUConnector": "jaxkv.distributed.kv_transfer.transfer_connector:JaxTransferConnector",
}


class KVConnectorFactory:
    @staticmethod
    def get_connector_class(name: str) -> type[KVConnectorBase_V1]:
        """A registered name, or "module:Class" of a ``KVConnectorBase_V1`` subclass."""
        target = CONNECTORS.get(name, name)
        if ":" not in target:
            raise ValueError(
                f"unknown kv_connector {name!r}: one of {sorted(CONNECTORS)} or 'module:Class'"
            )
        module, cls_name = target.split(":", 1)
        cls = getattr(importlib.import_module(module), cls_name, None)
        if not (isinstance(cls, type) and issubclass(cls, KVConnectorBase_V1)):
            raise ValueError(f"kv_connector {name!r} is not a KVConnectorBase_V1 subclass")
        return cls

    @staticmethod
    def create_connector(
        config, role: KVConnectorRole, kv_cache_config=None, **kwargs
    ) -> KVConnectorBase_V1:
        return KVConnectorFactory.get_connector_class(config.kv_connector)(
            config, role, kv_cache_config, **kwargs
        )
