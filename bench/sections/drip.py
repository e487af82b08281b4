"""Figure 16: a drip-feeding registry must not starve lookups of healthy registries.

The attack of issue 16: four pods name 40 images each on a registry that answers one byte a
second. Then 20 pods name a new image each on a healthy registry (a real docker-registry). Each
pod gets the admission deadline (3 s). Measured side by side in one run with the Resolver each
gunicorn worker builds: archway's per-host limit (registry.max_lookups_per_host, 8 of the 32
lookup threads) against no per-host limit (32: every thread may go to the drip host, as before).
"""
import time

from archway.config import RegistrySettings
from archway.registry.model import ImageInfo
from archway.registry.resolver import Resolver
from bench.common.lab import Lab
from bench.common.report import Figure
from bench.common.section import Started, measured
from bench.common.stats import percentile
from lab.servers.faults import DripServer
from lab.servers.registry import RegistryServer

DEADLINE = 3.0
DRIP_PODS, DRIP_IMAGES = 4, 40
HEALTHY_PODS = 20


SPEC = ("16", "healthy pods answered in time while a drip registry holds 160 lookups", "20 of 20")


def run(lab: Lab) -> list[Figure]:
    return measured([SPEC], lambda started: [_measure(lab, started)])


def _round(registry: RegistryServer, drip: DripServer, per_host: int, tag: str) -> tuple[int, list]:
    """(healthy pods answered, their latencies in ms) under the drip attack."""
    settings = RegistrySettings(insecure_hosts=(registry.host, drip.host), timeout_seconds=5,
                                max_lookups_per_host=per_host)
    resolver = Resolver(settings)
    for pod in range(DRIP_PODS):   # admitted at once (their lookups go on in the background)
        resolver.resolve_many([f"{drip.host}/drip/p{pod}-{tag}-{i}:v1" for i in range(DRIP_IMAGES)],
                              timeout=0)
    answered, latencies = 0, []
    for pod in range(HEALTHY_PODS):
        image = registry.ref(f"healthy/app{pod}-{tag}", "v1")
        start = time.monotonic()
        answer = resolver.resolve_many([image], timeout=DEADLINE)[image]
        latencies.append((time.monotonic() - start) * 1000)
        answered += isinstance(answer, ImageInfo)
    return answered, latencies


def _measure(lab: Lab, started: Started) -> Figure:
    number, name, target = SPEC
    registry = started(RegistryServer(lab.path("registry-drip")))
    drip = started(DripServer(phase="headers", interval=1.0))
    for tag in ("limited", "unlimited"):
        for pod in range(HEALTHY_PODS):
            registry.push_image(f"healthy/app{pod}-{tag}", "v1", "linux/arm64")
    limited, limited_ms = _round(registry, drip, 8, "limited")
    unlimited, unlimited_ms = _round(registry, drip, 32, "unlimited")
    return Figure(number, name, f"{limited} of {HEALTHY_PODS} (p99 {percentile(limited_ms, 99):.0f} ms) "
                              f"vs {unlimited} of {HEALTHY_PODS} without a per-host limit",
                  target, limited == HEALTHY_PODS, [
        f"{DRIP_PODS} pods x {DRIP_IMAGES} images on a server answering 1 byte/s (headers), then "
        f"{HEALTHY_PODS} pods with one new image each on a real docker-registry, each under a "
        f"{DEADLINE:g} s deadline; one worker's Resolver (32 lookup threads)",
        "side by side: registry.max_lookups_per_host 8 (the default) vs 32 (no per-host limit, "
        "as before issue 16)",
    ])
