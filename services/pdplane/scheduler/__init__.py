"""The pdplane scheduler: picks the prefill and decode instance for each request.

Callers (the gateway) use only what this package exports, the port
(`pdplane.scheduler.port`) and its factory:

    scheduler = open_scheduler(settings, source=instances)   # remote, or local for "embedded"
    decision = await scheduler.schedule(RequestFeatures(request_id, model, prompt_tokens))
    scheduler.release_nowait(request_id, Outcome.SUCCESS)

Inside: `candidate` (an instance as the scheduler sees it), `view` (live candidates from the
registry watcher), `compat` (compatibility filter and decode guard), `inflight` (the scheduler's
own assignments between load reports), `policies/` (one policy per module), `decision`
(`Decider`: the decision), `kv_index/` (the prefix index and its KV events stream),
`inflight_exchange` (in-flight assignments shared between replicas; its gRPC servicer
`inflight_servicer`), `local` / `remote` (the port's two implementations), `wire` (port <->
protobuf), `servicer` (gRPC translation), `server` / `app` (wiring of a scheduler process).
"""

from pdplane.scheduler import port
from pdplane.scheduler.factory import open_scheduler
from pdplane.scheduler.port import *  # noqa: F403 (the port's own __all__ is the public surface)
from pdplane.scheduler.settings import PolicySettings

__all__ = [*port.__all__, "PolicySettings", "open_scheduler"]
