"""HTTP/1.1 on one connection, without I/O: bytes in, whole requests out, and the bytes of an
answer. The parsing is llhttp's (Node.js' parser, through httptools): request line, headers,
Content-Length and chunked bodies, pipelining. This module adds the limits a server owes its
clients, and says every refusal in JSON (archway.server.routes.error_reply).

    request target  at most MAX_TARGET_BYTES        else 414
    request head    at most MAX_HEAD_BYTES          else 431
    HTTP version    1.0 or 1.1                      else 505
    Expect          100-continue only (answered)    else 417
    body            at most the route's max_body    else 413
    anything llhttp cannot parse                    400, naming what

A request refused before its body (no such route, a body over the route's limit) is still read
to its end when its body is at most DISCARD_LIMIT_BYTES, bytes dropped as they come, so that the
client, still sending, sees the answer rather than a reset and the connection stays usable;
larger bodies are refused at once and the connection closed.
"""
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from email.utils import formatdate

import httptools

from .routes import Reply, Route, Routes, error_reply, phrase

MAX_TARGET_BYTES = 8 * 1024
MAX_HEAD_BYTES = 64 * 1024
# A head is fed to the parser in slices this large, so that one still arriving is measured
# (llhttp keeps a header line's bytes to itself until the line ends).
HEAD_SLICE_BYTES = 4 * 1024
DISCARD_LIMIT_BYTES = 16 * 1024 * 1024
CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"


class HttpError(Exception):
    """What the client sent cannot be read on: answer `reply`, then close the connection."""

    def __init__(self, reply: Reply):
        super().__init__(reply.status)
        self.reply = reply


def refuse(status: int, message: str) -> HttpError:
    return HttpError(error_reply(status, message))


def _head_too_large() -> HttpError:
    return refuse(431, f"request head larger than {MAX_HEAD_BYTES // 1024} KiB")


@dataclass(slots=True)
class Parsed:
    """A whole request: for its route, or refused (`refusal`) after its body was dropped."""
    method: str
    path: str
    query: str
    headers: dict[str, str]
    body: bytes
    arrived: float
    keep_alive: bool
    route: Route | None
    refusal: Reply | None


@dataclass(slots=True)
class _Message:
    began: float
    target: bytearray = field(default_factory=bytearray)
    path: str = ""
    query: str = ""
    headers: dict[str, str] = field(default_factory=dict)
    head_bytes: int = 0
    method: str = ""
    keep_alive: bool = True
    route: Route | None = None
    refusal: Reply | None = None
    body: bytearray = field(default_factory=bytearray)
    dropped: int = 0          # body bytes read and dropped (a refused request's)
    in_body: bool = False
    head_done: bool = False
    head_fed: int = 0         # bytes fed while its head was arriving


