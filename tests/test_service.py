"""The admission service without HTTP: parse -> skip -> resolve -> decide -> reply.

The resolver and the pull-secret reader are stand-ins recording what they were asked, and the
clock is a counter: these tests do no I/O and take milliseconds.
"""
import base64
import dataclasses
import json

import jsonpatch
import pytest

from archway.cluster.caches import ClusterCaches
from archway.cluster.pullsecrets import PullCredentials
from archway.errors import DeadlineExceeded, NotFound
from archway.placement.policy import Policy
from archway.podview import PodView
from archway.registry.credentials import Keyring
from archway.registry.model import ImageInfo
from archway.registry.platforms import parse_platform
from archway.webhook.admission import MAX_WARNINGS
from archway.webhook.service import (
    ANSWER_MARGIN_SECONDS,
    PULL_SECRETS_SHARE,
    AdmissionService,
    AdmissionSettings,
)
from lab.clock import ManualClock

START = 1000.0


class Resolver:
    def __init__(self, results=None, error=None, clock=None, takes=0.0):
        self.results, self.error, self.clock, self.takes = results or {}, error, clock, takes
        self.calls = []

    def resolve_many(self, images, *, keyring=None, timeout, revalidate=frozenset(), limit=None,
                     scope=None, wait=True, record=True):
        self.calls.append((tuple(images), keyring, timeout))
        if self.clock is not None:
            self.clock.now += self.takes
        if self.error is not None:
            raise self.error
        return {image: self.results[image] for image in images if image in self.results}


class Secrets:
    def __init__(self, warnings=(), keyring=None, complete=True):
        self.warnings, self.keyring = tuple(warnings), keyring or Keyring.empty()
        self.complete = complete
        self.calls = []

    def credentials_for(self, pod, deadline):
        self.calls.append((pod, deadline))
        return PullCredentials(self.keyring, self.warnings, complete=self.complete)


CACHES = {field.name for field in dataclasses.fields(ClusterCaches)}


def service(resolver=None, secrets=None, clock=None, policy=Policy(), gating=None, events=None,
            **kw):
    """A service over stand-ins; `kw`: AdmissionSettings' fields and ClusterCaches' (fakes)."""
    settings = dict(deadline_seconds=3.0, exclude_namespaces=("kube-system",),
                    max_body_bytes=3 * 1024 * 1024)
    settings.update((k, v) for k, v in kw.items() if k not in CACHES)
    caches = ClusterCaches(**{k: v for k, v in kw.items() if k in CACHES})
    return AdmissionService(AdmissionSettings(policy=policy, **settings),
                            resolver=resolver or Resolver(), pull_secrets=secrets or Secrets(),
                            caches=caches, gating=gating, events=events,
                            clock=clock or ManualClock(START))


def review(*images, namespace="shop", operation="CREATE", annotations=None, node_name=None,
           pull_secrets=()):
    spec = {"containers": [{"name": f"c{i}", "image": im} for i, im in enumerate(images)]}
    if node_name:
        spec["nodeName"] = node_name
    if pull_secrets:
        spec["imagePullSecrets"] = [{"name": n} for n in pull_secrets]
    metadata = {"generateName": "web-"}
    if annotations:
        metadata["annotations"] = annotations
    return json.dumps({
        "apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
        "request": {"uid": "u-1", "operation": operation, "namespace": namespace,
                    "kind": {"group": "", "version": "v1", "kind": "Pod"},
                    "resource": {"group": "", "version": "v1", "resource": "pods"},
                    "object": {"apiVersion": "v1", "kind": "Pod", "metadata": metadata,
                               "spec": spec}}}).encode()


def info(image, *platforms):
    return ImageInfo(image, frozenset(parse_platform(p) for p in platforms), None, "oci-index")


def response(answer):
    assert answer.status == 200, answer.body
    return answer.body["response"]


