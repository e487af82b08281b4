"""Requests answered in the worker's main loop, without a pool thread.

kube-scheduler calls the extender once per pod, serially in its scheduling cycle, on one
kept-alive connection, so each call's round trip is time the scheduler waits. Through
gunicorn's pool a call costs three thread wake-ups (the main loop reads it, a pool thread
answers, the main loop re-arms the connection) plus gunicorn's parser, environ and response
objects: 0.35 ms of CPU per 100-name filter call against 0.13 ms for a minimal Go extender, and
on a loaded machine each wake-up also waits for a free CPU. A route the app lists as inline
(`app.inline_routes_for`: the extender's two verbs, on its own listener) is answered here instead, once the main loop
has read the whole request, when its handler can answer without waiting for anything; a
handler that would wait (a registry lookup, a first list of Nodes) returns None and the request
goes to the pool as before.

Only plain HTTP/1.1 with a Content-Length body up to INLINE_MAX_BODY_BYTES: what kube-scheduler
sends to the extender the chart binds to localhost. TLS, chunked bodies, `Expect`, HTTP/1.0 and
larger bodies (parsing them would hold every other connection of the worker for milliseconds)
go to the pool. An answer the socket cannot take at once is sent as the socket drains, under
REPLY_TIMEOUT_SECONDS.
"""
import logging
import re
import selectors
import ssl
import time
from collections.abc import Callable
from functools import partial
from http import HTTPStatus
from typing import Any

from gunicorn.util import http_date

log = logging.getLogger("archway.server")

# (body, when the request began arriving) -> (status, JSON body), or None: answer in the pool.
InlineHandler = Callable[[bytes, float], "tuple[int, bytes] | None"]

INLINE_MAX_BODY_BYTES = 1024 * 1024   # 5,000 node names are ~250 KB
REPLY_TIMEOUT_SECONDS = 10.0          # for a client that does not read its answer

_REQUEST_LINE = re.compile(rb"([A-Z]+) (/[^ ?#]*)(?:\?[^ ]*)? HTTP/1\.1\r\n")
_CLOSE = re.compile(rb"\r\nconnection[ \t]*:[^\r\n]*\bclose\b", re.IGNORECASE)


def inline_request(head: bytes, routes: dict) -> tuple[InlineHandler, bool] | None:
    """(the route's handler, whether the client asked to close) for a request head (without
    its final CRLF CRLF) of an inline route; None for any other."""
    line = _REQUEST_LINE.match(head + b"\r\n")
    if line is None:
        return None
    handler = routes.get((line.group(1).decode(), line.group(2).decode("latin-1")))
    if handler is None:
        return None
    return handler, _CLOSE.search(head) is not None


_date = ["", 0.0]   # the Date header's value and the second it was made for


def response_bytes(status: int, body: bytes, *, close: bool) -> bytes:
    """An HTTP/1.1 response with a JSON body."""
    now = time.time()
    if int(now) != _date[1]:
        _date[0], _date[1] = http_date(now), int(now)
    return (f"HTTP/1.1 {status} {HTTPStatus(status).phrase}\r\nDate: {_date[0]}\r\n"
            f"Connection: {'close' if close else 'keep-alive'}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
            ).encode() + body


class _Reply:
    """An answer still being sent."""
    __slots__ = ("ahead", "close", "conn", "deadline", "rest")

    def __init__(self, conn, rest: memoryview, close: bool, ahead: bytes):
        self.conn = conn
        self.rest = rest
        self.close = close
        self.ahead = ahead       # bytes of the client's next request, read with this one
        self.deadline = time.monotonic() + REPLY_TIMEOUT_SECONDS


class InlineAnswers:
    """The main-loop side of archway.server.worker.GuardedThreadWorker (mixed into it): answer
    a fully read request of an inline route, or leave it to the pool."""

    # listener address -> {(method, path): InlineHandler}: the app's, set in load_wsgi
    inline_routes_for: Callable[[object], dict] | None = None
    replies: dict   # TConn -> the _Reply still being sent on it
    # What it uses of the worker (gunicorn's ThreadWorker, archway's GuardedThreadWorker).
    alive: bool
    nr: int
    nr_conns: int
    max_requests: int
    max_keepalived: int
    keepalived_conns: Any
    poller: selectors.BaseSelector
    lingering: Any
    _forget: Callable
    _read_ahead: Callable
    on_client_socket_readable: Callable

    def _answered_inline(self, arrival) -> bool:
        """Answer the request `arrival` holds here; False: it goes to the pool untouched."""
        conn, head_end = arrival.conn, arrival.head_end
        if not self.alive or isinstance(conn.sock, ssl.SSLSocket):
            return False
        buf = arrival.buf
        if arrival.need - head_end - 4 > INLINE_MAX_BODY_BYTES:
            return False
        routes = self.inline_routes_for(conn.server) if self.inline_routes_for else {}
        request = inline_request(bytes(buf[:head_end]), routes)
        if request is None:
            return False
        handler, close = request
        try:
            answer = handler(bytes(buf[head_end + 4:arrival.need]), arrival.arrived)
        except Exception:   # answered (500, logged) by the pool's own call of the route
            return False
        if answer is None:
            return False
        self.nr += 1
        if self.nr >= self.max_requests:
            self.alive = False
        close = close or not self.alive or len(self.keepalived_conns) >= self.max_keepalived
        ahead = bytes(buf[arrival.need:])
        self._forget(arrival)
        data = memoryview(response_bytes(*answer, close=close))
        self._send_reply(_Reply(conn, data, close, ahead))
        return True

    def _send_reply(self, reply: _Reply, _fileobj=None) -> None:
        conn = reply.conn
        try:
            sent = conn.sock.send(reply.rest)
        except (BlockingIOError, InterruptedError):
            sent = 0
        except OSError:
            return self._drop_reply(reply)
        reply.rest = reply.rest[sent:]
        if reply.rest:
            self.replies[conn] = reply
            self.poller.modify(conn.sock, selectors.EVENT_WRITE, partial(self._send_reply, reply))
            return None
        self.replies.pop(conn, None)
        self._reply_sent(reply)
        return None

    def _reply_sent(self, reply: _Reply) -> None:
        conn = reply.conn
        if reply.close:
            self.poller.unregister(conn.sock)
            self.nr_conns -= 1
            return self.lingering.close(conn.sock)
        # As gunicorn's finish_request after a kept-alive answer (the socket stays registered:
        # no system call), or, when the client already sent (part of) its next request, as an
        # arriving request.
        if reply.ahead:
            self.poller.unregister(conn.sock)
            return self._read_ahead(conn, reply.ahead)
        conn.set_timeout()
        self.keepalived_conns.append(conn)
        self.poller.modify(conn.sock, selectors.EVENT_READ,
                           partial(self.on_client_socket_readable, conn))
        return None

    def _drop_reply(self, reply: _Reply) -> None:
        self.replies.pop(reply.conn, None)
        try:
            self.poller.unregister(reply.conn.sock)
        except (KeyError, ValueError):
            pass
        self.nr_conns -= 1
        reply.conn.close()

    def _late_replies(self, now: float) -> None:
        """Close the connections whose client did not take its answer in time."""
        for reply in [r for r in self.replies.values() if r.deadline <= now]:
            self._drop_reply(reply)
