"""archway's server (archway.server): the route table, HTTP/1.1 on a connection (httptools'
llhttp under archway's limits), the answer's bytes, the lingering close and the per-worker
listener, pure; and under a real gunicorn with archway's worker (tests/infra/siteserver.py):
answers on the loop and on threads, on kept-alive and pipelined connections, a client that does
not read, a request queued before the worker runs, and when a request arrived."""
import json
import os
import selectors
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest
import requests

from archway.server.http1 import (
    DISCARD_LIMIT_BYTES,
    MAX_HEAD_BYTES,
    HttpError,
    RequestReader,
    response_bytes,
)
from archway.server.linger import LINGER_SECONDS, MAX_DRAIN_BYTES, Lingering
from archway.server.listeners import own_listener
from archway.server.routes import Reply, Request, Route, Routes, Site, answer, first_answer
from lab.procs import REPO, Server, free_port
from tests.infra.siteserver import BIG

OK = Reply(200, b"{}")
ROUTES = Routes([Route("POST", "/mutate", lambda r: OK, max_body=100, limit_name="server.max_body_bytes"),
                 Route("GET", "/healthz", lambda r: OK)])


# --- the route table ---------------------------------------------------------------------------

def test_an_unknown_path_and_a_wrong_method_are_json_with_what_is_served():
    missing = ROUTES.find("GET", "/nope")
    assert isinstance(missing, Reply) and missing.status == 404
    assert json.loads(missing.body)["error"] == (
        "Not Found: GET /nope; archway serves POST /mutate, GET /healthz")
    wrong = ROUTES.find("PUT", "/mutate")
    assert isinstance(wrong, Reply) and wrong.status == 405 and ("Allow", "POST") in wrong.headers
    assert isinstance(ROUTES.find("HEAD", "/healthz"), Route)   # a GET route answers HEAD
    with pytest.raises(ValueError, match="declared twice"):
        ROUTES.add(Route("GET", "/healthz", lambda r: OK))


def test_a_listener_of_its_own_port_serves_its_own_routes():
    other = Routes([Route("GET", "/metrics", lambda r: OK)], not_found="only /metrics here")
    site = Site(ROUTES, {9000: other})
    assert site.routes_for(9000) is other and site.routes_for(8443) is ROUTES
    assert json.loads(other.find("POST", "/mutate").body)["error"] == "only /metrics here"


def test_the_loop_asks_first_and_a_thread_answers_what_would_wait_and_a_bug_is_a_500(caplog):
    def cached(request: Request):
        return OK if request.may_wait or request.body == b"hit" else None

    def broken(request: Request):
        raise RuntimeError("bug")

    route = Route("POST", "/x", cached, on_loop=True)
    assert first_answer(route, Request("POST", "/x", body=b"hit")) is OK
    assert first_answer(route, Request("POST", "/x", body=b"miss")) is None
    assert answer(route, Request("POST", "/x", body=b"miss")) is OK
    assert first_answer(Route("POST", "/x", cached), Request("POST", "/x", body=b"hit")) is None
    failed = answer(Route("POST", "/x", broken, on_loop=True), Request("POST", "/x"))
    assert failed.status == 500 and json.loads(failed.body) == {"error": "internal error; see archway's log"}
    assert "unhandled error on POST /x" in caplog.text


# --- HTTP/1.1 on one connection ----------------------------------------------------------------

def _reader(routes=ROUTES) -> RequestReader:
    return RequestReader(routes, clock=lambda: 5.0)


