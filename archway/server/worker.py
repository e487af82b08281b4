"""The gunicorn worker `archway serve` runs: gthread, with what a client controls kept out of the
thread pool, and connections spread over the workers.

Slow clients. gunicorn's gthread worker hands a connection to a pool thread as soon as a byte
arrives; the thread then blocks in the TLS handshake and in reading the request head for as long
as the client likes. 16 connections that sent 3 bytes of a ClientHello (or half a request line)
and stalled held every thread of a 2 x 8 server, and the webhook stopped answering (issue 16).
Here the main loop does those steps itself, non-blocking, each under a deadline:

    accept -> TLS handshake (HANDSHAKE_TIMEOUT_SECONDS)
           -> request head, and a body up to server.max_body_bytes with a Content-Length
              (HEADER_TIMEOUT_SECONDS, then BODY_TIMEOUT_SECONDS)
           -> a pool thread, which finds the whole request already read (or, for the app's
              inline routes, an answer written by the main loop itself: archway.server.inline)

A kept-alive connection goes through the same steps from its next request's first byte; one
that ends after its answer lingers in the poller until its client closes (archway.server.linger).

When a request began arriving (its connection's accept, or a kept-alive request's first byte)
goes to the app in the WSGI environ (archway.deadline.ARRIVED), with whether the main loop read
its whole body (archway.requestbody.BODY_READ): a request that waited in the queue for a thread,
behind others held by slow lookups, has that much less time before the apiserver gives up on
it, and the webhook counts its deadline from there. The main loop notes both against the
connection's socket as it hands the request over; gunicorn builds the environ in the pool thread
and puts that socket in it, and the worker's WSGI entry moves the note into the environ.

A worker holds at most MAX_CONNECTIONS connections and PREREAD_BUDGET_BYTES of partial requests:
past either, the oldest partial request (else the oldest idle kept-alive connection) is closed
to make room. Every cut is counted in archway_client_connections_cut_total{reason} and
summarised in one log line per LOG_EVERY_SECONDS.

Spreading connections over the workers' own listening sockets: archway.server.listeners.
"""
import errno
import logging
import re
import selectors
import socket
import ssl
import time
from collections import Counter, OrderedDict
from collections.abc import Callable
from functools import partial

from gunicorn import http
from gunicorn.sock import ssl_context
from gunicorn.workers.gthread import TConn, ThreadWorker

from archway import metrics
from archway.deadline import ARRIVED
from archway.logs import JsonFormatter
from archway.logsafe import SafeFormatter, escape
from archway.requestbody import BODY_READ

from .inline import InlineAnswers
from .linger import Lingering
from .listeners import own_listener

log = logging.getLogger("archway.server")

HANDSHAKE_TIMEOUT_SECONDS = 5.0   # from accept to the end of the TLS handshake
HEADER_TIMEOUT_SECONDS = 5.0      # from the handshake (or a kept-alive request's first byte)
BODY_TIMEOUT_SECONDS = 10.0       # from the request head to the end of a pre-read body
MAX_HEAD_BYTES = 64 * 1024        # a request head larger than this is refused (431)
MAX_CONNECTIONS = 1024            # per worker: open connections, whatever their state
PREREAD_BUDGET_BYTES = 64 * 1024 * 1024   # per worker: bytes held for partial requests
LOG_EVERY_SECONDS = 10.0
_SWEEP_EVERY_SECONDS = 0.25
_RECV_BYTES = 256 * 1024

_CONTENT_LENGTH = re.compile(rb"\r\ncontent-length[ \t]*:[ \t]*([0-9]{1,15})[ \t]*(?=\r\n)",
                             re.IGNORECASE)
# Bodies the thread reads itself: chunked ones (no length to wait for) and those whose client
# waits for "100 Continue" before sending them.
_THREAD_READS_BODY = re.compile(rb"\r\n(?:transfer-encoding|expect)[ \t]*:", re.IGNORECASE)
_TOO_LARGE = (b"HTTP/1.1 431 Request Header Fields Too Large\r\nContent-Type: application/json"
              b"\r\nContent-Length: 45\r\nConnection: close\r\n\r\n"
              b'{"error": "request head larger than 64 KiB"}\n')


