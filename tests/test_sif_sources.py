"""SIF images over HTTPS with Range requests, and library:// against a library API stand-in."""
import os

import pytest

from archway.config import RegistrySettings, SifSettings
from archway.errors import (
    AuthError,
    ConfigError,
    HostRefused,
    NotFound,
    RegistryError,
    ResponseTooLarge,
    SIFError,
)
from archway.registry.http import HttpClient
from archway.registry.reference import parse_reference
from archway.registry.resolver import Resolver
from archway.registry.sifsources import resolve_https, resolve_library
from lab.servers.fileserver import FileServer, LibraryServer, parse_range
from lab.tls import session_ca
from tests.infra import sifbuild, sifcorpus
from tests.infra.fixtures import LOOPBACK_HOSTS
from tests.infra.sifbuild import SHARED_SIF_ERRORS as README_ERRORS
from tests.infra.sifbuild import SHARED_SIF_EXPECTED as README_EXPECTED

# Starts real servers (registries, archway serve, helm...): outside the fast inner loop.
pytestmark = pytest.mark.slow

TOKEN = "lib-token-3f9a"
DEFAULT_LAYOUT = ["busybox_amd64.sif", "busybox_arm64.sif", "busybox_ppc64le.sif", "one-group.sif",
                  "one-group-signed-pgp.sif", "two-groups.sif", "empty.sif",
                  "empty-launch-script.sif", "one-object-generic-json.sif"]
GENERATED_DEFAULT_LAYOUT = [name for name in sorted(sifbuild.GENERATED)
                            if name.startswith("siftool-")]


@pytest.fixture(scope="module")
def ca(tmp_path_factory):
    return session_ca(tmp_path_factory)


@pytest.fixture(scope="module")
def files(ca, tmp_path_factory):
    """An HTTPS file server with the generated SIF files (/generated/...), siftool builds
    (/built/...), a 48 MiB image and a truncated one."""
    workdir = str(tmp_path_factory.mktemp("sif-https"))
    served = {f"/generated/{name}": path
              for name, path in sifbuild.generated_corpus(workdir).items()}
    for arch in ("amd64", "arm64", "ppc64le", "s390x", "riscv64", "386"):
        served[f"/built/{arch}.sif"] = sifbuild.siftool_image(workdir, f"{arch}.sif", arch)
    with open(served["/built/amd64.sif"], "rb") as f:
        amd64 = f.read()
    served["/big.sif"] = amd64 + b"\0" * (48 * 1024 * 1024)   # 48 MiB: what a real image weighs
    served["/truncated.sif"] = amd64[:20000]
    server = FileServer(ca, served)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def corpus(files):
    """The third-party corpus served too, under /sif/, when it is there (each test that reads
    it calls sifcorpus.require() first)."""
    for name in list(README_EXPECTED) + list(README_ERRORS) if sifcorpus.present() else ():
        files.files[f"/sif/{name}"] = sifcorpus.path(name)
    return files


@pytest.fixture
def http(ca):
    return HttpClient(RegistrySettings(allow_hosts=LOOPBACK_HOSTS, ca_file=ca.cert_path))


def https(files, path, http):
    files.clear()
    try:
        return resolve_https(parse_reference(files.url(path)), http, None)
    finally:
        files.settle()   # what the client read is recorded


# ---------------------------------------------------------------------------------------------
# https://


@pytest.mark.parametrize("name", sorted(README_EXPECTED))
def test_shared_files_over_https(corpus, http, name):
    sifcorpus.require()
    files = corpus
    info = https(files, f"/sif/{name}", http)
    assert {str(p) for p in info.platforms} == README_EXPECTED[name]
    assert info.source == "sif-https" and info.digest is None
    assert all(r.range and r.range.startswith("bytes=") for r in files.requests)


@pytest.mark.parametrize("name", DEFAULT_LAYOUT)
def test_default_layout_costs_one_32k_range_request(corpus, http, name):
    sifcorpus.require()
    files = corpus
    https(files, f"/sif/{name}", http)
    size = os.path.getsize(sifcorpus.path(name))
    assert [(r.status, r.range) for r in files.requests] == [(206, "bytes=0-32767")]
    assert files.bytes_sent() == min(32768, size) <= 64 * 1024
    assert http.stats.requests == 1 and http.stats.bytes_read == files.bytes_sent()