def test_requests_come_whole_in_order_whatever_the_bytes_are_cut_into():
    data = (b"POST /mutate?timeout=5s HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\n{}"
            b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    for cut in (1, 7, len(data)):
        reader = _reader()
        reader.first_arrival = 1.0
        for at in range(0, len(data), cut):
            reader.feed(data[at:at + cut])
        first, second = reader.complete
        assert (first.method, first.path, first.query, first.body) == ("POST", "/mutate", "timeout=5s", b"{}")
        assert first.keep_alive and first.arrived == 1.0 and first.route.path == "/mutate"
        assert (second.method, second.path, second.keep_alive, second.arrived) == ("GET", "/healthz", False, 5.0)
        assert second.headers["connection"] == "close" and reader.current is None


@pytest.mark.parametrize("version, connection, keep", [
    ("1.1", "", True), ("1.1", "close", False), ("1.1", "Keep-Alive, Close", False),
    ("1.0", "", False), ("1.0", "keep-alive", True)])
def test_keep_alive_follows_the_version_and_the_connection_header(version, connection, keep):
    reader = _reader()
    header = f"Connection: {connection}\r\n" if connection else ""
    reader.feed(f"GET /healthz HTTP/{version}\r\nHost: x\r\n{header}\r\n".encode())
    assert reader.complete[0].keep_alive is keep


def _refused(data: bytes) -> dict:
    with pytest.raises(HttpError) as caught:
        _reader().feed(data)
    return {"status": caught.value.reply.status, **json.loads(caught.value.reply.body)}


@pytest.mark.parametrize("data, status, words", [
    (b"GET /" + b"a" * 9000 + b" HTTP/1.1\r\n\r\n", 414, "longer than 8 KiB"),
    (b"GET /healthz HTTP/1.1\r\nX: " + b"a" * (MAX_HEAD_BYTES + 10), 431, "larger than 64 KiB"),
    (b"GET /healthz HTTP/1.1\r\n" + b"X-A: b\r\n" * 9000 + b"\r\n", 431, "larger than 64 KiB"),
    (b"GET /healthz HTTP/2.0\r\n\r\n", 505, "HTTP/2.0"),
    (b"POST /mutate HTTP/1.1\r\nExpect: later\r\nContent-Length: 2\r\n\r\n{}", 417, "later"),
    (b"NOPE /mutate HTTP/1.1\r\n\r\n", 400, "not an HTTP method"),
    (b"POST /mutate HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n", 400, "chunk size"),
    (b"POST /mutate HTTP/1.1\r\nContent-Length: %d\r\n\r\n" % (DISCARD_LIMIT_BYTES + 1), 413,
     "exceeds server.max_body_bytes (100)"),
    (b"POST /mutate HTTP/1.1\r\nExpect: 100-continue\r\nContent-Length: 101\r\n\r\n", 413,
     "request body of 101 bytes"),
    (b"POST /nope HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n", 404, "Not Found"),
])
def test_what_cannot_be_read_on_is_refused_in_json(data, status, words):
    refused = _refused(data)
    assert refused["status"] == status and words in refused["error"], refused


def test_a_head_dripped_in_small_pieces_is_measured_as_it_comes():
    reader = _reader()
    reader.feed(b"GET /healthz HTTP/1.1\r\nX-Filler: ")
    with pytest.raises(HttpError) as caught:
        for _ in range(MAX_HEAD_BYTES // 1000 + 2):
            reader.feed(b"a" * 1000)
    assert caught.value.reply.status == 431


def test_a_refused_body_small_enough_is_read_and_dropped_and_the_connection_goes_on():
    reader = _reader()
    reader.feed(b"POST /mutate HTTP/1.1\r\nContent-Length: 150\r\n\r\n" + b"x" * 150
                + b"POST /nope HTTP/1.1\r\nContent-Length: 3\r\n\r\nabc"
                + b"POST /mutate HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n96\r\n" + b"y" * 150
                + b"\r\n0\r\n\r\nGET /healthz HTTP/1.1\r\n\r\n")
    big, missing, chunked, fine = reader.complete
    assert big.refusal.status == 413 and big.body == b"" and big.keep_alive
    assert missing.refusal.status == 404
    assert chunked.refusal.status == 413 and chunked.body == b""
    assert fine.refusal is None and fine.route.path == "/healthz" and reader.held == 0


def test_a_client_waiting_for_100_continue_is_told_to_send_its_body():
    reader = _reader()
    reader.feed(b"POST /mutate HTTP/1.1\r\nExpect: 100-continue\r\nContent-Length: 2\r\n\r\n")
    assert reader.send_continue and reader.in_body and not reader.complete
    reader.feed(b"{}")
    assert reader.complete[0].body == b"{}"


def test_nothing_after_an_upgrade_is_read_and_its_answer_is_the_last():
    reader = _reader()
    reader.feed(b"GET /healthz HTTP/1.1\r\nConnection: Upgrade\r\nUpgrade: h2c\r\n\r\n"
                b"GET /healthz HTTP/1.1\r\n\r\n")
    assert reader.ended and len(reader.complete) == 1 and not reader.complete[0].keep_alive


def test_an_answer_is_http_1_1_with_its_length_and_connection():
    head, body = response_bytes(Reply(413, b'{"error":"x"}'), close=True).split(b"\r\n\r\n")
    lines = head.decode().split("\r\n")
    assert lines[0] == "HTTP/1.1 413 Request Entity Too Large"
    headers = dict(line.split(": ", 1) for line in lines[1:])
    assert headers["Content-Length"] == "13" and headers["Connection"] == "close"
    assert headers["Content-Type"] == "application/json" and headers["Date"].endswith(" GMT")
    assert body == b'{"error":"x"}'
    assert b"Connection: keep-alive" in response_bytes(OK, close=False)
    allowed = response_bytes(Reply(405, b"{}", headers=(("Allow", "POST"),)), close=False,
                             head_only=True)
    assert b"\r\nAllow: POST\r\n" in allowed and allowed.endswith(b"\r\n\r\n")


# --- the listener and the lingering close ---------------------------------------------------------

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


# --- a real gunicorn with archway's worker --------------------------------------------------------

def _serve(tmp_path, *extra: str, threads: int = 2) -> Server:
    port = free_port()
    return Server([sys.executable, "-m", "tests.infra.siteserver", "--bind", f"127.0.0.1:{port}",
                   "--threads", str(threads), *extra], port=port,
                  log_path=str(tmp_path / "gunicorn.log"), cwd=REPO, ready_timeout=30)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with _serve(tmp_path_factory.mktemp("server")) as served:
        yield served.port


def _request(asked: dict, *, close: bool = False, path: str = "/echo") -> bytes:
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
def test_calls_on_a_kept_alive_connection_are_answered_on_the_loop_or_a_thread(server):
    with socket.create_connection(("127.0.0.1", server)) as sock:
        for n in range(3):
            sock.sendall(_request({"n": n}))
            (headers, reply), = _responses(sock, 1)
            assert headers["status"] == "HTTP/1.1 200 OK" and headers["connection"] == "keep-alive"
            assert reply == {"n": n, "on_loop": True}
        # A handler that would wait leaves the request to a thread, on the same connection.
        sock.sendall(_request({"n": 3, "thread": True}))
        assert _responses(sock, 1)[0][1] == {"n": 3, "on_loop": False}
        sock.sendall(_request({"n": 4}))
        assert _responses(sock, 1)[0][1] == {"n": 4, "on_loop": True}
        sock.sendall(b"GET /probe HTTP/1.1\r\nHost: x\r\n\r\n")
        assert _responses(sock, 1)[0][1] == {"ok": True}


@pytest.mark.slow
def test_pipelined_calls_are_answered_in_order_and_close_is_honoured(server):
    with socket.create_connection(("127.0.0.1", server)) as sock:
        sock.sendall(_request({"n": 1}) + _request({"n": 2, "thread": True}) + _request({"n": 3})
                     + _request({"n": 4}, close=True))
        replies = _responses(sock, 4)
        assert [(r["n"], r["on_loop"]) for _, r in replies] == [(1, True), (2, False), (3, True), (4, True)]
        assert replies[3][0]["connection"] == "close"
        sock.settimeout(10)
        assert sock.recv(1) == b""   # closed after the answer the client asked to be the last


@pytest.mark.slow
def test_a_client_that_does_not_read_its_answer_holds_no_one_else(server):
    """An answer larger than the socket takes is sent as the client reads it; meanwhile the loop
    answers other connections."""
    with socket.create_connection(("127.0.0.1", server)) as slow:
        slow.sendall(_request({"n": 0, "big": True}))
        time.sleep(0.5)   # the server sent what the socket took, and waits for the rest
        with socket.create_connection(("127.0.0.1", server)) as other:
            started = time.monotonic()
            other.sendall(_request({"n": 1}))
            assert _responses(other, 1)[0][1] == {"n": 1, "on_loop": True}
            assert time.monotonic() - started < 5
        (_, reply), = _responses(slow, 1)
        assert reply["n"] == 0 and len(reply["pad"]) == BIG
        slow.sendall(_request({"n": 2}))   # and the connection goes on
        assert _responses(slow, 1)[0][1] == {"n": 2, "on_loop": True}


@pytest.mark.slow
def test_the_handler_is_told_when_a_request_arrived_not_when_a_thread_took_it(tmp_path):
    """One handler thread, three requests at once: two wait in the queue, and the handler sees
    that wait (CLOCK_MONOTONIC is the machine's, so the test can compare it with its own)."""
    with _serve(tmp_path, threads=1) as served:
        seen: list[dict] = []

        def post():
            sent = time.monotonic()
            seen.append(dict(requests.post(f"http://127.0.0.1:{served.port}/slow", timeout=30).json(),
                             sent=sent))

        threads = [threading.Thread(target=post) for _ in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
    assert len(seen) == 3
    for request in seen:
        assert request["sent"] <= request["arrived"] <= request["taken"]
    waits = sorted(r["taken"] - r["arrived"] for r in seen)
    assert waits[-1] >= 0.9     # behind two others, 0.5 s each


@pytest.mark.slow
def test_a_call_waiting_when_the_worker_starts_is_answered_and_closed(tmp_path):
    """A request queued on the master's socket before the worker runs is taken in, answered on
    the loop and (Connection: close) closed, as the worker starts (it once crashed the worker)."""
    port = free_port()
    with open(tmp_path / "gunicorn.log", "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "tests.infra.siteserver", "--bind", f"127.0.0.1:{port}",
             "--reuse-port"], cwd=REPO, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 30
        while True:   # the master listens before its worker has loaded the routes
            try:
                sock = socket.create_connection(("127.0.0.1", port), timeout=1)
                break
            except OSError:
                assert time.monotonic() < deadline and proc.poll() is None, "gunicorn did not listen"
                time.sleep(0.005)
        with sock:
            sock.sendall(_request({"n": 7}, close=True))
            (headers, reply), = _responses(sock, 1)
            assert reply == {"n": 7, "on_loop": True} and headers["connection"] == "close"
            assert sock.recv(1) == b""
    finally:
        proc.terminate()
        proc.wait(15)
    assert b"Exception in worker process" not in (tmp_path / "gunicorn.log").read_bytes()


@pytest.mark.slow
def test_a_graceful_stop_answers_what_is_under_way_and_closes_the_idle(tmp_path):
    with _serve(tmp_path) as served:
        idle = socket.create_connection(("127.0.0.1", served.port))
        idle.sendall(_request({"n": 0}))
        _responses(idle, 1)
        busy = socket.create_connection(("127.0.0.1", served.port))
        busy.sendall(_request({}, path="/slow"))
        time.sleep(0.2)   # a thread has it
        os.kill(served.proc.pid, signal.SIGTERM)
        (headers, reply), = _responses(busy, 1)
        assert headers["connection"] == "close" and "arrived" in reply
        idle.settimeout(10)
        assert idle.recv(1) == b""   # closed, not left to time out
        assert served.proc.wait(15) == 0
        busy.close()
        idle.close()
