"""SIF images pushed to the real Debian docker-registry as oras artifacts, resolved through
archway.registry.oci.RegistryClient with Range reads of the SIF layer only.

The registry's access log gives the bytes it sent per request; it does not log request headers,
so a recording proxy sits in front of it to show that every blob GET carried a Range header.
"""
import pytest

from archway.config import RegistrySettings
from archway.errors import SIFError
from archway.registry.http import HttpClient
from archway.registry.oci import RegistryClient
from archway.registry.reference import parse_reference
from archway.registry.sif import BlockReader, read_sif_platforms
from lab.servers.fileserver import RecordingProxy
from lab.servers.registry import RegistryServer
from lab.tls import session_ca
from tests.infra import sifbuild, sifcorpus
from tests.infra.fixtures import LOOPBACK_HOSTS
from tests.infra.sifbuild import SHARED_SIF_ERRORS as README_ERRORS
from tests.infra.sifbuild import SHARED_SIF_EXPECTED as README_EXPECTED

# Starts real servers (registries, archway serve, helm...): outside the fast inner loop.
pytestmark = pytest.mark.slow

BUILT_ARCHES = ("amd64", "arm64", "ppc64le", "s390x", "riscv64", "386")


def _repo_tag(name: str) -> tuple[str, str]:
    stem = name.split(".")[0].lower().replace("_", "-")
    return f"sif/{stem}", "v1"


def _generated_repo_tag(name: str) -> tuple[str, str]:
    return f"generated/{name.split('.')[0]}", "v1"


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """The registry behind a recording proxy, holding the generated SIF files; name -> size."""
    ca = session_ca(tmp_path_factory)
    registry = RegistryServer(tmp_path_factory.mktemp("oras-registry"), ca=ca)
    proxy = RecordingProxy(ca, registry.url, upstream_ca=ca.cert_path)
    sizes = {}
    workdir = str(tmp_path_factory.mktemp("oras-built"))
    for name, path in sifbuild.generated_corpus(workdir).items():
        with open(path, "rb") as f:
            data = f.read()
        registry.push_sif(*_generated_repo_tag(name), data, title=name)
        sizes[name] = data
    for arch in BUILT_ARCHES:
        with open(sifbuild.siftool_image(workdir, f"{arch}.sif", arch), "rb") as f:
            registry.push_sif("built/sif", arch, f.read())
    try:
        yield registry, proxy, sizes
    finally:
        proxy.stop()
        registry.stop()


@pytest.fixture(scope="module")
def corpus(setup):
    """The third-party corpus pushed too, when it is there (each test that reads it calls
    sifcorpus.require() first)."""
    registry, _, sizes = setup
    for name in list(README_EXPECTED) + list(README_ERRORS) if sifcorpus.present() else ():
        data = sifcorpus.read(name)
        registry.push_sif(*_repo_tag(name), data, title=name)
        sizes[name] = data
    return setup


def resolve(setup, repo, tag):
    registry, proxy, _ = setup
    settings = RegistrySettings(allow_hosts=LOOPBACK_HOSTS, ca_file=registry.ca.cert_path)
    http = HttpClient(settings)
    proxy.clear()
    mark = registry.mark()
    info = RegistryClient(http, settings).resolve(
        parse_reference(f"oras://{proxy.host}/{repo}:{tag}"))
    blob_gets = [e for e in registry.requests_since(mark) if "/blobs/" in e.path]
    proxy.settle()   # what the client read is recorded
    return info, proxy.requests, blob_gets, http


@pytest.mark.parametrize("name", sorted(README_EXPECTED))
def test_shared_sif_as_oras_artifact(corpus, name):
    sifcorpus.require()
    setup = corpus
    info, through_proxy, blob_gets, _ = resolve(setup, *_repo_tag(name))
    assert {str(p) for p in info.platforms} == README_EXPECTED[name]
    assert info.source == "sif-oras" and info.digest.startswith("sha256:")
    blob_requests = [r for r in through_proxy if "/blobs/" in r.path]
    assert blob_requests and all(r.range and r.range.startswith("bytes=") for r in blob_requests)
    assert all(e.status == 206 for e in blob_gets)
    # what the registry itself says it sent for the SIF layer
    size = len(setup[2][name])
    if name.endswith(".oci.sif"):
        assert sum(e.size for e in blob_gets) <= 32768 + 4096
    else:
        assert [e.size for e in blob_gets] == [min(32768, size)]


def test_default_layout_costs_one_manifest_and_one_32k_range(corpus):
    sifcorpus.require()
    info, through_proxy, blob_gets, http = resolve(corpus, *_repo_tag("busybox_ppc64le.sif"))
    assert info.architectures == {"ppc64le"}
    assert [(r.method, "/manifests/" in r.path, r.range) for r in through_proxy] == [
        ("GET", True, None), ("GET", False, "bytes=0-32767")]
    assert [e.size for e in blob_gets] == [32768]          # of a 2.8 MB image
    assert http.stats.requests == 2


