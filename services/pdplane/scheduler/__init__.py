"""The pdplane scheduler: picks the prefill and decode instance for each request.

Layout: `candidate` (an instance as the scheduler sees it), `view` (live candidates from the
registry watcher), `compat` (compatibility filter and decode guard), `inflight` (the scheduler's
own assignments between load reports), `policies/` (one policy per module), `service` (the
decision), `servicer` (gRPC translation), `server`/`app` (wiring), `client` (for the gateway).
"""
