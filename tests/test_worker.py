"""archway.worker's pure parts: which body the main loop reads, and the per-worker listener."""
import socket

import pytest

from archway.worker import _own_listener, body_to_preread


@pytest.mark.parametrize("head, expected", [
    (b"POST /mutate HTTP/1.1\r\nHost: x\r\nContent-Length: 120", 120),
    (b"POST /mutate HTTP/1.1\r\ncontent-length:  7 \r\nHost: x", 7),
    (b"POST /mutate HTTP/1.1\r\nHost: x", 0),                                  # no body
    (b"POST /mutate HTTP/1.1\r\nContent-Length: 5000", 0),                     # over the limit
    (b"POST /mutate HTTP/1.1\r\nContent-Length: 5\r\nContent-Length: 6", 0),  # gunicorn's 400
    (b"POST /mutate HTTP/1.1\r\nTransfer-Encoding: chunked\r\nContent-Length: 5", 0),
    (b"POST /mutate HTTP/1.1\r\nExpect: 100-continue\r\nContent-Length: 5", 0),
    (b"POST /mutate HTTP/1.1\r\nX-Content-Length: 5", 0),
])
def test_body_to_preread(head, expected):
    assert body_to_preread(head, 4096) == expected


def test_a_workers_own_listener_shares_the_address_and_sends_without_delay():
    shared = socket.socket()
    shared.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    shared.bind(("127.0.0.1", 0))
    shared.listen()
    own = _own_listener(shared)
    try:
        assert own is not None and own.getsockname() == shared.getsockname()
        # Accepted sockets inherit it; without it a reply's head and body, written separately,
        # wait for the client's delayed ACK.
        assert own.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)
        with socket.create_connection(own.getsockname()):
            pass
    finally:
        shared.close()
        if own is not None:
            own.close()
