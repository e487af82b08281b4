"""Hostile registries: slow drips, black holes, redirects that leak, spellings that dodge the
deny list, answers that crash parsers. Every peer here is a real socket on loopback
(lab/servers/faults.py); the real docker-registry stands in wherever a well-behaved one is needed.
"""
import base64
import hashlib
import ipaddress
import json
import subprocess
import sys
import threading
import time

import pytest
import yaml

from archway.config import RegistrySettings
from archway.errors import (
    ArchwayError,
    AuthError,
    DeadlineExceeded,
    HostRefused,
    InvalidReference,
    NotFound,
    RegistryError,
    TransportError,
    UnsupportedImage,
    classify_error,
)
from archway.logsafe import redact_url
from archway.registry.credentials import Keyring
from archway.registry.hostpolicy import HostPolicy, canonical_address
from archway.registry.http import HttpClient
from archway.registry.manifests import MAX_PLATFORMS
from archway.registry.model import ImageInfo
from archway.registry.oci import RegistryClient
from archway.registry.platforms import Platform
from archway.registry.redirects import redirect_step
from archway.registry.reference import parse_reference
from archway.registry.sifsources import resolve_https
from lab.procs import REPO, wait_until
from lab.servers.faults import BlackHole, DripServer, ScriptedServer
from tests.infra.fixtures import LOOPBACK_HOSTS, test_ca

# Starts real servers (registries, archway serve, helm...): outside the fast inner loop.
pytestmark = pytest.mark.slow

# Slack past a deadline: the watchdog acts at once, this only absorbs a loaded test machine.
SLACK = 3.0


def run_with_limit(fn, limit: float):
    """fn() in a thread; (finished, its exception or result). A thread still running after
    `limit` is what the drip defect looked like: a lookup thread pinned past every deadline."""
    outcome: dict = {}

    def target():
        try:
            outcome["value"] = fn()
        except Exception as e:
            outcome["value"] = e
    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(limit)
    return not thread.is_alive(), outcome.get("value")


def client_for(**settings_kw) -> RegistryClient:
    settings = RegistrySettings(**{"allow_hosts": LOOPBACK_HOSTS, **settings_kw})
    return RegistryClient(HttpClient(settings), settings)


@pytest.fixture
def servers():
    started = []

    def start(server):
        started.append(server)
        return server
    yield start
    for server in started:
        server.stop()


# -- 1. the deadline holds on the socket ----------------------------------------------------------

@pytest.mark.parametrize("peer, scheme", [("headers", "http"), ("body", "http"),
                                          ("handshake", "https"), ("black-hole", "http")])
def test_a_hostile_peer_is_cut_off_at_the_deadline(servers, peer, scheme):
    """1 byte a second satisfies every per-read timeout (5 s here): only a deadline enforced on
    the socket ends the request. The peer sees its connection closed: no thread stays on it."""
    server = servers(BlackHole() if peer == "black-hole" else DripServer(peer, interval=1.0))
    http = HttpClient(RegistrySettings(allow_hosts=LOOPBACK_HOSTS, insecure_hosts=(server.host,), timeout_seconds=5))
    budget = 1.5
    finished, answer = run_with_limit(
        lambda: http.get(f"{scheme}://{server.host}/v2/", deadline=time.monotonic() + budget,
                         max_bytes=4 << 20), budget + SLACK)
    assert finished, f"the request to a {peer} peer outlived its deadline"
    assert isinstance(answer, DeadlineExceeded), answer
    assert server.accepted == 1 and server.wait_closed(1, timeout=SLACK)


def test_a_dripping_token_service_and_redirect_target_end_at_the_deadline(servers):
    drip = servers(DripServer("headers", interval=1.0))
    realm = f"http://{drip.host}/token"

    def respond(request):
        if "/blobs/" in request.path:
            return 307, {"Location": f"http://{drip.host}/blob"}, b""
        return 401, {"WWW-Authenticate": f'Bearer realm="{realm}",service="s"'}, b""
    registry = servers(ScriptedServer(respond))
    client = client_for(insecure_hosts=(registry.host, drip.host), timeout_seconds=5)
    ref = parse_reference(f"{registry.host}/team/app:v1")
    finished, answer = run_with_limit(
        lambda: client.resolve(ref, Keyring.empty(), time.monotonic() + 1.5), 1.5 + SLACK)
    assert finished and isinstance(answer, DeadlineExceeded), answer
    finished, answer = run_with_limit(
        lambda: client.read_blob_range(ref, "sha256:" + "0" * 64, 0, 100, Keyring.empty(),
                                       time.monotonic() + 1.5), 1.5 + SLACK)
    assert finished and isinstance(answer, DeadlineExceeded), answer
    assert drip.wait_closed(2, timeout=SLACK)


