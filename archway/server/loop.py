"""The connection loop of one worker process: every socket operation, non-blocking, in one
thread; handler threads only compute answers.

    accept -> TLS: the first byte (a ClientHello, or plain HTTP: a 400 that says so)
           -> handshake                          HANDSHAKE_TIMEOUT_SECONDS from accept
           -> request head                       HEADER_TIMEOUT_SECONDS (from the handshake, a
                                                 kept-alive request's first byte, or the end of
                                                 the answer before a pipelined one)
           -> body, up to the route's limit      BODY_TIMEOUT_SECONDS from the head
           -> the answer: on this loop when the route's handler can give it at once (a cache
              hit: no thread hand-off at all), else from a handler thread
           -> written as the client takes it     REPLY_TIMEOUT_SECONDS
           -> kept alive (keepalive seconds), or closed as RFC 9112 9.6 asks (archway.server.linger)

What a client controls never holds a thread: a slow or stalled client costs a socket and the
bytes it sent, and is cut off at its deadline (a 408 when part of a request came). A worker
holds at most MAX_CONNECTIONS connections and PREREAD_BUDGET_BYTES of partial requests: past
either, the oldest partial request (else the oldest idle connection) is closed to make room.
Every cut is counted in archway_client_connections_cut_total{reason} and summarised in one log
line per LOG_EVERY_SECONDS.

A request's arrival (its connection's accept, or its first byte) goes to the handler: the
webhook counts its deadline from there, so time spent waiting for a thread is time spent.
"""
import errno
import logging
import os
import selectors
import socket
import ssl
import time
from collections import Counter, OrderedDict, deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from archway import metrics
from archway.logsafe import escape

from .http1 import CONTINUE, HttpError, Parsed, RequestReader, response_bytes
from .linger import Lingering
from .routes import Reply, Request, Route, Site, answer, error_reply, first_answer

log = logging.getLogger("archway.server")

HANDSHAKE_TIMEOUT_SECONDS = 5.0   # from accept to the end of the TLS handshake
HEADER_TIMEOUT_SECONDS = 5.0
BODY_TIMEOUT_SECONDS = 10.0       # from the end of the head to the end of the body
REPLY_TIMEOUT_SECONDS = 10.0      # for a client that does not read its answer
MAX_CONNECTIONS = 1024            # open connections per worker, whatever their state
PREREAD_BUDGET_BYTES = 64 * 1024 * 1024   # per worker: bytes held for partial requests
# Bodies larger than this are answered on a thread even by an `on_loop` route: parsing 50 MB of
# Nodes on the loop would hold every other connection of the worker.
LOOP_MAX_BODY_BYTES = 1024 * 1024
LOG_EVERY_SECONDS = 10.0
PLAIN_ON_TLS = ("this port serves HTTPS: the request came as plain HTTP; use https:// and "
                "archway's CA (curl --cacert ...)")
_SWEEP_EVERY_SECONDS = 0.25
_RECV_BYTES = 256 * 1024
_PLAIN_HEAD_BYTES = 8 * 1024      # of a plain-HTTP request on the TLS port, read before the 400
_TLS_HANDSHAKE = 0x16             # the first byte of every TLS record that opens a connection
_ACCEPTS_PER_WAKE = 64
_READ, _WRITE = selectors.EVENT_READ, selectors.EVENT_WRITE
_PARTIAL = frozenset({"sniff", "handshake", "plain", "head", "body"})


class _Conn:
    __slots__ = ("answering", "closed", "close_after", "deadline", "events", "fd", "head_only",
                 "held", "out", "peer", "phase", "plain", "port", "reader", "sock")

    def __init__(self, sock: socket.socket, peer: str, port: int | None, reader: RequestReader,
                 phase: str, deadline: float):
        self.sock = sock
        self.fd = sock.fileno()
        self.peer = peer
        self.port = port
        self.reader = reader
        # sniff, handshake, plain (HTTP on the TLS port), head, body, idle, answer
        self.phase = phase
        self.deadline = deadline
        self.events = 0               # what the selector watches for it (0: not registered)
        self.held = 0                 # bytes of partial requests counted in Loop.held
        self.out: memoryview | None = None   # an answer still being written
        self.close_after = False      # the answer being written is the last
        self.head_only = False
        self.answering = False        # a request is with a handler thread
        self.plain = bytearray()      # a plain-HTTP request on the TLS port, so far
        self.closed = False


