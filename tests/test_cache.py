"""A registry-friendly, outage-proof cache, against the real docker-registry.

The registry sits behind a switchable gateway (tests/infra/gateway.py) that can answer 503 or
429 instead of forwarding; every request that gets through is counted in the real registry's
access log. Cache ages move on a test clock: nothing here sleeps through a TTL.
"""
import time

import pytest
from prometheus_client import REGISTRY

from archway.config import CacheSettings, RegistrySettings
from archway.errors import ArchwayError, NotFound, Overloaded, RateLimited
from archway.registry.model import ImageInfo
from archway.registry.resolver import Resolver
from lab.clock import ManualClock
from lab.procs import wait_until
from lab.servers.faults import BlackHole
from tests.infra.fixtures import plain_registry
from tests.infra.gateway import RegistryGateway

# Starts real servers (registries, archway serve, helm...): outside the fast inner loop.
pytestmark = pytest.mark.slow

TTL = 60.0


@pytest.fixture
def gateway(plain_registry):
    gateway = RegistryGateway(plain_registry.url)
    yield gateway
    gateway.stop()


def resolver_for(*hosts, clock, **cache):
    cache.setdefault("tag_ttl_seconds", TTL)
    settings = RegistrySettings(insecure_hosts=hosts, timeout_seconds=2,
                                cache=CacheSettings(**cache))
    return Resolver(settings, clock=clock)


def settle(resolver):
    """Wait for background revalidations to end (they run on the resolver's threads)."""
    assert wait_until(lambda: resolver.lookups_in_flight == 0)


def manifest_requests(registry, mark, repo):
    return [e.method for e in registry.manifest_gets(mark, repo)]


def lookups(result):
    return REGISTRY.get_sample_value("archway_cache_lookups_total", {"result": result}) or 0.0


def revalidations(outcome):
    return REGISTRY.get_sample_value("archway_cache_revalidations_total",
                                     {"outcome": outcome}) or 0.0


def test_an_unchanged_tag_costs_one_get_then_heads_only(plain_registry, gateway):
    plain_registry.push_index("cache/steady", "v1", ["linux/amd64", "linux/arm64"])
    clock = ManualClock()
    resolver = resolver_for(gateway.host, clock=clock)
    image = f"{gateway.host}/cache/steady:v1"
    mark = plain_registry.mark()
    unchanged = revalidations("unchanged")
    for _ in range(6):
        info = resolver.resolve(image, deadline=time.monotonic() + 10)
        assert info.architectures == {"amd64", "arm64"}
        settle(resolver)
        clock.now += TTL + 1
    # Six TTL windows: the first costs the GET, each later one a HEAD (Docker Hub: free).
    assert manifest_requests(plain_registry, mark, "cache/steady") == ["GET"] + ["HEAD"] * 5
    assert revalidations("unchanged") == unchanged + 5


def test_a_repushed_tag_is_seen_after_its_ttl_with_one_get(plain_registry, gateway):
    plain_registry.push_image("cache/moved", "v1", "linux/amd64")
    clock = ManualClock()
    resolver = resolver_for(gateway.host, clock=clock)
    image = f"{gateway.host}/cache/moved:v1"
    assert resolver.resolve(image).architectures == {"amd64"}
    plain_registry.push_image("cache/moved", "v1", "linux/arm64")
    clock.now += TTL + 1
    mark = plain_registry.mark()
    # Stale-while-revalidate: this answer is the old one, served at once...
    assert resolver.resolve(image).architectures == {"amd64"}
    settle(resolver)
    # ...and the background check found the new digest and fetched it: one HEAD, one GET.
    assert resolver.resolve(image).architectures == {"arm64"}
    assert manifest_requests(plain_registry, mark, "cache/moved") == ["HEAD", "GET"]