def test_oci_sif_reads_past_the_first_block_with_a_second_range(corpus):
    sifcorpus.require()
    info, through_proxy, blob_gets, _ = resolve(corpus, *_repo_tag("docker-manifest-list.oci.sif"))
    assert len(info.platforms) == 9
    assert [r.range for r in through_proxy if "/blobs/" in r.path] == [
        "bytes=0-32767", "bytes=67866-69934"]
    assert [e.size for e in blob_gets] == [32768, 2069]


def test_small_sif_layer_range_is_capped_at_its_size(corpus):
    sifcorpus.require()
    _, through_proxy, blob_gets, _ = resolve(corpus, *_repo_tag("docker-manifest.oci.sif"))
    assert [r.range for r in through_proxy if "/blobs/" in r.path] == ["bytes=0-11967"]
    assert [e.size for e in blob_gets] == [11968]


def test_root_index_without_blobs_is_a_sif_error(corpus):
    sifcorpus.require()
    with pytest.raises(SIFError, match="missing blob"):
        resolve(corpus, *_repo_tag("one-object-oci-root-index.sif"))


@pytest.mark.parametrize("arch", BUILT_ARCHES)
def test_siftool_built_sif_as_oras_artifact(setup, arch):
    info, through_proxy, blob_gets, _ = resolve(setup, "built/sif", arch)
    assert {str(p) for p in info.platforms} == {f"linux/{arch}"}
    assert [r.range for r in through_proxy if "/blobs/" in r.path] == ["bytes=0-32767"]
    assert [e.size for e in blob_gets] == [32768]


# --- the generated stand-ins of the corpus: the same paths without it -------------------------

def local_fetches(data: bytes) -> list[tuple[int, int]]:
    """The (offset, length) reads a BlockReader makes of these bytes: the Range requests due."""
    fetches: list[tuple[int, int]] = []
    try:
        read_sif_platforms(BlockReader(lambda o, n: fetches.append((o, n)) or data[o:o + n]))
    except SIFError:
        pass
    return fetches


@pytest.mark.parametrize("name", sorted(sifbuild.GENERATED))
def test_generated_sif_as_oras_artifact(setup, name):
    shape, data = sifbuild.GENERATED[name], setup[2][name]
    if shape.platforms is None:
        with pytest.raises(SIFError, match=shape.error):
            resolve(setup, *_generated_repo_tag(name))
        return
    info, through_proxy, blob_gets, http = resolve(setup, *_generated_repo_tag(name))
    assert {str(p) for p in info.platforms} == set(shape.platforms)
    assert info.source == "sif-oras" and info.digest.startswith("sha256:")
    # one manifest, then exactly the ranges a local BlockReader reads, each answered 206
    expected = [f"bytes={o}-{min(o + n, len(data)) - 1}" for o, n in local_fetches(data)]
    assert [r.range for r in through_proxy if "/blobs/" in r.path] == expected
    assert [(r.method, r.range) for r in through_proxy][0] == ("GET", None)
    assert [e.status for e in blob_gets] == [206] * len(expected)
    assert sum(e.size for e in blob_gets) <= 32768 + 4096 and http.stats.requests == 1 + len(expected)


def test_generated_default_layout_costs_one_32k_range_of_a_bigger_file(setup):
    _, through_proxy, blob_gets, _ = resolve(setup, *_generated_repo_tag("siftool-ppc64le-aligned.sif"))
    assert [r.range for r in through_proxy if "/blobs/" in r.path] == ["bytes=0-32767"]
    assert [e.size for e in blob_gets] == [32768] and len(setup[2]["siftool-ppc64le-aligned.sif"]) > 65536


def test_generated_index_past_the_first_block_costs_a_second_range(setup):
    data = setup[2]["index-past-first-block.oci.sif"]
    _, through_proxy, _, _ = resolve(setup, *_generated_repo_tag("index-past-first-block.oci.sif"))
    first, second = [r.range for r in through_proxy if "/blobs/" in r.path]
    start = int(second.split("=")[1].split("-")[0])
    assert first == "bytes=0-32767" and start > 32768 and second.endswith(f"-{len(data) - 1}")


def test_generated_small_layer_range_is_capped_at_its_size(setup):
    size = len(setup[2]["single.oci.sif"])
    _, through_proxy, blob_gets, _ = resolve(setup, *_generated_repo_tag("single.oci.sif"))
    assert [r.range for r in through_proxy if "/blobs/" in r.path] == [f"bytes=0-{size - 1}"]
    assert [e.size for e in blob_gets] == [size]
