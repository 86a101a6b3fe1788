"""`specee-cpp serve`: an OpenAI-compatible HTTP server over one loaded model pair.

``app`` (routes, errors, events) sits on ``worker`` (the one thread that drives the models)
and ``schema`` (request bodies). Needs the ``server`` extra: FastAPI, uvicorn, sse-starlette.
"""
