"""pdplane's KV connector for vLLM (prefill/decode disaggregation, pull mode).

Load it in vLLM with::

    --kv-transfer-config '{"kv_connector": "PdPlaneConnector",
                           "kv_connector_module_path": "pdplane.connector",
                           "kv_role": "kv_producer", "kv_connector_extra_config": {...}}'

The facade is imported lazily so that light parts (transports, config, metadata) can be used
without importing vLLM.
"""

from __future__ import annotations

from typing import Any

__all__ = ["PdPlaneConnector", "PdPlaneConnectorMetadata"]


def __getattr__(name: str) -> Any:
    if name == "PdPlaneConnector":
        from pdplane.connector.facade import PdPlaneConnector

        return PdPlaneConnector
    if name == "PdPlaneConnectorMetadata":
        from pdplane.connector.metadata import PdPlaneConnectorMetadata

        return PdPlaneConnectorMetadata
    raise AttributeError(name)