def body_to_preread(head: bytes, limit: int) -> int:
    """How many body bytes to read before the request goes to a thread: the Content-Length when
    it is at most `limit` and nothing else decides how the body comes; else 0 (the thread reads
    it, bounded by the app). `head` is the request head without its final CRLF CRLF."""
    if _THREAD_READS_BODY.search(head):
        return 0
    lengths = _CONTENT_LENGTH.findall(head + b"\r\n")
    if len(lengths) != 1:
        return 0   # none, or several: gunicorn's parser answers 400 for conflicting ones
    length = int(lengths[0])
    return length if length <= limit else 0


class _Arrival:
    """A connection whose request (or TLS handshake) is still arriving."""
    __slots__ = ("arrived", "buf", "conn", "deadline", "head_end", "need", "scanned", "stage")

    def __init__(self, conn: TConn, stage: str, arrived: float, timeout: float):
        self.conn = conn
        self.stage = stage          # "handshake", "header" or "body": what a timeout cut off
        self.arrived = arrived      # time.monotonic() when the request began arriving
        self.deadline = arrived + timeout
        self.buf = bytearray()
        self.scanned = 0            # where to resume looking for the end of the head
        self.head_end = 0           # where the head's final CRLF CRLF begins, once it is in
        self.need: int | None = None  # total bytes of head + pre-read body, once the head is in


