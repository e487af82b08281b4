"""Mirrors from a containerd hosts directory: a real pull-through cache (docker-registry with
proxy.remoteurl) in front of a token-auth registry, asserted at both registries' access logs."""
import logging
import os
import re
import time

import pytest
from prometheus_client import REGISTRY

from archway.config import RegistrySettings
from archway.errors import ConfigError, NotFound
from archway.registry.credentials import Keyring
from archway.registry.mirrors import Mirrors, RegistryHost, parse_hosts_dir
from archway.registry.reference import parse_reference
from archway.registry.resolver import Resolver
from archway.vocabulary import USER_AGENT
from lab.servers.registry import RegistryServer
from lab.tls import session_ca
from tests.infra.fixtures import LOOPBACK_HOSTS, test_ca

ARCHWAY_AGENT = USER_AGENT


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """A token-auth upstream (TLS) and a pull-through cache of it (plain HTTP, anonymous)."""
    ca = session_ca(tmp_path_factory)
    upstream = RegistryServer(tmp_path_factory.mktemp("upstream"), ca=ca, auth="token")
    mirror = RegistryServer(tmp_path_factory.mktemp("mirror"), mirror_of=upstream)
    try:
        yield upstream, mirror
    finally:
        mirror.stop()
        upstream.stop()


def hosts_dir(tmp_path, registry_host: str, body: str, dirname: str | None = None) -> str:
    directory = tmp_path / "certs.d" / (dirname or registry_host)
    directory.mkdir(parents=True)
    (directory / "hosts.toml").write_text(body)
    return str(tmp_path / "certs.d")


def resolver(test_ca, hosts: str | None, **kw) -> Resolver:
    return Resolver(RegistrySettings(allow_hosts=LOOPBACK_HOSTS, ca_file=test_ca.cert_path, hosts_dir=hosts, **kw))


def archway_requests(registry, mark):
    return [e for e in registry.requests_since(mark) if e.agent.startswith(ARCHWAY_AGENT)]


def mirror_count(outcome: str) -> float:
    return REGISTRY.get_sample_value("archway_registry_mirror_requests_total",
                                     {"outcome": outcome}) or 0.0


def test_the_mirror_answers_and_the_upstream_never_sees_archway(pair, test_ca, tmp_path):
    upstream, mirror = pair
    pushed = upstream.push_index("team/multi", "v1", ["linux/amd64", "linux/arm64"])
    hosts = hosts_dir(tmp_path, upstream.host, f'server = "{upstream.url}"\n'
                      f'[host."{mirror.url}"]\n  capabilities = ["pull", "resolve"]\n')
    up_mark, mirror_mark, answered = upstream.mark(), mirror.mark(), mirror_count("answered")
    info = resolver(test_ca, hosts).resolve(upstream.ref("team/multi", "v1"),
                                            deadline=time.monotonic() + 20)
    assert info.architectures == {"amd64", "arm64"}
    assert info.digest == pushed.digest          # the same image as the upstream's
    served = archway_requests(mirror, mirror_mark)
    assert [e.path for e in served if e.status == 200] == ["/v2/team/multi/manifests/v1"]
    assert served[-1].query == f"ns={upstream.host.replace(':', '%3A')}"   # containerd's ns=
    assert archway_requests(upstream, up_mark) == []   # only the mirror's own client went there
    assert any(e.path == "/v2/team/multi/manifests/v1" for e in upstream.requests_since(up_mark))
    assert mirror_count("answered") == answered + 1


def test_the_mirror_still_answers_when_the_upstream_is_down(tmp_path, test_ca):
    upstream = RegistryServer(tmp_path / "up")
    mirror = RegistryServer(tmp_path / "mirror", mirror_of=upstream)
    try:
        digest = upstream.push_image("team/app", "v1", "linux/riscv64")
        hosts = hosts_dir(tmp_path, upstream.host, f'server = "{upstream.url}"\n'
                          f'[host."{mirror.url}"]\n', dirname=upstream.host.replace(":", "_") + "_")
        settings = dict(insecure_hosts=(upstream.host,))
        first = resolver(test_ca, hosts, **settings).resolve(upstream.ref("team/app", "v1"),
                                                             deadline=time.monotonic() + 20)
        config = upstream.get_manifest("team/app", digest).json()["config"]["digest"]
        mirror.wait_for_blob(config)
        upstream.stop()   # the mirror has cached the image: it keeps answering
        mark = mirror.mark()
        again = resolver(test_ca, hosts, **settings).resolve(upstream.ref("team/app", "v1"),
                                                             deadline=time.monotonic() + 20)
        assert again.architectures == first.architectures == {"riscv64"}
        assert again.digest == first.digest == digest
        assert any(e.path == "/v2/team/app/manifests/v1" and e.status == 200
                   for e in archway_requests(mirror, mark))
    finally:
        mirror.stop()
        upstream.stop()


