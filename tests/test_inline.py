"""archway.server.inline: requests of an app's inline routes answered in the worker's main loop,
under a real gunicorn with archway's worker; and the pure parts (which requests, the response)."""
import json
import socket
import subprocess
import sys
import threading
import time

import pytest

from archway.server.inline import inline_request, response_bytes
from lab.procs import REPO, Server, free_port

ROUTES = {("POST", "/scheduler/filter"): "filter"}


@pytest.mark.parametrize("head, expected", [
    (b"POST /scheduler/filter HTTP/1.1\r\nHost: x\r\nContent-Length: 2", ("filter", False)),
    (b"POST /scheduler/filter?x=1 HTTP/1.1\r\nContent-Length: 2", ("filter", False)),
    (b"POST /scheduler/filter HTTP/1.1\r\nConnection: close\r\nContent-Length: 2",
     ("filter", True)),
    (b"POST /scheduler/filter HTTP/1.1\r\nconnection:Keep-Alive, CLOSE", ("filter", True)),
    (b"POST /scheduler/filter HTTP/1.1\r\nX-Connection: close", ("filter", False)),
    (b"POST /scheduler/filter HTTP/1.0\r\nContent-Length: 2", None),   # the pool's
    (b"GET /scheduler/filter HTTP/1.1\r\nHost: x", None),
    (b"POST /scheduler/filterx HTTP/1.1\r\nHost: x", None),
    (b"POST http://x/scheduler/filter HTTP/1.1\r\nHost: x", None),
    (b"POST /scheduler/filter  HTTP/1.1\r\nHost: x", None),
])
def test_which_requests_are_answered_inline(head, expected):
    assert inline_request(head, ROUTES) == expected


def test_an_inline_response_is_http_1_1_with_its_length_and_connection():
    head, body = response_bytes(413, b'{"error":"x"}', close=True).split(b"\r\n\r\n")
    lines = head.decode().split("\r\n")
    assert lines[0] == "HTTP/1.1 413 Request Entity Too Large"
    headers = dict(line.split(": ", 1) for line in lines[1:])
    assert headers["Content-Length"] == "13" and headers["Connection"] == "close"
    assert headers["Content-Type"] == "application/json" and headers["Date"].endswith(" GMT")
    assert body == b'{"error":"x"}'
    assert b"Connection: keep-alive" in response_bytes(200, b"{}", close=False)


# --- a gunicorn app with one inline route --------------------------------------------------------

BIG = 8 * 1024 * 1024   # an answer larger than any socket buffer here


def _inline(body: bytes, arrived: float):
    """Answered in the main loop unless the body asks for the pool; says which thread answered."""
    asked = json.loads(body)
    if asked.get("pool"):
        return None
    answer = {"n": asked.get("n"), "main_loop": threading.current_thread() is threading.main_thread()}
    if asked.get("big"):
        answer["pad"] = "x" * BIG
    return 200, json.dumps(answer).encode()


def app(environ, start_response):
    """The pool's answer to the same route (and to every other request)."""
    length = int(environ.get("CONTENT_LENGTH") or 0)
    asked = json.loads(environ["wsgi.input"].read(length) or b"{}")
    body = json.dumps({"n": asked.get("n"), "main_loop": False}).encode()
    start_response("200 OK", [("Content-Type", "application/json"),
                              ("Content-Length", str(len(body)))])
    return [body]


app.inline_routes_for = lambda address: {("POST", "/scheduler/filter"): _inline}  # type: ignore[attr-defined]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    port = free_port()
    log = tmp_path_factory.mktemp("inline") / "gunicorn.log"
    with Server([sys.executable, "-m", "gunicorn", "--worker-class",
                 "archway.server.worker.GuardedThreadWorker", "--workers", "1", "--threads", "2",
                 "--bind", f"127.0.0.1:{port}", "tests.test_inline:app"],
                port=port, log_path=str(log), cwd=REPO, ready_timeout=30):
        yield port


def _request(asked: dict, *, close: bool = False, path: str = "/scheduler/filter") -> bytes:
    body = json.dumps(asked).encode()
    return (f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"{'Connection: close' + chr(13) + chr(10) if close else ''}"
            f"Content-Length: {len(body)}\r\n\r\n").encode() + body