def test_oci_sif_over_https_reads_the_index_past_the_first_block(corpus, http):
    sifcorpus.require()
    files = corpus
    info = https(files, "/sif/docker-manifest-list.oci.sif", http)
    assert len(info.platforms) == 9
    assert [r.range for r in files.requests] == ["bytes=0-32767", "bytes=67866-69934"]
    assert files.bytes_sent() == 32768 + 2069


def test_small_oci_sif_is_one_request(corpus, http):
    sifcorpus.require()
    files = corpus
    info = https(files, "/sif/docker-manifest.oci.sif", http)
    assert {str(p) for p in info.platforms} == {"linux/arm64"}
    assert len(files.requests) == 1 and files.bytes_sent() == 11968


def test_root_index_without_blobs_over_https(corpus, http):
    sifcorpus.require()
    with pytest.raises(SIFError, match=r"https://127\.0\.0\.1:\d+/sif/one-object-oci-root-index"
                                       r"\.sif: OCI-SIF image is missing blob"):
        https(corpus, "/sif/one-object-oci-root-index.sif", http)


# --- the generated stand-ins of the corpus: the same requests without it ----------------------

@pytest.mark.parametrize("name", sorted(sifbuild.GENERATED))
def test_generated_files_over_https(files, http, name):
    shape = sifbuild.GENERATED[name]
    if shape.platforms is None:
        with pytest.raises(SIFError, match=rf"https://127\.0\.0\.1:\d+/generated/{name}: "
                                           rf"OCI-SIF image is {shape.error}"):
            https(files, f"/generated/{name}", http)
        return
    info = https(files, f"/generated/{name}", http)
    assert {str(p) for p in info.platforms} == set(shape.platforms)
    assert info.source == "sif-https" and info.digest is None
    assert all(r.range and r.range.startswith("bytes=") and r.status == 206 for r in files.requests)


@pytest.mark.parametrize("name", GENERATED_DEFAULT_LAYOUT)
def test_generated_default_layout_costs_one_32k_range_request(files, http, name):
    https(files, f"/generated/{name}", http)
    size = os.path.getsize(files.files[f"/generated/{name}"])
    assert [(r.status, r.range) for r in files.requests] == [(206, "bytes=0-32767")]
    assert files.bytes_sent() == min(32768, size)
    assert http.stats.requests == 1 and http.stats.bytes_read == files.bytes_sent()


def test_generated_oci_sif_reads_the_index_past_the_first_block(files, http):
    path = files.files["/generated/index-past-first-block.oci.sif"]
    size = os.path.getsize(path)
    info = https(files, "/generated/index-past-first-block.oci.sif", http)
    assert len(info.platforms) == 9
    first, second = [r.range for r in files.requests]
    start = int(second.split("=")[1].split("-")[0])
    assert first == "bytes=0-32767" and start > 32768 and second == f"bytes={start}-{size - 1}"
    assert files.bytes_sent() == 32768 + size - start


def test_generated_small_oci_sif_is_one_request(files, http):
    size = os.path.getsize(files.files["/generated/single.oci.sif"])
    info = https(files, "/generated/single.oci.sif", http)
    assert {str(p) for p in info.platforms} == {"linux/arm64"}
    assert len(files.requests) == 1 and files.bytes_sent() == size < 32768


@pytest.mark.parametrize("arch", ["amd64", "arm64", "ppc64le", "s390x", "riscv64", "386"])
def test_siftool_built_files_over_https(files, http, arch):
    info = https(files, f"/built/{arch}.sif", http)
    assert {str(p) for p in info.platforms} == {f"linux/{arch}"}
    assert len(files.requests) == 1


def test_big_image_reads_only_its_header(files, http):
    info = https(files, "/big.sif", http)
    assert {str(p) for p in info.platforms} == {"linux/amd64"}
    assert files.bytes_sent() == 32768


