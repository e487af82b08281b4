"""The registry client against a real Debian docker-registry (distribution 2.8).

Content is pushed over the registry's own HTTP API; what the client asked for is read back from
the registry's access log (and the token server's own count). Stand-in servers appear only for
fault injection: oversized manifests, 5xx, garbage, silence, lying digests.
"""
import base64
import ipaddress
import json
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from hypothesis import given
from hypothesis import settings as hsettings
from hypothesis import strategies as st

from archway.config import RegistrySettings
from archway.errors import (
    ArchwayError,
    AuthError,
    DeadlineExceeded,
    HostRefused,
    NotFound,
    PeerRefused,
    RegistryError,
    ResponseTooLarge,
    SIFError,
    TransportError,
    UnsupportedImage,
    classify_error,
)
from archway.registry.auth import (
    RegistryAuth,
    cache_until,
    credential_for_realm,
    parse_www_authenticate,
    pick_challenge,
    token_lifetime,
)
from archway.registry.credentials import Keyring
from archway.registry.hostpolicy import HostPolicy
from archway.registry.http import HttpClient, Response
from archway.registry.manifests import (
    ACCEPT,
    manifest_media_type,
    parse_manifest,
    platforms_from_config,
    platforms_from_index,
)
from archway.registry.oci import RegistryClient
from archway.registry.platforms import Platform
from archway.registry.reference import parse_reference
from lab.httpd import BackgroundHTTPServer
from lab.servers.registry import OCI_MANIFEST, RegistryServer, sha256_digest
from tests.infra import sifbuild
from tests.infra.fixtures import (
    LOOPBACK_HOSTS,
    basic_auth_registry,
    plain_registry,
    test_ca,
    tls_registry,
    token_registry,
)

# Starts real servers (registries, archway serve, helm...): outside the fast inner loop.
pytestmark = pytest.mark.slow

def linux(*names):
    out = set()
    for name in names:
        parts = name.split("/")
        out.add(Platform("linux", parts[0], parts[1] if len(parts) > 1 else ""))
    return frozenset(out)


def make_client(policy=None, auth_clock=None, **settings_kw):
    settings = RegistrySettings(**{"allow_hosts": LOOPBACK_HOSTS, **settings_kw})
    http = HttpClient(settings, policy=policy)
    auth = RegistryAuth(http, clock=auth_clock) if auth_clock else None
    return RegistryClient(http, settings, auth=auth)


def resolve(client, text, keyring=None, timeout=10.0):
    return client.resolve(parse_reference(text), keyring or Keyring.empty(), time.monotonic() + timeout)


def keyring_for(registry, **kw):
    return Keyring.from_dockerconfigjson(registry.dockerconfigjson(**kw))


# ---------------------------------------------------------------------------------------------
# Stand-ins for fault injection


class StandIn:
    """A fake registry whose every answer comes from `respond(method, path, headers)` ->
    (status, headers, body); body may be an iterable of chunks (sent without Content-Length)."""

    def __init__(self, respond):
        self.respond = respond
        self.requests = []
        stand_in = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_GET(self):
                stand_in.requests.append((self.command, self.path, dict(self.headers)))
                status, headers, body = stand_in.respond(self.command, self.path, self.headers)
                self.send_response(status)
                for key, value in headers.items():
                    self.send_header(key, value)
                if isinstance(body, bytes):
                    self.send_header("Content-Length", str(len(body)))
                    self.end_headers()
                    self.wfile.write(body)
                    return
                self.end_headers()
                try:
                    for chunk in body:
                        self.wfile.write(chunk)
                except (BrokenPipeError, ConnectionResetError):
                    pass

        self._server = BackgroundHTTPServer(Handler)
        self.port = self._server.port

    @property
    def host(self):
        return f"127.0.0.1:{self.port}"

    def stop(self):
        self._server.stop()


class Listener:
    """Accepts TCP connections, records them, and never says a word."""

    def __init__(self):
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.accepted = []
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def host(self):
        return f"127.0.0.1:{self.port}"

    def _accept(self):
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.accepted.append(conn)

    def stop(self):
        self.sock.close()
        for conn in self.accepted:
            conn.close()


@pytest.fixture
def stand_in():
    servers = []

    def start(respond):
        server = StandIn(respond)
        servers.append(server)
        return server
    yield start
    for server in servers:
        server.stop()


@pytest.fixture
def listener():
    server = Listener()
    yield server
    server.stop()


# ---------------------------------------------------------------------------------------------
# Content on the plain (HTTP, anonymous) registry


@pytest.fixture(scope="module")
def plain(plain_registry):
    reg = plain_registry
    reg.content = {
        "multi": reg.push_index("team/multi", "v1", ["linux/amd64", "linux/arm64", "linux/arm/v7",
                                                     "linux/ppc64le", "linux/s390x"]),
        "list": reg.push_index("team/list", "v1", ["linux/amd64", "linux/arm64", "linux/arm/v7"],
                               kind="docker", attestations=True),
        "docker": reg.push_image("team/docker", "v1", "linux/amd64", kind="docker"),
        "oci": reg.push_image("team/oci", "v1", "linux/arm/v7"),
        "old": reg.push_schema1("team/old", "v1", "arm64"),
    }
    return reg


@pytest.fixture
def plain_client(plain):
    return make_client(insecure_hosts=(plain.host,))


