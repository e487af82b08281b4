"""The gunicorn worker `archway serve` runs: gunicorn's documented seam for a worker of one's
own (a subclass of `gunicorn.workers.base.Worker` overriding `run`, as uvicorn's worker does),
and past it archway's connection loop (archway.server.loop).

gunicorn keeps what it is good at: the master forks, watches and replaces workers, handles the
signals, binds the listening sockets and reads its settings (threads, keepalive,
graceful_timeout, max_requests, certfile and keyfile). What each worker serves is what the
application loads in it (`self.wsgi`, gunicorn's name for it): an archway.server.routes.Site.

Spreading connections: with gunicorn's reuse_port on, each worker listens on a socket of its
own on the same address (archway.server.listeners); the master's socket is drained of what it
queued and stops listening, so the kernel's hash alone spreads connections over the workers.
"""
import logging
import os
import socket

from gunicorn.workers.base import Worker

from archway.logs import JsonFormatter
from archway.logsafe import SafeFormatter

from .listeners import own_listener
from .loop import MAX_CONNECTIONS, Loop
from .routes import Site


class ArchwayWorker(Worker):
    """One worker process: archway's loop over the worker's listeners."""

    def init_process(self) -> None:
        # gunicorn's own lines may quote what clients sent; JSON lines escape already.
        for handler in self.log.error_log.handlers:
            current = handler.formatter or logging.Formatter()
            if not isinstance(current, (SafeFormatter, JsonFormatter)):
                handler.setFormatter(SafeFormatter(current._fmt, current.datefmt))
        super().init_process()   # loads the site, then runs the loop: returns when it stops

    def run(self) -> None:
        site = self.wsgi
        if not isinstance(site, Site):
            raise TypeError(f"archway's worker serves an archway.server.routes.Site, not {site!r}")
        listeners, own, queued = self._listeners()
        tls = None
        if self.cfg.is_ssl:
            from archway.certs.tls import server_context
            tls = server_context(self.cfg.certfile, self.cfg.keyfile)
        loop = Loop(listeners, site, tls=tls, threads=self.cfg.threads, keepalive=self.cfg.keepalive,
                    own=own, wakeup_fd=self.PIPE[0],
                    max_requests=self.max_requests if self.cfg.max_requests else None)
        for client, address, listener in queued:
            loop.adopt(client, address, listener)
        loop.run(lambda: self.alive, self._heartbeat, self.cfg.graceful_timeout)

    def _heartbeat(self) -> None:
        """Once a second: the master's liveness file touched, and a worker whose master is gone
        stops (nobody would replace it or stop it)."""
        self.notify()
        if os.getppid() != self.ppid:
            self.alive = False

    def _listeners(self) -> tuple[list, tuple, list]:
        """The sockets this worker accepts on, which of them are its own, and the connections
        the master's sockets had queued (client, address, the own socket of their address)."""
        shared = list(self.sockets)
        if not self.cfg.reuse_port:
            return shared, (), []
        own = [s for s in map(own_listener, shared) if s is not None]
        if len(own) != len(shared):   # keep the shared ones: spread by whoever wakes first
            for listener in own:
                listener.close()
            return shared, (), []
        queued = [(client, address, mine) for theirs, mine in zip(shared, own)
                  for client, address in _take_queued(theirs)]
        return own, tuple(own), queued


def _take_queued(shared) -> list:
    """What the master's socket queued before this worker had its own, and that socket stopped
    listening (for every worker: they share it), so new connections go to the own sockets."""
    taken = []
    try:
        shared.setblocking(False)
        for _ in range(MAX_CONNECTIONS):
            try:
                taken.append(shared.accept())
            except (BlockingIOError, InterruptedError):
                break
        shared.shutdown(socket.SHUT_RD)
    except OSError:
        pass   # already stopped by a sibling worker
    return taken
