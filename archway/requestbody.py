"""Reading a request body in a handler thread, within bounds: the one reader both products call.

gunicorn's gthread sockets block without limit, so a body still on its way is read with each
socket read bounded by BODY_READ_TIMEOUT_SECONDS, and, when the caller gives a deadline (the
extender's bodies of up to 64 MiB), the whole body by that deadline. A body archway.server.worker's
main loop read already (environ[BODY_READ]: one with a Content-Length up to
server.max_body_bytes) cannot make the thread wait: it is taken as it is, the socket untouched
and no timer armed (a timer's thread per call cost tens of ms of figure 7's tail on a busy
machine).
"""
import os
import socket
import threading
import time

# WSGI environ key: True when archway.server.worker's main loop read the whole request body
# before a thread got the request, so reading it cannot wait on the client.
BODY_READ = "archway.body_read"
# Bounds each socket read of a body still arriving; a client sending a byte now and then never
# trips it (the deadline of read_body does).
BODY_READ_TIMEOUT_SECONDS = 5.0


def body_stream(environ: dict):
    """The request body's stream (environ["wsgi.input"]), each socket read under it bounded by
    BODY_READ_TIMEOUT_SECONDS unless the worker read the whole body already (or there is no
    socket: a test client)."""
    sock = environ.get("gunicorn.socket")
    if sock is not None and not environ.get(BODY_READ):
        sock.settimeout(BODY_READ_TIMEOUT_SECONDS)
    return environ["wsgi.input"]


def read_body(environ: dict, limit: int, deadline: float | None = None) -> bytes:
    """Up to `limit` bytes of the request body (body_stream's bounds). `deadline`
    (time.monotonic()): all of it in by then, else TimeoutError (archway.app answers 408): at the
    deadline a timer shuts the socket's receiving side, which ends gunicorn's loop of reads
    (over plain HTTP the 408 still goes out; a TLS session is over)."""
    stream = body_stream(environ)
    sock = environ.get("gunicorn.socket")
    if deadline is None or sock is None or environ.get(BODY_READ):
        return stream.read(limit)
    expired = threading.Event()

    def cut_off() -> None:
        expired.set()
        # Through a duplicate of the descriptor: SSLSocket.shutdown would drop the TLS layer
        # the answer still needs.
        with socket.socket(fileno=os.dup(sock.fileno())) as raw:
            raw.shutdown(socket.SHUT_RD)

    timer = threading.Timer(max(0.0, deadline - time.monotonic()), cut_off)
    timer.daemon = True
    timer.start()
    try:
        body = stream.read(limit)
    except Exception:
        if expired.is_set():
            raise TimeoutError("request body not complete before its deadline") from None
        raise
    finally:
        timer.cancel()
    if expired.is_set():
        raise TimeoutError("request body not complete before its deadline")
    return body
