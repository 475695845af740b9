"""Makes the connector's log lines visible inside vLLM's processes.

vLLM configures only its own `vllm` logger; records of `pdplane.*` would fall through to
Python's last-resort handler (warnings only). The transfer ids logged at INFO are what an
operator greps to follow a request from prefill to decode, so they must show.
"""

from __future__ import annotations

import logging
import os
import sys

__all__ = ["setup_connector_logging"]

_FORMAT = "(pdplane pid=%(process)d) %(levelname)s %(asctime)s [%(name)s] %(message)s"


def setup_connector_logging() -> None:
    """Adds a stderr handler to the `pdplane` logger unless it already has one.
    Level from `PDPLANE_LOG_LEVEL` (default INFO)."""
    logger = logging.getLogger("pdplane")
    if logger.handlers:
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(_FORMAT, datefmt="%m-%d %H:%M:%S"))
    logger.addHandler(handler)
    logger.setLevel(os.environ.get("PDPLANE_LOG_LEVEL", "INFO").upper())
    logger.propagate = False
