"""The OpenAI-compatible gateway: schedules a (prefill, decode) pair per request and relays.

`pdplane.gateway.app.create_app` builds the FastAPI app; `pdplane.gateway.relay` (retries,
scheduling) and `pdplane.gateway.attempt` (one pair: both legs, the stream) hold the
prefill -> decode orchestration with no FastAPI imports; `pdplane gateway` runs it under uvicorn.
"""
