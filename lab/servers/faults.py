"""Hostile peers on loopback, for fault injection (real sockets, no mocks).

    drip = DripServer(phase="headers")   # answers 1 byte per `interval`, forever
    hole = BlackHole()                   # accepts, reads, never answers (also a recording listener)
    web = ScriptedServer(respond)        # every answer from respond(Request) -> (status, headers, body)
    web = ScriptedServer(respond, tls=issued_cert)   # the same over TLS

Each records what reached it, and the drip server and black hole record when the client gave
up: `wait_closed(n)` returns once n connections were closed by the client, which is how a test
sees that no archway thread is left reading from a hostile peer.
"""
import select
import socket
import threading
from collections.abc import Callable
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler

from lab.httpd import BackgroundHTTPServer


class _Recording:
    """Connections accepted and connections the client closed, with a condition to wait on."""

    def __init__(self) -> None:
        self.accepted = 0
        self.closed = 0
        self._cond = threading.Condition()

    def _note(self, what: str) -> None:
        with self._cond:
            setattr(self, what, getattr(self, what) + 1)
            self._cond.notify_all()

    def wait_closed(self, count: int = 1, timeout: float = 10.0) -> bool:
        """True once `count` connections were closed by the client (False after `timeout`)."""
        with self._cond:
            return self._cond.wait_for(lambda: self.closed >= count, timeout)


class _RawServer(_Recording):
    """Accepts on 127.0.0.1 and hands each connection to `serve(conn)` in its own thread."""

    def __init__(self) -> None:
        super().__init__()
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self._stopping = threading.Event()
        self._conns: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def host(self) -> str:
        return f"127.0.0.1:{self.port}"

    def _accept(self) -> None:
        while not self._stopping.is_set():
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return
            self._conns.append(conn)
            self._note("accepted")
            threading.Thread(target=self._run, args=(conn,), daemon=True).start()

    def _run(self, conn: socket.socket) -> None:
        try:
            if self.serve(conn):
                self._note("closed")
        except OSError:   # reset or broken pipe: the client went away
            self._note("closed")
        except ValueError:   # stop() closed the socket under select(): the test is over
            pass

    def serve(self, conn: socket.socket) -> bool:
        """Talk to one client; True when the client closed the connection."""
        raise NotImplementedError

    def _peer_gone(self, conn: socket.socket, wait: float) -> bool:
        """Wait up to `wait` s for the client to close; True if it did (data it sends is read)."""
        readable, _, _ = select.select([conn], [], [], wait)
        return bool(readable) and conn.recv(65536) == b""

    def stop(self) -> None:
        self._stopping.set()
        self._listener.close()
        for conn in self._conns:
            try:
                conn.close()
            except OSError:
                pass


class BlackHole(_RawServer):
    """Accepts connections and reads what comes, never answering a byte."""

    def serve(self, conn: socket.socket) -> bool:
        while not self._stopping.is_set():
            if self._peer_gone(conn, 0.05):
                return True
        return False


class DripServer(_RawServer):
    """An HTTP peer that answers one byte per `interval` seconds and never finishes.

    phase "headers": the status line and an endless header, byte by byte. phase "body": the
    headers at once (200, a Content-Length of 1 MiB), then the body byte by byte. phase
    "handshake": to a TLS client, the record header of a 16 KiB ServerHello, then byte by byte.
    The first `quick_answers` requests on a connection get a prompt `{}` (keep-alive) instead.
    """

    def __init__(self, phase: str = "headers", interval: float = 1.0, quick_answers: int = 0) -> None:
        self.phase = phase
        self.interval = interval
        self.quick_answers = quick_answers
        super().__init__()

    def serve(self, conn: socket.socket) -> bool:
        if self.phase == "handshake":
            return self._drip(conn, b"\x16\x03\x03\x40\x00" + b"\x02" * 16384)
        for answered in range(self.quick_answers + 1):
            request = b""
            while b"\r\n\r\n" not in request:
                readable, _, _ = select.select([conn], [], [], 0.05)
                if self._stopping.is_set():
                    return False
                if readable:
                    data = conn.recv(65536)
                    if not data:
                        return True
                    request += data
            if answered < self.quick_answers:
                conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n{}")
        if self.phase == "body":
            conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                         b"Content-Length: 1048576\r\n\r\n")
            return self._drip(conn, b"{" + b" " * 1_048_575)
        return self._drip(conn, b"HTTP/1.1 200 OK\r\nX-Drip: " + b"a" * 1_000_000)

    def _drip(self, conn: socket.socket, data: bytes) -> bool:
        for i in range(len(data)):
            if self._stopping.is_set():
                return False
            conn.sendall(data[i:i + 1])
            if self._peer_gone(conn, self.interval):
                return True
        return False


@dataclass
class Request:
    method: str
    path: str
    headers: dict
    body: bytes
    scheme: str


Respond = Callable[[Request], tuple[int, dict, bytes]]


class ScriptedServer:
    """An HTTP(S) server whose every answer comes from `respond(request)`; records each request.

    For fault injection only: redirects, 429s, odd challenges, answers no real registry gives.
    """

    def __init__(self, respond: Respond, tls=None) -> None:
        self.respond = respond
        self.requests: list[Request] = []
        self.scheme = "https" if tls is not None else "http"
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):  # keep test output quiet
                pass

            def _handle(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(min(length, 1 << 20)) if length else b""
                request = Request(self.command, self.path, dict(self.headers), body, server.scheme)
                server.requests.append(request)
                status, headers, answer = server.respond(request)
                self.send_response(status)
                for key, value in headers.items():
                    self.send_header(key, value)
                self.send_header("Content-Length", str(len(answer)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(answer)

            do_GET = do_POST = do_HEAD = do_PUT = _handle

        self._server = BackgroundHTTPServer(Handler, tls=tls)
        self.port = self._server.port

    @property
    def host(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def url(self) -> str:
        return f"{self.scheme}://{self.host}"

    def stop(self) -> None:
        self._server.stop()


