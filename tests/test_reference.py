"""Image references (Docker's normalisation + SIF schemes), platform normalisation, host policy."""
import socket

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from archway.errors import HostRefused, InvalidReference
from archway.registry.hostpolicy import HostPolicy, forbidden_address
from archway.registry.platforms import Platform, architectures, normalize, parse_platform
from archway.registry.reference import parse_reference

DIGEST = "sha256:" + "ab" * 32


@pytest.mark.parametrize("text,host,repository,tag,digest", [
    ("nginx", "docker.io", "library/nginx", "latest", None),
    ("nginx:1.25", "docker.io", "library/nginx", "1.25", None),
    ("library/nginx", "docker.io", "library/nginx", "latest", None),
    ("docker.io/nginx", "docker.io", "library/nginx", "latest", None),
    ("index.docker.io/library/nginx:1", "docker.io", "library/nginx", "1", None),
    ("Docker.IO/library/nginx", "docker.io", "library/nginx", "latest", None),
    ("team/app", "docker.io", "team/app", "latest", None),
    ("docker://ubuntu:22.04", "docker.io", "library/ubuntu", "22.04", None),
    ("localhost/app", "localhost", "app", "latest", None),
    ("localhost:5000/app:v1", "localhost:5000", "app", "v1", None),
    ("localhost:5000", "docker.io", "library/localhost", "5000", None),  # as Docker reads it
    ("reg.example.com:5000/team/app:v1", "reg.example.com:5000", "team/app", "v1", None),
    ("10.0.0.5:5000/a/b/c/d:tag", "10.0.0.5:5000", "a/b/c/d", "tag", None),
    ("[::1]:5000/app:v1", "[::1]:5000", "app", "v1", None),
    (f"nginx@{DIGEST}", "docker.io", "library/nginx", None, DIGEST),
    (f"reg.io/app:1.2@{DIGEST}", "reg.io", "app", "1.2", DIGEST),
    ("oras://reg.io/sif/busybox:1", "reg.io", "sif/busybox", "1", None),
])
def test_docker_and_oras_references(text, host, repository, tag, digest):
    ref = parse_reference(text)
    assert (ref.host, ref.repository, ref.tag, ref.digest) == (host, repository, tag, digest)
    assert ref.scheme == ("oras" if text.startswith("oras://") else "docker")
    assert parse_reference(str(ref)) == ref   # str() round-trips


def test_docker_hub_api_host_and_manifest_reference():
    ref = parse_reference("nginx:1.25")
    assert ref.api_host == "registry-1.docker.io" and ref.manifest_reference == "1.25"
    assert str(ref) == "docker.io/library/nginx:1.25"
    by_both = parse_reference(f"reg.io:5000/app:v1@{DIGEST}")
    assert by_both.manifest_reference == DIGEST      # tag+digest resolves by digest
    assert by_both.api_host == "reg.io:5000" and by_both.hostname == "reg.io"
    assert parse_reference("[::1]:5000/app").hostname == "::1"


@pytest.mark.parametrize("text,host,repository,tag", [
    ("library://alpine", "library.sylabs.io", "library/default/alpine", "latest"),
    ("library://sylabs/examples/lolcow:latest", "library.sylabs.io", "sylabs/examples/lolcow", "latest"),
    ("library://entity/container:1.0", "library.sylabs.io", "entity/default/container", "1.0"),
    ("library://lib.example.com/e/c/x:tag", "lib.example.com", "e/c/x", "tag"),
    ("library://lib.example.com:8443/e/c/x", "lib.example.com:8443", "e/c/x", "latest"),
])
def test_library_references(text, host, repository, tag):
    ref = parse_reference(text)
    assert (ref.scheme, ref.host, ref.repository, ref.tag) == ("library", host, repository, tag)


def test_library_default_host_is_configurable():
    assert parse_reference("library://e/c/x", "lib.internal").host == "lib.internal"


def test_https_reference_keeps_the_url():
    ref = parse_reference("https://files.example.com/images/busybox.sif")
    assert (ref.scheme, ref.host, ref.url) == ("https", "files.example.com",
                                               "https://files.example.com/images/busybox.sif")


