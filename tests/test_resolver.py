"""The resolver: cache lifetimes, single-flight, one deadline for many images, per-credential
caching — against the real Debian registry, counted at the server."""
import dataclasses
import threading
import time

import pytest

from archway.config import CacheSettings, RegistrySettings
from archway.errors import AuthError, DeadlineExceeded, HostRefused, InvalidReference
from archway.registry.cache import AnswerCache, Entry
from archway.registry.credentials import Keyring
from archway.registry.model import ImageInfo
from archway.registry.resolver import Resolver
from lab.clock import ManualClock
from lab.servers.proxy import DelayProxy
from lab.tls import session_ca
from tests.infra.fixtures import LOOPBACK_HOSTS, basic_auth_registry, plain_registry
from tests.infra.gateway import RegistryGateway


def _entry(clock, name, ttl, stale=0.0, size=10):
    info = ImageInfo(name, frozenset(), None, "x")
    return Entry(info, clock.now + ttl, clock.now + ttl + stale, size)


def test_answer_cache_expires_and_evicts_least_recently_used():
    clock = ManualClock()
    cache = AnswerCache(max_entries=2, max_bytes=1000, clock=clock)
    cache.put("a", _entry(clock, "a", 10))
    cache.put("b", _entry(clock, "b", 100))
    assert cache.get("a").answer.image == "a"   # a is now the most recently used
    cache.put("c", _entry(clock, "c", 100))     # evicts b, the least recently used
    assert cache.get("b") is None and cache.get("c").answer.image == "c"
    clock.now += 11
    assert cache.get("a") is None               # expired, and no stale window
    assert cache.get("c").state(clock()) == "fresh"


def test_answer_cache_serves_stale_answers_until_their_window_ends_and_counts_bytes():
    clock = ManualClock()
    cache = AnswerCache(max_entries=10, max_bytes=25, clock=clock)
    cache.put("a", _entry(clock, "a", 10, stale=100))
    clock.now += 50
    assert cache.get("a").state(clock()) == "stale"
    clock.now += 61
    assert cache.get("a") is None
    cache.put("b", _entry(clock, "b", 10))
    cache.put("c", _entry(clock, "c", 10))
    assert cache.bytes == 20
    cache.put("d", _entry(clock, "d", 10))      # 30 bytes > 25: the oldest goes
    assert cache.get("b") is None and cache.bytes == 20 and len(cache) == 2


def settings_for(*insecure, **cache):
    return RegistrySettings(allow_hosts=LOOPBACK_HOSTS, insecure_hosts=tuple(insecure), timeout_seconds=2,
                            cache=CacheSettings(**cache) if cache else CacheSettings())


