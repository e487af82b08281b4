"""The deadline of a request, enforced on its sockets.

A peer that sends one byte a second satisfies every per-read timeout, so each socket a request
uses is handed to a watchdog thread that shuts it down when the request's deadline passes,
wherever the request is (connect, TLS handshake, headers, body), and the blocked read returns
at once. registry.http opens the window (sockets_end_at); registry.connections hands each socket
it connects or reuses to the watchdog (watch_current).
"""
import heapq
import itertools
import os
import socket
import threading
import time


class _Watchdog:
    """Shuts sockets down at their deadline, from one thread for the whole process.

    A watched socket is a dup of the connection's descriptor: shutting it down ends the TCP
    connection the request is blocked on, and holding it means a descriptor number freed and
    reused meanwhile can never be hit. Cost per request: a dup, a heap push, a close.
    """

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._heap: list[tuple[float, int]] = []
        self._watched: dict[int, socket.socket] = {}
        self._ids = itertools.count()
        self._pid = 0

    def watch(self, sock: socket.socket, deadline: float) -> int:
        dup = socket.socket(fileno=os.dup(sock.fileno()))
        with self._cond:
            if self._pid != os.getpid():   # first use, or a forked worker: the thread is not here
                self._pid, self._heap, self._watched = os.getpid(), [], {}
                threading.Thread(target=self._run, name="archway-deadlines", daemon=True).start()
            ticket = next(self._ids)
            self._watched[ticket] = dup
            if len(self._heap) > 2 * len(self._watched) + 1024:   # mostly released entries
                self._heap = [entry for entry in self._heap if entry[1] in self._watched]
                heapq.heapify(self._heap)
            heapq.heappush(self._heap, (deadline, ticket))
            if self._heap[0][1] == ticket:
                self._cond.notify()
        return ticket

    def release(self, ticket: int) -> None:
        with self._cond:
            dup = self._watched.pop(ticket, None)
        if dup is not None:
            dup.close()

    def _run(self) -> None:
        while True:
            with self._cond:
                while self._heap and self._heap[0][1] not in self._watched:
                    heapq.heappop(self._heap)   # released before its deadline
                if not self._heap:
                    self._cond.wait()
                    continue
                deadline, ticket = self._heap[0]
                if deadline > time.monotonic():
                    self._cond.wait(deadline - time.monotonic())
                    continue
                heapq.heappop(self._heap)
                dup = self._watched.pop(ticket)
            try:
                dup.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass   # already closed by the peer
            dup.close()


WATCHDOG = _Watchdog()
_current = threading.local()   # the deadline of the request this thread is making, and its tickets


class sockets_end_at:
    """Within it, every socket this thread's request connects or reuses is shut at `deadline`."""

    def __init__(self, deadline: float) -> None:
        self.deadline = deadline

    def __enter__(self) -> None:
        _current.deadline, _current.tickets = self.deadline, []

    def __exit__(self, *exc) -> None:
        tickets, _current.deadline, _current.tickets = _current.tickets, None, []
        for ticket in tickets:
            WATCHDOG.release(ticket)


def current_deadline() -> float | None:
    """The deadline of the request this thread is making (within sockets_end_at), else None."""
    return getattr(_current, "deadline", None)


def watch_current(sock: socket.socket | None) -> None:
    """Shut `sock` down at the deadline of the request this thread is making, if any."""
    deadline = current_deadline()
    if sock is not None and deadline is not None:
        _current.tickets.append(WATCHDOG.watch(sock, deadline))
