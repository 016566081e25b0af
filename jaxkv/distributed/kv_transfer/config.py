"""``KVTransferConfig`` (vLLM's): which KV connector an engine runs, and in which role. No jax."""

from __future__ import annotations

import dataclasses
import json
import uuid

#: vLLM's ``kv_role`` values: a prefill instance produces KV, a decode instance consumes it,
#: "kv_both" does either (e.g. a storage connector that saves and loads).
KV_ROLES = ("kv_producer", "kv_consumer", "kv_both")

#: What a failed load does (vLLM's ``kv_load_failure_policy``): the request recomputes the
#: tokens whose KV did not arrive. ("fail", aborting the request, is not offered.)
KV_LOAD_FAILURE_POLICIES = ("recompute",)


@dataclasses.dataclass(frozen=True)
class KVTransferConfig:
    """Attributes:
    kv_connector: A connector name (``jaxkv.distributed.kv_transfer.factory``:
        "SharedStorageConnector" / "ExampleConnector", "JaxTransferConnector" /
        "TPUConnector") or "module:Class" of one of your own.
    kv_role: "kv_producer" (prefill), "kv_consumer" (decode) or "kv_both".
    kv_connector_extra_config: The connector's own settings (e.g. the storage connector's
        ``shared_storage_path``; the device-to-device connector's ``host``,
        ``hold_timeout_s``, ``load_timeout_s``).
    engine_id: Names this instance to its peers (a random one by default).
    kv_load_failure_policy: "recompute" (vLLM's default): a failed load recomputes.
    """

    kv_connector: str
    kv_role: str = "kv_both"
    kv_connector_extra_config: dict = dataclasses.field(default_factory=dict)
    engine_id: str = ""
    kv_load_failure_policy: str = "recompute"

    def __post_init__(self):
        if not isinstance(self.kv_connector, str) or not self.kv_connector:
            raise ValueError(f"kv_connector must be a connector name, got {self.kv_connector!r}")
        if self.kv_role not in KV_ROLES:
            raise ValueError(f"kv_role must be one of {list(KV_ROLES)}, got {self.kv_role!r}")
        if not isinstance(self.kv_connector_extra_config, dict):
            raise TypeError(
                f"kv_connector_extra_config must be a dict, got {self.kv_connector_extra_config!r}"
            )
        if self.kv_load_failure_policy not in KV_LOAD_FAILURE_POLICIES:
            raise ValueError(
                f"kv_load_failure_policy must be one of {list(KV_LOAD_FAILURE_POLICIES)}, "
                f"got {self.kv_load_failure_policy!r}"
            )
        if not isinstance(self.engine_id, str):
            raise TypeError(f"engine_id must be a str, got {self.engine_id!r}")
        if not self.engine_id:
            object.__setattr__(self, "engine_id", uuid.uuid4().hex[:12])

    @property
    def is_kv_producer(self) -> bool:
        return self.kv_role in ("kv_producer", "kv_both")

    @property
    def is_kv_consumer(self) -> bool:
        return self.kv_role in ("kv_consumer", "kv_both")

    @classmethod
    def from_any(cls, value) -> KVTransferConfig | None:
        """None, a ``KVTransferConfig``, a dict of its fields or a JSON string of one (what
        ``--kv-transfer-config`` takes, as vLLM's flag)."""
        if value is None or isinstance(value, cls):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                raise ValueError(
                    f"kv_transfer_config is not valid JSON: {exc}: {value!r}"
                ) from None
        if not isinstance(value, dict):
            raise TypeError(
                f"kv_transfer_config must be a KVTransferConfig, a dict or JSON, got {value!r}"
            )
        unknown = set(value) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            raise ValueError(f"kv_transfer_config has unknown keys {sorted(unknown)}")
        if "kv_connector" not in value:
            raise ValueError("kv_transfer_config needs a 'kv_connector'")
        return cls(**value)
