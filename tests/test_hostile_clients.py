"""Hostile clients against a real `archway serve` (gunicorn, 2 workers x 8 threads, TLS) with a
real docker-registry behind it (issue 16 items 2, 5, 8 and 9).

Raw sockets play the clients an attack run used to switch the webhook off: connections that
send nothing, 3 bytes of a ClientHello, half a request line, a head and part of the body, or a
kept-alive connection that starts its next request and stalls. While they are held, real
admissions (fresh connections, full TLS) must keep being answered; afterwards the server must
have cut every one of them off, counted by reason, and said so in its log.
"""
import copy
import json
import os
import re
import socket
import ssl
import sys
import time
import uuid

import pytest
import requests
import yaml

from archway.server.worker import MAX_CONNECTIONS
from lab.procs import REPO, Server, free_port
from lab.servers.registry import RegistryServer
from lab.servers.stalled import KINDS, request_head, stalled

pytestmark = pytest.mark.slow

FIXTURES = os.path.join(REPO, "tests", "fixtures")
STALLED_PER_KIND = 40        # x 6 kinds = 240 connections, 15 times the 16 handler threads
REAL_ADMISSIONS = 20


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    stack = []
    try:
        registry = RegistryServer(tmp_path_factory.mktemp("registry"))
        stack.append(registry)
        registry.push_index("archway/multi", "1.0", ["linux/amd64", "linux/arm64"])
        workdir = tmp_path_factory.mktemp("archway")
        config = {
            "server": {"state_dir": str(workdir / "state"), "workers": 2, "threads": 8,
                       "log_every_admission": True},
            "admission": {"fail_closed": True},
            "registry": {"insecure_hosts": [registry.host]},
            "kubernetes": {"enabled": "off"},
            "extender": {"node_cache": False},
        }
        (workdir / "archway.yaml").write_text(yaml.safe_dump(config))
        port = free_port()
        env = {k: v for k, v in os.environ.items() if k != "PROMETHEUS_MULTIPROC_DIR"}
        proc = Server([sys.executable, "-m", "archway.main.cli", "--config", str(workdir / "archway.yaml"),
                       "serve", "--bind", f"127.0.0.1:{port}"], port=port,
                      log_path=str(workdir / "serve.log"), cwd=REPO, env=env, ready_timeout=30)
        stack.append(proc)
        s = Served(proc, port, str(workdir / "state" / "tls" / "ca.crt"), registry)
        s.wait_ready()
        yield s
    finally:
        for part in reversed(stack):
            part.stop()


class Served:
    def __init__(self, proc: Server, port: int, cacert: str, registry: RegistryServer):
        self.proc, self.port, self.cacert, self.registry = proc, port, cacert, registry
        self.url = f"https://127.0.0.1:{port}"
        self.tls = ssl.create_default_context(cafile=cacert)

    def session(self) -> requests.Session:
        s = requests.Session()
        s.trust_env = False
        s.verify = self.cacert
        return s

    def wait_ready(self) -> None:
        end = time.monotonic() + 30
        while time.monotonic() < end:
            try:
                with self.session() as s:
                    if s.get(self.url + "/readyz", timeout=2).status_code == 200:
                        return
            except requests.RequestException:
                time.sleep(0.05)
        raise RuntimeError("archway serve never became ready:\n" + self.proc.log())

    def review(self, **metadata) -> dict:
        with open(os.path.join(FIXTURES, "admission", "v1-pod-multiarch.json")) as f:
            review = json.loads(f.read().replace("REGISTRY", self.registry.host))
        review["request"]["uid"] = str(uuid.uuid4())
        review["request"]["object"]["metadata"].update(metadata)
        return review

    def admit(self, review: dict, session: requests.Session | None = None) -> dict:
        """POST on a fresh connection (new TLS handshake, new accept) unless `session`."""
        own = session is None
        session = session or self.session()
        try:
            r = session.post(self.url + "/mutate", json=review, timeout=15)
        finally:
            if own:
                session.close()
        assert r.status_code == 200, r.text
        return r.json()["response"]

    def metrics(self) -> str:
        with self.session() as s:
            return s.get(self.url + "/metrics", timeout=10, headers={"Connection": "close"}).text

    def log(self) -> str:
        with open(self.proc.log_path, encoding="utf-8", errors="replace") as f:
            return f.read()

    # --- raw clients
    def tcp(self) -> socket.socket:
        return socket.create_connection(("127.0.0.1", self.port), timeout=10)

    def tls_socket(self) -> ssl.SSLSocket:
        return self.tls.wrap_socket(self.tcp(), server_hostname="127.0.0.1")


