"""The registry client library: keep an instance registered, and watch the registry.

- `RegistrationClient`: register + heartbeat (with load) in a daemon thread, re-register on
  NOT_FOUND or after the registry was unreachable, clean deregister (optionally draining).
- `InstanceWatcher`: a local view of all instances kept by `WatchInstances`, consistent across
  reconnects and registry restarts.

Both are thread-based and import only grpcio, `pdplane.core` and `pdplane.v1`, so they load
inside vLLM's engine process as well as in the scheduler and the gateway.
"""

from __future__ import annotations

from pdplane.registry.registration import RegistrationClient
from pdplane.registry.watcher import InstanceWatcher

__all__ = ["InstanceWatcher", "RegistrationClient"]
