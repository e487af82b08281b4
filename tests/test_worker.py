"""archway.server.worker's pure parts: which body the main loop reads, the per-worker listener,
the lingering close; and, under a real gunicorn, when a request arrived and whether its body is
in, as the app is told them."""
import json
import selectors
import socket
import sys
import threading
import time

import pytest
import requests

from archway.deadline import ARRIVED
from archway.requestbody import BODY_READ
from archway.server.linger import LINGER_SECONDS, MAX_DRAIN_BYTES, Lingering
from archway.server.listeners import own_listener
from archway.server.worker import GuardedThreadWorker, body_to_preread
from lab.procs import REPO, Server, free_port


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
    own = own_listener(shared)
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


def echo_arrival(environ, start_response):
    """A WSGI app for the test below: when the request arrived, and when a thread took it."""
    taken = time.monotonic()
    time.sleep(0.5)
    body = json.dumps({"arrived": environ.get(ARRIVED), "taken": taken}).encode()
    start_response("200 OK", [("Content-Type", "application/json"),
                              ("Content-Length", str(len(body)))])
    return [body]


@pytest.mark.slow
def test_the_app_is_told_when_a_request_arrived_not_when_a_thread_took_it(tmp_path):
    """gunicorn with archway's worker and one thread, three requests at once: two wait in the
    queue, and the app sees that wait (CLOCK_MONOTONIC is the machine's, so the test can compare
    it with its own)."""
    port = free_port()
    with Server([sys.executable, "-m", "gunicorn", "--worker-class",
                 "archway.server.worker.GuardedThreadWorker", "--workers", "1", "--threads", "1",
                 "--bind", f"127.0.0.1:{port}", "tests.test_worker:echo_arrival"],
                port=port, log_path=str(tmp_path / "gunicorn.log"), cwd=REPO, ready_timeout=30):
        seen: list[dict] = []

        def get():
            sent = time.monotonic()
            seen.append(dict(requests.get(f"http://127.0.0.1:{port}/", timeout=30).json(),
                             sent=sent))

        threads = [threading.Thread(target=get) for _ in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
    assert len(seen) == 3
    for request in seen:
        assert request["arrived"] is not None, "the worker did not tell when it arrived"
        assert request["sent"] <= request["arrived"] <= request["taken"]
    waits = sorted(r["taken"] - r["arrived"] for r in seen)
    assert waits[-1] >= 0.9     # behind two others, 0.5 s each


def echo_body_read(environ, start_response):
    """A WSGI app for the test below: whether the worker said the body was read, and its size."""
    body = environ["wsgi.input"].read()
    answer = json.dumps({"body_read": environ.get(BODY_READ), "length": len(body)}).encode()
    start_response("200 OK", [("Content-Type", "application/json"),
                              ("Content-Length", str(len(answer)))])
    return [answer]


@pytest.mark.slow
def test_the_app_is_told_whether_the_main_loop_read_the_whole_body(tmp_path):
    """A body with a Content-Length up to the pre-read limit is in before a thread takes the
    request (the extender then arms no timer for it, routes.read_body); a chunked one or one
    over the limit the thread reads. Every request on one kept-alive connection, so the answer
    is the request's own, not the previous one's."""
    port = free_port()
    limit = GuardedThreadWorker.preread_limit
    with Server([sys.executable, "-m", "gunicorn", "--worker-class",
                 "archway.server.worker.GuardedThreadWorker", "--workers", "1", "--threads", "2",
                 "--bind", f"127.0.0.1:{port}", "tests.test_worker:echo_body_read"],
                port=port, log_path=str(tmp_path / "gunicorn.log"), cwd=REPO, ready_timeout=30):
        url = f"http://127.0.0.1:{port}/"
        with requests.Session() as session:
            answers = [session.post(url, data=body, timeout=30).json() for body in
                       (b"x" * 1000, iter([b"x" * 1000]), b"x" * (limit + 1), b"x" * limit)]
    assert answers == [{"body_read": True, "length": 1000},
                       {"body_read": False, "length": 1000},           # chunked
                       {"body_read": False, "length": limit + 1},      # over the limit
                       {"body_read": True, "length": limit}]


def _dispatch(poller: selectors.BaseSelector) -> None:
    for key, _ in poller.select(1):
        key.data(key.fileobj)


def test_a_lingering_connection_shows_its_client_the_end_and_closes_when_the_client_does():
    poller = selectors.DefaultSelector()
    lingering = Lingering(poller)
    server, client = socket.socketpair()
    with client:
        lingering.close(server)
        client.settimeout(5)
        assert client.recv(10) == b""   # end of file at once: the answer is complete
        assert server.fileno() != -1 and server in lingering.sockets   # waits for the client
        client.sendall(b"late bytes")   # read and dropped, so closing sends no reset
        _dispatch(poller)
        assert server.fileno() != -1
    _dispatch(poller)   # the client closed
    assert server.fileno() == -1 and not lingering.sockets


def test_a_lingering_connection_whose_client_never_closes_or_keeps_sending_is_closed():
    poller = selectors.DefaultSelector()
    lingering = Lingering(poller)
    silent, silent_client = socket.socketpair()
    sending, sending_client = socket.socketpair()
    with silent_client, sending_client:
        lingering.close(silent)
        lingering.close(sending)
        sending_client.setblocking(False)
        sent = 0
        while sending.fileno() != -1 and sent < 4 * MAX_DRAIN_BYTES:
            try:
                sent += sending_client.send(b"x" * 4096)
            except BlockingIOError:
                pass
            _dispatch(poller)
        assert sending.fileno() == -1          # past MAX_DRAIN_BYTES
        lingering.sweep(time.monotonic())
        assert silent.fileno() != -1           # still within its time
        lingering.sweep(time.monotonic() + LINGER_SECONDS)
        assert silent.fileno() == -1 and not lingering.sockets
