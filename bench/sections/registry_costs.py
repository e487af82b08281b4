"""Figures 3 and 6: what resolving a new image costs the servers it lives on, counted by them.

Resolution runs in this process through `archway.registry.resolver.Resolver`, the object each gunicorn
worker builds; the counts come from the real docker-registry's access log
(`RegistryServer.requests_since`), the token server's request list, and the HTTPS file server's
record of body bytes sent.
"""
import os
import time

from archway.config import RegistrySettings
from archway.registry.credentials import Keyring
from archway.registry.resolver import Resolver
from bench.common.lab import LOOPBACK_HOSTS, Lab
from bench.common.report import Figure
from bench.common.section import Started, measured
from lab.procs import SHARED_TESTDATA
from lab.servers.fileserver import FileServer
from lab.servers.registry import RegistryServer

SIF_DIR = os.path.join(SHARED_TESTDATA, "sif")
# The real SIF files that record an architecture, and what they record (testdata README).
SIF_FILES = {
    "busybox_amd64.sif": {"amd64"},
    "busybox_arm64.sif": {"arm64"},
    "busybox_ppc64le.sif": {"ppc64le"},
    "one-group.sif": {"386"},
    "one-group-signed-pgp.sif": {"386"},
    "two-groups.sif": {"386"},
    "docker-manifest.oci.sif": {"arm64"},
    "image-defaults.oci.sif": {"arm64"},
    "docker-manifest-list.oci.sif": {"386", "amd64", "arm", "arm64", "mips64le", "ppc64le",
                                     "riscv64", "s390x"},
}
SIF_BUDGET = 64 * 1024


REQUESTS = ("3", "registry requests per new image", "index 1 / single 2, +1 token per scope, cached")
SIF = ("6", "SIF arch over HTTP, bytes read per image (oras, https)", "<= 64 KiB")


def run(lab: Lab) -> list[Figure]:
    return [*measured([REQUESTS], lambda started: [_requests_per_image(lab, started, *REQUESTS)]),
            *measured([SIF], lambda started: [_sif_bytes(lab, started, *SIF)])]


def _resolver(lab: Lab, keyring: Keyring | None = None) -> Resolver:
    return Resolver(RegistrySettings(ca_file=lab.ca.cert_path, allow_hosts=LOOPBACK_HOSTS), keyring=keyring or Keyring.empty())


def _cost(registry: RegistryServer, resolver: Resolver, image: str) -> tuple[int, int, object]:
    """(registry requests, token requests, ImageInfo) of resolving one new image."""
    mark = registry.mark()
    tokens = registry.token_server.count() if registry.token_server else 0
    info = resolver.resolve(image, deadline=time.monotonic() + 30)
    spent = registry.requests_since(mark)
    token_count = (registry.token_server.count() - tokens) if registry.token_server else 0
    return len(spent), token_count, info


# --- figure 3 ---------------------------------------------------------------------------------

