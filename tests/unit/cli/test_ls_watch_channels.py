"""`pdplane ls` talks to its registries over channels that reconnect quickly."""

from __future__ import annotations

from typing import Any

import pytest

from pdplane.cli import ls
from pdplane.core.grpc.util import FAST_RECONNECT_OPTIONS


class _Stop(Exception):
    pass


@pytest.mark.parametrize("watch", [True, False])
def test_ls_channels_take_the_registration_clients_reconnect_backoff(
    monkeypatch: pytest.MonkeyPatch, watch: bool
) -> None:
    # gRPC's own backoff grows to 120 s: a watch whose registry was down for a minute saw it
    # back ~30 s late. The registration client's options cap it at 0.5 s.
    seen: list[list[tuple[str, Any]]] = []

    def endpoints(registry: str, tls_ca: Any = None, extra_options: Any = ()) -> Any:
        seen.append(list(extra_options))
        raise _Stop

    monkeypatch.setattr(ls, "RegistryEndpoints", endpoints)
    with pytest.raises(_Stop):
        ls.main(["--registry", "127.0.0.1:1", "--token", "t", *(["--watch"] if watch else [])])
    assert seen == [FAST_RECONNECT_OPTIONS]