def _mutated(response: dict) -> bool:
    return response["allowed"] and "patch" in response


def _cuts(metrics_text: str) -> dict[str, float]:
    return {m["reason"]: float(m["n"]) for m in re.finditer(
        r'archway_client_connections_cut_total\{reason="(?P<reason>[a-z_]+)"\} (?P<n>[0-9.e+]+)',
        metrics_text)}


def _closed_by_server(sock: socket.socket, timeout: float) -> bool:
    """True once the server closed (or reset) the connection; False if it is still open."""
    sock.settimeout(timeout)
    try:
        while sock.recv(4096):
            pass   # an answer (431, a 4xx) before the close is fine
        return True
    except (ConnectionResetError, ssl.SSLError, BrokenPipeError):
        return True
    except TimeoutError:
        return False


def _stall(served: Served) -> dict[str, list[socket.socket]]:
    body = json.dumps(served.review()).encode()
    address = ("127.0.0.1", served.port)
    kinds: dict[str, list[socket.socket]] = {
        kind: [stalled(address, kind, served.tls, body) for _ in range(STALLED_PER_KIND)]
        for kind in KINDS}
    kinds["kept_alive"] = []
    for _ in range(STALLED_PER_KIND):
        s = served.tls_socket()
        s.sendall(request_head("/mutate", len(body)) + body)
        head = b""
        while b"\r\n\r\n" not in head:
            head += s.recv(65536)
        assert head.startswith(b"HTTP/1.1 200"), head[:200]
        s.sendall(b"POST /mutate HT")      # the next request on the kept-alive connection
        kinds["kept_alive"].append(s)
    kinds["pipelined"] = []
    for _ in range(STALLED_PER_KIND):
        s = served.tls_socket()   # a whole request and the start of the next in one write
        s.sendall(request_head("/mutate", len(body)) + body + b"POST /mutate HTTP/1.1\r\nHo")
        head = b""
        while b"\r\n\r\n" not in head:
            head += s.recv(65536)
        assert head.startswith(b"HTTP/1.1 200"), head[:200]
        kinds["pipelined"].append(s)
    return kinds


def test_stalled_clients_do_not_stop_admissions_and_are_cut_off(server):
    before = _cuts(server.metrics())
    server.admit(server.review())    # the image is cached in one worker at least
    kinds = _stall(server)
    try:
        answered = [server.admit(server.review()) for _ in range(REAL_ADMISSIONS)]
        assert all(_mutated(r) for r in answered), answered
        # Each stalled connection is then cut off at its deadline (handshake and header 5 s,
        # body 10 s after the head). Before this change the client_hello and request_line ones
        # held their threads for good, and these admissions timed out.
        for kind, sockets in kinds.items():
            still_open = [s for s in sockets if not _closed_by_server(s, 30)]
            assert not still_open, f"{len(still_open)} {kind} connections never cut off"
    finally:
        for sockets in kinds.values():
            for s in sockets:
                s.close()
    cuts = _cuts(server.metrics())
    grew = {reason: cuts.get(reason, 0) - before.get(reason, 0) for reason in cuts}
    n = STALLED_PER_KIND
    assert grew.get("handshake_timeout") == 2 * n, grew     # idle + client_hello
    assert grew.get("header_timeout") == 3 * n, grew        # request_line, kept_alive, pipelined
    assert grew.get("body_timeout") == n, grew
    assert not grew.get("tls_failed") and not grew.get("overflow"), grew
    assert re.search(r"WARNING archway\.server: cut off \d+ client connection\(s\) \(.*"
                     r"handshake_timeout", server.log())


def test_more_connections_than_a_worker_holds_make_room_for_real_clients(server):
    """1,000 idle TCP connections switched the webhook off; 2.3 times what the 2 workers hold
    now only close the oldest idle ones."""
    before = _cuts(server.metrics()).get("overflow", 0)
    held = []
    try:
        for _ in range(int(2.3 * MAX_CONNECTIONS)):
            held.append(server.tcp())
        answered = [server.admit(server.review()) for _ in range(5)]
        assert all(_mutated(r) for r in answered)
    finally:
        for s in held:
            s.close()
    assert _cuts(server.metrics()).get("overflow", 0) - before >= 0.3 * MAX_CONNECTIONS