class RequestReader:
    """The requests arriving on one connection, in order. `feed` raises HttpError for what
    cannot be read on; what it completes goes to `complete`. `routes` decide each request's body
    limit before its body is read."""

    def __init__(self, routes: Routes, clock: Callable[[], float] = time.monotonic):
        self.routes = routes
        self.clock = clock
        self.complete: deque[Parsed] = deque()
        self.current: _Message | None = None
        self.first_arrival: float | None = None  # the connection's: its first request's start
        self.send_continue = False      # a client waits for "100 Continue" before its body
        self.ended = False              # nothing more is read: an Upgrade came, or a refusal
        self._parser = httptools.HttpRequestParser(self)

    @property
    def held(self) -> int:
        """Bytes of the request still arriving that this reader keeps."""
        current = self.current
        return 0 if current is None else current.head_bytes + len(current.body)

    @property
    def in_body(self) -> bool:
        return self.current is not None and self.current.in_body

    def feed(self, data: bytes | memoryview) -> None:
        """Parse what came; `data` is not kept (the caller may reuse its buffer)."""
        view, at = memoryview(data), 0
        while at < len(view) and not self.ended:
            current = self.current
            sliced = current is None or not current.head_done   # a head may be arriving
            chunk = view[at:at + HEAD_SLICE_BYTES] if sliced else view[at:]
            self._feed(chunk)
            at += len(chunk)
            current = self.current
            if sliced and current is not None and not current.head_done:
                current.head_fed += len(chunk)
                if current.head_fed > MAX_HEAD_BYTES:
                    raise _head_too_large()

    def _feed(self, data) -> None:
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserCallbackError as e:
            if isinstance(e.__context__, HttpError):
                raise e.__context__ from None
            raise
        except httptools.HttpParserUpgrade:
            # The request before it is complete and answered; archway switches to nothing.
            self.ended = True
            if self.complete:
                self.complete[-1].keep_alive = False
        except httptools.HttpParserInvalidMethodError:
            raise refuse(400, "malformed HTTP request: not an HTTP method") from None
        except httptools.HttpParserError as e:
            raise refuse(400, f"malformed HTTP request: {e}") from None

    # --- llhttp's callbacks (inside feed) -------------------------------------------------------
    def on_message_begin(self) -> None:
        began = self.first_arrival if self.first_arrival is not None else self.clock()
        self.first_arrival = None
        self.current = _Message(began)

    def on_url(self, fragment: bytes) -> None:
        message = self.current
        assert message is not None
        message.target += fragment
        message.head_bytes += len(fragment)
        if len(message.target) > MAX_TARGET_BYTES:
            raise refuse(414, f"request target longer than {MAX_TARGET_BYTES // 1024} KiB")

    def on_header(self, name: bytes, value: bytes) -> None:
        message = self.current
        assert message is not None
        message.head_bytes += len(name) + len(value) + 4
        if message.head_bytes > MAX_HEAD_BYTES:
            raise _head_too_large()
        key = name.decode("latin-1").lower()
        text = value.decode("latin-1")
        headers = message.headers
        headers[key] = f"{headers[key]}, {text}" if key in headers else text

    def on_headers_complete(self) -> None:
        message = self.current
        assert message is not None
        version = self._parser.get_http_version()
        if version not in ("1.1", "1.0"):
            raise refuse(505, f"HTTP/{version} is not served: archway speaks HTTP/1.1")
        message.method = self._parser.get_method().decode("latin-1")
        tokens = {t.strip().lower() for t in message.headers.get("connection", "").split(",")}
        message.keep_alive = "close" not in tokens if version == "1.1" else "keep-alive" in tokens
        path, _, query = message.target.decode("latin-1").partition("?")
        message.path, message.query = path.partition("#")[0], query.partition("#")[0]
        found = self.routes.find(message.method, message.path)
        expect = message.headers.get("expect")
        if expect is not None and expect.lower() != "100-continue":
            raise refuse(417, f"Expect: {expect} is not supported")
        length = self._content_length(message)
        chunked = "transfer-encoding" in message.headers
        if isinstance(found, Route):
            message.route = found
            if length is not None and length > found.max_body:
                message.refusal = found.too_large(length)
        else:
            message.refusal = found
        has_body = chunked or bool(length)
        if message.refusal is not None and has_body and (
                length is None or length > DISCARD_LIMIT_BYTES or expect is not None):
            raise HttpError(message.refusal)   # not worth reading: answered, then closed
        message.in_body = has_body
        message.head_done = True
        self.send_continue = expect is not None and has_body

    def on_body(self, data: bytes) -> None:
        message = self.current
        assert message is not None
        if message.refusal is not None:
            message.dropped += len(data)
            if message.dropped > DISCARD_LIMIT_BYTES:
                raise HttpError(message.refusal)
            return
        message.body += data
        route = message.route
        assert route is not None
        if len(message.body) > route.max_body:   # a chunked body has no length to refuse early
            message.refusal = route.too_large(None)
            message.dropped, message.body = len(message.body), bytearray()

    def on_message_complete(self) -> None:
        message = self.current
        assert message is not None
        self.current = None
        self.complete.append(Parsed(
            message.method, message.path, message.query, message.headers,
            bytes(message.body), message.began, message.keep_alive, message.route,
            message.refusal))

    @staticmethod
    def _content_length(message: _Message) -> int | None:
        text = message.headers.get("content-length")
        return int(text) if text is not None else None   # llhttp checked its digits


class _DateHeader:
    """The Date header's value, made once a second."""

    def __init__(self):
        self.second, self.value = -1, ""

    def now(self) -> str:
        second = int(time.time())
        if second != self.second:
            self.second, self.value = second, formatdate(second, usegmt=True)
        return self.value


_date = _DateHeader()


def response_bytes(reply: Reply, *, close: bool, head_only: bool = False) -> bytes:
    """The HTTP/1.1 answer carrying `reply` (its body left out for a HEAD request)."""
    extra = "".join(f"{name}: {value}\r\n" for name, value in reply.headers)
    head = (f"HTTP/1.1 {reply.status} {phrase(reply.status)}\r\nServer: archway\r\n"
            f"Date: {_date.now()}\r\n"
            f"Connection: {'close' if close else 'keep-alive'}\r\n"
            f"Content-Type: {reply.content_type}\r\nContent-Length: {len(reply.body)}\r\n"
            f"{extra}\r\n").encode("latin-1")
    return head if head_only else head + reply.body