@pytest.mark.parametrize("text,fragment", [
    ("", "empty"), ("   ", "empty"), ("NGINX", "lowercase"), ("reg.io/App", "lowercase"),
    ("reg.io/app:", "malformed tag"), ("reg.io/app:-x", "malformed tag"),
    ("reg.io/app:" + "t" * 129, "malformed tag"), ("reg.io/app@sha256:short", "malformed digest"),
    ("reg.io:port/app", "malformed registry host"), ("reg.io//app", "lowercase"),
    ("ftp://host/x", "unsupported scheme"), ("http://", "no host"), ("library://", "expected library://"),
    ("library://a/b/c/d/e", "expected library://"), ("x" * 5000, "longer than"),
])
def test_invalid_references_say_what_is_wrong(text, fragment):
    with pytest.raises(InvalidReference) as info:
        parse_reference(text)
    assert fragment in str(info.value)


@pytest.mark.parametrize("text", ["reg.io/app\n:v1", f"reg.io/app:v1\n@{DIGEST}", "reg.io\n/app"])
def test_newlines_inside_a_reference_are_rejected(text):
    with pytest.raises(InvalidReference):
        parse_reference(text)


def test_non_ascii_tag_is_rejected():
    with pytest.raises(InvalidReference):
        parse_reference("reg.io/app:\u00fc")


def test_sha256_digest_must_be_hex():
    with pytest.raises(InvalidReference):
        parse_reference("reg.io/app@sha256:" + "Z" * 64)


@settings(max_examples=400, deadline=None)
@given(st.text(max_size=120))
def test_any_text_parses_or_raises_invalid_reference(text):
    try:
        ref = parse_reference(text)
    except InvalidReference:
        return
    assert ref.scheme in ("docker", "oras", "library", "https", "http")


# -- platforms -----------------------------------------------------------------------------------

@pytest.mark.parametrize("os_name,arch,variant,expected", [
    ("linux", "x86_64", None, "linux/amd64"), ("linux", "x86-64", None, "linux/amd64"),
    ("linux", "amd64", "v1", "linux/amd64"), ("linux", "aarch64", None, "linux/arm64"),
    ("linux", "arm64", "v8", "linux/arm64"), ("linux", "arm64", "8", "linux/arm64"),
    ("linux", "arm", None, "linux/arm/v7"), ("linux", "arm", "7", "linux/arm/v7"),
    ("linux", "arm", "6", "linux/arm/v6"), ("linux", "arm", "v5", "linux/arm/v5"),
    ("linux", "armhf", None, "linux/arm/v7"), ("linux", "armel", None, "linux/arm/v6"),
    ("linux", "i386", None, "linux/386"), ("linux", "i686", None, "linux/386"),
    ("linux", "ppc64el", None, "linux/ppc64le"), ("Linux", "AMD64", "", "linux/amd64"),
    ("linux", "s390x", None, "linux/s390x"), ("linux", "riscv64", None, "linux/riscv64"),
    ("windows", "amd64", None, "windows/amd64"),
])
def test_normalize_like_containerd(os_name, arch, variant, expected):
    assert str(normalize(os_name, arch, variant)) == expected


def test_parse_platform_and_architectures():
    assert parse_platform("arm/v7") == Platform("linux", "arm", "v7")
    assert parse_platform("linux/arm64/v8") == Platform("linux", "arm64", "")
    assert parse_platform("windows/amd64") == Platform("windows", "amd64", "")
    platforms = {parse_platform(p) for p in ("linux/amd64", "linux/arm/v7", "linux/arm/v6", "windows/arm64")}
    assert architectures(platforms) == {"amd64", "arm"}   # GOARCH only, linux only
    assert architectures(set()) == frozenset()


# -- host policy ---------------------------------------------------------------------------------

def fake_resolver(table: dict):
    """getaddrinfo stand-in: name -> address; unknown names do not resolve."""
    def resolve(host, port, family=0, socktype=0, proto=0, flags=0):
        if host not in table:
            raise socket.gaierror(socket.EAI_NONAME, "not known")
        family = socket.AF_INET6 if ":" in table[host] else socket.AF_INET
        return [(family, socket.SOCK_STREAM, proto, "", (table[host], port))]
    return resolve