def test_a_request_without_a_deadline_still_ends(servers):
    drip = servers(DripServer("headers", interval=0.2))
    http = HttpClient(RegistrySettings(allow_hosts=LOOPBACK_HOSTS, insecure_hosts=(drip.host,), timeout_seconds=0.5))
    finished, answer = run_with_limit(
        lambda: http.get(f"http://{drip.host}/v2/", max_bytes=1024), 3 * 0.5 + SLACK)
    assert finished and isinstance(answer, DeadlineExceeded), answer


def test_a_connection_reused_from_the_pool_is_watched_too(servers):
    """The first answer is quick and keeps the connection alive; the second drips on it."""
    drip = servers(DripServer("headers", interval=1.0, quick_answers=1))
    http = HttpClient(RegistrySettings(allow_hosts=LOOPBACK_HOSTS, insecure_hosts=(drip.host,), timeout_seconds=5))
    assert http.get(f"http://{drip.host}/a", max_bytes=64, deadline=time.monotonic() + 5).body == b"{}"
    finished, answer = run_with_limit(
        lambda: http.get(f"http://{drip.host}/b", max_bytes=64, deadline=time.monotonic() + 1.5),
        1.5 + SLACK)
    assert finished and isinstance(answer, DeadlineExceeded), answer
    assert drip.accepted == 1 and drip.wait_closed(1, timeout=SLACK)


def test_a_request_done_before_its_deadline_leaves_its_connection_alone(servers):
    """The watchdog lets go of a socket when its request ends: once that request's deadline has
    passed, the pooled connection still serves the next request."""
    peer = servers(DripServer("headers", interval=1.0, quick_answers=2))
    http = HttpClient(RegistrySettings(allow_hosts=LOOPBACK_HOSTS, insecure_hosts=(peer.host,), timeout_seconds=5))
    assert http.get(f"http://{peer.host}/a", max_bytes=64, deadline=time.monotonic() + 0.3).body == b"{}"
    time.sleep(0.5)   # past the first request's deadline
    assert http.get(f"http://{peer.host}/b", max_bytes=64, deadline=time.monotonic() + 5).body == b"{}"
    assert peer.accepted == 1 and peer.closed == 0