def test_truncated_file_over_https(files, http):
    with pytest.raises(SIFError, match="truncated SIF image: the descriptor table"):
        https(files, "/truncated.sif", http)
    assert [r.status for r in files.requests] == [206]


def test_missing_file_is_not_found(files, http):
    with pytest.raises(NotFound, match="404"):
        https(files, "/sif/nope.sif", http)


def test_plain_http_refused_unless_insecure(files, http):
    files.clear()
    with pytest.raises(HostRefused, match="insecure_hosts"):
        resolve_https(parse_reference(f"http://{files.host}/generated/siftool-empty.sif"), http, None)
    assert files.requests == [] and http.stats.requests == 0


@pytest.fixture
def ignoring_range(files):
    files.ignore_range = True
    yield files
    files.ignore_range = False
    files.send_length = True


@pytest.mark.parametrize("send_length", [True, False])
def test_server_that_ignores_range_is_refused_without_reading_the_file(ignoring_range, http,
                                                                       send_length):
    ignoring_range.send_length = send_length
    with pytest.raises(ResponseTooLarge, match="ignored the Range request"):
        https(ignoring_range, "/big.sif", http)
    size = len(ignoring_range.files["/big.sif"])
    # The server answered 200 and tried to send 48 MiB; archway hung up after the headers (or
    # after 32 KiB + one chunk without a Content-Length), so most of it never left the server.
    served = ignoring_range.wait_for_requests(1)
    assert [r.status for r in served] == [200]
    assert served[0].bytes_sent < size // 4


def test_small_file_from_a_server_that_ignores_range_still_works(ignoring_range, http):
    info = https(ignoring_range, "/generated/single.oci.sif", http)
    assert {str(p) for p in info.platforms} == {"linux/arm64"}
    assert [r.status for r in ignoring_range.requests] == [200]


def test_https_through_the_resolver(files, ca):
    resolver = Resolver(RegistrySettings(allow_hosts=LOOPBACK_HOSTS, ca_file=ca.cert_path))
    info = resolver.resolve(files.url("/generated/siftool-arm64.sif"))
    assert info.architectures == {"arm64"} and info.source == "sif-https"


def test_untrusted_certificate_is_a_transport_error(files):
    with pytest.raises(RegistryError, match="TLS error"):
        https(files, "/generated/siftool-empty.sif", HttpClient(RegistrySettings(allow_hosts=LOOPBACK_HOSTS)))


@pytest.mark.parametrize("header,size,window", [
    ("bytes=0-99", 50, (0, 49)), ("bytes=10-", 50, (10, 49)), ("bytes=-5", 50, (45, 49)),
    ("bytes=50-60", 50, None), ("bytes=5-1", 50, None), ("bytes=a-b", 50, None),
])
def test_fileserver_range_parsing(header, size, window):
    assert parse_range(header, size) == window


# ---------------------------------------------------------------------------------------------
# library://


@pytest.fixture(scope="module")
def library(ca):
    server = LibraryServer(ca, token=TOKEN)
    for arch in ("amd64", "arm64", "ppc64le"):
        server.add_image("alice/tools/busybox", ["latest", "1.36"], arch,
                         image_id=f"img-{arch}-136")
    server.add_image("alice/tools/busybox", ["1.35"], "amd64", image_id="img-amd64-135",
                     hash="sha256." + "ab" * 32)
    server.add_image("alice/tools/legacy", ["latest"], None, image_id="img-legacy")
    yield server
    server.stop()


@pytest.fixture(scope="module")
def other_library(ca):
    server = LibraryServer(ca)   # no token needed: it must still never receive ours
    server.add_image("bob/x/tool", ["latest"], "s390x")
    yield server
    server.stop()


@pytest.fixture
def library_settings(library, ca, tmp_path):
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    return SifSettings(library_url=library.url(), library_token_file=str(token_file))


def lib(library, settings, text):
    library.clear()
    http = HttpClient(RegistrySettings(allow_hosts=LOOPBACK_HOSTS, ca_file=library.ca_path))
    return resolve_library(parse_reference(text, library.host), http, settings, None)