def test_concurrent_resolutions_of_one_uncached_image_make_one_manifest_request(plain_registry):
    plain_registry.push_index("sf/app", "v1", ["linux/amd64", "linux/arm64"])
    resolver = Resolver(settings_for(plain_registry.host))
    image = plain_registry.ref("sf/app", "v1")
    mark = plain_registry.mark()
    barrier = threading.Barrier(50)
    results = []

    def admit():
        barrier.wait()
        results.append(resolver.resolve(image, deadline=time.monotonic() + 10))

    threads = [threading.Thread(target=admit) for _ in range(50)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(results) == 50
    assert all(r.architectures == {"amd64", "arm64"} for r in results)
    assert len(plain_registry.manifest_gets(mark, "sf/app")) == 1


def test_cached_answers_make_no_request_and_tag_answers_expire(plain_registry):
    plain_registry.push_image("sf/single", "v1", "linux/arm64")
    clock = ManualClock()
    resolver = Resolver(settings_for(plain_registry.host, tag_ttl_seconds=60), clock=clock)
    image = plain_registry.ref("sf/single", "v1")
    first = resolver.resolve(image)
    mark = plain_registry.mark()
    again = resolver.resolve(image)
    by_digest = resolver.resolve(plain_registry.ref("sf/single", digest=first.digest))
    assert again == first and by_digest.architectures == {"arm64"}
    assert plain_registry.requests_since(mark) == []  # the digest form was cached by the tag lookup
    clock.now += 61
    resolver.resolve(image)
    assert len(plain_registry.manifest_gets(mark, "sf/single")) == 1
    # The digest entry lives longer than the tag's.
    mark = plain_registry.mark()
    resolver.resolve(plain_registry.ref("sf/single", digest=first.digest))
    assert plain_registry.requests_since(mark) == []


def test_failures_are_cached_briefly_then_retried(plain_registry):
    clock = ManualClock()
    resolver = Resolver(settings_for(plain_registry.host, negative_ttl_seconds=30), clock=clock)
    image = plain_registry.ref("sf/later", "v1")
    with pytest.raises(Exception) as first:
        resolver.resolve(image)
    mark = plain_registry.mark()
    with pytest.raises(type(first.value)):
        resolver.resolve(image)
    assert plain_registry.requests_since(mark) == []
    plain_registry.push_image("sf/later", "v1", "linux/s390x")
    clock.now += 31
    assert resolver.resolve(image).architectures == {"s390x"}


def test_resolve_many_answers_within_the_deadline_and_the_lookup_fills_the_cache(plain_registry):
    plain_registry.push_image("sf/slow", "v1", "linux/ppc64le")
    proxy = DelayProxy(plain_registry.port, delay=1.5)
    try:
        # The lookup's own bound well past the registry's delay: it ends with the answer.
        resolver = Resolver(dataclasses.replace(settings_for(proxy.host), timeout_seconds=10))
        slow, bad = f"{proxy.host}/sf/slow:v1", "Not A Reference"
        start = time.monotonic()
        results = resolver.resolve_many([slow, bad], timeout=0.3)
        elapsed = time.monotonic() - start
        assert elapsed < 1.2        # the deadline's, not the registry's 1.5 s (a busy 2-core machine)
        assert isinstance(results[slow], DeadlineExceeded)
        assert isinstance(results[bad], InvalidReference)
        # The lookup went on after the caller gave up; the next pod gets the answer from memory.
        deadline = time.monotonic() + 30
        while resolver.cache_size == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        connections = proxy.connections
        warm = resolver.resolve_many([slow], timeout=0.3)[slow]
        assert isinstance(warm, ImageInfo) and warm.architectures == {"ppc64le"}
        assert proxy.connections == connections     # answered from memory
    finally:
        proxy.stop()


def test_the_images_of_one_pod_are_looked_up_concurrently(plain_registry):
    """Every manifest request waits at the gateway until all five are in flight at once: a
    resolver that looked images up one after another would break the barrier."""
    for i in range(5):
        plain_registry.push_image(f"sf/five{i}", "v1", "linux/amd64")
    gateway = RegistryGateway(plain_registry.url)
    barrier = threading.Barrier(5, timeout=5)
    gateway.before_forward = lambda request: barrier.wait() if "/manifests/" in request.path else None
    try:
        resolver = Resolver(settings_for(gateway.host))
        results = resolver.resolve_many([f"{gateway.host}/sf/five{i}:v1" for i in range(5)],
                                        timeout=10)
        assert all(isinstance(r, ImageInfo) for r in results.values()), results
        assert not barrier.broken
    finally:
        gateway.stop()


def test_a_pods_images_are_looked_up_concurrently_by_a_resolver_that_has_idle_threads(
        plain_registry):
    """A resolver whose one lookup thread sat idle handed the whole burst to it: the pool
    counted that thread as available for every submit, woke it once and started no other, so a
    pod's five new images were looked up one after another (bench figure 5 at 5x, issue 21)."""
    for i in range(16):
        plain_registry.push_image(f"sf/idle{i}", "v1", "linux/amd64")
    gateway = RegistryGateway(plain_registry.url)
    try:
        resolver = Resolver(settings_for(gateway.host))
        first = f"{gateway.host}/sf/idle15:v1"
        assert isinstance(resolver.resolve_many([first], timeout=10)[first], ImageInfo)
        barrier = threading.Barrier(5, timeout=5)
        gateway.before_forward = lambda request: (barrier.wait() if "/manifests/" in request.path
                                                  else None)
        for burst in range(3):   # threads idle after each burst: each one is a new case
            barrier.reset()
            images = [f"{gateway.host}/sf/idle{5 * burst + i}:v1" for i in range(5)]
            results = resolver.resolve_many(images, timeout=10)
            assert all(isinstance(r, ImageInfo) for r in results.values()), results
            assert not barrier.broken
    finally:
        gateway.stop()


def test_failures_without_credentials_are_not_served_to_pods_with_them(basic_auth_registry):
    reg = basic_auth_registry
    reg.push_image("sf/private", "v1", "linux/arm64")
    resolver = Resolver(RegistrySettings(allow_hosts=LOOPBACK_HOSTS, ca_file=reg.ca.cert_path, timeout_seconds=2))
    image = reg.ref("sf/private", "v1")
    anonymous = resolver.resolve_many([image], timeout=5)[image]
    assert isinstance(anonymous, AuthError)
    keyring = Keyring.from_dockerconfigjson(reg.dockerconfigjson())
    with_secret = resolver.resolve_many([image], keyring=keyring, timeout=5)[image]
    assert isinstance(with_secret, ImageInfo) and with_secret.architectures == {"arm64"}
    # ...and the answer made with the secret is not handed to a pod without it.
    assert isinstance(resolver.resolve_many([image], timeout=5)[image], AuthError)


def test_refused_hosts_fail_fast_without_a_lookup():
    resolver = Resolver(RegistrySettings(deny_hosts=("blocked.example",)))
    results = resolver.resolve_many(["blocked.example/team/app:v1", "169.254.169.254/x/y:1"],
                                    timeout=5)
    assert all(isinstance(r, HostRefused) for r in results.values())


# --- registry kinds: one table keyed by scheme (issue 23) -----------------------------------------

def test_every_scheme_the_parser_reads_is_one_entry_of_the_kinds_table():
    from archway.registry.reference import KINDS, parse_reference, scheme_of
    for image, scheme in [("nginx", "docker"), ("docker://nginx", "docker"), ("oras://reg.example/a:1", "oras"),
                          ("library://alpine:3", "library"), ("https://h/x.sif", "https"),
                          ("http://h/x.sif", "http")]:
        ref = parse_reference(image)
        assert ref.scheme == scheme and scheme_of(image) == scheme
    assert scheme_of("ftp://h/x") == "invalid" and scheme_of("UPPER/Case") == "invalid"
    # Registry content is addressed by digest and read with pull secrets; SIF files are not.
    assert [s for s, kind in KINDS.items() if kind.head_digest] == ["docker", "oras"]
    assert [s for s, kind in KINDS.items() if kind.pull_secrets] == ["docker", "oras"]


def test_a_new_registry_kind_is_a_module_and_one_entry(monkeypatch, tmp_path):
    """A kind the code has never heard of (SIF files on this machine, `sif+file://`) registered
    in KINDS alone: parsed, resolved, cached, labelled, shown by `archway inspect`."""
    from archway.registry import imageref, inspect, reference, sif
    from tests.infra import sifbuild
    path = sifbuild.siftool_image(str(tmp_path), "tool.sif", "arm64")
    read = []

    def resolve_file(clients, ref, keyring, deadline):   # the new kind's module
        read.append(ref.url)
        found = sif.read_sif_platforms(sif.file_reader(ref.url.removeprefix("sif+file://")))
        return ImageInfo(str(ref), found.platforms, None, "sif-file", found.note)

    def file_syntax(scheme, rest, text, default_library_host):
        return imageref.ImageReference(scheme, "localhost", rest.lstrip("/"), url=text)

    monkeypatch.setitem(reference.KINDS, "sif+file",
                        reference.RegistryKind(file_syntax, resolve=resolve_file))
    image = f"sif+file://{path}"
    resolver = Resolver(RegistrySettings())
    assert resolver.resolve(image).architectures == {"arm64"}
    assert resolver.resolve(image).architectures == {"arm64"} and read == [image]   # cached
    assert reference.scheme_of(image) == "sif+file"
    assert inspect.pinned(image, "sha256:" + "a" * 64) is None   # no digest: nothing to pin


def test_a_pod_pulling_always_on_another_worker_is_checked_at_the_registry_not_told_the_shared_answer(
        plain_registry, tmp_path):
    """Two workers of one server share lookups (registry/sharedlookups.py). The tag is re-pushed
    after the first read it: a pod pulling Always, on the other worker, is answered from the
    registry (the shared answer is the one to check), with and without its own cached answer."""
    from archway.registry.sharedlookups import SharedLookups
    plain_registry.push_image("sf/always", "v1", "linux/amd64")
    image = plain_registry.ref("sf/always", "v1")

    def worker():
        return Resolver(settings_for(plain_registry.host), shared=SharedLookups(str(tmp_path)))
    first, second = worker(), worker()
    assert first.resolve(image, deadline=time.monotonic() + 10).architectures == {"amd64"}
    assert second.resolve(image, deadline=time.monotonic() + 10).architectures == {"amd64"}
    plain_registry.push_image("sf/always", "v1", "linux/arm64")
    for resolver in (worker(), second):     # no answer of its own; a cached one
        answer = resolver.resolve_many([image], timeout=10, revalidate=frozenset([image]))[image]
        assert answer.architectures == {"arm64"}