def _requests_per_image(lab: Lab, started: Started, number: str, name: str, target: str) -> Figure:
    anonymous = started(RegistryServer(lab.path("registry-anon"), ca=lab.ca))
    token = started(RegistryServer(lab.path("registry-token"), ca=lab.ca, auth="token"))
    for registry in (anonymous, token):
        for tag in ("a", "b"):
            registry.push_index("team/multi", tag, ["linux/amd64", "linux/arm64"])
            registry.push_image("team/single", tag, "linux/arm64")
    resolver = _resolver(lab)
    index_anon, _, info_i = _cost(anonymous, resolver, anonymous.ref("team/multi", "a"))
    single_anon, _, info_s = _cost(anonymous, resolver, anonymous.ref("team/single", "a"))

    keyring = Keyring.from_dockerconfigjson(token.dockerconfigjson())
    resolver = _resolver(lab, keyring)
    first = _cost(token, resolver, token.ref("team/multi", "a"))       # first contact: 401
    index_same = _cost(token, resolver, token.ref("team/multi", "b"))  # scope's token cached
    single_new = _cost(token, resolver, token.ref("team/single", "a"))  # new scope
    single_same = _cost(token, resolver, token.ref("team/single", "b"))
    resolved = (info_i.architectures == {"amd64", "arm64"} and info_s.architectures == {"arm64"}
                and first[2].architectures == {"amd64", "arm64"}
                and single_same[2].architectures == {"arm64"})
    ok = (resolved and index_anon == 1 and single_anon == 2
          and index_same[:2] == (1, 0) and single_new[:2] == (2, 1) and single_same[:2] == (2, 0)
          and first[1] == 1)
    value = (f"index {index_anon} / single {single_anon}; token auth: +{single_new[1]} "
             f"token for a new scope, +{single_same[1]} once cached")
    return Figure(number, name, value, target, ok, [
        "fresh Resolver (the object each worker builds) against a real docker-registry over TLS; "
        "requests counted from the registry's access log, tokens at the token server",
        f"token registry: new scope (single manifest) {single_new[0]} registry requests + "
        f"{single_new[1]} token; same scope again {single_same[0]} + {single_same[1]}; index in a "
        f"scope with a cached token {index_same[0]} + {index_same[1]}",
        f"token registry, very first image of the host: {first[0]} registry requests (the 401 "
        f"that names the token service, then the manifest) + {first[1]} token; later scopes on "
        f"that host get their token up front (remembered challenge)",
    ])


# --- figure 6 ---------------------------------------------------------------------------------

def _sif_bytes(lab: Lab, started: Started, number: str, name: str, target: str) -> Figure:
    registry = started(RegistryServer(lab.path("registry-sif"), ca=lab.ca))
    files = started(FileServer(lab.ca, {f"/sif/{f}": os.path.join(SIF_DIR, f) for f in SIF_FILES}))
    per_file = []
    for filename in SIF_FILES:
        with open(os.path.join(SIF_DIR, filename), "rb") as f:
            registry.push_sif("sif/" + filename.split(".")[0].replace("_", "-"), "1", f.read())
    for filename, expected in SIF_FILES.items():
        size = os.path.getsize(os.path.join(SIF_DIR, filename))
        repo = "sif/" + filename.split(".")[0].replace("_", "-")
        resolver = _resolver(lab)   # nothing cached between images
        mark = registry.mark()
        oras = resolver.resolve(registry.ref(repo, "1", scheme="oras"),
                                deadline=time.monotonic() + 30)
        served = registry.requests_since(mark)
        oras_total = sum(e.size for e in served)
        oras_blob = sum(e.size for e in served if "/blobs/" in e.path)
        files.clear()
        https = resolver.resolve(files.url(f"/sif/{filename}"), deadline=time.monotonic() + 30)
        https_bytes = files.bytes_sent()
        for how, info in (("oras", oras), ("https", https)):
            if set(info.architectures) != expected:
                raise RuntimeError(f"{filename} over {how} resolved to "
                                   f"{sorted(info.architectures)}, expected {sorted(expected)}")
        per_file.append((filename, size, oras_total, oras_blob, len(served), https_bytes,
                         len(files.requests)))
    worst_oras = max(per_file, key=lambda r: r[2])
    worst_https = max(per_file, key=lambda r: r[5])
    ok = worst_oras[2] <= SIF_BUDGET and worst_https[5] <= SIF_BUDGET
    value = (f"max oras {worst_oras[2] / 1024:.1f} KiB ({worst_oras[0]}), "
             f"max https {worst_https[5] / 1024:.1f} KiB ({worst_https[0]})")
    rows = "; ".join(f"{f} ({s // 1024} KiB file): oras {o / 1024:.1f} KiB in {n} requests "
                     f"(SIF blob {b / 1024:.1f}), https {h / 1024:.1f} KiB in {hn}"
                     for f, s, o, b, n, h, hn in per_file)
    return Figure(number, name, value, target, ok, [
        f"the {len(SIF_FILES)} real SIF files of ../shared/testdata/sif that record an "
        "architecture, pushed as oras artifacts to docker-registry and served by the HTTPS Range "
        "file server; bytes = response bodies the server sent for one resolution (oras: "
        "manifest + SIF blob ranges, from the registry's access log)",
        "per file: " + rows,
    ])