def test_a_mirror_that_is_down_costs_one_try_then_the_upstream_answers(pair, test_ca, tmp_path):
    upstream, _ = pair
    upstream.push_image("team/direct", "v1", "linux/ppc64le")
    dead = "http://127.0.0.1:9"   # discard port: nothing listens
    hosts = hosts_dir(tmp_path, upstream.host, f'[host."{dead}"]\n')   # no server: the registry
    keyring = Keyring.from_dockerconfigjson(upstream.dockerconfigjson())
    mark, failed = upstream.mark(), mirror_count("transport_error")
    info = resolver(test_ca, hosts).resolve(upstream.ref("team/direct", "v1"), keyring=keyring,
                                            deadline=time.monotonic() + 20)
    assert info.architectures == {"ppc64le"}
    assert any(e.path == "/v2/team/direct/manifests/v1" and e.status == 200
               for e in archway_requests(upstream, mark))
    assert mirror_count("transport_error") == failed + 1


def test_the_upstreams_credentials_never_go_to_a_mirror(pair, test_ca, tmp_path):
    """A mirror that wants a password of its own gets none of the upstream's: archway falls back
    to the upstream; with a pull secret naming the mirror, the mirror answers."""
    upstream, _ = pair
    upstream.push_image("team/secret", "v1", "linux/arm/v7")
    guarded = RegistryServer(tmp_path / "guarded", ca=upstream.ca, auth="htpasswd",
                             users={"mirror-user": "mirror-pw"}, mirror_of=upstream)
    try:
        hosts = hosts_dir(tmp_path, upstream.host, f'[host."{guarded.url}"]\n')
        upstream_secret = Keyring.from_dockerconfigjson(upstream.dockerconfigjson())
        mark = guarded.mark()
        info = resolver(test_ca, hosts).resolve(upstream.ref("team/secret", "v1"),
                                                keyring=upstream_secret, deadline=time.monotonic() + 20)
        assert info.architectures == {"arm"}
        assert {e.status for e in archway_requests(guarded, mark)} == {401}
        both = upstream_secret.merged(Keyring.from_dockerconfigjson(guarded.dockerconfigjson()))
        mark = guarded.mark()
        resolver(test_ca, hosts).resolve(upstream.ref("team/secret", "v1"), keyring=both,
                                         deadline=time.monotonic() + 20)
        assert 200 in {e.status for e in archway_requests(guarded, mark)}
    finally:
        guarded.stop()


def test_a_pull_only_mirror_serves_digests_and_tags_go_to_the_upstream(pair, test_ca, tmp_path):
    upstream, mirror = pair
    digest = upstream.push_image("team/pinned", "v2", "linux/s390x")
    hosts = hosts_dir(tmp_path, upstream.host, f'server = "{upstream.url}"\n'
                      f'[host."{mirror.url}"]\n  capabilities = ["pull"]\n')
    keyring = Keyring.from_dockerconfigjson(upstream.dockerconfigjson())
    up_mark, mirror_mark = upstream.mark(), mirror.mark()
    resolver(test_ca, hosts).resolve(upstream.ref("team/pinned", "v2"), keyring=keyring,
                                     deadline=time.monotonic() + 20)
    assert archway_requests(mirror, mirror_mark) == []
    assert archway_requests(upstream, up_mark)
    up_mark = upstream.mark()
    info = resolver(test_ca, hosts).resolve(upstream.ref("team/pinned", digest=digest),
                                            deadline=time.monotonic() + 20)
    assert info.digest == digest and info.architectures == {"s390x"}
    assert archway_requests(mirror, mirror_mark) and archway_requests(upstream, up_mark) == []


def test_default_hosts_apply_to_every_registry_without_its_own(pair, test_ca, tmp_path):
    upstream, mirror = pair
    upstream.push_image("team/any", "v1", "linux/mips64le")
    hosts = hosts_dir(tmp_path, "_default", f'[host."{mirror.url}"]\n')
    mark = mirror.mark()
    info = resolver(test_ca, hosts).resolve(upstream.ref("team/any", "v1"),
                                            deadline=time.monotonic() + 20)
    assert info.architectures == {"mips64le"}
    assert archway_requests(mirror, mark)


def test_not_found_everywhere_is_the_upstreams_answer(pair, test_ca, tmp_path):
    upstream, mirror = pair
    hosts = hosts_dir(tmp_path, upstream.host, f'[host."{mirror.url}"]\n')
    keyring = Keyring.from_dockerconfigjson(upstream.dockerconfigjson())
    with pytest.raises(NotFound, match=upstream.host):
        resolver(test_ca, hosts).resolve(upstream.ref("team/nothing", "v1"), keyring=keyring,
                                         deadline=time.monotonic() + 20)


