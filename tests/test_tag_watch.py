"""Dropped architectures, against the real Debian registry: the resolver tells its observer when
a revalidation finds a tag moved (the one seam in the registry layer), and the leader's rounds
(gate/tagwatch.py) turn a move that drops an architecture into ArchitecturesDropped on each
workload using the tag, and remove learned exclusions whose evidence moved."""
import threading
import time

import pytest
from prometheus_client import REGISTRY

from archway.config import CacheSettings, RegistrySettings, RemediationSettings
from archway.gate.tagwatch import TagWatch
from archway.registry.resolver import Resolver
from archway.webhook.policy import Policy
from archway.webhook.pullsecrets import PullCredentials
from archway.webhook.workloadcache import workload_facts
from tests.infra.registry import plain_registry
from tests.test_cache import settle

pytestmark = pytest.mark.slow


def resolver_for(registry) -> Resolver:
    return Resolver(RegistrySettings(insecure_hosts=(registry.host,), timeout_seconds=2,
                                     cache=CacheSettings(tag_ttl_seconds=60)))


def test_a_revalidation_that_finds_the_tag_moved_tells_the_observer(plain_registry):
    first = plain_registry.push_index("tw/app", "v1", ["linux/amd64", "linux/arm64"]).digest
    resolver = resolver_for(plain_registry)
    seen = []
    resolver.tag_moved = lambda ref, old, new: seen.append(
        (str(ref), old.digest, sorted(old.architectures), new.digest, sorted(new.architectures)))
    image = plain_registry.ref("tw/app", "v1")
    assert resolver.resolve(image).digest == first
    resolver.resolve_many([image], timeout=5, revalidate={image})   # the same digest: a HEAD
    settle(resolver)
    assert seen == []
    moved = plain_registry.push_image("tw/app", "v1", "linux/amd64")
    assert resolver.resolve_many([image], timeout=5, revalidate={image})[image].digest == moved
    settle(resolver)
    assert seen == [(image, first, ["amd64", "arm64"], moved, ["amd64"])]

    def broken(ref, old, new):
        raise RuntimeError("an observer's bug")
    resolver.tag_moved = broken
    again = plain_registry.push_index("tw/app", "v1", ["linux/amd64", "linux/arm64"]).digest
    answer = resolver.resolve_many([image], timeout=5, revalidate={image})[image]
    assert answer.digest == again and answer.architectures == {"amd64", "arm64"}


class Events:
    def __init__(self):
        self.sent = []

    def record(self, regarding, event_type, reason, action, note):
        self.sent.append((regarding["kind"], regarding["name"], event_type, reason, note))


class Secrets:
    def credentials_for(self, pod, deadline):
        from archway.registry.credentials import Keyring
        return PullCredentials(Keyring.empty())


class Workloads:
    """The leader's workload caches, holding these objects."""

    def __init__(self, *objects):
        self.facts = [workload_facts(o["kind"])(o) for o in objects]

    def wait_synced(self, timeout):
        return True

    def tops(self):
        return list(self.facts)

    def lookup(self, kind, namespace, name):
        return next((f for f in self.facts if (f.kind, f.object_name) == (kind, name)), None)


def deployment(name, image, annotations=None):
    return {"kind": "Deployment", "metadata": {"name": name, "namespace": "shop",
                                               "uid": f"uid-{name}",
                                               "annotations": annotations or {}},
            "spec": {"template": {"spec": {"containers": [{"name": "c", "image": image}]}}}}


def dropped(arch):
    return REGISTRY.get_sample_value("archway_image_architectures_dropped_total",
                                     {"architecture": arch}) or 0.0


def test_each_round_checks_the_tags_and_a_dropped_architecture_raises_the_alarm(plain_registry):
    first = plain_registry.push_index("tw/web", "v2", ["linux/amd64", "linux/arm64"]).digest
    plain_registry.push_image("tw/x", "1", "linux/amd64")
    image = plain_registry.ref("tw/web", "v2")
    objects = [deployment("web", image), deployment("api", image),
               deployment("other", plain_registry.ref("tw/x", "1")),
               deployment("pinned", plain_registry.ref("tw/web", digest=first))]
    events = Events()
    resolver = resolver_for(plain_registry)
    # Learning off: the rounds' resets (GET and PATCH of the workload) are the real apiserver's
    # part, in tests/e2e/test_remediation.py.
    tags = TagWatch(api=None, settings=RemediationSettings(
                               learn_failed_architectures=False), policy=Policy(),
                           events=events, workloads=Workloads(*objects),
                           resolver=resolver, pull_secrets=Secrets())
    resolver.tag_moved = tags.tag_moved
    tags.review()       # the first sight of each tag: nothing to compare with
    mark = plain_registry.mark()
    tags.review(threading.Event())
    settle(resolver)
    # One HEAD per tag and round; the digest reference is never checked (it cannot move).
    checked = [(e.method, e.path) for e in plain_registry.manifest_gets(mark)]
    assert sorted(checked) == [("HEAD", "/v2/tw/web/manifests/v2"),
                               ("HEAD", "/v2/tw/x/manifests/1")], checked
    assert events.sent == []

    before = dropped("arm64")
    moved = plain_registry.push_image("tw/web", "v2", "linux/amd64")
    tags.review()
    settle(resolver)
    alarms = [e for e in events.sent if e[3] == "ArchitecturesDropped"]
    assert sorted(e[1] for e in alarms) == ["api", "web"]       # each workload using the tag
    (_, _, kind, _, note) = alarms[0]
    assert kind == "Warning" and image in note and moved[:19] in note and first[:19] in note
    assert "lacks arm64" in note
    assert dropped("arm64") == before + 1                        # one move, one count
    # Moving back to a digest that has arm64 again drops nothing.
    plain_registry.push_index("tw/web", "v2", ["linux/amd64", "linux/arm64"])
    tags.review()
    settle(resolver)
    assert len(events.sent) == 2 and dropped("arm64") == before + 1


def test_a_round_paces_its_checks_per_registry_host(plain_registry):
    """As pre-warming does (registry.prewarm.requests_per_second): a cluster's thousand tags on
    one registry are not a thousand requests at once every round."""
    images = []
    for i in range(4):
        plain_registry.push_image(f"tw/paced{i}", "1", "linux/amd64")
        images.append(plain_registry.ref(f"tw/paced{i}", "1"))
    resolver = resolver_for(plain_registry)
    tags = TagWatch(api=None, settings=RemediationSettings(
                               learn_failed_architectures=False), policy=Policy(),
                           events=Events(), resolver=resolver,
                           workloads=Workloads(*[deployment(f"d{i}", image)
                                                 for i, image in enumerate(images)]),
                           pull_secrets=Secrets(), per_second=10.0)
    tags.review()                     # first sight: GETs
    settle(resolver)
    started = time.monotonic()
    tags.review()                     # 4 HEADs, 0.1 s apart
    assert time.monotonic() - started >= 0.3
    settle(resolver)


def test_with_watch_tags_off_the_rounds_ask_no_registry(plain_registry):
    plain_registry.push_index("tw/quiet", "v1", ["linux/amd64"])
    resolver = resolver_for(plain_registry)
    tags = TagWatch(api=None, settings=RemediationSettings(watch_tags=False),
                           policy=Policy(), events=Events(),
                           workloads=Workloads(deployment("q", plain_registry.ref("tw/quiet",
                                                                                  "v1"))),
                           resolver=resolver, pull_secrets=Secrets())
    mark = plain_registry.mark()
    tags.review()
    assert plain_registry.requests_since(mark) == [] and tags.rounds == 1