class GuardedThreadWorker(InlineAnswers, ThreadWorker):
    """gunicorn's gthread worker (see the module docstring for what changes), answering the
    app's inline routes in its main loop (archway.server.inline)."""

    #: Bodies up to this size are read in the main loop; `archway serve` sets it to
    #: server.max_body_bytes (the extender's larger bodies are read by their thread).
    preread_limit = 3 * 1024 * 1024
    sockets: list   # the listeners this worker polls (gunicorn's Worker sets them)
    wsgi: Callable  # the app (gunicorn's Worker.load_wsgi sets it)

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.arrivals: OrderedDict[TConn, _Arrival] = OrderedDict()   # oldest first
        self.buffered = 0
        self.own_listeners: list[socket.socket] = []
        self.shared_listeners: list = []   # the master's, until run() stops them listening
        # socket descriptor -> (arrived, body read) of the request handed to a pool thread on
        # it, until the app is called (_hand_over, load_wsgi)
        self.handed_over: dict[int, tuple[float, bool]] = {}
        self.replies = {}
        self._next_sweep = 0.0
        self._cuts: Counter[str] = Counter()
        self._last_cut_peer = "-"
        self._next_log = 0.0

    # --- start and stop -------------------------------------------------------------------------
    def init_process(self) -> None:
        # gunicorn's own lines ("Invalid request from ip=...: ...") quote what clients sent.
        # JSON lines (server.log_format: json) escape control characters already.
        for handler in self.log.error_log.handlers:
            current = handler.formatter or logging.Formatter()
            if not isinstance(current, (SafeFormatter, JsonFormatter)):
                handler.setFormatter(SafeFormatter(current._fmt, current.datefmt))
        if self.cfg.reuse_port:
            own = [s for s in map(own_listener, self.sockets) if s is not None]
            if own and len(own) == len(self.sockets):
                self.shared_listeners, self.sockets = list(self.sockets), own
                self.own_listeners = own
            else:   # keep polling the shared socket(s): spread by whichever worker wakes first
                for listener in own:
                    listener.close()
        super().init_process()   # runs the worker: returns only when it stops

    def run(self) -> None:
        # The master's socket belongs to the same SO_REUSEPORT group and would still get its
        # share of new connections, accepted by whichever worker wakes first: take in what it
        # holds, then stop it listening (for every worker: they share that one socket), so the
        # kernel's hash alone spreads connections over the workers' own sockets. What is taken
        # in may be answered (and closed) at once: archway.server.inline.
        self.lingering = Lingering(self.poller)
        for shared in self.shared_listeners:
            try:
                shared.setblocking(False)
                for _ in range(MAX_CONNECTIONS):
                    if not self._accept_one(shared):
                        break
                shared.shutdown(socket.SHUT_RD)
            except OSError:
                pass   # already stopped by a sibling worker
        self.shared_listeners = []
        super().run()

    def set_accept_enabled(self, enabled: bool) -> None:
        super().set_accept_enabled(enabled)
        if not enabled and not self.alive and self.own_listeners:
            # Stopping: a connection left in this worker's own accept queue would be reset when
            # the socket closes, so take in what is queued (it is answered with
            # "Connection: close") and close the socket, leaving new ones to the other sockets.
            for listener in self.own_listeners:
                for _ in range(MAX_CONNECTIONS):
                    if not self._accept_one(listener):
                        break
                listener.close()
            self.sockets = [s for s in self.sockets if s not in self.own_listeners]
            self.own_listeners = []

    # --- new connections -----------------------------------------------------------------------
    def accept(self, listener) -> None:
        self._accept_one(listener)

    def _accept_one(self, listener) -> bool:
        try:
            client, address = listener.accept()
        except OSError as e:
            if e.errno in (errno.EAGAIN, errno.EWOULDBLOCK, errno.ECONNABORTED, errno.EBADF,
                           errno.EINVAL):   # EINVAL: a listener no longer listening
                return False
            if e.errno in (errno.EMFILE, errno.ENFILE):
                # Out of descriptors: make room rather than spin on a listener we cannot serve.
                self._make_room()
                return False
            raise
        if self.nr_conns >= MAX_CONNECTIONS:
            self._make_room()
        self.nr_conns += 1
        conn = TConn(self.cfg, client, address, listener.getsockname())  # non-blocking
        now = time.monotonic()
        if self.cfg.is_ssl:
            conn.sock = ssl_context(self.cfg).wrap_socket(
                client, server_side=True, do_handshake_on_connect=False,
                suppress_ragged_eofs=self.cfg.suppress_ragged_eofs)
            arrival = _Arrival(conn, "handshake", now, HANDSHAKE_TIMEOUT_SECONDS)
        else:
            arrival = _Arrival(conn, "header", now, HEADER_TIMEOUT_SECONDS)
        self.arrivals[conn] = arrival
        self.poller.register(conn.sock, selectors.EVENT_READ, partial(self._on_event, arrival))
        self._advance(arrival)   # a fast client's ClientHello is usually here already
        return True

    def on_client_socket_readable(self, conn: TConn, client) -> None:
        """A kept-alive connection's next request begins: read it here, not in a thread."""
        try:
            self.keepalived_conns.remove(conn)
        except ValueError:
            return   # closed to make room earlier in this batch of events
        arrival = _Arrival(conn, "header", time.monotonic(), HEADER_TIMEOUT_SECONDS)
        self.arrivals[conn] = arrival
        self.poller.modify(conn.sock, selectors.EVENT_READ, partial(self._on_event, arrival))
        self._advance(arrival)

    def finish_request(self, conn: TConn, fs) -> None:
        """A request is answered. When the client already sent (part of) its next one, which the
        thread read ahead into the parser's buffer or TLS holds decrypted, gunicorn would hand
        the connection straight back to a thread that then blocks on the rest: read the rest
        here instead, like any other arriving request."""
        answered = fs.result() if not fs.cancelled() and fs.exception() is None else None
        if answered is False:   # the last answer: gunicorn's close would block this loop
            self.nr_conns -= 1
            return self.lingering.close(conn.sock)
        if answered is True and conn.parser is not None and not conn.is_http2:
            ahead = conn.parser.unreader.take_buffered()
            if ahead or (isinstance(conn.sock, ssl.SSLSocket) and conn.sock.pending()):
                conn.sock.setblocking(False)
                return self._read_ahead(conn, ahead)
        super().finish_request(conn, fs)

    def _read_ahead(self, conn: TConn, ahead: bytes) -> None:
        """The next request on `conn`, of which `ahead` was read already: on as it arrives."""
        arrival = _Arrival(conn, "header", time.monotonic(), HEADER_TIMEOUT_SECONDS)
        arrival.buf += ahead
        self.buffered += len(ahead)
        self.arrivals[conn] = arrival
        self.poller.register(conn.sock, selectors.EVENT_READ, partial(self._on_event, arrival))
        if self._complete(arrival):
            self._hand_over(arrival)
        else:
            self._advance(arrival)

    def _on_event(self, arrival: _Arrival, _fileobj) -> None:
        # An event of a connection closed earlier in the same batch of events (to make room, or
        # past the partial-request budget) is stale: handling it would close it twice.
        if self.arrivals.get(arrival.conn) is arrival:
            self._advance(arrival)

    # --- reading what arrives, without blocking -------------------------------------------------
    def _advance(self, arrival: _Arrival) -> None:
        conn = arrival.conn
        try:
            if arrival.stage == "handshake":
                try:
                    conn.sock.do_handshake()
                except ssl.SSLWantReadError:
                    return self._wait(arrival, selectors.EVENT_READ)
                except ssl.SSLWantWriteError:
                    return self._wait(arrival, selectors.EVENT_WRITE)
                arrival.stage = "header"
                arrival.deadline = time.monotonic() + HEADER_TIMEOUT_SECONDS
            while True:
                try:
                    data = conn.sock.recv(_RECV_BYTES)
                except (ssl.SSLWantReadError, BlockingIOError, InterruptedError):
                    return self._wait(arrival, selectors.EVENT_READ)
                except ssl.SSLWantWriteError:
                    return self._wait(arrival, selectors.EVENT_WRITE)
                if not data:
                    return self._close(arrival, None)   # the client went away
                arrival.buf += data
                self.buffered += len(data)
                if self._complete(arrival):
                    return self._hand_over(arrival)
                if arrival.need is None and len(arrival.buf) > MAX_HEAD_BYTES:
                    return self._close(arrival, "header_too_large", answer=_TOO_LARGE)
                self._within_budget(arrival)
        except (OSError, ValueError) as e:   # ssl.SSLError is an OSError
            stage = arrival.stage
            reason = "tls_failed" if stage == "handshake" and not _is_reset(e) else None
            return self._close(arrival, reason)

    def _complete(self, arrival: _Arrival) -> bool:
        buf = arrival.buf
        if arrival.need is None:
            end = buf.find(b"\r\n\r\n", arrival.scanned)
            if end < 0:
                arrival.scanned = max(0, len(buf) - 3)
                return False
            arrival.head_end = end
            arrival.need = end + 4 + body_to_preread(bytes(buf[:end]), self.preread_limit)
            if arrival.need > end + 4:
                arrival.stage = "body"
                arrival.deadline = time.monotonic() + BODY_TIMEOUT_SECONDS
        return len(buf) >= arrival.need

    def _wait(self, arrival: _Arrival, events: int) -> None:
        key = self.poller.get_key(arrival.conn.sock)
        if key.events != events:
            self.poller.modify(arrival.conn.sock, events, key.data)

    def _hand_over(self, arrival: _Arrival) -> None:
        if arrival.stage == "body" and self.inline_routes_for and self._answered_inline(arrival):
            return
        conn = arrival.conn
        self._forget(arrival)
        self.poller.unregister(conn.sock)
        if conn.parser is None:   # a new connection: what TConn.init would have done
            conn.parser = http.get_parser(self.cfg, conn.sock, conn.client)
            conn.initialized = True
        conn.data_ready = True
        conn.parser.unreader.unread(bytes(arrival.buf))
        # For the app, in the thread: when it arrived, and whether its body is all here. A
        # note left by a request that failed before the app is replaced by the next hand-over
        # on that descriptor, before its app call.
        self.handed_over[conn.sock.fileno()] = (arrival.arrived, arrival.stage == "body")
        self.enqueue_req(conn)

    # --- in a pool thread ---------------------------------------------------------------------
    def load_wsgi(self) -> None:
        """The app, called with its request's arrival and body state in the environ."""
        super().load_wsgi()
        app, handed_over = self.wsgi, self.handed_over
        self.inline_routes_for = getattr(app, "inline_routes_for", None)

        def told_of_arrival(environ, start_response):
            sock = environ.get("gunicorn.socket")   # gunicorn's: the connection's own socket
            note = handed_over.pop(sock.fileno(), None) if sock is not None else None
            if note is not None:
                environ[ARRIVED], environ[BODY_READ] = note
            return app(environ, start_response)

        self.wsgi = told_of_arrival

    # --- cutting off ------------------------------------------------------------------------------
    def _forget(self, arrival: _Arrival) -> None:
        del self.arrivals[arrival.conn]
        self.buffered -= len(arrival.buf)

    def _close(self, arrival: _Arrival, reason: str | None, answer: bytes = b"") -> None:
        """Close a connection still arriving; `reason`: why it is cut off (None: the client
        closed it, or reset it, which is no news)."""
        conn = arrival.conn
        self._forget(arrival)
        try:
            self.poller.unregister(conn.sock)
        except (KeyError, ValueError):
            pass
        if answer:
            try:
                conn.sock.send(answer)   # best effort: a full socket buffer drops it
            except (OSError, ValueError):
                pass
        self.nr_conns -= 1
        conn.close()
        if reason:
            self._cut(reason, conn.client)

    def _cut(self, reason: str, client) -> None:
        metrics.client_cut(reason)
        self._cuts[reason] += 1
        self._last_cut_peer = _peer(client)
        now = time.monotonic()
        if now >= self._next_log:
            self._log_cuts(now)

    def _log_cuts(self, now: float) -> None:
        if self._cuts:
            counts = ", ".join(f"{reason} {n}" for reason, n in sorted(self._cuts.items()))
            log.warning("cut off %d client connection(s) (%s; last from %s): slow or stalled "
                        "clients, or more than this worker holds (%d connections, %d MiB of "
                        "partial requests)", sum(self._cuts.values()), counts,
                        escape(self._last_cut_peer), MAX_CONNECTIONS,
                        PREREAD_BUDGET_BYTES // 2**20)
            self._cuts.clear()
        self._next_log = now + LOG_EVERY_SECONDS

    def _make_room(self) -> None:
        """Close the oldest partial request, else the oldest idle kept-alive connection."""
        if self.arrivals:
            self._close(next(iter(self.arrivals.values())), "overflow")
        elif self.keepalived_conns:
            conn = self.keepalived_conns.popleft()
            try:
                self.poller.unregister(conn.sock)
            except (KeyError, ValueError):
                pass
            self.nr_conns -= 1
            conn.close()
            self._cut("overflow", conn.client)

    def _within_budget(self, reading: _Arrival) -> None:
        while self.buffered > PREREAD_BUDGET_BYTES:
            oldest = next(iter(self.arrivals.values()))
            if oldest is reading:
                break   # the one reading now is the oldest: let it finish or time out
            self._close(oldest, "overflow")

    def murder_pending(self) -> None:
        """Called by gunicorn's loop after every wake-up: also cut arrivals past deadline."""
        super().murder_pending()
        now = time.monotonic()
        if now < self._next_sweep:
            return
        self._next_sweep = now + _SWEEP_EVERY_SECONDS
        late = [a for a in self.arrivals.values() if a.deadline <= now]
        for arrival in late:
            self._close(arrival, f"{arrival.stage}_timeout")
        self.lingering.sweep(now)
        self._late_replies(now)
        if self._cuts and now >= self._next_log:
            self._log_cuts(now)


def _is_reset(e: Exception) -> bool:
    return isinstance(e, (ConnectionResetError, BrokenPipeError)) or (
        isinstance(e, ssl.SSLError) and e.reason in ("UNEXPECTED_EOF_WHILE_READING",))


def _peer(client) -> str:
    if isinstance(client, tuple) and client:
        return str(client[0])
    return str(client or "-")
