"""Figures 35a-35d: the cluster's image records (docs/image-records.md), side by side with
archway without them, on a real kube-apiserver (the CRDs the chart installs) and a real
docker-registry counted in its access log.

Each "replica" is what one archway serve process resolves with: a Resolver (its workers share
lookups, so one per replica is what the registry sees), with or without the record store
(objects/imagerecords.py: one list + watch, the background writer) on its own API client.
"""
import gc
import subprocess
import time
import tracemalloc
from concurrent.futures import ThreadPoolExecutor

import yaml

from archway import metrics
from archway.config import CacheSettings, KubernetesSettings, RegistrySettings
from archway.kubeclient import build_api_client
from archway.objects.imagerecords import ImageRecords
from archway.objects.records import record_object
from archway.registry.model import ImageInfo
from archway.registry.platforms import parse_platform
from archway.registry.records import CLUSTER, ImageRecord
from archway.registry.resolver import Resolver
from bench.common.lab import Lab, push_index_variants, resolve_ms
from bench.common.report import Figure
from bench.common.section import Started, measured
from bench.common.stats import percentile
from lab.cluster.controlplane import ControlPlane
from lab.servers.registry import RegistryServer

IMAGES = 1000
RECORDS = 10_000
REPLICAS = 2
LATENCY_SAMPLES = 2000
CRDS = ("clusterimagerecords", "imagerecords")
SPECS = (("35a", f"registry requests per archway rollout ({REPLICAS} replicas), {IMAGES:,} images "
                 f"the cluster runs: with records vs without", "0 with records"),
         ("35b", f"apiserver writes per new image, {REPLICAS} replicas reading it at once",
          "<= 1"),
         ("35c", f"memory per record per worker ({RECORDS:,} records listed)", "<= 2 KiB"),
         ("35d", f"admission resolve p99 with {RECORDS:,} records vs none",
          "+ <= 0.5 ms warm; first answer from a record <= 2 ms"))


def run(lab: Lab) -> list[Figure]:
    def measure(started: Started) -> list[Figure]:
        registry = started(RegistryServer(lab.path("records-registry")))
        tags = push_index_variants(registry, "records/app", IMAGES)
        images = [registry.ref("records/app", tag) for tag in tags]
        plane = started(ControlPlane(lab.path("records-control-plane"), nodes=(), audit=False))
        plane.start()
        _install_crds(plane)
        client, _ = build_api_client(KubernetesSettings(kubeconfig=plane.admin_kubeconfig))
        settings = RegistrySettings(insecure_hosts=(registry.host,), timeout_seconds=5,
                                    cache=CacheSettings())
        rollout, writes = _rollout(registry, client, settings, images)
        return [rollout, writes, _memory(plane, client), _latency(client, settings, images)]
    return measured(SPECS, measure)


def _install_crds(plane: ControlPlane) -> None:
    for plural in CRDS:
        text = subprocess.run(["helm", "template", "bench", "charts/archway", "--show-only",
                               f"templates/crds/{plural}.yaml"], check=True, capture_output=True,
                              text=True).stdout
        plane.kube.create("/apis/apiextensions.k8s.io/v1/customresourcedefinitions",
                          yaml.safe_load(text))
    plane.kube.wait_for(lambda: all(_served(plane, p) for p in CRDS), timeout=60,
                        what="the image record CRDs to be served")


def _served(plane: ControlPlane, plural: str) -> bool:
    try:
        plane.kube.items(f"/apis/archway.dev/v1alpha1/{plural}")
        return True
    except Exception:
        return False


def _replica(client, settings, records: bool = True) -> Resolver:
    resolver = Resolver(settings)
    if records:
        store = ImageRecords.build(lambda: client, refresh_seconds=150, max_pending=IMAGES * 2)
        store.serve(resolver).start(120)
    return resolver


def _stop(resolvers) -> None:
    """Their watches and writers: a process that ended (its watch would otherwise go on
    copying its records at each event of the next figures)."""
    for resolver in resolvers:
        if resolver.records is not None:
            resolver.records.stop()


def _resolve_all(resolver: Resolver, images: list[str]) -> None:
    answers = resolver.resolve_many(images, timeout=120)
    bad = [image for image, answer in answers.items() if not isinstance(answer, ImageInfo)]
    if bad:
        raise RuntimeError(f"{len(bad)} images unresolved, e.g. {bad[0]}: {answers[bad[0]]}")


def _writes() -> dict[str, float]:
    return {sample.labels["result"]: sample.value
            for family in metrics.IMAGE_RECORD_WRITES.collect() for sample in family.samples
            if sample.name.endswith("_total")}


