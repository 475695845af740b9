"""The pdplane registry: instances register, hold a lease by heartbeat and report load.

`pdplane.registry.client` is the client library (imported inside vLLM's engine process, so it
stays light); the service itself is `server` (wiring), `servicer` (protobuf <-> store), `store`
(the `InstanceStore` interface) and `memory_store` (the default, in-memory store).
"""