class Loop:
    """`listeners`: the sockets to accept on (non-blocking); `own`: those this worker may close
    when it stops (the rest are the master's, shared); `site`: the routes; `tls`: the server
    context, None for plain HTTP; `threads`: handler threads; `keepalive`: seconds an idle
    connection stays open; `wakeup_fd`: a descriptor whose bytes mean "look at alive()" (a
    signal arrived); `max_requests`: answers after which the worker stops (None: no limit)."""

    def __init__(self, listeners: list, site: Site, *, tls: ssl.SSLContext | None, threads: int,
                 keepalive: float, own: tuple = (), wakeup_fd: int | None = None,
                 max_requests: int | None = None, clock: Callable[[], float] = time.monotonic):
        self.listeners = list(listeners)
        self.own = set(own)
        self.site = site
        self.tls = tls
        self.keepalive = keepalive
        self.max_requests = max_requests
        self.clock = clock
        self.selector = selectors.DefaultSelector()
        self.conns: OrderedDict[int, _Conn] = OrderedDict()   # by descriptor, oldest first
        self.held = 0
        self.answered = 0
        self.stopping = False
        self.pool = ThreadPoolExecutor(max_workers=max(1, threads),
                                       thread_name_prefix="archway-handler")
        self.finished: deque[tuple[_Conn, Reply]] = deque()   # from the handler threads
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self.selector.register(self._wake_r, _READ, self._drain_wakeups)
        if wakeup_fd is not None:
            self.selector.register(wakeup_fd, _READ, self._drain_fd)
        for listener in self.listeners:
            listener.setblocking(False)
            self.selector.register(listener, _READ, listener)
        self.lingering = Lingering(self.selector)
        # Every read lands here: a fresh 256 KiB bytes object per read cost more than the rest
        # of a small request's reading (its allocation and release, 20 us).
        self._buffer = memoryview(bytearray(_RECV_BYTES))
        self._cuts: Counter[str] = Counter()
        self._last_cut_peer = "-"
        self._next_log = 0.0
        self._next_sweep = 0.0

    # --- the loop ---------------------------------------------------------------------------
    def run(self, alive: Callable[[], bool], heartbeat: Callable[[], None],
            graceful_seconds: float) -> None:
        """Serve until `alive()` turns False (or max_requests), then finish what is under way
        for at most `graceful_seconds`. `heartbeat` is called about once a second."""
        beat, stop_by = 0.0, None
        while True:
            now = self.clock()
            if now >= beat:
                heartbeat()
                beat = now + 1.0
            if stop_by is None and (not alive() or self.stopping):
                stop_by = now + graceful_seconds
                self._stop_listening()
            if stop_by is not None and (not self._busy() or now >= stop_by):
                break
            for key, events in self.selector.select(_SWEEP_EVERY_SECONDS):
                self._dispatch(key, events)
            self._sweep(self.clock())
        self.pool.shutdown(wait=False, cancel_futures=True)
        for conn in list(self.conns.values()):
            self._close(conn)

    def _dispatch(self, key, events: int) -> None:
        data = key.data
        try:
            if isinstance(data, _Conn):
                if not data.closed:
                    self._on_event(data, events)
            elif callable(data):
                data(key.fileobj)
            else:
                self._accept(data)
        except Exception:   # one connection's surprise must not end the worker's others
            log.exception("unexpected error in the connection loop")
            if isinstance(data, _Conn):
                self._close(data)

    def _busy(self) -> bool:
        return any(conn.phase != "idle" for conn in self.conns.values())

    # --- accepting --------------------------------------------------------------------------
    def _accept(self, listener) -> None:
        for _ in range(_ACCEPTS_PER_WAKE):
            try:
                client, address = listener.accept()
            except OSError as e:
                if e.errno in (errno.EMFILE, errno.ENFILE):
                    self._make_room()   # out of descriptors: make room, never spin
                elif e.errno not in (errno.EAGAIN, errno.ECONNABORTED, errno.EINVAL, errno.EBADF):
                    raise
                return
            self.adopt(client, address, listener)

    def adopt(self, client: socket.socket, address, listener) -> None:
        """Serve a connection accepted on `listener` (its port chooses the routes)."""
        if len(self.conns) >= MAX_CONNECTIONS:
            self._make_room()
        client.setblocking(False)
        port = _port_of(listener)
        now = self.clock()
        reader = RequestReader(self.site.routes_for(port), self.clock)
        reader.first_arrival = now
        if self.tls is not None and port not in self.site.plain_ports:
            conn = _Conn(client, _peer(address), port, reader, "sniff", now + HANDSHAKE_TIMEOUT_SECONDS)
        else:
            conn = _Conn(client, _peer(address), port, reader, "head", now + HEADER_TIMEOUT_SECONDS)
        self.conns[conn.fd] = conn
        self._want(conn, _READ)
        self._on_event(conn, _READ)   # a fast client's first bytes are usually here already

    def _stop_listening(self) -> None:
        """No new connections: what this worker's own sockets queued is taken in (and answered
        with `Connection: close`), then they close; the master's shared sockets stay open for
        the other workers."""
        self.stopping = True
        for listener in self.listeners:
            try:
                self.selector.unregister(listener)
            except (KeyError, ValueError):
                continue
            if listener in self.own:
                self._accept(listener)
                listener.close()
        self.listeners = []
        for conn in [c for c in self.conns.values() if c.phase == "idle"]:
            self._close(conn)

    # --- reading ----------------------------------------------------------------------------
    def _on_event(self, conn: _Conn, events: int) -> None:
        try:
            if conn.out is not None:
                if self._write(conn) and not conn.closed:
                    self._serve(conn)
            elif conn.phase == "sniff":
                self._sniff(conn)
            elif conn.phase == "handshake":
                self._handshake(conn)
            elif conn.phase == "plain":
                self._read_plain(conn)
            elif not conn.answering:
                self._read(conn)
        except (OSError, ValueError) as e:   # ssl.SSLError is an OSError
            if conn.phase == "handshake" and not _is_reset(e):
                self._cut(conn, "tls_failed")
            else:
                self._close(conn)

    def _sniff(self, conn: _Conn) -> None:
        try:
            first = conn.sock.recv(1, socket.MSG_PEEK)
        except (BlockingIOError, InterruptedError):
            return
        if not first:
            return self._close(conn)
        if first[0] != _TLS_HANDSHAKE:
            conn.phase, conn.deadline = "plain", self.clock() + HEADER_TIMEOUT_SECONDS
            return self._read_plain(conn)
        assert self.tls is not None
        self.selector.unregister(conn.fd)   # the TLS socket takes over the descriptor
        conn.events = 0
        conn.sock = self.tls.wrap_socket(conn.sock, server_side=True,
                                         do_handshake_on_connect=False, suppress_ragged_eofs=True)
        conn.phase = "handshake"
        self._want(conn, _READ)
        self._handshake(conn)

    def _handshake(self, conn: _Conn) -> None:
        try:
            conn.sock.do_handshake()   # type: ignore[attr-defined]
        except ssl.SSLWantReadError:
            return self._want(conn, _READ)
        except ssl.SSLWantWriteError:
            return self._want(conn, _WRITE)
        conn.phase, conn.deadline = "head", self.clock() + HEADER_TIMEOUT_SECONDS
        self._want(conn, _READ)
        self._read(conn)

    def _read_plain(self, conn: _Conn) -> None:
        """Plain HTTP on the TLS port: read its head (a client still sending would see a reset),
        then a 400 that says so, as nginx does, in plain HTTP."""
        while len(conn.plain) < _PLAIN_HEAD_BYTES and b"\r\n\r\n" not in conn.plain:
            try:
                data = conn.sock.recv(_PLAIN_HEAD_BYTES)
            except (BlockingIOError, InterruptedError):
                return
            if not data:
                return self._close(conn)
            conn.plain += data
        self._cut(conn, "plain_http", error_reply(400, PLAIN_ON_TLS), linger=True)

    def _read(self, conn: _Conn) -> None:
        reader = conn.reader
        while not reader.complete:
            try:
                size = conn.sock.recv_into(self._buffer)
            except (ssl.SSLWantReadError, BlockingIOError, InterruptedError):
                break
            except ssl.SSLWantWriteError:
                return self._want(conn, _WRITE)
            if not size:
                return self._close(conn)   # the client went away
            self._feed(conn, self._buffer[:size])
            if conn.closed:
                return
        if reader.complete:
            return self._serve(conn)
        self._want(conn, _READ)

    def _feed(self, conn: _Conn, data: memoryview) -> None:
        reader = conn.reader
        now = self.clock()
        if conn.phase == "idle":
            conn.phase, conn.deadline = "head", now + HEADER_TIMEOUT_SECONDS
        try:
            reader.feed(data)
        except HttpError as e:
            reader.complete.append(Parsed("", "", "", {}, b"", now, False, None, e.reply))
            reader.ended = True   # read nothing more: answer what came, then the refusal
        if reader.send_continue:
            reader.send_continue = False
            try:
                conn.sock.send(CONTINUE)   # best effort: a full buffer this early is a hostile client
            except OSError:
                pass
        if reader.in_body and conn.phase == "head":
            conn.phase, conn.deadline = "body", now + BODY_TIMEOUT_SECONDS
        self._count_held(conn)
        if self.held > PREREAD_BUDGET_BYTES:
            self._within_budget(conn)

    # --- answering --------------------------------------------------------------------------
    def _serve(self, conn: _Conn) -> None:
        """Answer the complete requests of `conn` in order, as far as that goes without waiting
        (a thread, a client slow to read), then read on."""
        while conn.reader.complete:
            reply = self._answer_now(conn)
            if reply is None or not self._reply(conn, reply) or conn.closed:
                return
        self._read_on(conn)

    def _answer_now(self, conn: _Conn) -> Reply | None:
        """The answer to the oldest complete request of `conn`, or None: a thread has it."""
        reader = conn.reader
        parsed = reader.complete.popleft()
        conn.phase = "answer"
        self._count_held(conn)
        conn.close_after = (not parsed.keep_alive or self.stopping
                            or (reader.ended and not reader.complete))
        conn.head_only = parsed.method == "HEAD"
        route = parsed.route
        if parsed.refusal is not None or route is None:
            reply = parsed.refusal or error_reply(400, "malformed HTTP request")
            metrics.bad_request(reply.status)
            return reply
        request = Request(parsed.method, parsed.path, parsed.query, parsed.headers, parsed.body,
                          parsed.arrived, conn.peer, may_wait=False)
        if len(parsed.body) <= LOOP_MAX_BODY_BYTES and not self.stopping:
            at_once = first_answer(route, request)
            if at_once is not None:
                return at_once
        conn.answering = True
        self._want(conn, 0)   # nothing is read until the answer is out (pipelining waits)
        self.pool.submit(self._on_thread, conn, route, request)
        return None

    def _on_thread(self, conn: _Conn, route: Route, request: Request) -> None:
        self.finished.append((conn, answer(route, request)))
        try:
            os.write(self._wake_w, b"\0")
        except BlockingIOError:
            pass   # the loop is awake already: the pipe is full of wake-ups

    def _drain_wakeups(self, _fileobj) -> None:
        self._drain_fd(self._wake_r)
        while self.finished:
            conn, reply = self.finished.popleft()
            conn.answering = False
            if conn.closed:
                continue
            try:
                if self._reply(conn, reply) and not conn.closed:
                    self._serve(conn)
            except (OSError, ValueError):   # the client went away meanwhile
                self._close(conn)

    @staticmethod
    def _drain_fd(fd) -> None:
        try:
            while os.read(fd if isinstance(fd, int) else fd.fileno(), 4096):
                pass
        except (BlockingIOError, InterruptedError):
            pass

    # --- writing ----------------------------------------------------------------------------
    def _reply(self, conn: _Conn, reply: Reply) -> bool:
        """Start sending `reply`; True when it is all out (and, if it was the last, the
        connection closing)."""
        self.answered += 1
        if self.max_requests is not None and self.answered >= self.max_requests:
            self.stopping = True
        if self.stopping:
            conn.close_after = True
        conn.out = memoryview(response_bytes(reply, close=conn.close_after,
                                             head_only=conn.head_only))
        conn.deadline = self.clock() + REPLY_TIMEOUT_SECONDS
        return self._write(conn)

    def _write(self, conn: _Conn) -> bool:
        assert conn.out is not None
        while conn.out:
            try:
                sent = conn.sock.send(conn.out)
            except (BlockingIOError, InterruptedError, ssl.SSLWantWriteError):
                self._want(conn, _WRITE)
                return False
            except ssl.SSLWantReadError:
                self._want(conn, _READ)
                return False
            conn.out = conn.out[sent:]
        conn.out = None
        if conn.close_after:
            self._finish(conn)
        return True

    def _read_on(self, conn: _Conn) -> None:
        """Every answer is out: wait for the next request (part of it may be in already)."""
        reader = conn.reader
        now = self.clock()
        if reader.current is None:
            conn.phase, conn.deadline = "idle", now + self.keepalive
        elif reader.in_body:
            conn.phase, conn.deadline = "body", now + BODY_TIMEOUT_SECONDS
        else:
            conn.phase, conn.deadline = "head", now + HEADER_TIMEOUT_SECONDS
        self._count_held(conn)
        self._want(conn, _READ)
        pending = getattr(conn.sock, "pending", None)
        if pending is not None and pending():   # TLS holds decrypted bytes: no event will come
            self._read(conn)

    # --- selector bookkeeping -----------------------------------------------------------------
    def _want(self, conn: _Conn, events: int) -> None:
        if events == conn.events:
            return
        if conn.events and events:
            self.selector.modify(conn.fd, events, conn)
        elif events:
            self.selector.register(conn.fd, events, conn)
        else:
            self.selector.unregister(conn.fd)
        conn.events = events

    def _count_held(self, conn: _Conn) -> None:
        held = conn.reader.held if conn.phase in _PARTIAL else 0
        self.held += held - conn.held
        conn.held = held

    # --- closing ------------------------------------------------------------------------------
    def _forget(self, conn: _Conn) -> None:
        conn.closed = True
        self.conns.pop(conn.fd, None)
        self.held -= conn.held
        conn.held = 0
        if conn.events:
            try:
                self.selector.unregister(conn.fd)
            except (KeyError, ValueError):
                pass
            conn.events = 0

    def _close(self, conn: _Conn) -> None:
        if not conn.closed:
            self._forget(conn)
            try:
                conn.sock.close()
            except OSError:
                pass

    def _finish(self, conn: _Conn) -> None:
        """The last answer is out: shut the write side, drain, close (archway.server.linger)."""
        self._forget(conn)
        self.lingering.close(conn.sock)

    def _cut(self, conn: _Conn, reason: str, reply: Reply | None = None, *,
             linger: bool = False) -> None:
        """Close a connection archway gives up on, with a last answer when there is one."""
        if reply is not None:
            try:
                conn.sock.send(response_bytes(reply, close=True))   # best effort
            except (OSError, ValueError):
                pass
        if linger:
            self._finish(conn)
        else:
            self._close(conn)
        metrics.client_cut(reason)
        self._cuts[reason] += 1
        self._last_cut_peer = conn.peer
        now = self.clock()
        if now >= self._next_log:
            self._log_cuts(now)

    def _timed_out(self, conn: _Conn) -> None:
        phase = conn.phase
        if phase == "idle":
            return self._close(conn)
        if conn.out is not None:   # its client does not take its answer
            return self._close(conn)
        if phase in ("sniff", "handshake"):
            return self._cut(conn, "handshake_timeout")
        if phase == "plain":
            return self._cut(conn, "plain_http", error_reply(400, PLAIN_ON_TLS), linger=True)
        started = conn.reader.current is not None
        reply = error_reply(408, f"the request stopped arriving: no whole {phase} within "
                                 f"{HEADER_TIMEOUT_SECONDS if phase == 'head' else BODY_TIMEOUT_SECONDS:g} s")
        self._cut(conn, f"{phase if phase == 'body' else 'header'}_timeout",
                  reply if started else None)

    def _sweep(self, now: float) -> None:
        if now < self._next_sweep:
            return
        self._next_sweep = now + _SWEEP_EVERY_SECONDS
        for conn in [c for c in self.conns.values()
                     if c.deadline <= now and not c.answering and (c.phase != "answer" or c.out)]:
            self._timed_out(conn)
        self.lingering.sweep(now)
        if self._cuts and now >= self._next_log:
            self._log_cuts(now)

    def _make_room(self) -> None:
        """Close the oldest partial request, else the oldest idle kept-alive connection."""
        partial = next((c for c in self.conns.values() if c.phase in _PARTIAL), None)
        oldest = partial or next((c for c in self.conns.values() if c.phase == "idle"), None)
        if oldest is not None:
            self._cut(oldest, "overflow")

    def _within_budget(self, reading: _Conn) -> None:
        while self.held > PREREAD_BUDGET_BYTES:
            oldest = next((c for c in self.conns.values() if c.held and c is not reading), None)
            if oldest is None:
                return   # the one reading now holds it all: it finishes or times out
            self._cut(oldest, "overflow")

    def _log_cuts(self, now: float) -> None:
        if self._cuts:
            counts = ", ".join(f"{reason} {n}" for reason, n in sorted(self._cuts.items()))
            log.warning("cut off %d client connection(s) (%s; last from %s): slow or stalled "
                        "clients, plain HTTP on the TLS port, or more than this worker holds "
                        "(%d connections, %d MiB of partial requests)", sum(self._cuts.values()), counts,
                        escape(self._last_cut_peer), MAX_CONNECTIONS,
                        PREREAD_BUDGET_BYTES // 2**20)
            self._cuts.clear()
        self._next_log = now + LOG_EVERY_SECONDS


def _port_of(listener) -> int | None:
    try:
        address = listener.getsockname()
    except OSError:
        return None
    return address[1] if isinstance(address, tuple) else None


def _peer(address) -> str:
    if isinstance(address, tuple) and address:
        return str(address[0])
    return str(address or "-")


def _is_reset(e: Exception) -> bool:
    return isinstance(e, (ConnectionResetError, BrokenPipeError)) or (
        isinstance(e, ssl.SSLError) and e.reason in ("UNEXPECTED_EOF_WHILE_READING",))
