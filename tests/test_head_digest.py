"""Tag revalidation by HEAD and 429 rate limits, against the real docker-registry.

HEAD is what a cache calls to learn whether a tag still points where it did (a GET counts as a
pull on Docker Hub, a HEAD does not). Stand-in servers (lab/servers/faults.py) only inject what
a real registry does not do here: 429s with Retry-After, a HEAD without a digest.
"""
import email.utils
import time

import pytest
from prometheus_client import REGISTRY

from archway.config import RegistrySettings
from archway.errors import AuthError, NotFound, RateLimited, classify_error
from archway.registry.credentials import Keyring
from archway.registry.http import HttpClient, parse_retry_after
from archway.registry.manifests import ACCEPT
from archway.registry.oci import RegistryClient
from archway.registry.reference import parse_reference
from archway.registry.resolver import Resolver
from archway.registry.sifsources import resolve_https
from archway.vocabulary import USER_AGENT
from lab.servers.faults import ScriptedServer
from lab.servers.registry import RegistryServer
from lab.tls import session_ca
from tests.infra.fixtures import LOOPBACK_HOSTS, plain_registry, test_ca, token_registry


def client_for(**settings_kw) -> RegistryClient:
    settings = RegistrySettings(**{"allow_hosts": LOOPBACK_HOSTS, **settings_kw})
    return RegistryClient(HttpClient(settings), settings)


def deadline(seconds: float = 10.0) -> float:
    return time.monotonic() + seconds


def requests_count(method: str, outcome: str) -> float:
    return REGISTRY.get_sample_value("archway_registry_requests_total",
                                     {"method": method, "outcome": outcome}) or 0.0


def test_head_gives_the_digest_the_get_resolves_to_and_costs_one_head(plain_registry):
    reg = plain_registry
    index = reg.push_index("head/multi", "v1", ["linux/amd64", "linux/arm64"])
    single = reg.push_image("head/single", "v1", "linux/arm64")
    client = client_for(insecure_hosts=(reg.host,))
    client.resolve(parse_reference(reg.ref("head/multi", "v1")), deadline=deadline())  # learn http
    for repo, pushed in (("head/multi", index.digest), ("head/single", single)):
        ref = parse_reference(reg.ref(repo, "v1"))
        mark, heads = reg.mark(), requests_count("HEAD", "2xx")
        assert client.head_digest(ref, Keyring.empty(), deadline()) == pushed
        assert [(e.method, e.path) for e in reg.requests_since(mark)] == [
            ("HEAD", f"/v2/{repo}/manifests/v1")]
        assert requests_count("HEAD", "2xx") == heads + 1
        assert client.resolve(ref, deadline=deadline()).digest == pushed


def test_head_asks_for_every_manifest_type():
    server = ScriptedServer(lambda request: (200, {"Docker-Content-Digest": "sha256:" + "a" * 64}, b""))
    try:
        ref = parse_reference(f"{server.host}/team/app:v1")
        assert client_for(insecure_hosts=(server.host,)).head_digest(ref) == "sha256:" + "a" * 64
        [request] = [r for r in server.requests if r.method == "HEAD"]
        assert request.headers["Accept"] == ACCEPT
    finally:
        server.stop()


def test_head_of_a_missing_tag_is_not_found_and_a_digest_reference_costs_nothing(plain_registry):
    reg = plain_registry
    client = client_for(insecure_hosts=(reg.host,))
    with pytest.raises(NotFound):
        client.head_digest(parse_reference(reg.ref("head/none", "v1")), deadline=deadline())
    digest = "sha256:" + "b" * 64
    mark = reg.mark()
    assert client.head_digest(parse_reference(reg.ref("head/none", digest=digest))) == digest
    assert reg.requests_since(mark) == []


def test_head_with_token_auth_gets_a_token_once(token_registry, test_ca):
    reg = token_registry
    pushed = reg.push_image("head/private", "v1", "linux/amd64")
    client = client_for(ca_file=test_ca.cert_path)
    ref = parse_reference(reg.ref("head/private", "v1"))
    keyring = Keyring.from_dockerconfigjson(reg.dockerconfigjson())
    reg.token_server.clear()
    assert client.head_digest(ref, keyring, deadline()) == pushed
    assert client.head_digest(ref, keyring, deadline()) == pushed   # the token is reused
    assert [r.user for r in reg.token_server.requests] == ["alice"]
    assert client.resolve(ref, keyring, deadline()).digest == pushed
    with pytest.raises(AuthError):
        client_for(ca_file=test_ca.cert_path).head_digest(ref, Keyring.empty(), deadline())


@pytest.mark.parametrize("header", [None, "sha256:short", "md5:" + "c" * 32, "SHA256:" + "D" * 64])
def test_no_usable_digest_on_head_is_none(header):
    headers = {"Docker-Content-Digest": header} if header else {}
    server = ScriptedServer(lambda request: (200, headers, b""))
    try:
        ref = parse_reference(f"{server.host}/team/app:v1")
        assert client_for(insecure_hosts=(server.host,)).head_digest(ref) is None
    finally:
        server.stop()


