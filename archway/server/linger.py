"""Closing a connection after its last answer, without blocking the worker's main loop.

A server that closes while a client's unread bytes sit in its receive buffer makes the kernel
send a reset, which can destroy the answer before the client has read it (RFC 9112 section 9.6).
So the write side is shut first (the client gets the answer, then end of file) and whatever the
client still sends is read and dropped until it closes its end. gunicorn 27 does that read in
the worker's main loop, blocking, for up to 2 s per connection: five clients that sent
"Connection: close" and then neither read nor closed held every other request of the worker for
seconds. Here the poller drives it, non-blocking, under the same bounds (time, bytes), and the
sockets held for it are capped.
"""
import selectors
import socket
import time
from collections import OrderedDict

LINGER_SECONDS = 2.0          # as gunicorn's close_graceful
MAX_DRAIN_BYTES = 64 * 1024   # likewise: past it the client is not closing, it is sending
MAX_LINGERING = 1024          # sockets held at once; past it the oldest is closed outright


class _Linger:
    __slots__ = ("deadline", "drained")

    def __init__(self, deadline: float):
        self.deadline = deadline
        self.drained = 0


class Lingering:
    """Sockets whose last answer is sent, waiting for their client to close (oldest first)."""

    def __init__(self, poller: selectors.BaseSelector):
        self.poller = poller
        self.sockets: OrderedDict[socket.socket, _Linger] = OrderedDict()

    def close(self, sock: socket.socket) -> None:
        """Shut the write side of `sock` now and close it once its client has closed its end
        (or after LINGER_SECONDS, or MAX_DRAIN_BYTES); never blocks."""
        try:
            sock.setblocking(False)
            sock.shutdown(socket.SHUT_WR)   # a TLS socket drops its TLS layer here, as gunicorn's
            self.poller.register(sock, selectors.EVENT_READ, self._readable)
        except (OSError, ValueError, KeyError):
            return _close(sock)   # already closed or reset: nothing to wait for
        if len(self.sockets) >= MAX_LINGERING:
            self._end(next(iter(self.sockets)))
        self.sockets[sock] = _Linger(time.monotonic() + LINGER_SECONDS)
        self._readable(sock)   # the client may have closed already

    def sweep(self, now: float) -> None:
        """Close the sockets whose client did not close in time."""
        while self.sockets:
            sock, linger = next(iter(self.sockets.items()))
            if linger.deadline > now:
                return
            self._end(sock)

    def _readable(self, sock: socket.socket) -> None:
        linger = self.sockets.get(sock)
        if linger is None:
            return
        while True:
            try:
                data = sock.recv(4096)
            except (BlockingIOError, InterruptedError):
                return
            except (OSError, ValueError):
                return self._end(sock)
            linger.drained += len(data)
            if not data or linger.drained >= MAX_DRAIN_BYTES:
                return self._end(sock)

    def _end(self, sock: socket.socket) -> None:
        del self.sockets[sock]
        try:
            self.poller.unregister(sock)
        except (KeyError, ValueError, OSError):
            pass
        _close(sock)


def _close(sock: socket.socket) -> None:
    try:
        sock.close()
    except OSError:
        pass