def test_pull_secret_warnings_come_first_and_the_rest_is_counted_right():
    """Six image warnings and one pull-secret warning: the pull-secret one is kept, first, and
    the last line counts the three image warnings that did not fit."""
    images = [f"reg.example/app{i}:1" for i in range(6)]
    secrets = Secrets(warnings=["pull secret shop/regcred: not found"])
    answer = service(Resolver({im: NotFound("x") for im in images}), secrets).review(
        review(*images, pull_secrets=["regcred"]))
    warnings = response(answer)["warnings"]
    assert len(warnings) == MAX_WARNINGS
    assert warnings[0] == "pull secret shop/regcred: not found"
    assert [w.split()[3] for w in warnings[1:4]] == images[:3]   # "could not inspect <image>"
    assert warnings[4] == "... and 3 more warnings from archway"


def test_warnings_fitting_the_cap_are_all_kept():
    images = [f"reg.example/app{i}:1" for i in range(MAX_WARNINGS - 1)]
    answer = service(Resolver({im: DeadlineExceeded("x") for im in images}),
                     Secrets(warnings=["w"])).review(review(*images))
    warnings = response(answer)["warnings"]
    assert warnings[0] == "w" and len(warnings) == MAX_WARNINGS
    assert not any(w.startswith("...") for w in warnings)


def test_a_pod_is_pinned_to_its_images_architectures():
    resolver = Resolver({"reg/arm:1": info("reg/arm:1", "linux/arm64")})
    answer = response(service(resolver).review(review("reg/arm:1")))
    patch = json.loads(base64.b64decode(answer["patch"]))
    pod = jsonpatch.apply_patch({"metadata": {}, "spec": {}}, patch)
    assert pod["spec"]["nodeSelector"] == {"kubernetes.io/arch": "arm64"}
    assert answer["auditAnnotations"] == {"outcome": "mutated", "architectures": "arm64"}
    assert "warnings" not in answer


def test_the_deadline_is_shared_between_the_api_and_the_registries():
    clock = ManualClock(START)
    resolver, secrets = Resolver(clock=clock), Secrets()
    clock.now = START + 0.5   # the body took half a second to arrive
    service(resolver, secrets, clock).review(review("reg/a:1"), started=START)
    (pod, secrets_deadline), = secrets.calls
    assert isinstance(pod, PodView) and pod.namespace == "shop"
    assert secrets_deadline == pytest.approx(START + 0.5 + 2.5 * PULL_SECRETS_SHARE)
    (images, keyring, timeout), = resolver.calls
    assert images == ("reg/a:1",) and keyring is secrets.keyring
    assert timeout == pytest.approx(3.0 - ANSWER_MARGIN_SECONDS - 0.5)


class Gating:
    def __init__(self):
        self.asked = []

    def leader_fresh(self, deadline=None):
        self.asked.append(deadline)
        return True


def test_a_request_that_waited_for_a_thread_gets_only_what_is_left():
    clock = ManualClock(START + 2.0)    # two of its three seconds went in the queue
    resolver, secrets = Resolver(clock=clock), Secrets()
    service(resolver, secrets, clock).review(review("reg/a:1"), started=START)
    assert secrets.calls[0][1] == pytest.approx(START + 2.0 + 1.0 * PULL_SECRETS_SHARE)
    assert resolver.calls[0][2] == pytest.approx(1.0 - ANSWER_MARGIN_SECONDS)


def test_a_request_with_no_time_left_is_gated_at_once_from_what_the_cache_knows():
    """Queued past its deadline: the API is not asked, the resolver answers from its cache
    (timeout 0; the lookups it starts fill the cache), and an image it does not know gates the
    pod, while one it knows places it."""
    clock = ManualClock(START + 3.5)
    known = info("reg/arm:1", "linux/arm64")
    resolver, secrets = Resolver({"reg/arm:1": known}, clock=clock), Secrets()
    svc = service(resolver, secrets, clock, unresolved="gate", gating=Gating())
    gated = response(svc.review(review("reg/new:1"), started=START))
    assert gated["auditAnnotations"]["outcome"] == "gated"
    placed = response(svc.review(review("reg/arm:1"), started=START))
    assert placed["auditAnnotations"] == {"outcome": "mutated", "architectures": "arm64"}
    assert [call[2] for call in resolver.calls] == [0.0, 0.0]
    assert [deadline for _, deadline in secrets.calls] == [START + 3.5] * 2   # no time for reads


@pytest.mark.parametrize("unresolved, outcome, allowed", [("admit", "fail_open", True),
                                                          ("deny", "denied", False)])