@pytest.mark.slow
def test_head_through_registry_access_uses_the_mirror_as_resolve_does(tmp_path_factory, tmp_path):
    """A pull-through cache in hosts_dir answers the HEAD; the upstream never sees archway."""
    ca = session_ca(tmp_path_factory)
    upstream = RegistryServer(tmp_path_factory.mktemp("upstream"), ca=ca, auth="token")
    mirror = RegistryServer(tmp_path_factory.mktemp("mirror"), mirror_of=upstream)
    try:
        pushed = upstream.push_image("head/mirrored", "v1", "linux/arm64")
        certs = tmp_path / "certs.d" / upstream.host
        certs.mkdir(parents=True)
        (certs / "hosts.toml").write_text(f'server = "{upstream.url}"\n[host."{mirror.url}"]\n'
                                          f'  capabilities = ["pull", "resolve"]\n')
        access = Resolver(RegistrySettings(allow_hosts=LOOPBACK_HOSTS, ca_file=ca.cert_path,
                                           hosts_dir=str(tmp_path / "certs.d"))).access
        ref = parse_reference(upstream.ref("head/mirrored", "v1"))
        up_mark, mirror_mark = upstream.mark(), mirror.mark()
        assert access.head_digest(ref, Keyring.empty(), deadline()) == pushed
        assert [e.method for e in mirror.requests_since(mirror_mark)
                if e.agent == USER_AGENT] == ["HEAD"]
        assert [e for e in upstream.requests_since(up_mark)
                if e.agent == USER_AGENT] == []
    finally:
        mirror.stop()
        upstream.stop()


# -- 429 ----------------------------------------------------------------------------------------

def test_retry_after_parsing():
    now = 1_700_000_000.0
    assert parse_retry_after("120", now) == 120.0
    assert parse_retry_after(email.utils.formatdate(now + 30, usegmt=True), now) == 30.0
    assert parse_retry_after(email.utils.formatdate(now - 30, usegmt=True), now) == 0.0
    assert parse_retry_after("9" * 40, now) == 3600   # bounded: one hour, the one cap
    assert parse_retry_after("36000", now) == 3600
    assert parse_retry_after(email.utils.formatdate(now + 7200, usegmt=True), now) == 3600
    for unusable in (None, "", "soon", "-5", "1.5", "Wed, 21 Oct 2015 07:28:00"):
        assert parse_retry_after(unusable, now) is None


@pytest.mark.parametrize("retry_after, expected", [("7", 7.0), (None, None)])
def test_a_429_on_the_manifest_is_rate_limited(retry_after, expected):
    headers = {"Retry-After": retry_after} if retry_after else {}
    server = ScriptedServer(lambda request: (429, headers, b'{"errors":[{"code":"TOOMANYREQUESTS"}]}'))
    try:
        client = client_for(insecure_hosts=(server.host,))
        ref = parse_reference(f"{server.host}/team/app:v1")
        for method, call in (("GET", client.resolve), ("HEAD", client.head_digest)):
            before = requests_count(method, "429")
            with pytest.raises(RateLimited) as caught:
                call(ref, Keyring.empty(), deadline())
            assert caught.value.retry_after == expected and caught.value.status == 429
            assert requests_count(method, "429") == before + 1
        assert classify_error(caught.value).label == "rate_limited"
        assert classify_error(caught.value).words == "registry rate limit (HTTP 429)"
    finally:
        server.stop()


def test_a_429_from_the_token_service_is_rate_limited():
    def respond(request):
        if request.path.startswith("/token"):
            return 429, {"Retry-After": email.utils.formatdate(time.time() + 60, usegmt=True)}, b""
        return 401, {"WWW-Authenticate": f'Bearer realm="http://{server.host}/token",service="s"'}, b""
    server = ScriptedServer(respond)
    try:
        client = client_for(insecure_hosts=(server.host,))
        before = REGISTRY.get_sample_value("archway_registry_token_requests_total",
                                           {"outcome": "rate_limited"}) or 0.0
        with pytest.raises(RateLimited) as caught:
            client.resolve(parse_reference(f"{server.host}/team/app:v1"), deadline=deadline())
        assert 55 <= caught.value.retry_after <= 60
        assert REGISTRY.get_sample_value("archway_registry_token_requests_total",
                                         {"outcome": "rate_limited"}) == before + 1
    finally:
        server.stop()


def test_a_429_from_a_sif_file_server_is_rate_limited():
    server = ScriptedServer(lambda request: (429, {"Retry-After": "3"}, b""))
    try:
        http = HttpClient(RegistrySettings(insecure_hosts=(server.host,)))
        with pytest.raises(RateLimited) as caught:
            resolve_https(parse_reference(f"http://{server.host}/app.sif"), http, deadline())
        assert caught.value.retry_after == 3.0
    finally:
        server.stop()