def test_a_tag_moved_back_to_known_content_costs_no_get(plain_registry, gateway):
    first = plain_registry.push_image("cache/back", "v1", "linux/s390x")
    clock = ManualClock()
    resolver = resolver_for(gateway.host, clock=clock)
    image = f"{gateway.host}/cache/back:v1"
    resolver.resolve(image)
    plain_registry.push_image("cache/back", "v1", "linux/ppc64le")
    clock.now += TTL + 1
    resolver.resolve(image)
    settle(resolver)
    assert resolver.resolve(image).architectures == {"ppc64le"}
    plain_registry.push_manifest("cache/back", "v1", plain_registry.get_manifest(
        "cache/back", first).content, "application/vnd.oci.image.manifest.v1+json")
    clock.now += TTL + 1
    mark = plain_registry.mark()
    resolver.resolve(image)
    settle(resolver)
    assert resolver.resolve(image).architectures == {"s390x"}
    assert manifest_requests(plain_registry, mark, "cache/back") == ["HEAD"]


def test_an_outage_is_served_the_last_known_answer_until_stale_if_error_ends(plain_registry,
                                                                               gateway):
    plain_registry.push_image("cache/outage", "v1", "linux/arm64")
    clock = ManualClock()
    resolver = resolver_for(gateway.host, clock=clock, stale_if_error_seconds=3600,
                            negative_ttl_seconds=30)
    image = f"{gateway.host}/cache/outage:v1"
    assert resolver.resolve(image).architectures == {"arm64"}
    gateway.mode = "down"
    failed = revalidations("registry_error")
    for _ in range(3):
        clock.now += TTL + 31
        answer = resolver.resolve_many([image], timeout=5)[image]
        assert isinstance(answer, ImageInfo) and answer.architectures == {"arm64"}
        settle(resolver)
    assert revalidations("registry_error") == failed + 3
    assert len(gateway.refused) == 3     # one check per negative TTL, not one per pod
    # A pod pulling Always waits for the check (it fails) and still gets the known answer.
    clock.now += 31
    answer = resolver.resolve_many([image], timeout=5, revalidate={image})[image]
    assert isinstance(answer, ImageInfo) and answer.architectures == {"arm64"}
    # Past stale_if_error the answer is no longer vouched for: the pod is not placed from it.
    clock.now += 3600
    settle(resolver)
    answer = resolver.resolve_many([image], timeout=5)[image]
    assert isinstance(answer, ArchwayError) and not isinstance(answer, ImageInfo)


def test_an_image_never_seen_during_an_outage_fails(plain_registry, gateway):
    plain_registry.push_image("cache/never", "v1", "linux/arm64")
    resolver = resolver_for(gateway.host, clock=ManualClock())
    gateway.mode = "down"
    image = f"{gateway.host}/cache/never:v1"
    assert isinstance(resolver.resolve_many([image], timeout=5)[image], ArchwayError)


def test_a_429_backs_the_host_off_until_retry_after_and_the_cache_answers(plain_registry,
                                                                          gateway):
    plain_registry.push_image("cache/limited", "v1", "linux/amd64")
    plain_registry.push_image("cache/limited-new", "v1", "linux/amd64")
    clock = ManualClock()
    resolver = resolver_for(gateway.host, clock=clock)
    known = f"{gateway.host}/cache/limited:v1"
    new = f"{gateway.host}/cache/limited-new:v1"
    resolver.resolve(known)
    gateway.mode, gateway.retry_after = "rate_limited", "120"
    clock.now += TTL + 1
    assert resolver.resolve(known).architectures == {"amd64"}   # stale, check started
    settle(resolver)
    assert len(gateway.refused) == 1 and resolver.hosts_backed_off() == 1
    # Until Retry-After has passed, nothing is sent: known images come from the cache, new ones
    # fail at once and say why.
    for _ in range(3):
        clock.now += 30
        assert resolver.resolve(known).architectures == {"amd64"}
        answer = resolver.resolve_many([new], timeout=5)[new]
        assert isinstance(answer, RateLimited) and "429" in str(answer)
        settle(resolver)
    assert len(gateway.refused) == 1
    gateway.mode = "pass"
    clock.now += 31                                               # 121 s after the 429
    resolver.resolve(known)
    settle(resolver)
    assert resolver.hosts_backed_off() == 0
    assert resolver.resolve(new, deadline=time.monotonic() + 10).architectures == {"amd64"}