def test_multi_arch_oci_index_costs_one_manifest_request(plain, plain_client):
    resolve(plain_client, plain.ref("team/multi", "v1"))   # warm: learns the host speaks http
    mark = plain.mark()
    info = resolve(plain_client, plain.ref("team/multi", "v1"))
    assert info.platforms == linux("amd64", "arm64", "arm/v7", "ppc64le", "s390x")
    assert info.architectures == {"amd64", "arm64", "arm", "ppc64le", "s390x"}
    assert (info.source, info.digest) == ("oci-index", plain.content["multi"].digest)
    served = plain.requests_since(mark)
    assert [(e.method, e.path, e.status) for e in served] == [("GET", "/v2/team/multi/manifests/v1", 200)]


def test_docker_manifest_list_skips_attestation_entries(plain, plain_client):
    pushed = plain.content["list"]
    raw = json.loads(plain.get_manifest("team/list", "v1").content)
    assert sum(1 for m in raw["manifests"] if m["platform"]["os"] == "unknown") == 3  # really there
    info = resolve(plain_client, plain.ref("team/list", "v1"))
    assert info.platforms == linux("amd64", "arm64", "arm/v7")
    assert (info.source, info.digest) == ("docker-manifest-list", pushed.digest)


@pytest.mark.parametrize("name,repo,platform,source", [
    ("docker", "team/docker", "amd64", "docker-manifest"),
    ("oci", "team/oci", "arm/v7", "oci-manifest"),
])
def test_single_manifest_reads_its_config_blob(plain, plain_client, name, repo, platform, source):
    resolve(plain_client, plain.ref("team/multi", "v1"))
    mark = plain.mark()
    info = resolve(plain_client, plain.ref(repo, "v1"))
    assert info.platforms == linux(platform)
    assert (info.source, info.digest) == (source, plain.content[name])
    served = plain.requests_since(mark)
    assert [(e.method, e.path.split("/")[-2], e.status) for e in served] == [
        ("GET", "manifests", 200), ("GET", "blobs", 200)]


def test_schema1_manifest_by_tag_and_by_digest(plain, plain_client):
    # distribution 2.8 accepts signed schema1 pushes when compatibility.schema1.enabled is set:
    # this is a real schema1 manifest served by the real registry, not a stand-in.
    by_tag = resolve(plain_client, plain.ref("team/old", "v1"))
    assert (by_tag.platforms, by_tag.source) == (linux("arm64"), "docker-schema1")
    assert by_tag.digest == plain.content["old"]
    by_digest = resolve(plain_client, plain.ref("team/old", digest=plain.content["old"]))
    assert by_digest.platforms == linux("arm64") and by_digest.digest == plain.content["old"]


def test_variants_and_arch_aliases_are_normalised(plain, plain_client):
    index = plain.push_index("team/arm", "v1", ["linux/arm/v6", "linux/arm/v7", "linux/arm64/v8",
                                                "linux/arm", "linux/386"])
    info = resolve(plain_client, plain.ref("team/arm", "v1"))
    assert info.platforms == linux("arm/v6", "arm/v7", "arm64", "386")
    assert info.architectures == {"arm", "arm64", "386"}
    assert info.digest == index.digest
    plain.push_image("team/alias", "v1", "linux/aarch64")
    assert resolve(plain_client, plain.ref("team/alias", "v1")).platforms == linux("arm64")
    plain.push_image("team/alias", "v2", "linux/x86_64")
    assert resolve(plain_client, plain.ref("team/alias", "v2")).platforms == linux("amd64")


def windows_entry(registry, repo):
    """An index entry for a windows/amd64 image whose config says os windows."""
    digest = registry.push_image(repo, None, "windows/amd64",
                                 config_extra={"os.version": "10.0.20348.2340"})
    return {"mediaType": OCI_MANIFEST, "digest": digest,
            "size": len(registry.get_manifest(repo, digest).content),
            "platform": {"architecture": "amd64", "os": "windows", "os.version": "10.0.20348.2340"}}


def test_every_os_of_an_index_is_kept_for_the_pod_to_choose(plain, plain_client):
    plain.push_index("team/mixed", "v1", ["linux/arm64"], extra_entries=[windows_entry(plain, "team/mixed")])
    mixed = resolve(plain_client, plain.ref("team/mixed", "v1"))
    assert mixed.platforms == linux("arm64") | {Platform("windows", "amd64")}
    assert (mixed.architectures_for("linux"), mixed.architectures_for("windows")) == ({"arm64"}, {"amd64"})
    assert mixed.operating_systems == {"linux", "windows"}
    plain.push_index("team/win", "v1", [], extra_entries=[windows_entry(plain, "team/win")])
    only_windows = resolve(plain_client, plain.ref("team/win", "v1"))
    assert only_windows.platforms == {Platform("windows", "amd64")} and only_windows.note == ""
    assert only_windows.architectures_for("linux") == frozenset()
    plain.push_image("team/winimage", "v1", "windows/amd64")   # a manifest whose config says windows
    single = resolve(plain_client, plain.ref("team/winimage", "v1"))
    assert (single.platforms, single.source) == ({Platform("windows", "amd64")}, "oci-manifest")


def test_digest_references_and_tag_plus_digest(plain, plain_client):
    pushed = plain.content["multi"]
    resolve(plain_client, plain.ref("team/multi", "v1"))
    mark = plain.mark()
    by_digest = resolve(plain_client, plain.ref("team/multi", digest=pushed.digest))
    # The tag names nothing that exists: with a digest the tag is ignored, as Docker does.
    both = resolve(plain_client, plain.ref("team/multi", "no-such-tag", pushed.digest))
    assert by_digest.platforms == both.platforms == linux("amd64", "arm64", "arm/v7", "ppc64le", "s390x")
    assert by_digest.digest == both.digest == pushed.digest
    paths = [e.path for e in plain.requests_since(mark)]
    assert paths == [f"/v2/team/multi/manifests/{pushed.digest}"] * 2
    child = resolve(plain_client, plain.ref("team/multi", digest=pushed.children["linux/arm64"]))
    assert (child.platforms, child.source) == (linux("arm64"), "oci-manifest")


