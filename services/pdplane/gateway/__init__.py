"""The OpenAI-compatible gateway: schedules a (prefill, decode) pair per request and relays.

`pdplane.gateway.app.create_app` builds the FastAPI app; `pdplane.gateway.relay` holds one
request's path top to bottom (schedule, both legs, the reply, after-care; each step in a module
of its own) with no FastAPI imports; `pdplane gateway` runs it under uvicorn.
"""