def test_a_retry_after_past_an_hour_pauses_the_host_and_its_cached_answers_checks_an_hour(
        plain_registry, gateway):
    """One cap for every wait a 429 asks for (issue 23): a Retry-After of 10 h once paused the
    host for an hour but the checks of its cached answers for 10 h."""
    plain_registry.push_image("cache/capped", "v1", "linux/amd64")
    clock = ManualClock()
    resolver = resolver_for(gateway.host, clock=clock)
    known = f"{gateway.host}/cache/capped:v1"
    resolver.resolve(known)
    gateway.mode, gateway.retry_after = "rate_limited", "36000"
    clock.now += TTL + 1
    assert resolver.resolve(known).architectures == {"amd64"}   # stale: its check meets the 429
    settle(resolver)
    assert len(gateway.refused) == 1
    gateway.mode = "pass"
    clock.now += 3601
    before = revalidations("unchanged")
    assert resolver.resolve(known).architectures == {"amd64"}   # an hour on: checked again
    settle(resolver)
    assert revalidations("unchanged") == before + 1 and resolver.hosts_backed_off() == 0


def test_a_429_holds_for_every_spelling_of_the_host(plain_registry, gateway):
    """Host names are case-insensitive (issue 21, item 6): after a 429 with Retry-After 600, 40
    spellings of the host (LOCALHOST:PORT, ...) sent 40 requests. One host: one back-off, one
    metric label, one cache entry, one credential."""
    import itertools

    from archway.registry.credentials import Credential, Keyring
    plain_registry.push_image("cache/cased", "v1", "linux/amd64")
    port = gateway.host.rsplit(":", 1)[1]
    host = f"localhost:{port}"
    resolver = resolver_for(host, clock=ManualClock())
    image = f"{host}/cache/cased:v1"
    assert resolver.resolve(image).architectures == {"amd64"}
    spellings = ["".join(letters) for letters in itertools.islice(
        itertools.product(*((c.upper(), c) for c in "localhost")), 40)]
    assert len(set(spellings)) == 40 and spellings[0] == "LOCALHOST"
    before = len(gateway.requests)
    for spelled in spellings:   # one cache entry: every spelling is answered from it
        answer = resolver.resolve_many([f"{spelled}:{port}/cache/cased:v1"], timeout=5)
        assert answer[f"{spelled}:{port}/cache/cased:v1"].architectures == {"amd64"}
    assert len(gateway.requests) == before
    gateway.mode, gateway.retry_after = "rate_limited", "600"
    new = resolver.resolve_many([f"{host}/cache/cased:new"], timeout=5)[f"{host}/cache/cased:new"]
    assert isinstance(new, RateLimited) and len(gateway.refused) == 1
    for spelled in spellings:
        answer = resolver.resolve_many([f"{spelled}:{port}/cache/cased:other"], timeout=5)
        assert isinstance(answer[f"{spelled}:{port}/cache/cased:other"], RateLimited)
    assert len(gateway.refused) == 1 and resolver.hosts_backed_off() == 1
    labels = [s.labels["host"] for m in REGISTRY.collect() if m.name ==
              "archway_registry_backoff_until_timestamp_seconds" for s in m.samples
              if s.labels["host"].lower() == host]
    assert labels == [host]
    # A pull secret filed under any spelling is the image's, whatever spelling the pod uses.
    keyring = Keyring([Credential(f"LocalHost:{port}", "user", "secret")])
    assert [c.username for c in keyring.candidates(f"localhost:{port}/cache/cased")] == ["user"]
    from archway.registry.access import image_name
    from archway.registry.reference import parse_reference
    assert image_name(parse_reference(f"LOCALHOST:{port}/cache/cased:v1")) == f"{host}/cache/cased"