def test_with_no_time_left_the_configured_policy_answers(unresolved, outcome, allowed):
    clock = ManualClock(START + 10.0)
    svc = service(Resolver(clock=clock), clock=clock, unresolved=unresolved,
                  policy=Policy(fail_closed=unresolved == "deny"))
    answer = response(svc.review(review("reg/new:1"), started=START))
    assert answer["allowed"] is allowed and answer["auditAnnotations"]["outcome"] == outcome


def test_the_apiservers_timeout_bounds_the_deadline():
    clock = ManualClock(START)
    resolver = Resolver(clock=clock)
    svc = service(resolver, clock=clock)
    svc.review(review("reg/a:1"), started=START, timeout=2.0)    # ?timeout=2s: 1.5 s to use
    svc.review(review("reg/a:1"), started=START, timeout=30.0)   # longer than archway's own
    assert [call[2] for call in resolver.calls] == [
        pytest.approx(1.5 - ANSWER_MARGIN_SECONDS), pytest.approx(3.0 - ANSWER_MARGIN_SECONDS)]


def test_skipped_requests_read_nothing():
    resolver, secrets = Resolver(), Secrets()
    svc = service(resolver, secrets)
    for body in (review("reg/a:1", namespace="kube-system"),
                 review("reg/a:1", operation="UPDATE"),
                 review("reg/a:1", annotations={"archway.dev/skip": "true"}),
                 review("reg/a:1", node_name="n1")):
        assert response(svc.review(body)) == {"uid": "u-1", "allowed": True}
    assert resolver.calls == [] and secrets.calls == []


def test_a_pod_without_images_reads_no_secrets():
    secrets = Secrets(warnings=["should not appear"])
    answer = response(service(secrets=secrets).review(review()))
    assert answer["allowed"] and "warnings" not in answer and secrets.calls == []


def test_a_malformed_pod_is_a_400_with_the_field_named():
    body = json.loads(review("reg/a:1"))
    body["request"]["object"]["spec"]["containers"][0]["imagePullPolicy"] = 3
    answer = service().review(json.dumps(body).encode())
    assert answer.status == 400
    assert answer.body == {"error": "request.object: spec.containers[0].imagePullPolicy must be a "
                                    "string"}


def test_an_oversized_body_is_a_413():
    answer = service(max_body_bytes=100).review(review("reg/a:1"))
    assert answer.status == 413 and "server.max_body_bytes" in answer.body["error"]


def test_a_failing_resolver_fails_open_or_closed_by_policy():
    broken = Resolver(error=RuntimeError("bug"))
    opened = response(service(broken).review(review("reg/a:1")))
    assert opened["allowed"] and "patch" not in opened
    assert opened["warnings"] == ["archway failed to decide (internal error); pod admitted unchanged"]
    assert opened["auditAnnotations"] == {"outcome": "error"}
    closed = response(service(broken, policy=Policy(fail_closed=True)).review(review("reg/a:1")))
    assert not closed["allowed"] and "unresolved is deny" in closed["status"]["message"]


# --- per-namespace policy, the cluster's nodes, Events (stand-in caches) --------------------------

class Cache:
    """A synced list + watch cache holding `items`; `synced=False`: the first list is not in."""
    def __init__(self, items, synced=True):
        self.items, self.synced, self.waits = dict(items), synced, []
        self.version = 1

    def wait_synced(self, timeout):
        self.waits.append(timeout)
        return self.synced


class Events:
    def __init__(self):
        self.sent = []

    def record(self, regarding, event_type, reason, action, note, being_created=False):
        self.sent.append((f"{regarding['namespace']}/{regarding['name']}", event_type, reason, note))
        self.being_created = being_created


class Node:
    def __init__(self, arch):
        self.arch, self.taints, self.os = arch, (), "linux"


