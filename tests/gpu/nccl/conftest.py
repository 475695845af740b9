"""Fixtures of the NCCL GPU tests: KV node processes (tests/support/nccl_node.py) on one GPU.

Every test here is skipped where there is no CUDA GPU or no libnccl (CI).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.nccl_cluster import NodeProcess


def _gpu_reason() -> str | None:
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if not torch.cuda.is_available():
        return "no CUDA GPU"
    from pdplane.connector.transports.nccl.binding import NcclLibrary, NcclUnavailableError

    try:
        NcclLibrary.get()
    except NcclUnavailableError as exc:
        return str(exc)
    return None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    here = Path(__file__).parent
    mine = [i for i in items if here in Path(str(i.fspath)).parents]
    if not mine:
        return
    reason = _gpu_reason()
    if reason:
        for item in mine:
            item.add_marker(pytest.mark.skip(reason=reason))


@pytest.fixture
def start_node(tmp_path: Path) -> Iterator[Callable[..., Any]]:
    """`start_node(instance_id, **options)` -> a running NodeProcess; all stopped at teardown.
    Node logs (stderr) go to the test's tmp_path."""
    nodes: list[Any] = []

    def start(instance_id: str, **options: Any) -> Any:
        node = NodeProcess(instance_id, log_dir=tmp_path, **options)
        nodes.append(node)
        return node

    yield start
    for node in nodes:
        node.stop()
