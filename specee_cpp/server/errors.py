"""Errors in OpenAI's shape, ``{"error": {"message", "type", "param", "code"}}``: what every
refusal of the server sends, from a route or from the gate in front of them (limits.py)."""
from __future__ import annotations

from fastapi.responses import JSONResponse


def error_body(message: str, kind: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def error(status: int, message: str, **kw) -> JSONResponse:
    headers = kw.pop("headers", None)
    return JSONResponse(error_body(message, **kw), status_code=status, headers=headers)
