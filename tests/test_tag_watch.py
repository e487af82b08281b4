"""Dropped architectures, against the real Debian registry: the resolver tells its observer when
a revalidation finds a tag moved (the one seam in the registry layer), and the leader's rounds
(gate/tagwatch.py) turn a move that drops an architecture into ArchitecturesDropped on each
workload using the tag, and remove learned exclusions whose evidence moved. On the real control
plane: the baseline is what the pods were admitted with, so a re-push before the first round or
before a new leader is caught."""
import threading
import time

import pytest
from prometheus_client import REGISTRY

from archway.cluster.pullsecrets import PullCredentials
from archway.cluster.workloadcache import workload_facts
from archway.config import CacheSettings, RegistrySettings, RemediationSettings
from archway.gate.tagwatch import TagWatch
from archway.placement.policy import Policy
from archway.registry.resolver import Resolver
from tests.infra.fixtures import plain_registry
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


def deployment(name, image, annotations=None, namespace="shop"):
    return {"kind": "Deployment", "metadata": {"name": name, "namespace": namespace,
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


# --- the baseline is what pods were admitted with, whatever this leader saw -----------------

def admin_api(control_plane):
    from archway.config import config_from_dict
    from archway.kubeapi import KubeApi
    from archway.kubeclient import build_api_client
    config = config_from_dict({"kubernetes": {"kubeconfig": control_plane.admin_kubeconfig}})
    return KubeApi(build_api_client(config.kubernetes)[0])


def admitted_pod(control_plane, namespace: str, image: str, digest: str) -> None:
    """A pod of the workload as archway's admission annotated it (archway.dev/images)."""
    import json
    control_plane.kube.create(f"/api/v1/namespaces/{namespace}/pods", {
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"generateName": "web-", "annotations": {
            "archway.dev/images": json.dumps([{"image": image, "digest": digest}])}},
        "spec": {"schedulerName": "nobody", "containers": [{"name": "c", "image": image}]}})


def leader(control_plane, registry, namespace: str, image: str, events: Events) -> TagWatch:
    """A new leader's tag watch: a resolver (and cache) of its own, as a new process has."""
    return TagWatch(api=admin_api(control_plane),
                    settings=RemediationSettings(learn_failed_architectures=False),
                    policy=Policy(), events=events,
                    workloads=Workloads(deployment("web", image, namespace=namespace)),
                    resolver=resolver_for(registry), pull_secrets=Secrets())


def alarms(events: Events) -> list:
    return [e for e in events.sent if e[3] == "ArchitecturesDropped"]


def test_a_tag_repushed_before_the_first_round_raises_the_alarm(plain_registry, control_plane):
    first = plain_registry.push_index("tw/early", "v1", ["linux/amd64", "linux/arm64"]).digest
    image = plain_registry.ref("tw/early", "v1")
    namespace = control_plane.new_namespace("tw-early")
    admitted_pod(control_plane, namespace, image, first)
    moved = plain_registry.push_image("tw/early", "v1", "linux/amd64")   # before any look
    events, before = Events(), dropped("arm64")
    tags = leader(control_plane, plain_registry, namespace, image, events)
    tags.review()
    (alarm,) = alarms(events)
    assert alarm[1] == "web" and first[:19] in alarm[4] and moved[:19] in alarm[4]
    assert "lacks arm64" in alarm[4] and dropped("arm64") == before + 1
    tags.review()                                          # one move, one alarm
    assert len(alarms(events)) == 1 and dropped("arm64") == before + 1


def test_a_new_leader_catches_a_repush_its_predecessor_never_saw(plain_registry, control_plane):
    first = plain_registry.push_index("tw/handover", "v1", ["linux/amd64", "linux/arm64"]).digest
    image = plain_registry.ref("tw/handover", "v1")
    namespace = control_plane.new_namespace("tw-handover")
    admitted_pod(control_plane, namespace, image, first)
    old_events = Events()
    leader(control_plane, plain_registry, namespace, image, old_events).review()
    assert alarms(old_events) == []                        # nothing moved while it led
    moved = plain_registry.push_image("tw/handover", "v1", "linux/amd64")
    events = Events()
    leader(control_plane, plain_registry, namespace, image, events).review()
    (alarm,) = alarms(events)
    assert alarm[1] == "web" and moved[:19] in alarm[4] and "lacks arm64" in alarm[4]
    # A pod admitted with the new digest, once the old pods are gone, is no alarm.
    for pod in control_plane.kube.items(f"/api/v1/namespaces/{namespace}/pods"):
        control_plane.kube.delete(f"/api/v1/namespaces/{namespace}/pods/"
                                  f"{pod['metadata']['name']}", gracePeriodSeconds=0)
    admitted_pod(control_plane, namespace, image, moved)
    calm = Events()
    leader(control_plane, plain_registry, namespace, image, calm).review()
    assert alarms(calm) == []


def test_a_repush_raises_one_alarm_whichever_leader_sees_it(plain_registry, control_plane):
    """Hardening round 6: every new leader raised ArchitecturesDropped again for the same
    re-push (13 Events for one). The Events in the API are the memory every leader shares."""
    from archway.cluster.events import EventSink
    first = plain_registry.push_index("tw/once", "v1", ["linux/amd64", "linux/arm64"]).digest
    image = plain_registry.ref("tw/once", "v1")
    namespace = control_plane.new_namespace("tw-once")
    admitted_pod(control_plane, namespace, image, first)
    moved = plain_registry.push_image("tw/once", "v1", "linux/amd64")

    def told() -> list[dict]:
        return [e for e in control_plane.kube.items(f"/api/v1/namespaces/{namespace}/events")
                if e.get("reason") == "ArchitecturesDropped"]
    for n in range(3):     # three leaders in turn, each a new process's own
        sink = EventSink(admin_api(control_plane), instance=f"leader-{n}")
        before = dropped("arm64")
        leader(control_plane, plain_registry, namespace, image, sink).review()
        sink.flush(10)
        if n == 0:
            assert dropped("arm64") == before + 1
            control_plane.kube.wait_for(told, timeout=10, what="the first leader's alarm listed")
        else:
            assert dropped("arm64") == before, n      # no second alarm, no second count
    (alarm,) = told()
    assert moved[:19] in alarm["message"] and "lacks arm64" in alarm["message"]