def test_without_retry_after_the_pause_grows(plain_registry, gateway):
    plain_registry.push_image("cache/grow", "v1", "linux/amd64")
    clock = ManualClock()
    resolver = resolver_for(gateway.host, clock=clock, negative_ttl_seconds=0.5)
    image = f"{gateway.host}/cache/grow:v1"
    gateway.mode = "rate_limited"
    sent = []
    for _ in range(4):
        resolver.resolve_many([image], timeout=5)
        settle(resolver)
        sent.append(len(gateway.refused))
        clock.now += 1.5   # past the first pause (1 s), not past the second (2 s)
    assert sent == [1, 2, 2, 3]


def test_pull_policy_always_costs_one_head(plain_registry, gateway):
    plain_registry.push_image("cache/always", "v1", "linux/arm64")
    resolver = resolver_for(gateway.host, clock=ManualClock())
    image = f"{gateway.host}/cache/always:v1"
    resolver.resolve(image)
    mark = plain_registry.mark()
    answer = resolver.resolve_many([image], timeout=5, revalidate={image})[image]
    assert answer.architectures == {"arm64"}
    assert manifest_requests(plain_registry, mark, "cache/always") == ["HEAD"]
    # The same tag re-pushed: the Always pod sees the new content at once, not after the TTL.
    plain_registry.push_image("cache/always", "v1", "linux/riscv64")
    answer = resolver.resolve_many([image], timeout=5, revalidate={image})[image]
    assert answer.architectures == {"riscv64"}


def test_cached_failures_are_copies_that_never_grow_a_traceback():
    hole = BlackHole()
    try:
        image = f"{hole.host}/x/y:1"
        resolver = Resolver(RegistrySettings(insecure_hosts=(hole.host,), timeout_seconds=0.3))
        errors = []
        for _ in range(5):
            with pytest.raises(ArchwayError) as caught:
                resolver.resolve(image, deadline=time.monotonic() + 5)
            errors.append(caught.value)
        depths = [len(list(_frames(e.__traceback__))) for e in errors]
        assert len(set(depths)) == 1, depths
        assert len({id(e) for e in errors}) == 5   # each caller its own exception object
    finally:
        hole.stop()


def _frames(tb):
    while tb is not None:
        yield tb
        tb = tb.tb_next


def test_a_hung_host_cannot_starve_lookups_of_other_hosts(plain_registry):
    plain_registry.push_image("cache/healthy", "v1", "linux/amd64")
    hole = BlackHole()
    try:
        settings = RegistrySettings(insecure_hosts=(hole.host, plain_registry.host),
                                    timeout_seconds=5, max_lookups_per_host=4)
        resolver = Resolver(settings, max_workers=8)
        # A pod naming 40 images on a host that never answers...
        flood = [f"{hole.host}/flood/image{i}:v1" for i in range(40)]
        answers = resolver.resolve_many(flood, timeout=0.2)
        assert all(isinstance(a, ArchwayError) for a in answers.values())
        # ...holds 4 lookup threads at most, so the next pod's healthy image is answered.
        healthy = plain_registry.ref("cache/healthy", "v1")
        answer = resolver.resolve_many([healthy], timeout=3)[healthy]
        assert isinstance(answer, ImageInfo), answer
        assert hole.accepted <= 4
    finally:
        hole.stop()


def test_one_pod_resolves_at_most_its_limit_and_the_queue_is_bounded():
    hole = BlackHole()
    # The hole named, or archway's host policy refuses loopback at once and nothing queues.
    resolver = Resolver(RegistrySettings(max_queued_lookups=3, max_lookups_per_host=1,
                                         insecure_hosts=(hole.host,)), max_workers=1)
    try:
        images = [f"{hole.host}/q/image{i}:v1" for i in range(10)]
        answers = resolver.resolve_many(images, timeout=0.1, limit=6)
        over_limit = [image for image, a in answers.items() if isinstance(a, Overloaded)
                      and "at most 6" in str(a)]
        assert over_limit == images[6:]
        # 6 submitted to 1 thread and a queue of 3: 2 refused at once (3 when the thread had
        # not yet taken the first lookup off the queue).
        queue_full = [a for a in answers.values() if isinstance(a, Overloaded)
                      and "already waiting" in str(a)]
        assert len(queue_full) in (2, 3)
    finally:
        hole.stop()