def _rollout(registry, client, settings, images) -> tuple[Figure, Figure]:
    # Without records: every new replica reads every image.
    mark = registry.mark()
    for _ in range(REPLICAS):
        _resolve_all(Resolver(settings), images)
    without = len(registry.requests_since(mark))
    # With records: the cluster learns the images once, REPLICAS processes at once...
    before = _writes()
    learners = [_replica(client, settings) for _ in range(REPLICAS)]
    with ThreadPoolExecutor(REPLICAS) as pool:
        list(pool.map(lambda r: _resolve_all(r, images), learners))
    _wait_written(learners, len(images))
    after = _writes()
    made = {k: after.get(k, 0) - before.get(k, 0) for k in after}
    # ...then an archway rollout: REPLICAS new processes, warm from the records.
    mark = registry.mark()
    rollout = [_replica(client, settings) for _ in range(REPLICAS)]
    for resolver in rollout:
        _resolve_all(resolver, images)
    with_records = len(registry.requests_since(mark))
    _stop(learners + rollout)
    requests = Figure("35a", SPECS[0][1], f"{with_records} vs {without} without records",
                      SPECS[0][2], with_records == 0, [
        f"{IMAGES:,} distinct multi-platform images (OCI indexes) in the real registry; a rollout "
        f"= {REPLICAS} new processes each resolving every image, as pre-warming does; requests "
        f"from the registry's access log (manifest GETs; no blob for an index)"])
    attempts = made.get("created", 0) + made.get("updated", 0) + made.get("exists", 0)
    per_image = (made.get("created", 0) + made.get("updated", 0)) / len(images)
    writes = Figure("35b", SPECS[1][1], f"{per_image:.2f} ({attempts / len(images):.2f} write "
                    f"requests, a 409 included)", SPECS[1][2], per_image <= 1.0, [
        f"{REPLICAS} processes with the record store resolving the same {IMAGES:,} new images at "
        f"once; archway_image_record_writes_total by result: {made}"])
    return requests, writes


def _wait_written(resolvers, count: int) -> None:
    end = time.monotonic() + 120
    while time.monotonic() < end:
        stores = [r.records for r in resolvers]
        if all(s.writer.pending == 0 and len(s.cluster.items) >= count for s in stores):
            return
        time.sleep(0.2)
    raise RuntimeError("the records were not all written and watched within 120 s")


def _memory(plane: ControlPlane, client) -> Figure:
    existing = len(plane.kube.items("/apis/archway.dev/v1alpha1/clusterimagerecords"))
    now = time.time()

    def create(i: int) -> None:
        reference = f"registry.example/bench/img{i}:v1"
        info = ImageInfo(reference, frozenset({parse_platform("linux/amd64"),
                                               parse_platform("linux/arm64")}),
                         f"sha256:{i:064x}", "oci-index")
        plane.kube.create("/apis/archway.dev/v1alpha1/clusterimagerecords",
                          record_object(ImageRecord(CLUSTER, reference, info, now, now)))
    began = time.monotonic()
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(create, range(RECORDS - existing)))
    created_in = time.monotonic() - began
    gc.collect()
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    store = ImageRecords.build(lambda: client, refresh_seconds=150, max_pending=10)
    store.start(120)
    count = len(store.cluster.items)
    gc.collect()
    held = tracemalloc.get_traced_memory()[0] - base
    tracemalloc.stop()
    store.stop()
    per_record = held / max(count, 1)
    return Figure("35c", SPECS[2][1], f"{per_record / 1024:.2f} KiB ({held / 2 ** 20:.1f} MiB for "
                  f"{count:,})", SPECS[2][2], per_record <= 2048 and count >= RECORDS, [
        "Python heap held by one process's record watches after their first list (tracemalloc), "
        f"each record 2 platforms; {RECORDS - existing:,} records created in {created_in:.0f} s "
        "(8 threads, admin client)"])


def _latency(client, settings, images) -> Figure:
    sample = images[:200]
    none = Resolver(settings)
    _resolve_all(none, sample)
    recorded = _replica(client, settings)
    try:
        first = [resolve_ms(recorded, image) for image in sample]     # answered from the record
        without = [resolve_ms(none, images[i % len(sample)]) for i in range(LATENCY_SAMPLES)]
        warm = [resolve_ms(recorded, images[i % len(sample)]) for i in range(LATENCY_SAMPLES)]
    finally:
        _stop([recorded])
    p99_none, p99_warm, p99_first = (percentile(s, 99) for s in (without, warm, first))
    return Figure("35d", SPECS[3][1], f"{p99_warm:.3f} ms vs {p99_none:.3f} ms (first answer "
                  f"from a record: p99 {p99_first:.3f} ms, p50 {percentile(first, 50):.3f} ms)",
                  SPECS[3][2], p99_warm <= p99_none + 0.5 and p99_first <= 2.0, [
        f"Resolver.resolve_many of one image (the admission's call) over {len(sample)} images, "
        f"{LATENCY_SAMPLES} calls: a process with {RECORDS:,} records listed vs one without "
        "records, both warm; and a new process's first answer of each image, from its record "
        "(a registry read instead: milliseconds to seconds)"])