def _responses(sock: socket.socket, count: int, timeout: float = 30.0) -> list[tuple[dict, dict]]:
    """`count` responses read off `sock`: (headers, JSON body) each."""
    sock.settimeout(timeout)
    data, out = b"", []
    while len(out) < count:
        end = data.find(b"\r\n\r\n")
        if end >= 0:
            lines = data[:end].decode().split("\r\n")
            headers = {k.lower(): v for k, v in (line.split(": ", 1) for line in lines[1:])}
            headers["status"] = lines[0]
            length = int(headers["content-length"])
            if len(data) >= end + 4 + length:
                out.append((headers, json.loads(data[end + 4:end + 4 + length])))
                data = data[end + 4 + length:]
                continue
        chunk = sock.recv(1 << 20)
        assert chunk, "the server closed the connection"
        data += chunk
    return out


@pytest.mark.slow
def test_calls_on_a_kept_alive_connection_are_answered_in_the_main_loop(server):
    with socket.create_connection(("127.0.0.1", server)) as sock:
        for n in range(3):
            sock.sendall(_request({"n": n}))
            (headers, answer), = _responses(sock, 1)
            assert headers["status"] == "HTTP/1.1 200 OK"
            assert answer == {"n": n, "main_loop": True}
            assert headers["connection"] == "keep-alive"
        # A handler that would wait leaves the request to the pool, on the same connection.
        sock.sendall(_request({"n": 3, "pool": True}))
        assert _responses(sock, 1)[0][1] == {"n": 3, "main_loop": False}
        sock.sendall(_request({"n": 4}))
        assert _responses(sock, 1)[0][1] == {"n": 4, "main_loop": True}
        # Another path is the pool's.
        sock.sendall(_request({"n": 5}, path="/other"))
        assert _responses(sock, 1)[0][1] == {"n": 5, "main_loop": False}


@pytest.mark.slow
def test_pipelined_calls_are_answered_in_order_and_close_is_honoured(server):
    with socket.create_connection(("127.0.0.1", server)) as sock:
        sock.sendall(_request({"n": 1}) + _request({"n": 2}) + _request({"n": 3}, close=True))
        answers = _responses(sock, 3)
        assert [a["n"] for _, a in answers] == [1, 2, 3]
        assert all(a["main_loop"] for _, a in answers)
        assert answers[2][0]["connection"] == "close"
        sock.settimeout(10)
        assert sock.recv(1) == b""   # closed after the answer the client asked to be the last


@pytest.mark.slow
def test_a_client_that_does_not_read_its_answer_holds_no_one_else(server):
    """An answer larger than the socket takes is sent as the client reads it; meanwhile the main
    loop answers other connections."""
    with socket.create_connection(("127.0.0.1", server)) as slow:
        slow.sendall(_request({"n": 0, "big": True}))
        time.sleep(0.5)   # the server sent what the socket took, and waits for the rest
        with socket.create_connection(("127.0.0.1", server)) as other:
            started = time.monotonic()
            other.sendall(_request({"n": 1}))
            assert _responses(other, 1)[0][1] == {"n": 1, "main_loop": True}
            assert time.monotonic() - started < 5
        (_, answer), = _responses(slow, 1)
        assert answer["n"] == 0 and len(answer["pad"]) == BIG
        slow.sendall(_request({"n": 2}))   # and the connection goes on
        assert _responses(slow, 1)[0][1] == {"n": 2, "main_loop": True}


@pytest.mark.slow
def test_a_call_waiting_when_the_worker_starts_is_answered_and_closed(tmp_path):
    """A request queued on the master's socket before the worker runs is taken in, answered in
    the main loop and (Connection: close) closed, as the worker starts: it crashed the worker."""
    port = free_port()
    with open(tmp_path / "gunicorn.log", "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "gunicorn", "--worker-class",
             "archway.server.worker.GuardedThreadWorker", "--workers", "1", "--threads", "2",
             "--reuse-port", "--bind", f"127.0.0.1:{port}", "tests.test_inline:app"],
            cwd=REPO, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 30
        while True:   # the master listens before its worker has loaded the app
            try:
                sock = socket.create_connection(("127.0.0.1", port), timeout=1)
                break
            except OSError:
                assert time.monotonic() < deadline and proc.poll() is None, "gunicorn did not listen"
                time.sleep(0.005)
        with sock:
            sock.sendall(_request({"n": 7}, close=True))
            (headers, answer), = _responses(sock, 1)
            assert answer == {"n": 7, "main_loop": True} and headers["connection"] == "close"
            assert sock.recv(1) == b""
    finally:
        proc.terminate()
        proc.wait(15)
    assert b"Exception in worker process" not in (tmp_path / "gunicorn.log").read_bytes()