@pytest.mark.parametrize("netloc", [
    "169.254.169.254", "169.254.169.254:80", "[fe80::1]:5000", "100.100.100.200",
    "[fd00:ec2::254]", "metadata.google.internal", "METADATA.google.internal:80",
    "metadata", "0.0.0.0:5000", "224.0.0.1", "[::ffff:169.254.169.254]",
])
def test_link_local_and_metadata_always_refused(netloc):
    with pytest.raises(HostRefused):
        HostPolicy(resolve=fake_resolver({})).check(netloc)


@pytest.mark.parametrize("name,address", [("trap.test", "169.254.169.254"),
                                          ("trap6.test", "fe80::1"),
                                          ("mapped.test", "::ffff:169.254.169.254")])
def test_names_resolving_to_link_local_are_refused(name, address):
    policy = HostPolicy(resolve=fake_resolver({name: address}))
    with pytest.raises(HostRefused, match="resolves to"):
        policy.check(f"{name}:5000")


def test_numeric_ip_spellings_resolve_to_what_they_are():
    # getaddrinfo reads 0xa9fea9fe and 2852039166 as 169.254.169.254: refused like the dotted form.
    policy = HostPolicy()
    for netloc in ("0xa9fea9fe:80", "2852039166:80"):
        with pytest.raises(HostRefused, match="169.254.169.254"):
            policy.check(netloc)


def test_deny_and_allow_lists():
    policy = HostPolicy(deny_hosts=("bad.example", "*.evil.io", "10.0.0.5:5000"),
                        resolve=fake_resolver({"ok.test": "10.1.2.3"}))
    for netloc in ("bad.example", "bad.example:443", "x.evil.io", "10.0.0.5:5000"):
        with pytest.raises(HostRefused, match="deny_hosts"):
            policy.check(netloc)
    for netloc in ("10.0.0.5:5001", "evil.io", "ok.test:80", "unresolvable.test"):
        policy.check(netloc)
    allow = HostPolicy(allow_hosts=("*.corp.example", "127.0.0.1:5000"))
    allow.check("reg.corp.example")
    allow.check("127.0.0.1:5000")
    for netloc in ("corp.example", "127.0.0.1:5001", "127.0.0.1"):
        with pytest.raises(HostRefused, match="allow_hosts"):
            allow.check(netloc)


def test_loopback_and_private_addresses_are_not_implicitly_refused():
    policy = HostPolicy(resolve=fake_resolver({}))
    for netloc in ("127.0.0.1:5000", "10.0.0.5:5000", "192.168.1.1"):
        policy.check(netloc)
    assert not forbidden_address("127.0.0.1")


def test_ipv6_loopback_is_not_refused():
    HostPolicy(resolve=fake_resolver({"localhost": "::1"})).check("localhost:5000")


def test_bracketed_ipv6_deny_pattern_matches():
    with pytest.raises(HostRefused, match="deny_hosts"):
        HostPolicy(deny_hosts=("[2001:db8::1]",), resolve=fake_resolver({})).check("[2001:db8::1]:5000")


def test_malformed_bracket_netloc_is_refused_not_crashing():
    with pytest.raises(HostRefused):
        HostPolicy().check("[::1")


@pytest.mark.parametrize("text,host,shown", [
    ("LOCALHOST:5001/team/app:V1", "localhost:5001", "localhost:5001/team/app:V1"),
    ("Registry.Example.COM/team/app", "registry.example.com",
     "registry.example.com/team/app:latest"),
    ("oras://Reg.Example/sif/tool:1.0", "reg.example", "oras://reg.example/sif/tool:1.0"),
    ("library://Lib.Example/ent/coll/c:1", "lib.example", "library://lib.example/ent/coll/c:1"),
    ("HTTPS://u:PassWord@Files.Example:8443/Images/X.sif", "files.example:8443",
     "https://***@files.example:8443/Images/X.sif"),
])
def test_host_names_are_lowercased_once_paths_and_secrets_are_not(text, host, shown):
    ref = parse_reference(text)
    assert ref.host == host and str(ref) == shown
    if ref.url:   # the password and the path keep their case: they are not names
        assert ref.url == "https://u:PassWord@files.example:8443/Images/X.sif"
        assert ref.repository == "Images/X.sif"