# --- the file format, as containerd reads it ----------------------------------------------------

def test_hosts_toml_is_read_as_containerd_reads_it(tmp_path):
    directory = tmp_path / "docker.io"
    directory.mkdir()
    (directory / "hosts.toml").write_text('''
server = "https://registry-1.docker.io"
[host."https://mirror-b.example"]
  capabilities = ["pull"]
  ca = "mirror-ca.crt"
[host."http://mirror-a.example:5000/cache"]
  skip_verify = true
  [host."http://mirror-a.example:5000/cache".header]
    x-team = ["a", "b"]
[host."https://raw.example/api"]
  override_path = true
''')
    b, a, raw, server = parse_hosts_dir(str(directory))
    assert (b.netloc, b.capabilities, b.ca_files) == (
        "mirror-b.example", frozenset({"pull"}), (str(directory / "mirror-ca.crt"),))
    assert (a.scheme, a.path, a.skip_verify, a.headers) == ("http", "/cache/v2", True,
                                                          (("x-team", "a, b"),))
    assert raw.path == "/api" and not server.mirror and server.netloc == "registry-1.docker.io"
    ref = parse_reference("nginx")
    hosts = Mirrors(str(tmp_path)).hosts_for(ref)
    assert [h.url("/v2/library/nginx/manifests/latest") for h in hosts] == [
        "https://mirror-b.example/v2/library/nginx/manifests/latest?ns=docker.io",
        "http://mirror-a.example:5000/cache/v2/library/nginx/manifests/latest?ns=docker.io",
        "https://raw.example/api/library/nginx/manifests/latest?ns=docker.io",
        "https://registry-1.docker.io/v2/library/nginx/manifests/latest"]
    assert hosts[0].reference(ref).host == "mirror-b.example"   # its own credentials only
    assert hosts[-1].reference(ref) is ref
    assert not hosts[0].serves(ref) and hosts[1].serves(ref)     # pull-only: no tags


def test_directory_names_and_the_default(tmp_path):
    for name in ("reg.example_5000_", "Other.Example", "_default"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "hosts.toml").write_text(f'[host."https://{name.strip("_")}.mirror"]\n')
    mirrors = Mirrors(str(tmp_path))
    first = lambda image: mirrors.hosts_for(parse_reference(image))[0].netloc  # noqa: E731
    assert first("reg.example:5000/x") == "reg.example_5000.mirror"
    assert first("other.example/x") == "other.example.mirror"   # names match in any case
    assert first("OTHER.example/x") == "other.example.mirror"
    assert first("third.example/x") == "default.mirror"
    assert Mirrors(str(tmp_path / "missing")).hosts_for(parse_reference("x.example/y")) is None


@pytest.mark.parametrize("body, words", [
    ('[host."https://m"]\ncapabilities = ["fetch"]\n', "unknown capability"),
    ('server = 5\n', "server must be a string"),
    ('[host."https://m".header]\nAuthorization = "Basic eA=="\n', "not Authorization"),
    ('[host."ftp://m"]\n', "not an http(s) URL"),
    ("server = \n", "not valid TOML"),
])
def test_bad_hosts_files_are_refused_and_the_registry_is_used_alone(tmp_path, caplog, body, words):
    directory = tmp_path / "reg.example"
    directory.mkdir()
    (directory / "hosts.toml").write_text(body)
    with pytest.raises(ConfigError, match=re.escape(words)):
        parse_hosts_dir(str(directory))
    with caplog.at_level(logging.WARNING):
        assert Mirrors(str(tmp_path)).hosts_for(parse_reference("reg.example/app")) is None
    assert words in caplog.text


def test_a_changed_hosts_file_is_used_by_the_next_lookup(tmp_path):
    directory = tmp_path / "reg.example"
    directory.mkdir()
    path = directory / "hosts.toml"
    path.write_text('[host."https://one.mirror"]\n')
    mirrors = Mirrors(str(tmp_path))
    ref = parse_reference("reg.example/app")
    assert mirrors.hosts_for(ref)[0].netloc == "one.mirror"
    path.with_suffix(".new").write_text('[host."https://two.mirror"]\n')
    os.replace(path.with_suffix(".new"), path)
    assert mirrors.hosts_for(ref)[0].netloc == "two.mirror"


def test_docker_certs_layout_without_hosts_toml_adds_the_registrys_ca(tmp_path):
    directory = tmp_path / "reg.example"
    directory.mkdir()
    (directory / "ca.crt").write_text("-----BEGIN CERTIFICATE-----\n")
    (only,) = Mirrors(str(tmp_path)).hosts_for(parse_reference("reg.example/app"))
    assert only == RegistryHost("https", "reg.example", "/v2", ca_files=(str(directory / "ca.crt"),),
                                mirror=False)