def test_missing_tag_and_repository_are_not_found(plain, plain_client):
    with pytest.raises(NotFound) as info:
        resolve(plain_client, plain.ref("team/multi", "v2"))
    assert f"manifest unknown: team/multi:v2 not found on {plain.host}" in str(info.value)
    assert info.value.status == 404
    with pytest.raises(NotFound):
        resolve(plain_client, plain.ref("team/never-pushed", "v1"))


def test_oci_artifacts_resolve_to_no_platform_and_say_so(plain, plain_client):
    config = b'{"name": "chart"}'
    layer = b"chart tarball"
    manifest = {"schemaVersion": 2, "mediaType": OCI_MANIFEST,
                "config": {"mediaType": "application/vnd.cncf.helm.config.v1+json",
                           "digest": plain.push_blob("team/chart", config), "size": len(config)},
                "layers": [{"mediaType": "application/vnd.cncf.helm.chart.content.v1.tar+gzip",
                            "digest": plain.push_blob("team/chart", layer), "size": len(layer)}]}
    plain.push_manifest("team/chart", "1.0.0", manifest, OCI_MANIFEST)
    chart = resolve(plain_client, plain.ref("team/chart", "1.0.0"))
    assert (chart.platforms, chart.source) == (frozenset(), "oci-artifact")
    assert "helm.config" in chart.note and "no platform" in chart.note
    digest = plain.push_artifact("team/model", "v1", "application/vnd.example.model.v1")
    model = resolve(plain_client, plain.ref("team/model", "v1"))
    assert (model.platforms, model.digest, model.source) == (frozenset(), digest, "oci-artifact")
    assert model.note == "an OCI artifact (application/vnd.example.model.v1): no platform"
    plain.push_artifact("team/bundle", "v1")   # no artifactType: the empty config says it
    assert "vnd.oci.empty.v1+json" in resolve(plain_client, plain.ref("team/bundle", "v1")).note


# -- schemes -------------------------------------------------------------------------------------

def test_plain_http_registry_needs_insecure_hosts(plain):
    # localhost/127.0.0.1 are not implicitly insecure: https is tried and fails.
    with pytest.raises(TransportError) as info:
        resolve(make_client(), plain.ref("team/multi", "v1"))
    assert plain.host in str(info.value)


def test_insecure_host_falls_back_to_http_once_and_remembers(plain):
    client = make_client(insecure_hosts=(plain.host,))
    resolve(client, plain.ref("team/multi", "v1"))
    assert client.http.stats.requests == 2          # https attempt + http
    resolve(client, plain.ref("team/list", "v1"))
    assert client.http.stats.requests == 3          # straight to http


def test_tls_registry_with_test_ca(tls_registry, test_ca):
    reg = tls_registry
    digest = reg.push_image("team/app", "v1", "linux/arm64")
    info = resolve(make_client(ca_file=test_ca.cert_path), reg.ref("team/app", "v1"))
    assert (info.platforms, info.digest) == (linux("arm64"), digest)


def test_tls_registry_without_the_ca_fails_with_advice(tls_registry):
    with pytest.raises(TransportError) as info:
        resolve(make_client(), tls_registry.ref("team/app", "v1"))
    assert "registry.ca_file" in str(info.value)


def test_tls_registry_listed_insecure_is_used_unverified_over_https(tls_registry):
    tls_registry.push_image("team/app", "v1", "linux/arm64")
    client = make_client(insecure_hosts=(tls_registry.host,))
    mark = tls_registry.mark()
    assert resolve(client, tls_registry.ref("team/app", "v1")).platforms == linux("arm64")
    assert len(tls_registry.requests_since(mark)) == 2   # served over TLS: no http fallback
    assert client.http.stats.requests == 2


# -- basic auth ----------------------------------------------------------------------------------

def test_htpasswd_basic_auth(basic_auth_registry, test_ca):
    reg = basic_auth_registry
    digest = reg.push_image("team/app", "v1", "linux/ppc64le")
    client = make_client(ca_file=test_ca.cert_path)
    mark = reg.mark()
    info = resolve(client, reg.ref("team/app", "v1"), keyring_for(reg))
    assert (info.platforms, info.digest) == (linux("ppc64le"), digest)
    first = [e.status for e in reg.requests_since(mark)]
    mark = reg.mark()
    resolve(client, reg.ref("team/app", "v1"), keyring_for(reg))
    second = [e.status for e in reg.requests_since(mark)]
    assert first == [401, 200, 200]     # challenge, manifest, config
    assert second == [200, 200]         # Basic sent up front once the host's challenge is known


def test_basic_auth_without_or_with_wrong_credentials(basic_auth_registry, test_ca):
    reg = basic_auth_registry
    reg.push_image("team/app", "v1", "linux/ppc64le")
    client = make_client(ca_file=test_ca.cert_path)
    with pytest.raises(AuthError) as info:
        resolve(client, reg.ref("team/app", "v1"))
    assert str(info.value) == f"401 from {reg.host} for team/app: no pull secret matched this host"
    other_host = Keyring.from_dockerconfigjson(reg.dockerconfigjson(key="elsewhere.example:5000"))
    with pytest.raises(AuthError, match="no pull secret matched this host"):
        resolve(client, reg.ref("team/app", "v1"), other_host)
    with pytest.raises(AuthError) as info:
        resolve(client, reg.ref("team/app", "v1"), keyring_for(reg, password="wrong"))
    assert str(info.value) == f"401 from {reg.host} for team/app: the credentials for this host were rejected"
    assert "wrong" not in str(info.value)


