"""Figures 10 and 11: what the cache costs a registry over a day, and what an expired tag costs
an admission.

Both run the Resolver each gunicorn worker builds, against a real docker-registry, counted in
its access log. Time moves on a test clock (a simulated day takes seconds); the registry's
latency is real: a DelayProxy adds REGISTRY_DELAY to every answer, so a revalidation in the
request path would show in figure 11.
"""
import time

from archway.config import CacheSettings, RegistrySettings
from archway.registry.model import ImageInfo
from archway.registry.resolver import Resolver
from bench.common.lab import Lab, resolve_ms
from bench.common.plots import plot
from bench.common.report import Figure
from bench.common.section import Started, measured
from bench.common.stats import percentile
from lab.clock import ManualClock
from lab.servers.proxy import DelayProxy
from lab.servers.registry import RegistryServer

TAG_TTL = 300.0                 # the default cache.tag_ttl_seconds
ADMISSION_EVERY = 60.0          # one pod with the tag per simulated minute
DAY = 24 * 3600.0
REGISTRY_DELAY = 0.2
TAGS = 200


class _RefetchingResolver(Resolver):
    """The same resolver without HEAD revalidation: an expired tag is fetched again (what
    archway did before), for the side-by-side count."""

    def _unmoved(self, ref, keyring, known, deadline):
        return None


GETS = ("10", "manifest GETs per tag per day, steady state (digest unchanged)", "0 after the first")
EXPIRED = ("11", "admission resolve p99, warm tag just past its TTL vs fresh",
           "= fresh p99 (no registry wait)")


def run(lab: Lab) -> list[Figure]:
    return [*measured([GETS], lambda started: [_gets_per_day(lab, started, *GETS)]),
            *measured([EXPIRED], lambda started: [_expired_tag_latency(lab, started, *EXPIRED)])]


def _settle(resolver: Resolver) -> None:
    end = time.monotonic() + 30
    while resolver.lookups_in_flight and time.monotonic() < end:
        time.sleep(0.002)


def _day_of_admissions(registry: RegistryServer, resolver_class, repo: str) -> tuple[int, int, list]:
    """(manifest GETs, HEADs, hourly) the registry served for one tag admitted every minute for
    a day; hourly: (hour, GETs so far, HEADs so far) at the end of each simulated hour."""
    clock = ManualClock()
    resolver = resolver_class(RegistrySettings(insecure_hosts=(registry.host,),
                                               cache=CacheSettings(tag_ttl_seconds=TAG_TTL)),
                              clock=clock)
    image = registry.ref(repo, "v1")
    mark = registry.mark()
    hourly = [(0.0, 0, 0)]
    per_hour = int(3600 / ADMISSION_EVERY)
    for i in range(int(DAY / ADMISSION_EVERY)):
        answer = resolver.resolve_many([image], timeout=5)[image]
        if not isinstance(answer, ImageInfo):
            raise RuntimeError(f"{image}: {answer}")
        _settle(resolver)
        clock.now += ADMISSION_EVERY
        if (i + 1) % per_hour == 0:
            hourly.append(((i + 1) / per_hour, *_gets_and_heads(registry, mark, repo)))
    return (*_gets_and_heads(registry, mark, repo), hourly)


def _gets_and_heads(registry: RegistryServer, mark, repo: str) -> tuple[int, int]:
    served = registry.manifest_gets(mark, repo)
    return (sum(1 for e in served if e.method == "GET"), sum(1 for e in served if e.method == "HEAD"))


def _day_plot(revalidated: list, refetched: list) -> dict:
    """Figure 10 over the day: manifest requests so far, hour by hour."""
    def column(rows, k):
        return {"x": [r[0] for r in rows], "y": [r[k] for r in rows]}
    return plot("registry-requests-per-image", "registry requests for one tag admitted every "
                f"minute, tag TTL {TAG_TTL:g} s (figure 10)", "simulated hours",
                "manifest requests so far", {
                    "GETs (archway: HEAD revalidation)": column(revalidated, 1),
                    "HEADs (archway)": column(revalidated, 2),
                    "GETs (refetching an expired tag)": column(refetched, 1)})


def _gets_per_day(lab: Lab, started: Started, number: str, name: str, target: str) -> Figure:
    registry = started(RegistryServer(lab.path("registry-day")))
    registry.push_index("day/revalidated", "v1", ["linux/amd64", "linux/arm64"])
    registry.push_index("day/refetched", "v1", ["linux/amd64", "linux/arm64"])
    gets, heads, hourly = _day_of_admissions(registry, Resolver, "day/revalidated")
    old_gets, old_heads, old_hourly = _day_of_admissions(registry, _RefetchingResolver,
                                                         "day/refetched")
    steady = gets - 1
    return Figure(number, name, f"{steady} (+1 first GET, {heads} HEADs) vs {old_gets} GETs "
                                f"refetching", target, steady == 0, [
        f"one tag admitted every {ADMISSION_EVERY:g} s of a simulated day, cache.tag_ttl_seconds "
        f"{TAG_TTL:g}, one worker's Resolver; requests from the real registry's access log",
        f"side by side, the same resolver fetching an expired tag again instead of a HEAD: "
        f"{old_gets} GETs, {old_heads} HEADs per day (Docker Hub counts each GET as a pull)",
    ], data={"plots": _day_plot(hourly, old_hourly)})


def _expired_tag_latency(lab: Lab, started: Started, number: str, name: str, target: str) -> Figure:
    registry = started(RegistryServer(lab.path("registry-expired")))
    proxy = started(DelayProxy(registry.port, delay=REGISTRY_DELAY))
    registry.push_index("expired/app", "base", ["linux/amd64", "linux/arm64"])
    tags = [f"t{i}" for i in range(TAGS)]
    for tag in tags:
        registry.push_index("expired/app", tag, ["linux/amd64", "linux/arm64"])
    clock = ManualClock()
    resolver = Resolver(RegistrySettings(insecure_hosts=(proxy.host,),
                                         cache=CacheSettings(tag_ttl_seconds=TAG_TTL)),
                        clock=clock)
    images = [f"{proxy.host}/expired/app:{tag}" for tag in tags]
    resolver.resolve_many(images, timeout=60)               # warm
    fresh = [resolve_ms(resolver, image) for image in images]
    clock.now += TAG_TTL + 1                                   # every tag just expired
    expired = [resolve_ms(resolver, image) for image in images]
    _settle(resolver)
    fresh_p99, expired_p99 = percentile(fresh, 99), percentile(expired, 99)
    ok = expired_p99 < REGISTRY_DELAY * 1000 / 4 and expired_p99 <= max(3 * fresh_p99, 1.0)
    return Figure(number, name, f"{expired_p99:.3f} ms vs {fresh_p99:.3f} ms "
                                f"(p50 {percentile(expired, 50):.3f} vs {percentile(fresh, 50):.3f})",
                  target, ok, [
        f"{TAGS} tags resolved in process (Resolver.resolve_many, the admission's call), first "
        f"fresh, then each just past its TTL; the registry answers {REGISTRY_DELAY * 1000:g} ms "
        f"late, so a revalidation in the request path would cost that much",
        "the expired answers are served at once; their HEADs run in the background",
    ])