def test_clients_leaving_while_a_full_worker_makes_room_do_not_crash_it(server):
    """A full worker closes its oldest connection to accept a new one; when that connection's
    own close was already among the events being handled, handling it again raised, the worker
    died, and every connection it held (real admissions too) was reset."""
    held = [server.tcp() for _ in range(int(2.3 * MAX_CONNECTIONS))]
    fresh = []
    try:
        for s in held:   # the new connection's accept and the oldest one's close: one batch
            fresh.append(server.tcp())
            s.close()
        assert all(_mutated(server.admit(server.review())) for _ in range(5))
    finally:
        for s in held + fresh:
            s.close()
    assert "Exception in worker process" not in server.log()


def test_clients_that_ask_to_close_and_then_neither_read_nor_close_do_not_stall_the_worker(
        server):
    """After its last answer a connection lingers until its client closes (RFC 9112 9.6).
    gunicorn 27 waited for that in the worker's main loop, up to 2 s per connection: 40 such
    clients held every admission of both workers for ~40 s. The wait now runs in the poller."""
    body = json.dumps(server.review()).encode()
    head = request_head("/mutate", len(body)).replace(b"\r\n\r\n", b"\r\nConnection: close\r\n\r\n")
    lingering = []
    started = time.monotonic()   # each new connection's handshake needs the main loop too
    try:
        for _ in range(40):
            s = server.tls_socket()
            s.sendall(head + body)   # then never reads its answer, and never closes
            lingering.append(s)
        answered = [server.admit(server.review()) for _ in range(5)]
        took = time.monotonic() - started
    finally:
        for s in lingering:
            s.close()
    assert all(_mutated(r) for r in answered), answered
    assert took < 15, f"40 lingering connections and 5 admissions took {took:.1f} s"


def test_a_request_head_over_64_kib_is_a_431(server):
    with server.tls_socket() as s:
        s.sendall(b"POST /mutate HTTP/1.1\r\nHost: x\r\nX-Filler: " + b"a" * 70_000)
        s.settimeout(10)
        answer = b""
        try:
            while chunk := s.recv(4096):
                answer += chunk
        except (ConnectionResetError, ssl.SSLError):
            pass
    assert answer.startswith(b"HTTP/1.1 431"), answer[:200]
    assert b'"error"' in answer


def _raw_exchange(server: Served, request: bytes) -> tuple[int, dict]:
    with server.tls_socket() as s:
        s.sendall(request)
        s.settimeout(10)
        data = b""
        while b"\r\n\r\n" not in data:
            data += s.recv(65536)
        head, _, body = data.partition(b"\r\n\r\n")
        found = re.search(rb"(?i)content-length: *(\d+)", head)
        assert found, head
        length = int(found.group(1))
        while len(body) < length:
            body += s.recv(65536)
    return int(head.split()[1]), json.loads(body)


def test_an_invalid_chunk_size_is_a_400(server):
    status, answer = _raw_exchange(server, (
        b"POST /mutate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Transfer-Encoding: chunked\r\n\r\nzz\r\n{}\r\n0\r\n\r\n"))
    assert status == 400 and "chunk size" in answer["error"], answer


MALFORMED = [
    # (what the client sends, the status, words of the error)
    (b"GARBAGE / HTTP/1.1\r\nHost: x\r\n\r\n", 400, "not an HTTP method"),
    (b"GET /\x01 HTTP/1.1\r\nHost: x\r\n\r\n", 400, "malformed HTTP request"),
    (b"GET /healthz HTTP/1.1\r\nHost x\r\n\r\n", 400, "malformed HTTP request"),
    (b"POST /mutate HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\nContent-Length: 3\r\n\r\n{}",
     400, "Content-Length"),
    (b"POST /mutate HTTP/1.1\r\nHost: x\r\nContent-Length: 1x\r\n\r\n{}", 400, "Content-Length"),
    (b"POST /mutate HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\nContent-Length: 2\r\n\r\n",
     400, "Transfer-Encoding"),
    (b"GET /" + b"a" * 9000 + b" HTTP/1.1\r\nHost: x\r\n\r\n", 414, "longer than 8 KiB"),
    (b"GET /healthz HTTP/2.0\r\nHost: x\r\n\r\n", 505, "HTTP/2.0 is not served"),
    (b"POST /mutate HTTP/1.1\r\nHost: x\r\nExpect: magic\r\nContent-Length: 2\r\n\r\n{}", 417, "magic"),
    (b"DELETE /mutate HTTP/1.1\r\nHost: x\r\n\r\n", 405, "Method Not Allowed: DELETE /mutate"),
    (b"GET /nothing HTTP/1.1\r\nHost: x\r\n\r\n", 404, "archway serves POST /mutate"),
    (b"POST /mutate HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % (3 * 1024 * 1024 + 1)
     + b" " * (3 * 1024 * 1024 + 1), 413, "exceeds server.max_body_bytes"),
    (b"POST /mutate HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n%x\r\n" % (4 << 20)
     + b" " * (4 << 20) + b"\r\n0\r\n\r\n", 413, "exceeds server.max_body_bytes"),
]