# -- token auth ----------------------------------------------------------------------------------

def test_token_auth_with_a_dockerconfigjson_and_token_cache(token_registry, test_ca):
    reg = token_registry
    digest = reg.push_image("team/app", "v1", "linux/s390x")
    index = reg.push_index("team/multi", "v1", ["linux/amd64", "linux/arm64"])
    client = make_client(ca_file=test_ca.cert_path)
    tokens = reg.token_server
    tokens.clear()
    mark = reg.mark()
    info = resolve(client, reg.ref("team/app", "v1"), keyring_for(reg))
    assert (info.platforms, info.digest) == (linux("s390x"), digest)
    assert [e.status for e in reg.requests_since(mark)] == [401, 200, 200]
    assert tokens.count() == 1 and tokens.requests[0].user == "alice"
    assert tokens.requests[0].params["scope"] == "repository:team/app:pull"
    # Second resolve, new keyring object with the same secret: the cached token is reused.
    mark = reg.mark()
    resolve(client, reg.ref("team/app", "v1"), keyring_for(reg))
    assert [e.status for e in reg.requests_since(mark)] == [200, 200]
    assert tokens.count() == 1
    # Another repository on the same host: a token up front (the challenge is known), no 401.
    mark = reg.mark()
    assert resolve(client, reg.ref("team/multi", "v1"), keyring_for(reg)).digest == index.digest
    assert [e.status for e in reg.requests_since(mark)] == [200]
    assert tokens.count() == 2


def test_token_auth_failures_say_what_to_fix(token_registry, test_ca):
    reg = token_registry
    reg.push_image("team/app", "v1", "linux/s390x")
    client = make_client(ca_file=test_ca.cert_path)
    with pytest.raises(AuthError) as info:
        resolve(client, reg.ref("team/app", "v1"))
    assert str(info.value) == f"401 from {reg.host} for team/app: no pull secret matched this host"
    with pytest.raises(AuthError) as info:
        resolve(client, reg.ref("team/app", "v1"), keyring_for(reg, password="wrong-pw"))
    assert str(info.value).startswith(
        f"401 from {reg.host} for team/app: the credentials for this host were rejected")
    assert "wrong-pw" not in str(info.value)


def test_token_expiry_refetches(token_registry, test_ca):
    reg = token_registry
    reg.push_image("team/app", "v1", "linux/s390x")
    now = [1000.0]
    client = make_client(ca_file=test_ca.cert_path, auth_clock=lambda: now[0])
    tokens = reg.token_server
    tokens.clear()
    resolve(client, reg.ref("team/app", "v1"), keyring_for(reg))
    assert tokens.count() == 1
    now[0] += 289      # the server said expires_in 300; archway stops 10 s early
    resolve(client, reg.ref("team/app", "v1"), keyring_for(reg))
    assert tokens.count() == 1
    now[0] += 2
    resolve(client, reg.ref("team/app", "v1"), keyring_for(reg))
    assert tokens.count() == 2