def test_library_multi_arch_tag(library, library_settings):
    info = lib(library, library_settings, "library://alice/tools/busybox:latest")
    assert info.architectures == {"amd64", "arm64", "ppc64le"}
    assert info.source == "sif-library" and info.digest is None
    assert [(r.path, r.status) for r in library.requests] == [
        ("/v1/containers/alice/tools/busybox", 200)]


def test_library_tag_only_some_arches_have(library, library_settings):
    info = lib(library, library_settings, "library://alice/tools/busybox:1.35")
    assert info.architectures == {"amd64"} and info.digest == "img-amd64-135"


def test_library_tag_no_arch_has(library, library_settings):
    with pytest.raises(NotFound, match="no architecture has the tag '9.9'"):
        lib(library, library_settings, "library://alice/tools/busybox:9.9")


def test_library_missing_container_carries_the_library_message(library, library_settings):
    with pytest.raises(NotFound, match="answered 404: container not found"):
        lib(library, library_settings, "library://alice/tools/nothing:latest")


def test_library_hash_reference_uses_the_images_endpoint(library, library_settings):
    info = lib(library, library_settings, "library://alice/tools/busybox:sha256." + "ab" * 32)
    assert info.architectures == {"amd64"} and info.digest == "sha256." + "ab" * 32
    assert [r.path for r in library.requests] == [
        "/v1/images/alice/tools/busybox:sha256." + "ab" * 32]


def test_library_without_arch_tags_falls_back_to_images(library, library_settings):
    library.arch_tags = False
    try:
        info = lib(library, library_settings, "library://alice/tools/busybox:1.35")
    finally:
        library.arch_tags = True
    assert info.architectures == {"amd64"}
    assert [r.path for r in library.requests] == ["/v1/containers/alice/tools/busybox",
                                                   "/v1/images/alice/tools/busybox:1.35"]


def test_library_image_without_arch_is_unknown(library, library_settings):
    info = lib(library, library_settings, "library://alice/tools/legacy:latest")
    assert info.platforms == frozenset() and "no architecture" in info.note


def test_library_token_sent_to_the_library_host(library, library_settings):
    lib(library, library_settings, "library://alice/tools/busybox:latest")
    assert [r.authorization for r in library.requests] == [f"Bearer {TOKEN}"]


def test_library_token_never_sent_to_another_host(library, other_library, library_settings):
    other_library.clear()
    info = lib(library, library_settings, f"library://{other_library.host}/bob/x/tool:latest")
    assert info.architectures == {"s390x"}
    assert [r.authorization for r in other_library.requests] == [None]
    assert library.requests == []


def test_library_without_token_is_an_auth_error(library, ca):
    settings = SifSettings(library_url=library.url())
    with pytest.raises(AuthError, match="401: Unauthorized.*sif.library_token_file"):
        lib(library, settings, "library://alice/tools/busybox:latest")


def test_library_token_file_missing_is_a_config_error(library, ca, tmp_path):
    settings = SifSettings(library_url=library.url(), library_token_file=str(tmp_path / "absent"))
    with pytest.raises(ConfigError, match="sif.library_token_file"):
        lib(library, settings, "library://alice/tools/busybox:latest")


def test_library_garbage_answer(files, ca):
    # a host that answers 200 with bytes that are not the library's JSON
    settings = SifSettings(library_url=files.url())
    files.files["/v1/containers/a/b/c"] = b"\x1f\x8b not json"
    try:
        with pytest.raises(RegistryError, match="without a JSON `data` object"):
            resolve_library(parse_reference("library://a/b/c", files.host), HttpClient(RegistrySettings(allow_hosts=LOOPBACK_HOSTS, ca_file=ca.cert_path)),
                            settings, None)
    finally:
        del files.files["/v1/containers/a/b/c"]


def test_library_through_the_resolver(library, library_settings):
    info = Resolver(RegistrySettings(allow_hosts=LOOPBACK_HOSTS, ca_file=library.ca_path), sif=library_settings).resolve("library://alice/tools/busybox:1.36")
    assert info.architectures == {"amd64", "arm64", "ppc64le"}
