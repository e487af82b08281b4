"""Figure 9: resident memory of one gunicorn worker holding 10,000 images in its resolver cache.

One worker (so every admission lands in the cache being measured), TLS, real registry. The
first REAL_IMAGES images are pushed to docker-registry and resolved by real admissions; the rest
of the 10,000 go through bench/apps/memory_worker.py's fill route (the resolver's own caching path,
with copies of those real answers instead of network lookups). RSS is VmRSS of the worker
process from /proc, before (after one admission) and after.
"""
import time

from bench.common.lab import Lab, mutated_archs, pod_review, push_index_variants
from bench.common.plots import plot
from bench.common.report import Figure
from bench.common.section import Started, measured
from bench.common.servers import GunicornServer, rss_bytes
from lab.servers.registry import RegistryServer

IMAGES = 10_000
REAL_IMAGES = 300
IMAGES_PER_POD = 30
TARGET_MB = 80
MB = 1024 * 1024


SPEC = ("9", f"RSS per worker with {IMAGES:,} cached images", f"<= {TARGET_MB} MB")


def run(lab: Lab) -> list[Figure]:
    return measured([SPEC], lambda started: _measure(lab, started))


def _measure(lab: Lab, started: Started) -> list[Figure]:
    number, name, target = SPEC
    registry = started(RegistryServer(lab.path("registry-memory"), ca=lab.ca))
    repo = "bench/memory"
    real = [registry.ref(repo, tag) for tag in push_index_variants(registry, repo, REAL_IMAGES)]
    # Each tag is remembered twice (by tag, and by the digest it resolved to), so 10,000
    # images need 20,000 entries; the default max_entries (10,000) would evict half.
    config = lab.archway_config("memory", server={"workers": 1},
                                registry={"cache": {"max_entries": 2 * IMAGES}})
    server = started(GunicornServer.module(lab.path("memory"), "bench.apps.memory_worker",
                                           config, tls_ca=lab.ca.cert_path, name="memory"))
    worker, = server.wait_workers(1)
    _admit(server, real[:1])
    before = rss_bytes(worker)
    for i in range(0, REAL_IMAGES, IMAGES_PER_POD):
        _admit(server, real[i:i + IMAGES_PER_POD])
    after_real = rss_bytes(worker)
    synthetic = [registry.ref(repo, f"s{i}") for i in range(IMAGES - REAL_IMAGES)]
    answer = server.session.post(server.url("/bench/fill"), timeout=300,
                                 json={"template": real[0], "images": synthetic,
                                       "per_pod": IMAGES_PER_POD}).json()
    if answer["failed"]:
        raise RuntimeError(f"the fill route could not cache {answer['failed']} images")
    time.sleep(0.5)   # let the resolver's threads go idle
    after = rss_bytes(worker)
    ready = server.session.get(server.url("/readyz"), timeout=10).json()
    if server.worker_pids() != [worker]:
        raise RuntimeError("the worker was replaced during the measurement")
    per_image = (after - after_real) / (IMAGES - REAL_IMAGES)
    return [Figure(number, name, f"{after / MB:.1f} MB ({before / MB:.1f} MB before, "
                   f"+{per_image / 1024:.1f} KiB per image)", target, after <= TARGET_MB * MB, [
        f"VmRSS of the one gunicorn worker (archway serve, workers=1, TLS): {before / MB:.1f} MB "
        f"after its first admission, {after_real / MB:.1f} MB after {REAL_IMAGES} images resolved "
        f"from docker-registry by real admissions ({IMAGES_PER_POD} images per pod), "
        f"{after / MB:.1f} MB with {IMAGES:,} images ({ready.get('resolver_cache_entries')} cache "
        f"entries: each tag is cached under its tag and its digest)",
        f"the other {IMAGES - REAL_IMAGES:,} went through bench/apps/memory_worker.py's fill route, "
        f"{IMAGES_PER_POD} at a time: the worker's Resolver.resolve_many and "
        f"RegistryClient.resolve, with only the HTTP answer replayed (the real registry's "
        f"manifest of one image, annotated with each name: own body, own digest); "
        f"registry.cache.max_entries raised to {2 * IMAGES:,} so that none is evicted; "
        f"+{per_image:.0f} bytes of RSS per image for those",
    ], data={"plots": plot("memory-images", "one webhook worker's RSS against cached images "
                                            "(figure 9)", "images cached", "RSS (MB)", {
        "webhook worker": {"x": [1, REAL_IMAGES, IMAGES],
                           "y": [before / MB, after_real / MB, after / MB]}}, log_x=True)})]


def _admit(server: GunicornServer, images: list[str]) -> None:
    answer = server.post("/mutate", pod_review(images, uid=f"memory-{time.monotonic_ns()}"))
    if mutated_archs(answer) != {"amd64", "arm64", "arm"}:
        raise RuntimeError(f"pod with {len(images)} images not mutated: {answer.text[:300]}")