def test_concurrent_first_lookups_share_one_token_request(token_registry, test_ca):
    reg = token_registry
    reg.push_image("team/app", "v1", "linux/s390x")
    client = make_client(ca_file=test_ca.cert_path)
    reg.token_server.clear()
    results, errors = [], []

    def work():
        try:
            results.append(resolve(client, reg.ref("team/app", "v1"), keyring_for(reg)))
        except Exception as e:  # collected, asserted below
            errors.append(e)
    threads = [threading.Thread(target=work) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    assert errors == [] and {r.platforms for r in results} == {linux("s390x")}
    assert reg.token_server.count() == 1


def test_identity_token_is_exchanged_by_post_and_a_wrong_one_is_a_clear_error(token_registry, test_ca):
    reg = token_registry
    reg.push_image("team/app", "v1", "linux/s390x")
    reg.token_server.refresh_tokens["refresh-GOOD"] = "alice"
    good = Keyring.from_dockerconfigjson({"auths": {reg.host: {"identitytoken": "refresh-GOOD"}}})
    info = resolve(make_client(ca_file=test_ca.cert_path), reg.ref("team/app", "v1"), good)
    assert info.platforms == linux("s390x")
    bad = Keyring.from_dockerconfigjson({"auths": {reg.host: {"identitytoken": "refresh-XYZ"}}})
    with pytest.raises(AuthError, match="credentials for this host were rejected") as error:
        resolve(make_client(ca_file=test_ca.cert_path), reg.ref("team/app", "v1"), bad)
    assert "refresh-XYZ" not in str(error.value)


@pytest.fixture(scope="module")
def foreign_realm_registry(tmp_path_factory, test_ca):
    """Token auth whose realm is on another host name (localhost vs 127.0.0.1); anonymous pull."""
    reg = RegistryServer(tmp_path_factory.mktemp("foreign-realm"), ca=test_ca, auth="token",
                         anonymous_pull=True, token_realm_host="localhost")
    yield reg
    reg.stop()


def test_token_realm_on_another_host_gets_no_registry_password(foreign_realm_registry, test_ca):
    reg = foreign_realm_registry
    reg.push_image("team/app", "v1", "linux/riscv64")
    tokens = reg.token_server
    tokens.clear()
    info = resolve(make_client(ca_file=test_ca.cert_path), reg.ref("team/app", "v1"), keyring_for(reg))
    assert info.platforms == linux("riscv64")
    assert tokens.count() == 1 and tokens.requests[0].authorization is None
    # A credential that names the realm's own host is sent there.
    both = keyring_for(reg).merged(Keyring.from_dockerconfigjson(
        reg.dockerconfigjson(key=f"localhost:{tokens.port}")))
    resolve(make_client(ca_file=test_ca.cert_path), reg.ref("team/app", "v1"), both)
    assert tokens.count() == 2 and tokens.requests[1].user == "alice"


def test_foreign_realm_without_anonymous_pull_explains_the_fix(tmp_path, test_ca):
    reg = RegistryServer(tmp_path, ca=test_ca, auth="token", token_realm_host="localhost")
    try:
        reg.push_image("team/app", "v1", "linux/arm64")
        with pytest.raises(AuthError) as info:
            resolve(make_client(ca_file=test_ca.cert_path), reg.ref("team/app", "v1"), keyring_for(reg))
        assert "token service is on another host" in str(info.value)
        assert all(r.authorization is None for r in reg.token_server.requests)
    finally:
        reg.stop()


def test_no_password_to_a_plain_http_realm_unless_insecure(tmp_path):
    reg = RegistryServer(tmp_path, auth="token", anonymous_pull=True)   # registry + realm over http
    try:
        reg.push_image("team/app", "v1", "linux/arm64")
        tokens = reg.token_server
        resolve(make_client(insecure_hosts=(reg.host,)), reg.ref("team/app", "v1"), keyring_for(reg))
        assert tokens.requests[-1].authorization is None
        resolve(make_client(insecure_hosts=(reg.host, tokens.host)), reg.ref("team/app", "v1"),
                keyring_for(reg))
        assert tokens.requests[-1].user == "alice"
    finally:
        reg.stop()


# -- oras SIF artifacts --------------------------------------------------------------------------

@pytest.fixture(scope="module")
def sif_files(tmp_path_factory):
    return sifbuild.generated_corpus(str(tmp_path_factory.mktemp("oci-sif")))


@pytest.mark.parametrize("name,arch", [("siftool-amd64.sif", "amd64"), ("siftool-arm64.sif", "arm64"),
                                       ("siftool-ppc64le-aligned.sif", "ppc64le")])
def test_oras_sif_is_read_with_one_range_request(plain, plain_client, sif_files, name, arch):
    with open(sif_files[name], "rb") as f:
        data = f.read()
    repo = "sif/" + name.split(".")[0]
    digest = plain.push_sif(repo, "latest", data)
    resolve(plain_client, plain.ref("team/multi", "v1"))
    mark = plain.mark()
    info = resolve(plain_client, plain.ref(repo, "latest", scheme="oras"))
    assert (info.platforms, info.source, info.digest) == (linux(arch), "sif-oras", digest)
    served = plain.requests_since(mark)
    blobs = [e for e in served if "/blobs/" in e.path]
    assert [e.status for e in blobs] == [206], served
    assert sum(e.size for e in blobs) <= 32768 < len(data)


def test_oras_reference_to_an_index_takes_its_platforms(plain, plain_client):
    info = resolve(plain_client, plain.ref("team/multi", "v1", scheme="oras"))
    assert info.platforms == linux("amd64", "arm64", "arm/v7", "ppc64le", "s390x")


def test_oras_sif_with_unknown_arch_and_corrupt_header(plain, plain_client, sif_files):
    with open(sif_files["siftool-empty.sif"], "rb") as f:
        plain.push_sif("sif/empty", "latest", f.read())
    info = resolve(plain_client, plain.ref("sif/empty", "latest", scheme="oras"))
    assert info.platforms == frozenset() and info.note
    with open(sif_files["siftool-arm64.sif"], "rb") as f:
        head = bytearray(f.read(65536))
    head[88:96] = (10 ** 9).to_bytes(8, "little")     # descriptors total: absurd
    plain.push_sif("sif/corrupt", "latest", bytes(head))
    with pytest.raises(SIFError):
        resolve(plain_client, plain.ref("sif/corrupt", "latest", scheme="oras"))


def test_read_blob_range(plain, plain_client):
    data = bytes(range(256)) * 40
    digest = plain.push_blob("team/blob", data)
    ref = parse_reference(plain.ref("team/blob", "x"))
    deadline = time.monotonic() + 5
    assert plain_client.read_blob_range(ref, digest, 10, 20, Keyring.empty(), deadline) == data[10:30]
    assert plain_client.read_blob_range(ref, digest, len(data) - 5, 100, Keyring.empty(), deadline) == data[-5:]


def test_read_blob_range_past_the_end_and_ignored_ranges(stand_in):
    data = b"0123456789" * 10
    answers = {}
    server = stand_in(lambda m, p, h: answers["next"])
    client = make_client(insecure_hosts=(server.host,))
    ref = parse_reference(f"{server.host}/team/blob:x")
    digest = sha256_digest(data)
    answers["next"] = (416, {}, b"")
    assert client.read_blob_range(ref, digest, 500, 10, Keyring.empty(), time.monotonic() + 5) == b""
    assert server.requests[-1][2]["Range"] == "bytes=500-509"
    answers["next"] = (200, {}, data)           # ignores Range, but the whole blob fits
    assert client.read_blob_range(ref, digest, 20, 200, Keyring.empty(), time.monotonic() + 5) == data[20:]
    answers["next"] = (200, {}, data * 100)     # ignores Range, and the blob is big: refused
    with pytest.raises(ResponseTooLarge, match="ignored the Range request"):
        client.read_blob_range(ref, digest, 0, 64, Keyring.empty(), time.monotonic() + 5)


# ---------------------------------------------------------------------------------------------
# Fault injection


def manifest_answer(document, content_type=OCI_MANIFEST, status=200, headers=None):
    body = document if isinstance(document, bytes) else json.dumps(document).encode()
    return status, {"Content-Type": content_type, **(headers or {})}, body


def test_manifest_over_4_mib_is_refused(stand_in):
    big = b'{"manifests": [' + b" " * (4 * 1024 * 1024) + b"]}"
    declared = stand_in(lambda m, p, h: manifest_answer(big))
    streamed = stand_in(lambda m, p, h: (200, {"Content-Type": OCI_MANIFEST},
                                         iter([b" " * 65536] * 100)))   # 6.25 MiB, no length
    for server in (declared, streamed):
        client = make_client(insecure_hosts=(server.host,))
        with pytest.raises(ResponseTooLarge) as info:
            resolve(client, f"{server.host}/team/app:v1")
        assert "4194304" in str(info.value) and "team/app" in str(info.value)
        assert client.http.stats.bytes_read == 0


@pytest.mark.parametrize("answer,error,fragment", [
    ((500, {"Content-Type": "application/json"},
      b'{"errors":[{"code":"UNKNOWN","message":"storage driver down"}]}'),
     RegistryError, "failed with HTTP 500"),
    ((503, {}, b"<html>down</html>"), RegistryError, "try again later"),
    ((429, {}, b""), RegistryError, "rate limited"),
    ((403, {}, b'{"errors":[{"code":"DENIED","message":"no"}]}'), AuthError, "may not pull"),
    ((401, {}, b""), AuthError, "no pull secret matched"),             # 401 without a challenge
    ((401, {"WWW-Authenticate": 'Negotiate abc'}, b""), AuthError, "does not speak"),
    ((418, {}, b""), RegistryError, "unexpected HTTP 418"),
    ((200, {"Content-Type": "text/html"}, b"<html>login</html>"), RegistryError, "not a JSON object"),
    ((200, {"Content-Type": OCI_MANIFEST}, b"[1, 2]"), RegistryError, "not a JSON object"),
    ((200, {"Content-Type": OCI_MANIFEST}, b'{"config": 5}'), RegistryError, "config descriptor"),
    ((200, {"Content-Type": "application/vnd.oci.image.index.v1+json"}, b'{"manifests": {}}'),
     RegistryError, "not a list"),
    ((200, {"Content-Type": "application/json"}, b'{"hello": "world"}'), UnsupportedImage,
     "unknown manifest type"),
])
def test_bad_registry_answers_are_typed_errors(stand_in, answer, error, fragment):
    server = stand_in(lambda m, p, h: answer)
    with pytest.raises(error) as info:
        resolve(make_client(insecure_hosts=(server.host,)), f"{server.host}/team/app:v1")
    assert fragment in str(info.value)


def test_config_blob_failures(stand_in):
    config = json.dumps({"architecture": "arm64", "os": "linux"}).encode()
    manifest = {"schemaVersion": 2, "mediaType": OCI_MANIFEST,
                "config": {"mediaType": "application/vnd.oci.image.config.v1+json",
                           "digest": sha256_digest(config), "size": len(config)}, "layers": []}
    answers = {"blob": (500, {}, b"")}

    def respond(method, path, headers):
        return manifest_answer(manifest) if "/manifests/" in path else answers["blob"]
    server = stand_in(respond)
    client = make_client(insecure_hosts=(server.host,))
    with pytest.raises(RegistryError, match="config blob"):
        resolve(client, f"{server.host}/team/app:v1")
    answers["blob"] = (200, {}, b'{"architecture": "amd64"}')     # not what the digest names
    with pytest.raises(RegistryError, match="does not match its digest"):
        resolve(client, f"{server.host}/team/app:v1")
    answers["blob"] = (200, {}, config)
    assert resolve(client, f"{server.host}/team/app:v1").platforms == linux("arm64")


def test_lying_digests_are_refused(stand_in):
    index = {"schemaVersion": 2, "mediaType": "application/vnd.oci.image.index.v1+json",
             "manifests": [{"mediaType": OCI_MANIFEST, "digest": "sha256:" + "1" * 64, "size": 1,
                            "platform": {"architecture": "amd64", "os": "linux"}}]}
    body = json.dumps(index).encode()
    honest = sha256_digest(body)
    other = "sha256:" + "2" * 64
    server = stand_in(lambda m, p, h: manifest_answer(body, index["mediaType"],
                                                      headers={"Docker-Content-Digest": other}))
    client = make_client(insecure_hosts=(server.host,))
    with pytest.raises(RegistryError, match="does not match its digest"):
        resolve(client, f"{server.host}/team/app@{other}")          # asked by digest
    with pytest.raises(RegistryError, match="does not match its digest"):
        resolve(client, f"{server.host}/team/app:v1")               # header lies
    assert resolve(client, f"{server.host}/team/app@{honest}").digest == honest


def test_accept_header_lists_every_manifest_type(stand_in):
    server = stand_in(lambda m, p, h: (404, {}, b""))
    with pytest.raises(NotFound):
        resolve(make_client(insecure_hosts=(server.host,)), f"{server.host}/team/app:v1")
    accept = server.requests[-1][2]["Accept"]
    assert accept == ACCEPT
    for media_type in ("application/vnd.oci.image.index.v1+json",
                       "application/vnd.docker.distribution.manifest.list.v2+json",
                       "application/vnd.oci.image.manifest.v1+json",
                       "application/vnd.docker.distribution.manifest.v2+json",
                       "application/vnd.docker.distribution.manifest.v1+json",
                       "application/vnd.docker.distribution.manifest.v1+prettyjws"):
        assert media_type in accept


def test_a_registry_that_never_answers_is_bounded_by_the_deadline(listener):
    client = make_client(insecure_hosts=(listener.host,), timeout_seconds=5)
    start = time.monotonic()
    with pytest.raises((DeadlineExceeded, TransportError)):
        resolve(client, f"{listener.host}/team/app:v1", timeout=0.8)
    assert time.monotonic() - start < 2.0
    assert listener.accepted   # it was really contacted, and really silent


# -- refused hosts are never contacted -----------------------------------------------------------

def test_deny_list_host_is_never_contacted(listener):
    client = make_client(deny_hosts=(listener.host,), insecure_hosts=(listener.host,))
    with pytest.raises(HostRefused, match="deny_hosts"):
        resolve(client, f"{listener.host}/team/app:v1")
    time.sleep(0.05)
    assert listener.accepted == [] and client.http.stats.requests == 0


def test_host_outside_allow_list_is_never_contacted(listener):
    client = make_client(allow_hosts=("registry.corp.example",), insecure_hosts=(listener.host,))
    with pytest.raises(HostRefused, match="allow_hosts"):
        resolve(client, f"{listener.host}/team/app:v1")
    time.sleep(0.05)
    assert listener.accepted == []


def test_name_resolving_to_metadata_address_is_never_contacted(listener):
    # The injected resolver says localhost is 169.254.169.254; were the policy skipped, the
    # connection would go to the real localhost, where the listener waits.
    def resolver(host, port, family=0, socktype=0, proto=0, flags=0):
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", ("169.254.169.254", port))]
    netloc = f"localhost:{listener.port}"
    client = make_client(policy=HostPolicy(resolve=resolver), insecure_hosts=(netloc,))
    with pytest.raises(HostRefused, match="169.254.169.254"):
        resolve(client, f"{netloc}/team/app:v1")
    time.sleep(0.05)
    assert listener.accepted == []


def test_a_name_that_rebinds_between_check_and_connect_is_refused_on_the_socket(plain_registry):
    """DNS rebinding: the name check sees a harmless address, the connection lands on a
    forbidden one. No test can listen on 169.254.169.254, so here loopback plays the forbidden
    address: the policy's check sees 10.0.0.7 for localhost, the socket lands on 127.0.0.1."""
    def resolver(host, port, family=0, socktype=0, proto=0, flags=0):
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", ("10.0.0.7", port))]

    def forbidden(address):
        return ipaddress.ip_address(address).is_loopback

    plain_registry.push_image("team/rebind", "v1", "linux/amd64")
    netloc = f"localhost:{plain_registry.port}"
    client = make_client(policy=HostPolicy(resolve=resolver, forbidden=forbidden),
                         insecure_hosts=(netloc,))
    mark = plain_registry.mark()
    with pytest.raises(HostRefused, match="link-local or metadata") as refused:
        resolve(client, f"{netloc}/team/rebind:v1")
    assert plain_registry.requests_since(mark) == []
    # Refused only once the port answered: the pod's author reads it as any unreachable host,
    # or a closed port (unreachable) and an open one (refused) would read apart (issue 47).
    assert isinstance(refused.value, PeerRefused)
    assert classify_error(refused.value).words == "registry unreachable"
    # The same client with the real rules reaches the registry: the refusal was the peer check.
    allowed = make_client(policy=HostPolicy(resolve=resolver), insecure_hosts=(netloc,))
    assert resolve(allowed, f"{netloc}/team/rebind:v1").platforms == linux("amd64")


def test_redirect_and_token_realm_to_refused_hosts_are_never_followed(stand_in, listener):
    manifest = {"schemaVersion": 2, "mediaType": OCI_MANIFEST,
                "config": {"mediaType": "application/vnd.oci.image.config.v1+json",
                           "digest": "sha256:" + "3" * 64, "size": 10}, "layers": []}

    def respond(method, path, headers):
        if "/manifests/" in path:
            return manifest_answer(manifest)
        return 307, {"Location": f"http://{listener.host}/blob"}, b""
    redirecting = stand_in(respond)
    challenging = stand_in(lambda m, p, h: (401, {
        "WWW-Authenticate": f'Bearer realm="http://{listener.host}/token",service="x"'}, b""))
    for server in (redirecting, challenging):
        client = make_client(deny_hosts=(listener.host,), insecure_hosts=(server.host,))
        with pytest.raises(HostRefused):
            resolve(client, f"{server.host}/team/app:v1")
    time.sleep(0.05)
    assert listener.accepted == []


def test_authorization_is_not_forwarded_on_a_cross_host_redirect(stand_in):
    config = json.dumps({"architecture": "arm64", "os": "linux"}).encode()
    storage = stand_in(lambda m, p, h: (200, {}, config))
    manifest = {"schemaVersion": 2, "mediaType": OCI_MANIFEST,
                "config": {"mediaType": "application/vnd.oci.image.config.v1+json",
                           "digest": sha256_digest(config), "size": len(config)}, "layers": []}

    def respond(method, path, headers):
        if headers.get("Authorization") != "Basic " + base64.b64encode(b"u:p").decode():
            return 401, {"WWW-Authenticate": 'Basic realm="r"'}, b""
        if "/manifests/" in path:
            return manifest_answer(manifest)
        return 307, {"Location": f"http://localhost:{storage.port}/blob"}, b""
    registry = stand_in(respond)
    keyring = Keyring.from_dockerconfigjson({"auths": {registry.host: {"auth": base64.b64encode(b"u:p").decode()}}})
    client = make_client(insecure_hosts=(registry.host, f"localhost:{storage.port}"))
    assert resolve(client, f"{registry.host}/team/app:v1", keyring).platforms == linux("arm64")
    assert storage.requests and "Authorization" not in storage.requests[0][2]


# ---------------------------------------------------------------------------------------------
# Pure parts: challenges, realm credentials, token lifetimes, manifest interpretation


def test_parse_www_authenticate():
    [bearer] = parse_www_authenticate(
        'Bearer realm="https://auth.docker.io/token",service="registry.docker.io",'
        'scope="repository:library/nginx:pull,push"')
    assert bearer.scheme == "bearer" and bearer.params == {
        "realm": "https://auth.docker.io/token", "service": "registry.docker.io",
        "scope": "repository:library/nginx:pull,push"}
    basic, second = parse_www_authenticate('Basic realm="Reg, Inc", Bearer realm="https://t/x", error="insufficient_scope"')
    assert (basic.scheme, basic.params) == ("basic", {"realm": "Reg, Inc"})
    assert second.params == {"realm": "https://t/x", "error": "insufficient_scope"}
    assert pick_challenge([basic, second]) is second
    assert parse_www_authenticate('Bearer realm="a\\"b",service=plain')[0].params == {
        "realm": 'a"b', "service": "plain"}
    assert parse_www_authenticate("") == []
    assert pick_challenge(parse_www_authenticate("Negotiate")) is None
    assert pick_challenge(parse_www_authenticate("Bearer service=x")) is None   # no realm


@hsettings(max_examples=300, deadline=None)
@given(st.text(max_size=200))
def test_parse_www_authenticate_never_crashes(text):
    for challenge in parse_www_authenticate(text):
        assert isinstance(challenge.params, dict)


def test_credential_for_realm():
    keyring = Keyring.from_dockerconfigjson({"auths": {
        "reg.example.com:5000": {"auth": base64.b64encode(b"reg:1").decode()},
        "https://index.docker.io/v1/": {"auth": base64.b64encode(b"hub:2").decode()},
        "auth.corp.example": {"auth": base64.b64encode(b"realm:3").decode()}}})
    ref = parse_reference("reg.example.com:5000/team/app")
    assert credential_for_realm(keyring, ref, "reg.example.com:5000").username == "reg"
    assert credential_for_realm(keyring, ref, "reg.example.com:8443").username == "reg"  # same machine
    assert credential_for_realm(keyring, ref, "evil.example.net") is None
    assert credential_for_realm(keyring, ref, "auth.corp.example").username == "realm"
    hub = parse_reference("nginx")
    assert credential_for_realm(keyring, hub, "auth.docker.io").username == "hub"
    assert credential_for_realm(keyring, hub, "auth.evil.io") is None


def test_token_lifetime_and_cache_margin():
    assert token_lifetime({}) == 60
    assert token_lifetime({"expires_in": 300}) == 300
    for bad in (0, -5, "300", True, None):
        assert token_lifetime({"expires_in": bad}) == 60
    assert token_lifetime({"expires_in": 10 ** 9}) == 24 * 3600
    assert cache_until(100.0, 300) == 390.0
    assert cache_until(100.0, 20) == 115.0


def test_manifest_media_type_decision():
    assert manifest_media_type("application/vnd.oci.image.index.v1+json; charset=utf-8", {}) == \
        "application/vnd.oci.image.index.v1+json"
    assert manifest_media_type("application/json",
                               {"mediaType": "application/vnd.docker.distribution.manifest.v2+json"}) == \
        "application/vnd.docker.distribution.manifest.v2+json"
    assert manifest_media_type("", {"manifests": []}) == "application/vnd.oci.image.index.v1+json"
    assert manifest_media_type("", {"schemaVersion": 1, "signatures": []}).endswith("prettyjws")
    assert manifest_media_type("text/plain", {"a": 1}) is None


def test_index_interpretation():
    platforms, note = platforms_from_index({"manifests": [
        {"platform": {"architecture": "amd64", "os": "linux"}},
        {"platform": {"architecture": "unknown", "os": "unknown"}},
        {"platform": {"architecture": "arm64", "os": "linux"},
         "annotations": {"vnd.docker.reference.type": "attestation-manifest"}},
        {"platform": {"architecture": "arm", "os": "linux", "variant": "v7"}},
        {"platform": {"architecture": "amd64", "os": "windows"}},
        {"digest": "sha256:x"}, "garbage", {"platform": "garbage"},
    ]})
    assert platforms == linux("amd64", "arm/v7") | {Platform("windows", "amd64")} and note == ""
    assert platforms_from_index({"manifests": []}) == (frozenset(), "the index lists no platform")
    assert platforms_from_config({"architecture": "aarch64", "os": "linux", "variant": "v8"}) == (linux("arm64"), "")
    assert platforms_from_config({"os": "linux"})[0] == frozenset()


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=12),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(
        st.sampled_from(["manifests", "platform", "architecture", "os", "variant", "config",
                         "mediaType", "schemaVersion", "annotations", "history", "digest"]) | st.text(max_size=6),
        children, max_size=5),
    max_leaves=25)


@hsettings(max_examples=200, deadline=None)
@given(document=json_values, content_type=st.sampled_from(["", "application/json", OCI_MANIFEST,
       "application/vnd.oci.image.index.v1+json",
       "application/vnd.docker.distribution.manifest.v1+prettyjws"]))
def test_any_manifest_body_gives_an_answer_or_a_typed_error(document, content_type):
    from requests.structures import CaseInsensitiveDict
    body = json.dumps(document).encode()
    response = Response(200, CaseInsensitiveDict({"Content-Type": content_type}), body, "u")
    ref = parse_reference("reg.example.com/team/app:v1")
    try:
        manifest = parse_manifest(response, ref)
        if "index" in manifest.media_type:
            platforms_from_index(manifest.document)
        else:
            platforms_from_config(manifest.document)
    except ArchwayError:
        pass
