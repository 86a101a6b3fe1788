"""What a client may cost the server before a route runs (server/limits.py), on a real
uvicorn server with short limits and an app that echoes the body's size: a partial request
is closed, a slow body gets 408, a large one 413 without being read, a missing key 401, and
other clients are answered meanwhile."""
from __future__ import annotations

import json
import socket
import threading
import time

import pytest

uvicorn = pytest.importorskip("uvicorn")

from specee_cpp.server.limits import Gate, H11WithDeadline  # noqa: E402


async def echo(scope, receive, send):
    """The body's size, as a route would see it."""
    if scope["type"] != "http":
        return
    n, more = 0, True
    while more:
        m = await receive()
        n += len(m.get("body", b""))
        more = m.get("more_body", False)
    body = json.dumps({"n": n}).encode()
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


class Quick(H11WithDeadline):
    header_read_s = 0.5


@pytest.fixture(scope="module")
def port():
    app = Gate(echo, api_key="k", max_bytes=1000, read_s=0.5)
    sock = socket.create_server(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", http=Quick))
    t = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    t.start()
    while not server.started:
        time.sleep(0.01)
    yield sock.getsockname()[1]
    server.should_exit = True
    t.join(timeout=10)


def request(port: int, raw: bytes, timeout: float = 5.0) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        s.sendall(raw)
        out = b""
        while chunk := s.recv(65536):
            out += chunk
            if b"\r\n\r\n" in out and out.endswith(b"}"):
                break
        return out


def post(body: bytes, key: str = "k", length: int | None = None) -> bytes:
    n = len(body) if length is None else length
    return (f"POST / HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {key}\r\n"
            f"Content-Length: {n}\r\n\r\n").encode() + body


def test_a_body_within_the_limits_reaches_the_app_whole(port):
    assert request(port, post(b"x" * 1000)).endswith(b'{"n": 1000}')


def test_a_wrong_or_missing_key_is_401_before_the_body_is_read(port):
    assert b" 401 " in request(port, post(b"x" * 10, key="no"))
    assert b" 401 " in request(port, b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")


def test_a_large_body_is_413_from_its_length_or_as_it_arrives(port):
    said = request(port, post(b"", length=10**9))   # nothing sent: refused from the header
    assert b" 413 " in said and b"1000000000 bytes" in said
    chunked = (b"POST / HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer k\r\n"
               b"Transfer-Encoding: chunked\r\n\r\n" + b"400\r\n" + b"y" * 1024 + b"\r\n")
    assert b" 413 " in request(port, chunked)


def test_a_body_that_stops_arriving_is_408(port):
    t = time.monotonic()
    said = request(port, post(b"x" * 10, length=100))
    assert b" 408 " in said and time.monotonic() - t < 3


def test_partial_requests_are_closed_and_others_answered_meanwhile(port):
    held = []
    for _ in range(50):
        s = socket.create_connection(("127.0.0.1", port))
        s.sendall(b"POST / HTTP/1.1\r\nHost: x\r\n")   # headers never finished
        held.append(s)
    assert request(port, post(b"ok")).endswith(b'{"n": 2}')   # served meanwhile
    time.sleep(1.0)
    for s in held:
        s.settimeout(2)
        assert s.recv(100) == b""   # the server closed it
        s.close()
    # a kept-alive connection whose next request stalls is closed the same way
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        s.sendall(post(b"a"))
        time.sleep(0.2)
        assert s.recv(65536).endswith(b'{"n": 1}')
        s.sendall(b"POST / HTTP/1.1\r\n")
        time.sleep(1.0)
        assert s.recv(100) == b""


def test_an_empty_key_is_refused_by_the_app_too():
    from specee_cpp.errors import SpeceeError
    from specee_cpp.server.app import ServeConfig

    for key in ("", "  "):
        with pytest.raises(SpeceeError, match="API key is empty"):
            ServeConfig("m", mode=None, options=None, api_key=key)
    assert ServeConfig("m", mode=None, options=None, api_key=None).api_key is None