def test_namespace_mode_off_reads_nothing_and_audit_patches_annotations_only():
    from archway.placement.namespaces import NamespaceFacts
    resolver = Resolver({"reg/arm:1": info("reg/arm:1", "linux/arm64")})
    namespaces = Cache({"quiet": NamespaceFacts("quiet", mode="off"),
                        "audited": NamespaceFacts("audited", mode="audit")})
    svc = service(resolver, namespaces=namespaces)
    off = response(svc.review(review("reg/arm:1", namespace="quiet")))
    assert off["allowed"] and "patch" not in off and resolver.calls == []
    audited = response(svc.review(review("reg/arm:1", namespace="audited")))
    pod = jsonpatch.apply_patch({"metadata": {}, "spec": {}},
                                json.loads(base64.b64decode(audited["patch"])))
    assert pod["spec"] == {} and set(pod["metadata"]["annotations"]) == {
        "archway.dev/architectures", "archway.dev/images", "archway.dev/policy"}
    assert pod["metadata"]["annotations"]["archway.dev/policy"] == "namespace label"
    assert audited["auditAnnotations"]["would"] == "mutated"
    enforced = response(svc.review(review("reg/arm:1", namespace="shop")))   # no facts: config
    assert "nodeSelector" in jsonpatch.apply_patch(
        {"metadata": {}, "spec": {}}, json.loads(base64.b64decode(enforced["patch"])))["spec"]


def test_namespace_cache_not_synced_waits_at_most_the_api_share_then_uses_the_config():
    from archway.placement.namespaces import NamespaceFacts
    clock = ManualClock(START)
    namespaces = Cache({"shop": NamespaceFacts("shop", mode="off")}, synced=False)
    svc = service(Resolver({"reg/arm:1": info("reg/arm:1", "linux/arm64")}), clock=clock,
                  namespaces=namespaces)
    answer = response(svc.review(review("reg/arm:1")))
    assert "patch" in answer and namespaces.waits == [pytest.approx(3.0 * PULL_SECRETS_SHARE)]


def test_unschedulable_pod_is_warned_with_an_event_or_denied():
    nodes = Cache({"a": Node("amd64"), "b": Node("arm64")})
    events = Events()
    resolver = Resolver({"reg/z:1": info("reg/z:1", "linux/s390x")})
    warned = response(service(resolver, nodes=nodes, events=events).review(review("reg/z:1")))
    assert warned["allowed"] and warned["warnings"][0].startswith("images are s390x-only")
    assert events.sent == [("shop/web-", "Warning", "ArchwayUnschedulable",
                            ("images are s390x-only; nodes: amd64, arm64: the pod stays Pending "
                             "until such a node joins"))]
    denied = response(service(resolver, nodes=nodes, events=events,
                              policy=Policy(deny_unschedulable=True)).review(review("reg/z:1")))
    assert not denied["allowed"] and "s390x-only" in denied["status"]["message"]
    assert len(events.sent) == 1   # a denied pod does not exist: no Event about it
    unsynced = Cache({"a": Node("amd64")}, synced=False)
    assert "warnings" not in response(service(resolver, nodes=unsynced).review(review("reg/z:1")))


class NodePools(Cache):
    def nodes_that_may_join(self):
        return [node for pool in self.items.values() for node in pool]


def test_node_pools_count_as_nodes_that_may_join_once_listed():
    nodes = Cache({"a": Node("amd64")})
    resolver = Resolver({"reg/z:1": info("reg/z:1", "linux/arm64")})
    deny = Policy(deny_unschedulable=True)
    assert not response(service(resolver, nodes=nodes, policy=deny).review(review("reg/z:1")))["allowed"]
    pools = NodePools({"default": [Node("amd64"), Node("arm64")]})
    admitted = response(service(resolver, nodes=nodes, policy=deny,
                                node_pools=pools).review(review("reg/z:1")))
    assert admitted["allowed"] and "warnings" not in admitted
    # NodePools not listed yet (or no Karpenter: 404): whether a node may join is unknown
    unlisted = NodePools({}, synced=False)
    assert response(service(resolver, nodes=nodes, policy=deny,
                            node_pools=unlisted).review(review("reg/z:1")))["allowed"]


# --- answered at once: on the server's loop, or not at all ----------------------------------------

class Listing:
    """A cache whose first list is still on its way (`settled` False) or done."""

    def __init__(self, settled: bool):
        self.settled, self.items = settled, {}

    def ensure_started(self):
        pass

    def wait_synced(self, seconds):
        return self.settled