def test_the_cache_is_bounded_in_bytes(plain_registry):
    for i in range(6):
        plain_registry.push_image(f"cache/bytes{i}", "v1", "linux/amd64")
    resolver = Resolver(RegistrySettings(insecure_hosts=(plain_registry.host,),
                                         cache=CacheSettings(max_bytes=3000)))
    for i in range(6):
        resolver.resolve(plain_registry.ref(f"cache/bytes{i}", "v1"))
    assert 0 < resolver.cache_bytes <= 3000
    assert resolver.cache_size < 12      # 6 images by tag and by digest would be 12 entries


def test_a_missing_image_is_a_cached_failure_then_found(plain_registry, gateway):
    clock = ManualClock()
    resolver = resolver_for(gateway.host, clock=clock, negative_ttl_seconds=30)
    image = f"{gateway.host}/cache/later:v1"
    assert isinstance(resolver.resolve_many([image], timeout=5)[image], NotFound)
    count = len(gateway.requests)
    assert isinstance(resolver.resolve_many([image], timeout=5)[image], NotFound)
    assert len(gateway.requests) == count
    plain_registry.push_image("cache/later", "v1", "linux/amd64")
    clock.now += 31
    assert resolver.resolve(image).architectures == {"amd64"}


def test_a_stuck_lookup_is_not_joined_forever(plain_registry, monkeypatch):
    """Fault injection: the first lookup blocks past every socket bound (as a hung name lookup
    does); once it has run twice its budget, the next caller starts its own."""
    import threading
    plain_registry.push_image("cache/stuck", "v1", "linux/arm64")
    resolver = Resolver(RegistrySettings(insecure_hosts=(plain_registry.host,), timeout_seconds=0.1))
    release, real_lookup, calls = threading.Event(), resolver._lookup, []

    def lookup(ref, keyring, deadline):
        calls.append(ref)
        if len(calls) == 1:
            release.wait(30)
        return real_lookup(ref, keyring, time.monotonic() + 5)

    monkeypatch.setattr(resolver, "_lookup", lookup)
    image = plain_registry.ref("cache/stuck", "v1")
    try:
        assert isinstance(resolver.resolve_many([image], timeout=0.1)[image], ArchwayError)
        assert isinstance(resolver.resolve_many([image], timeout=0.1)[image], ArchwayError)
        assert len(calls) == 1                       # joined while young
        time.sleep(resolver.fetch_timeout * 2)       # the first lookup is now presumed stuck
        answer = resolver.resolve_many([image], timeout=5)[image]
        assert isinstance(answer, ImageInfo) and answer.architectures == {"arm64"}
        assert len(calls) == 2
    finally:
        release.set()


def test_a_full_lookup_queue_still_serves_known_answers(plain_registry):
    plain_registry.push_image("cache/known", "v1", "linux/arm64")
    hole = BlackHole()
    clock = ManualClock()
    try:
        resolver = Resolver(RegistrySettings(
            insecure_hosts=(plain_registry.host, hole.host), timeout_seconds=2,
            max_queued_lookups=2, max_lookups_per_host=1,
            cache=CacheSettings(tag_ttl_seconds=TTL)), max_workers=1, clock=clock)
        known = plain_registry.ref("cache/known", "v1")
        resolver.resolve(known, deadline=time.monotonic() + 10)
        # A pod naming images on a host that never answers takes the thread and fills the queue.
        flood = resolver.resolve_many([f"{hole.host}/q/image{i}:v1" for i in range(4)], timeout=0)
        assert any(isinstance(a, Overloaded) for a in flood.values())
        clock.now += TTL + 1
        answer = resolver.resolve_many([known], timeout=1)[known]
        assert isinstance(answer, ImageInfo) and answer.architectures == {"arm64"}
    finally:
        hole.stop()
