"""What a client may cost the server before its request reaches a route: its key, its
body's size and the time it takes to send its request.

A client that sends a partial request and waits holds a connection (a file descriptor) for
ever unless something times it out, and a body of many megabytes would be parsed on the
event loop that serves every other client. So: request headers whole within
``HEADER_READ_S`` of a connection's start or its last response (`H11WithDeadline`); then,
before any route, the key, then the body refused past ``MAX_BODY_BYTES`` (413, from its
Content-Length before reading a byte where it says one) and read whole within
``BODY_READ_S`` (408) (`Gate`).
"""
from __future__ import annotations

import asyncio
import hmac
import time

from uvicorn.protocols.http.h11_impl import H11Protocol

from ..config import BODY_READ_S, HEADER_READ_S, MAX_BODY_BYTES
from .errors import error


class Gate:
    """ASGI middleware in front of every route: the API key (when one is set, compared in
    constant time), then the body, read whole within its limits and handed on as read."""

    def __init__(self, app, api_key: str | None = None, max_bytes: int = MAX_BODY_BYTES,
                 read_s: float = BODY_READ_S):
        self.app, self.max_bytes, self.read_s = app, max_bytes, read_s
        self.expected = f"Bearer {api_key}".encode() if api_key else None

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        if self.expected is not None and not hmac.compare_digest(
                headers.get(b"authorization", b""), self.expected):
            return await error(401, "missing or wrong API key (send 'Authorization: Bearer "
                                     "KEY')", kind="authentication_error",
                                code="invalid_api_key")(scope, receive, send)
        length = headers.get(b"content-length", b"")
        if length.isdigit() and int(length) > self.max_bytes:
            return await self._too_large(int(length))(scope, receive, send)
        body, end = bytearray(), time.monotonic() + self.read_s
        while True:
            try:
                message = await asyncio.wait_for(receive(), max(end - time.monotonic(), 0))
            except asyncio.TimeoutError:
                return await error(408, f"the request body did not arrive within "
                                         f"{self.read_s:g} s")(scope, receive, send)
            if message["type"] == "http.disconnect":
                return None
            body += message.get("body", b"")
            if len(body) > self.max_bytes:
                return await self._too_large(len(body), read=True)(scope, receive, send)
            if not message.get("more_body", False):
                break
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": bytes(body), "more_body": False}
            return await receive()   # after the body: the client's disconnect, if it comes

        return await self.app(scope, replay, send)

    def _too_large(self, n: int, read: bool = False):
        what = f"more than {n} bytes so far" if read else f"{n} bytes"
        return error(413, f"request body of {what}; the limit is {self.max_bytes} bytes")


class H11WithDeadline(H11Protocol):
    """uvicorn's h11 protocol, closing a connection whose request headers have not all
    arrived within ``HEADER_READ_S`` of its start or of its last response (the keep-alive
    timeout covers a silent connection; this one a slow or partial request)."""

    header_read_s = HEADER_READ_S
    _deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._arm()

    def handle_events(self) -> None:
        super().handle_events()
        if self.cycle is not None and not self.cycle.response_complete:
            self._disarm()   # headers in: the body's deadline is the Gate's

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._arm()

    def connection_lost(self, exc) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _arm(self) -> None:
        self._disarm()
        self._deadline = self.loop.call_later(self.header_read_s, self._expire)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _expire(self) -> None:
        self._deadline = None
        if self.cycle is None or self.cycle.response_complete:   # no request running
            self.transport.close()