def test_a_warm_admission_is_answered_at_once_as_it_would_be_with_time():
    """What the server's loop asks first (archway.server.routes): every image, pull secret and
    policy in memory, the same answer as a handler thread's, to the byte."""
    arm = info("reg/arm:1", "linux/arm64")
    at_once = service(Resolver({"reg/arm:1": arm})).review(review("reg/arm:1"), at_once=True)
    waited = service(Resolver({"reg/arm:1": arm})).review(review("reg/arm:1"))
    assert at_once is not None and at_once == waited
    skipped = service().review(review("reg/arm:1", namespace="kube-system"), at_once=True)
    assert skipped is not None and response(skipped)["allowed"]   # nothing to read


@pytest.mark.parametrize("case", ["image not in memory", "pull secret not read", "policy cache listing",
                                  "no image told its architectures", "debug container"])
def test_what_is_not_in_memory_is_left_for_a_thread_and_nothing_is_counted(case, caplog):
    arm = info("reg/arm:1", "linux/arm64")
    kw: dict = {"resolver": Resolver({"reg/arm:1": arm})}
    body = review("reg/arm:1")
    if case == "image not in memory":
        kw["resolver"] = Resolver({})
    elif case == "pull secret not read":
        kw["secrets"] = Secrets(complete=False)
    elif case == "policy cache listing":
        kw["policies"] = Listing(settled=False)
    elif case == "no image told its architectures":
        kw["resolver"] = Resolver({"reg/arm:1": NotFound("gone")})
    else:
        body = json.dumps({"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
                           "request": {"uid": "u", "operation": "UPDATE", "namespace": "shop",
                                       "subResource": "ephemeralcontainers",
                                       "kind": {"group": "", "version": "v1", "kind": "Pod"},
                                       "resource": {"group": "", "version": "v1", "resource": "pods"},
                                       "object": {"metadata": {"name": "p"}, "spec": {
                                           "containers": [{"name": "c", "image": "reg/arm:1"}],
                                           "ephemeralContainers": [{"name": "d", "image": "reg/x:1"}]}},
                                       "oldObject": {"metadata": {"name": "p"}, "spec": {
                                           "containers": [{"name": "c", "image": "reg/arm:1"}]}}}}).encode()
    events = Events()
    with caplog.at_level("DEBUG", logger="archway.admission"):
        assert service(events=events, **kw).review(body, at_once=True) is None
    assert caplog.records == [] and events.sent == []
    if case == "pull secret not read":
        # No lookup is started without the pod's secrets: a private registry would be asked
        # anonymously and refuse (a request the thread's answer, from the record, never needed).
        assert kw["resolver"].calls == []
    assert service(events=Events(), **kw).review(body).status == 200   # with time: answered


class Workloads:
    """A workload cache whose pod's controller has not come (yet): `waits` says whether a
    thread's top_of would wait for it (WorkloadCache.would_wait_for)."""

    def __init__(self, waits: bool):
        self.waits, self.settled = waits, True

    def ensure_started(self):
        pass

    def wait_synced(self, seconds):
        return True

    def top_of(self, pod, timeout=0.0):
        return None

    def would_wait_for(self, pod):
        return self.waits


def test_a_missing_controller_sends_the_admission_to_a_thread_only_when_a_thread_would_wait():
    """A ReplicaSet made a moment before its pods: a thread waits for the watch to bring it, so
    the loop leaves the pod to one; one a whole wait missed before is not waited for again, and
    the loop answers as the thread would (nothing learned)."""
    review_body = json.loads(review("reg/arm:1"))
    review_body["request"]["object"]["metadata"]["ownerReferences"] = [
        {"apiVersion": "apps/v1", "kind": "ReplicaSet", "name": "web-5d8", "uid": "r",
         "controller": True}]
    body = json.dumps(review_body).encode()
    resolver = Resolver({"reg/arm:1": info("reg/arm:1", "linux/arm64")})
    assert service(resolver, workloads=Workloads(waits=True)).review(body, at_once=True) is None
    at_once = service(resolver, workloads=Workloads(waits=False)).review(body, at_once=True)
    assert at_once is not None
    assert at_once == service(resolver, workloads=Workloads(waits=False)).review(body)