@pytest.mark.parametrize("request_bytes, status, words", MALFORMED,
                         ids=[f"{status}-{n}" for n, (_, status, _) in enumerate(MALFORMED)])
def test_malformed_http_of_every_kind_is_a_json_4xx_with_its_reason(server, request_bytes, status,
                                                                     words):
    """gunicorn answered these with HTML pages (400, 431...) or not at all; every one is JSON
    now, counted in archway_bad_requests_total, and the server goes on answering."""
    before = _bad_requests(server.metrics()).get(str(status), 0)
    got, answer = _raw_exchange(server, request_bytes)
    assert got == status and words in answer["error"], (got, answer)
    assert _bad_requests(server.metrics()).get(str(status), 0) == before + 1
    assert _mutated(server.admit(server.review()))


def _bad_requests(metrics_text: str) -> dict[str, float]:
    return {m["code"]: float(m["n"]) for m in re.finditer(
        r'archway_bad_requests_total\{code="(?P<code>\d+)"\} (?P<n>[0-9.e+]+)', metrics_text)}


def test_plain_http_to_the_tls_port_is_a_400_that_says_so(server):
    """A client that forgot https:// got a TCP reset with no word; it is told, in plain HTTP."""
    with server.tcp() as s:
        s.sendall(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        s.settimeout(10)
        answer = b""
        while chunk := s.recv(4096):
            answer += chunk
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400 Bad Request") and b"Connection: close" in head, head
    assert "use https://" in json.loads(body)["error"]
    assert _cuts(server.metrics()).get("plain_http", 0) >= 1


def test_an_extender_body_over_its_cap_is_a_413_unread(server):
    status, answer = _raw_exchange(server, (
        b"POST /scheduler/filter HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n" % (65 * 1024 * 1024)))
    assert status == 413 and answer["error"], answer


def test_a_pod_name_cannot_forge_a_log_line(server):
    forged = "2026-01-01 00:00:00,000 INFO archway.admission: admission kube-system/forged"
    name = f"web\n{forged}\r\x1b[2K"
    response = server.admit(server.review(name=name))
    assert _mutated(response)
    pod = copy.deepcopy(server.review(name=name)["request"]["object"])
    with server.session() as s:
        r = s.post(server.url + "/scheduler/filter", timeout=10, json={
            "Pod": pod, "NodeNames": ["n1"]})
    assert r.status_code == 200, r.text
    log = server.log()
    assert not any(line.startswith(forged[:30]) for line in log.splitlines())
    assert log.count("web\\n2026-01-01 00:00:00,000 INFO") >= 2, log[-3000:]   # both products
    assert "\\r\\x1b[2K" in log


def test_an_extender_body_dripped_slower_than_its_deadline_is_cut_off(server):
    """Extender bodies over server.max_body_bytes are read by a handler thread: a client that
    keeps dripping one (each byte within the 5 s per-read timeout) is cut off at the body's
    deadline (10 s) instead of holding the thread: over plain HTTP it gets a 408; over TLS the
    session cannot carry one after its receiving side was shut, so the connection ends."""
    with server.tls_socket() as s:
        s.sendall(b"POST /scheduler/filter HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
                  b"\r\nContent-Length: %d\r\n\r\n" % (10 * 1024 * 1024) + b"{" + b" " * 1000)
        s.settimeout(0.5)
        answer, ended = b"", False
        for _ in range(120):   # one byte every 0.5 s until the server ends it (60 s at most)
            try:
                chunk = s.recv(65536)
            except TimeoutError:
                try:
                    s.sendall(b" ")
                except (OSError, ssl.SSLError):
                    ended = True
                    break
                continue
            except (OSError, ssl.SSLError):
                ended = True
                break
            answer += chunk
            if not chunk or b"\r\n\r\n" in answer:
                ended = True
                break
    assert ended, "the server kept reading the dripped body for 60 s"
    assert not answer or answer.startswith(b"HTTP/1.1 408"), answer[:300]
