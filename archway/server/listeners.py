"""A listening socket of each gunicorn worker's own, on the shared address.

All workers polling one listening socket let the first one awake accept every connection a client
opens at once (the API server keeps a few for minutes): one worker did over 90 % of the work in 3
of 6 keep-alive runs. With gunicorn's reuse_port on, each worker listens on a socket of its own on
the same address (SO_REUSEPORT), the master's socket stops listening once a worker has its own, and
the kernel spreads new connections over the workers' sockets by a hash of the client's address and
port. A worker that stops takes in what its socket holds before closing it; one that is killed
loses its socket's queue (the clients see a reset and retry), as the other workers keep listening.
"""
import logging
import socket

log = logging.getLogger("archway.server")


def own_listener(shared) -> socket.socket | None:
    """A listening socket of this worker's own on the address of `shared` (SO_REUSEPORT)."""
    family = getattr(shared, "family", None)
    if family not in (socket.AF_INET, socket.AF_INET6):
        return None
    own = socket.socket(family, socket.SOCK_STREAM)
    try:
        own.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        own.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        # As gunicorn sets on its own listener, and accepted sockets inherit: without it a
        # reply's head and body, written separately, wait out the client's delayed ACK (40 ms).
        own.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if family == socket.AF_INET6:
            own.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY,
                           shared.getsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY))
        own.bind(shared.getsockname()[:2] if family == socket.AF_INET else shared.getsockname())
        own.listen(2048)
        own.setblocking(False)
        return own
    except OSError as e:
        own.close()
        log.warning("no listening socket of this worker's own (%s): connections are spread by "
                    "whichever worker wakes first", e)
        return None