def test_inspect_exits_at_its_timeout_against_a_dripping_registry(servers, tmp_path):
    drip = servers(DripServer("headers", interval=1.0))
    config = tmp_path / "archway.yaml"
    config.write_text(yaml.safe_dump({"registry": {"insecure_hosts": [drip.host]}}))
    timeout = 2.0
    start = time.monotonic()
    process = subprocess.Popen([sys.executable, "-m", "archway.main.cli", "inspect", "--json",
                                "--timeout", str(timeout), "--config", str(config),
                                f"{drip.host}/team/app:v1"], cwd=REPO, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
    try:
        out, err = process.communicate(timeout=timeout + 5 + SLACK)   # + interpreter start-up
    except subprocess.TimeoutExpired:
        process.kill()
        process.communicate()
        pytest.fail(f"archway inspect --timeout {timeout} still running after "
                    f"{time.monotonic() - start:.1f} s")
    assert process.returncode == 1, err
    (row,) = json.loads(out)
    assert row["architectures"] == [] and row["error"]
    assert drip.wait_closed(1, timeout=SLACK)


# -- 3. nothing secret follows a redirect to another host ----------------------------------------

def token_answer():
    return 200, {"Content-Type": "application/json"}, json.dumps({"token": "t0k"}).encode()


def registry_behind(realm: str):
    """A registry stand-in that wants a bearer token from `realm`, then serves an index."""
    index = json.dumps({"schemaVersion": 2, "mediaType": "application/vnd.oci.image.index.v1+json",
                        "manifests": []}).encode()

    def respond(request):
        if request.headers.get("Authorization") != "Bearer t0k":
            return 401, {"WWW-Authenticate": f'Bearer realm="{realm}",service="s"'}, b""
        return 200, {"Content-Type": "application/vnd.oci.image.index.v1+json"}, index
    return respond


@pytest.mark.parametrize("status", [307, 308, 303, 302])
def test_a_redirected_identity_token_exchange_sends_nothing_to_the_other_host(servers, status):
    other = servers(ScriptedServer(lambda request: token_answer()))   # records what reached it
    moved = f"http://localhost:{other.port}/token"
    token_service = servers(ScriptedServer(lambda request: (status, {"Location": moved}, b"")))
    registry = servers(ScriptedServer(registry_behind(f"http://{token_service.host}/token")))
    keyring = Keyring.from_dockerconfigjson(
        {"auths": {registry.host: {"identitytoken": "refresh-secret-1"}}})
    client = client_for(insecure_hosts=(registry.host, token_service.host, f"localhost:{other.port}"))
    ref = parse_reference(f"{registry.host}/team/app:v1")
    if status in (307, 308):   # the form would go as it is: not followed
        with pytest.raises(TransportError, match="request body"):
            client.resolve(ref, keyring, time.monotonic() + 10)
    else:   # continued as a GET without the form
        assert client.resolve(ref, keyring, time.monotonic() + 10).digest
    [post] = token_service.requests
    assert post.method == "POST" and b"refresh-secret-1" in post.body   # the token went here only
    for request in other.requests:   # 303/302 may be followed: as a GET, with nothing secret
        assert request.method == "GET" and request.body == b""
        assert "refresh-secret-1" not in request.path
        assert not {"Authorization", "Cookie"} & set(request.headers)
    if status in (307, 308):
        assert other.requests == []


def test_a_redirected_basic_token_request_loses_its_authorization(servers):
    other = servers(ScriptedServer(lambda request: token_answer()))
    token_service = servers(ScriptedServer(lambda request: (
        302, {"Location": f"http://localhost:{other.port}/token?x=1"}, b"")))
    registry = servers(ScriptedServer(registry_behind(f"http://{token_service.host}/token")))
    secret = base64.b64encode(b"alice:pw-2").decode()
    keyring = Keyring.from_dockerconfigjson({"auths": {registry.host: {"auth": secret}}})
    client = client_for(insecure_hosts=(registry.host, token_service.host, f"localhost:{other.port}"))
    info = client.resolve(parse_reference(f"{registry.host}/team/app:v1"), keyring,
                          time.monotonic() + 10)
    assert info.digest
    assert token_service.requests[0].headers["Authorization"] == "Basic " + secret
    [moved] = other.requests
    assert "Authorization" not in moved.headers


def test_cookies_a_peer_sets_are_never_sent_back(servers):
    """The HTTP session serves every pod: a cookie one pod's credentials earned must not ride
    along on another pod's lookup."""
    server = servers(ScriptedServer(lambda request: (
        200, {"Set-Cookie": "session=earned-with-alices-password; Path=/"}, b"{}")))
    http = HttpClient(RegistrySettings(allow_hosts=LOOPBACK_HOSTS, insecure_hosts=(server.host,)))
    for _ in range(2):
        http.get(f"http://{server.host}/token", max_bytes=64, deadline=time.monotonic() + 5)
    assert [r.headers.get("Cookie") for r in server.requests] == [None, None]


def test_redirect_decision():
    a, b = "https://reg.example/v2/x", "https://cdn.example/blob"
    assert redirect_step(a, b, 307, "GET", False, False) == ("GET", False, False)
    assert redirect_step(a, "https://reg.example:443/y", 307, "GET", False, False) == ("GET", False, True)
    assert redirect_step(a, "https://reg.example/t", 307, "POST", True, False) == ("POST", True, True)
    assert redirect_step(a, b, 303, "POST", True, False) == ("GET", False, False)
    assert redirect_step(a, b, 302, "POST", True, False) == ("GET", False, False)
    assert redirect_step(a, b, 303, "HEAD", False, False) == ("HEAD", False, False)
    assert "request body" in redirect_step(a, b, 307, "POST", True, False)
    assert "request body" in redirect_step(a, "https://reg.example:8443/t", 308, "POST", True, False)
    assert "plain http" in redirect_step(a, "http://reg.example/v2/x", 301, "GET", False, False)
    assert redirect_step(a, "http://reg.example/v2/x", 301, "GET", False, True) == ("GET", False, False)
    assert "not an http" in redirect_step(a, "file:///etc/passwd", 302, "GET", False, False)
    assert redirect_step("http://r/x", "http://r/y", 302, "GET", False, False) == ("GET", False, True)


# -- 4. https is never left for http -------------------------------------------------------------

@pytest.fixture
def dual_protocol(servers, test_ca):
    """A registry on https with Basic auth whose manifests "moved" to a plain-http port; the
    plain side records whatever reaches it."""
    plain = servers(ScriptedServer(lambda request: (200, {}, b"{}")))
    cert = test_ca.issue("dual-protocol", ["127.0.0.1", "localhost"])

    def make(target_host: str, status: int = 302):
        def respond(request):
            if not request.headers.get("Authorization", "").startswith("Basic "):
                return 401, {"WWW-Authenticate": 'Basic realm="r"'}, b""
            return status, {"Location": f"http://{target_host}:{plain.port}{request.path}"}, b""
        return servers(ScriptedServer(respond, tls=cert))
    return plain, make


@pytest.mark.parametrize("target_host", ["127.0.0.1", "localhost"])
@pytest.mark.parametrize("status", [301, 302, 307, 308])
def test_a_redirect_from_https_to_http_is_not_followed(dual_protocol, test_ca, target_host, status):
    plain, make = dual_protocol
    secure = make(target_host, status)
    keyring = Keyring.from_dockerconfigjson(
        {"auths": {secure.host: {"auth": base64.b64encode(b"alice:pw-3").decode()}}})
    client = client_for(ca_file=test_ca.cert_path)
    with pytest.raises(TransportError) as caught:
        client.resolve(parse_reference(f"{secure.host}/team/app:v1"), keyring, time.monotonic() + 10)
    assert "plain http" in str(caught.value) and "pw-3" not in str(caught.value)
    assert plain.requests == []


def test_https_to_http_is_followed_to_a_host_listed_insecure(dual_protocol, test_ca):
    plain, make = dual_protocol
    secure = make("localhost")
    keyring = Keyring.from_dockerconfigjson(
        {"auths": {secure.host: {"auth": base64.b64encode(b"alice:pw-4").decode()}}})
    client = client_for(ca_file=test_ca.cert_path, insecure_hosts=(f"localhost:{plain.port}",))
    with pytest.raises(Exception):   # noqa: B017 - the "moved" manifest is `{}`: not an image
        client.resolve(parse_reference(f"{secure.host}/team/app:v1"), keyring, time.monotonic() + 10)
    [request] = plain.requests
    assert "Authorization" not in request.headers


# -- 7. the deny list matches addresses, however they are spelled --------------------------------

SPELLINGS_OF_LOOPBACK = ["127.0.0.1", "2130706433", "0x7f000001", "127.1", "0177.0.0.1",
                         "0x7f.0.0.1", "[::ffff:127.0.0.1]", "[::ffff:7f00:1]", "localhost"]


@pytest.mark.parametrize("deny", ["127.0.0.1", "127.0.0.0/8", "[::ffff:127.0.0.1]", "0x7f000001"])
def test_no_spelling_of_a_denied_address_reaches_it(servers, deny):
    listener = servers(BlackHole())
    for spelling in SPELLINGS_OF_LOOPBACK:
        netloc = f"{spelling}:{listener.port}"
        client = client_for(deny_hosts=(deny,), insecure_hosts=(netloc,), timeout_seconds=0.5)
        with pytest.raises(HostRefused, match="deny_hosts"):
            client.resolve(parse_reference(f"{netloc}/team/app:v1"), Keyring.empty(),
                           time.monotonic() + 2)
    assert listener.accepted == 0


def test_every_spelling_of_loopback_does_connect_when_listed(servers):
    """The control for the test above: these spellings are real ways to reach 127.0.0.1 (listed
    in allow_hosts: loopback is refused unless named, test_safe_defaults.py)."""
    listener = servers(BlackHole())
    for spelling in SPELLINGS_OF_LOOPBACK:
        netloc = f"{spelling}:{listener.port}"
        with pytest.raises((DeadlineExceeded, TransportError)):
            client_for(timeout_seconds=0.3).resolve(
                parse_reference(f"{netloc}/team/app:v1"), Keyring.empty(), time.monotonic() + 0.3)
        assert listener.accepted == SPELLINGS_OF_LOOPBACK.index(spelling) + 1, spelling


def test_allow_list_matches_addresses_however_spelled():
    policy = HostPolicy(allow_hosts=("127.0.0.1:5000", "10.1.0.0/16", "*.corp.example"))
    for allowed in ("2130706433:5000", "127.1:5000", "[::ffff:127.0.0.1]:5000", "10.1.2.3",
                    "0x0a010203", "reg.corp.example"):
        policy.check(allowed)
    for refused in ("127.0.0.1:5001", "10.2.0.1", "corp.example", "0x0a020001"):
        with pytest.raises(HostRefused, match="allow_hosts"):
            policy.check(refused)


def test_canonical_addresses():
    v4 = ipaddress.IPv4Address("127.0.0.1")
    for spelling in ("127.0.0.1", "2130706433", "0x7f000001", "127.1", "0177.0.0.1", "0x7f.1",
                     "[::ffff:127.0.0.1]", "::ffff:7f00:1", "::127.0.0.1", "64:ff9b::7f00:1"):
        assert canonical_address(spelling) == v4, spelling
    assert canonical_address("[fe80::1%eth0]") == ipaddress.IPv6Address("fe80::1")
    assert canonical_address("::1") == ipaddress.IPv6Address("::1")
    for name in ("localhost", "cafe", "1e100", "08.0.0.1", "reg.example", "1.2.3.4.5", ""):
        assert canonical_address(name) is None, name


# -- 6. an index cannot list more platforms than any real image has ------------------------------

OCI_INDEX = "application/vnd.oci.image.index.v1+json"


def index_server(servers, entries):
    body = json.dumps({"schemaVersion": 2, "mediaType": OCI_INDEX, "manifests": entries},
                      separators=(",", ":")).encode()
    return servers(ScriptedServer(lambda request: (200, {"Content-Type": OCI_INDEX}, body))), body


def test_an_index_of_fifty_thousand_platforms_is_refused(servers):
    server, body = index_server(servers, [{"platform": {"architecture": f"x{i}", "os": "linux"}}
                                          for i in range(50_000)])
    assert len(body) < 4 << 20   # within max_manifest_bytes: only the platform cap stops it
    with pytest.raises(UnsupportedImage, match="50000 manifests") as caught:
        client_for(insecure_hosts=(server.host,)).resolve(
            parse_reference(f"{server.host}/team/wide:v1"), Keyring.empty(), time.monotonic() + 10)
    assert classify_error(caught.value).label == "unsupported_image"


@pytest.mark.parametrize("count, refused", [(MAX_PLATFORMS, False), (MAX_PLATFORMS + 1, True)])
def test_the_platform_cap(servers, count, refused):
    server, _ = index_server(servers, [{"platform": {"architecture": f"x{i}", "os": "linux"}}
                                       for i in range(count)])
    client = client_for(insecure_hosts=(server.host,))
    ref = parse_reference(f"{server.host}/team/wide:v1")
    if refused:
        with pytest.raises(UnsupportedImage, match=f"{count} platforms"):
            client.resolve(ref, Keyring.empty(), time.monotonic() + 10)
    else:
        assert len(client.resolve(ref, Keyring.empty(), time.monotonic() + 10).platforms) == count


_HELD = """
import gc, json, sys, tracemalloc
from archway.registry.model import ImageInfo
from archway.registry.platforms import Platform

def build(count):
    return ImageInfo(f"reg.example/team/app-{count}:v1",
                     frozenset(Platform("linux", f"arch-{count}-{i}", "v1") for i in range(count)),
                     "sha256:" + "e" * 64, "oci-index", "")

figures = []
for count in map(int, sys.argv[1:]):
    gc.collect()
    tracemalloc.start()
    info = build(count)
    held, _ = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    figures.append((count, held, info.approx_bytes()))
print(json.dumps(figures))
"""


def test_approx_bytes_tracks_what_an_answer_holds():
    # Measured in a fresh interpreter: in a long-lived one, objects come from CPython's free
    # lists without an allocation tracemalloc sees (the whole suite measured 475 bytes held for
    # an answer that holds ~800).
    out = subprocess.run([sys.executable, "-c", _HELD, "1", "16", str(MAX_PLATFORMS)],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    figures = json.loads(out.stdout)
    for count, held, approx in figures:
        assert held * 0.7 <= approx <= held * 1.5, (count, held, approx)
    assert figures[-1][2] > 40 * figures[0][2]


# -- 8. hostile answers become typed errors, never internal ones ---------------------------------

DEEP = b"[" * 30_000 + b"]" * 30_000   # 60 KB: within every size bound, 30x the recursion limit


@pytest.mark.parametrize("answer, error, words", [
    ((200, {"Content-Type": OCI_INDEX}, DEEP), RegistryError, "not a JSON object"),
    ((404, {"Content-Type": "application/json"}, DEEP), NotFound, "not found"),
    ((401, {"WWW-Authenticate": 'Bearer realm="https://[::1",service="x"'}, b""), AuthError,
     "unusable token realm"),
    ((401, {"WWW-Authenticate": 'Bearer realm="https://reg.example:99999/t"'}, b""), AuthError,
     "unusable token realm"),
    ((302, {"Location": "http://[::1/elsewhere"}, b""), TransportError, "cannot use"),
])
def test_hostile_registry_answers_are_typed_errors(servers, answer, error, words):
    server = servers(ScriptedServer(lambda request: answer))
    with pytest.raises(error, match=words):
        client_for(insecure_hosts=(server.host,)).resolve(
            parse_reference(f"{server.host}/team/app:v1"), Keyring.empty(), time.monotonic() + 10)


def test_deeply_nested_token_and_config_answers_are_typed_errors(servers):
    config_digest = "sha256:" + hashlib.sha256(DEEP).hexdigest()
    manifest = json.dumps({"schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
                           "config": {"mediaType": "application/vnd.oci.image.config.v1+json",
                                      "digest": config_digest, "size": len(DEEP)},
                           "layers": []}).encode()

    def respond(request):
        if request.path.startswith("/token"):
            return 200, {"Content-Type": "application/json"}, DEEP
        if "/blobs/" in request.path:
            return 200, {}, DEEP
        return 200, {"Content-Type": "application/vnd.oci.image.manifest.v1+json"}, manifest
    server = servers(ScriptedServer(respond))
    client = client_for(insecure_hosts=(server.host,))
    with pytest.raises(RegistryError, match="config blob .* not a JSON object"):
        client.resolve(parse_reference(f"{server.host}/team/app:v1"), Keyring.empty(),
                       time.monotonic() + 10)
    challenging = servers(ScriptedServer(lambda request: (200, {}, DEEP) if request.path.startswith(
        "/token") else (401, {"WWW-Authenticate": f'Bearer realm="http://{server.host}/token"'}, b"")))
    with pytest.raises(RegistryError, match="without a usable token"):
        client_for(insecure_hosts=(challenging.host, server.host)).resolve(
            parse_reference(f"{challenging.host}/team/app:v1"), Keyring.empty(),
            time.monotonic() + 10)


# -- 10. the password of a URL reference is never shown ------------------------------------------

SECRET = "s3cr3t-pw"


def test_a_url_reference_shows_no_password():
    ref = parse_reference(f"https://alice:{SECRET}@files.example:8443/images/app.sif")
    assert str(ref) == "https://***@files.example:8443/images/app.sif"
    assert ref.host == "files.example:8443" and SECRET in ref.url   # still used to fetch
    assert redact_url(f"oras://reg.example/app@sha256:{'a' * 64}") == f"oras://reg.example/app@sha256:{'a' * 64}"
    assert redact_url(f"https://tok:{SECRET}@h?x=@y") == "https://***@h?x=@y"
    with pytest.raises(InvalidReference) as caught:
        parse_reference(f"ftp://alice:{SECRET}@files.example/app.sif")
    assert SECRET not in str(caught.value) and "***@files.example" in str(caught.value)


@pytest.mark.parametrize("peer", ["404", "401", "denied", "closed", "drip"])
def test_no_error_about_a_url_reference_holds_its_password(servers, peer):
    if peer == "drip":
        server = servers(DripServer("headers", interval=0.2))
    elif peer == "closed":
        server = servers(BlackHole())
        server.stop()   # nothing listens on its port any more
    else:
        server = servers(ScriptedServer(lambda request: (int(peer) if peer != "denied" else 200, {}, b"")))
    url = f"http://alice:{SECRET}@{server.host}/images/app.sif"
    http = HttpClient(RegistrySettings(allow_hosts=LOOPBACK_HOSTS, insecure_hosts=(server.host,), timeout_seconds=1,
                                       deny_hosts=(server.host,) if peer == "denied" else ()))
    with pytest.raises(ArchwayError) as caught:
        resolve_https(parse_reference(url), http, time.monotonic() + 1.5)
    error = caught.value
    assert SECRET not in str(error) and SECRET not in getattr(error, "host", "")
    if peer in ("404", "401"):
        [request] = server.requests   # the URL's credentials go to its own host, and only there
        assert request.headers["Authorization"] == "Basic " + base64.b64encode(
            f"alice:{SECRET}".encode()).decode()


def test_inspect_shows_no_password(servers, tmp_path):
    server = servers(ScriptedServer(lambda request: (404, {}, b"")))
    config = tmp_path / "archway.yaml"
    config.write_text(yaml.safe_dump({"registry": {"insecure_hosts": [server.host]}}))
    url = f"http://alice:{SECRET}@{server.host}/images/app.sif"
    for output in ([], ["--json"]):
        result = subprocess.run([sys.executable, "-m", "archway.main.cli", "inspect", *output,
                                 "--config", str(config), url], cwd=REPO, capture_output=True,
                                text=True, timeout=60, check=False)
        assert result.returncode == 1
        assert "404" in result.stdout and f"http://***@{server.host}/images/app.sif" in result.stdout
        assert SECRET not in result.stdout + result.stderr


# --- one repository's token realm cannot poison the host (issue 21, item 5) ----------------------

class HostileRealmFront:
    """A real token-auth docker-registry behind a front that answers every request for the
    repositories in `realms` with a 401 naming that repository's own (hostile) realm, as a
    registry serving several tenants may. The rest reaches the real registry."""

    def __init__(self, registry, realms: dict[str, str]):
        from tests.infra.gateway import RegistryGateway
        realms_by_prefix = {f"/v2/{repo}/": realm for repo, realm in realms.items()}

        class Front(RegistryGateway):
            def _respond(self, request):
                for prefix, realm in realms_by_prefix.items():
                    if request.path.startswith(prefix):
                        challenge = f'Bearer realm="{realm}",service="tenant"'
                        return 401, {"WWW-Authenticate": challenge}, b'{"errors":[]}'
                return super()._respond(request)

        self.gateway = Front(registry.url)
        self.host = self.gateway.host

    def stop(self):
        self.gateway.stop()


@pytest.fixture
def poisoned(tmp_path):
    from lab.servers.registry import RegistryServer
    registry = RegistryServer(tmp_path / "registry", auth="token", anonymous_pull=True)
    for tag in ("v1", "v2", "v3", "v4"):
        registry.push_image("team/app", tag, "linux/arm64")
    huge = ScriptedServer(lambda request: (200, {"Content-Type": "application/json"},
                                           b'{"token":"' + b"x" * (10 * 1024 * 1024) + b'"}'))
    hang = BlackHole()
    front = HostileRealmFront(registry, {"evil/big": f"http://{huge.host}/token",
                                         "evil/hang": f"http://{hang.host}/token"})
    yield registry, front, (huge, hang)
    for part in (front, huge, hang, registry):
        part.stop()


def test_a_hostile_realm_of_one_repository_never_stops_another_on_the_same_host(poisoned):
    """Challenges were kept per host from whichever repository last answered 401 and used up
    front for every repository there: after a 10 MB token or a hanging realm, no lookup on the
    host reached the registry until restart."""
    from concurrent.futures import ThreadPoolExecutor

    from archway.registry.resolver import Resolver
    registry, front, (huge, hang) = poisoned
    resolver = Resolver(RegistrySettings(allow_hosts=LOOPBACK_HOSTS,
        insecure_hosts=(front.host, registry.token_server.host, huge.host, hang.host),
        timeout_seconds=2))

    def resolve(image):
        return resolver.resolve_many([f"{front.host}/{image}"], timeout=15)[f"{front.host}/{image}"]

    big = resolve("evil/big:1")   # the host's very first 401 names the hostile realm
    assert isinstance(big, RegistryError) and "more than 65536 bytes" in str(big)
    mark = registry.mark()
    assert resolve("team/app:v1").architectures == {"arm64"}
    again = resolve("evil/big:2")   # again, after the host's good challenge was learnt
    assert isinstance(again, RegistryError) and "more than 65536 bytes" in str(again)
    assert resolve("team/app:v2").architectures == {"arm64"}
    with ThreadPoolExecutor(1) as pool:
        hanging = pool.submit(resolve, "evil/hang:1")
        wait_until(lambda: hang.accepted >= 1, 10, "the token request to reach the black hole")
        started = time.monotonic()
        assert resolve("team/app:v3").architectures == {"arm64"}
        assert time.monotonic() - started < 1.5
        assert isinstance(hanging.result(timeout=20), (TransportError, DeadlineExceeded))
    assert resolve("team/app:v4").architectures == {"arm64"}
    reached = {e.path for e in registry.requests_since(mark) if e.status == 200}
    assert {f"/v2/team/app/manifests/v{n}" for n in range(1, 5)} <= reached


def test_a_hosts_challenge_expires(poisoned):
    from archway.registry.auth import CHALLENGE_SECONDS, RegistryAuth
    from lab.clock import ManualClock
    registry, front, _ = poisoned
    clock = ManualClock()
    http = HttpClient(RegistrySettings(allow_hosts=LOOPBACK_HOSTS, insecure_hosts=(front.host, registry.token_server.host)))
    client = RegistryClient(http, RegistrySettings(allow_hosts=LOOPBACK_HOSTS), auth=RegistryAuth(http, clock=clock))

    def statuses(tag):
        mark = registry.mark()
        client.resolve(parse_reference(f"{front.host}/team/app:{tag}"), deadline=time.monotonic() + 10)
        return [e.status for e in registry.requests_since(mark) if "/manifests/" in e.path]

    assert statuses("v1") == [401, 200]   # first contact: the 401 names the challenge
    assert statuses("v2") == [200]        # remembered: the token up front
    clock.now += CHALLENGE_SECONDS + 1
    assert statuses("v3") == [401, 200]   # forgotten: asked again


# --- a kept-alive connection the peer closed ------------------------------------------------------

class ClosesKeptAliveConnections:
    """Answers the first request of every connection (keep-alive), then closes that connection
    when the next request arrives on it, without a word: a proxy or load balancer closing an idle
    connection just as archway reuses it (seen with tinyproxy under load)."""

    def __init__(self):
        import socket as _socket
        self.listener = _socket.create_server(("127.0.0.1", 0))
        self.host = f"127.0.0.1:{self.listener.getsockname()[1]}"
        self.connections = 0
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            self.connections += 1
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn):
        with conn:
            data = b""
            while b"\r\n\r\n" not in data:
                chunk = conn.recv(65536)
                if not chunk:
                    return
                data += chunk
            body = b'{"ok": true}'
            conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                         b"Content-Length: %d\r\nConnection: keep-alive\r\n\r\n%s" % (len(body), body))
            conn.recv(65536)          # the next request on this connection: closed unanswered

    def stop(self):
        self.listener.close()


@pytest.mark.parametrize("through", ["registry", "egress proxy"])
def test_a_kept_alive_connection_closed_by_the_peer_is_retried_once_on_a_new_one(through):
    from archway.config import ProxySettings
    server = ClosesKeptAliveConnections()
    try:
        if through == "registry":
            url, settings = f"http://{server.host}/v2/", RegistrySettings(allow_hosts=LOOPBACK_HOSTS,
                insecure_hosts=(server.host,), timeout_seconds=5)
        else:   # plain HTTP through a proxy that answers for the registry itself
            url, settings = "http://127.0.0.1:9/v2/", RegistrySettings(allow_hosts=LOOPBACK_HOSTS,
                insecure_hosts=("127.0.0.1:9",), timeout_seconds=5,
                proxy=ProxySettings(url=f"http://{server.host}"))
        http = HttpClient(settings)
        for _ in range(3):
            answer = http.get(url, max_bytes=1024, deadline=time.monotonic() + 5)
            assert answer.status == 200 and answer.json() == {"ok": True}
        assert server.connections == 3      # each reuse failed and was sent again, once
    finally:
        server.stop()
