"""The OpenAI-compatible gateway: schedules a (prefill, decode) pair per request and relays.

`pdplane.gateway.app.create_app` builds the FastAPI app; `pdplane.gateway.relay` holds the
prefill -> decode orchestration (no FastAPI imports); `pdplane gateway` runs it under uvicorn.
"""
