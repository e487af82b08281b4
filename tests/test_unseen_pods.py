"""Pods archway never saw (gate/unseen.py): the leader's revisit, fed by the closed loop's watch
of every pod (remediation.FailingPods) from the API stand-in, with the real node, workload and
namespace caches, the controller's real resolver reading a real registry, and Evictions. The
passes are driven one at a time (take_due, revisit_all), so "once" is counted, not waited for."""
import pytest
from prometheus_client import REGISTRY

from archway.cluster.caches import ClusterCaches, NamespaceCache
from archway.cluster.nodes import NodeCache
from archway.cluster.pullsecrets import PullSecrets
from archway.cluster.workloadcache import WorkloadCache
from archway.config import config_from_dict
from archway.gate.coverage import WebhookCoverage
from archway.gate.remediation import FailingPods, Remediation
from archway.gate.unseen import REASON_EVICTED, REASON_UNSEEN, REPEAT_SECONDS, UnseenPods, unseen_pod
from archway.kubeapi import KubeApi
from archway.kubeclient import build_api_client
from archway.objects.policies import NAMESPACED_KIND, PolicyCache
from archway.placement.policy import Policy
from archway.registry.resolver import Resolver
from lab.clock import ManualClock
from lab.procs import wait_until
from lab.servers.apiserver import FakeApiServer
from tests.infra.fixtures import plain_registry

DECIDED = {"archway.dev/architectures": "amd64", "archway.dev/images": "[]"}


class Events:
    def __init__(self):
        self.sent: list[tuple[str, str, str, str]] = []

    def record(self, regarding, event_type, reason, action, note):
        self.sent.append((regarding["kind"], regarding["name"], reason, note))

    def about(self, name: str) -> list[tuple[str, str, str, str]]:
        return [e for e in self.sent if e[1] == name]


def counted(placement: str) -> float:
    return REGISTRY.get_sample_value("archway_unseen_pods_total", {"placement": placement}) or 0.0


def pod(name: str, node: str, image: str, *, owner: dict | None = None, annotations=None,
        labels=None) -> dict:
    meta: dict = {"name": name, "labels": labels or {"app": "web"},
                  "annotations": annotations or {}}
    if owner is not None:
        meta["ownerReferences"] = [{"apiVersion": "apps/v1", "kind": owner["kind"],
                                    "name": owner["metadata"]["name"],
                                    "uid": owner["metadata"]["uid"], "controller": True}]
    return {"apiVersion": "v1", "kind": "Pod", "metadata": meta,
            "spec": {"nodeName": node, "containers": [{"name": "c", "image": image}]},
            "status": {"phase": "Pending"}}


def workload(server: FakeApiServer, namespace: str) -> dict:
    """Deployment web -> ReplicaSet web-1 in `namespace`: the ReplicaSet, as stored."""
    apps = f"/apis/apps/v1/namespaces/{namespace}"
    top = server.put(f"{apps}/deployments/web", {
        "apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "web"},
        "spec": {"selector": {"matchLabels": {"app": "web"}}}})
    return server.put(f"{apps}/replicasets/web-1", {
        "apiVersion": "apps/v1", "kind": "ReplicaSet", "metadata": {
            "name": "web-1", "ownerReferences": [{
                "apiVersion": "apps/v1", "kind": "Deployment", "name": "web",
                "uid": top["metadata"]["uid"], "controller": True}]},
        "spec": {"selector": {"matchLabels": {"app": "web"}}}})


@pytest.fixture
def clock():
    """The revisit's clock, moved by the test: a wait elapses only when a test says so."""
    return ManualClock()


@pytest.fixture
def leader(request, tmp_path, plain_registry, clock):
    """(server, unseen, events, image, start): the revisit as the leader runs it (evict on, or
    the parameter) on `clock`, its watch and caches synced by start(), over a stand-in holding
    two nodes (amd64 and arm64) and an amd64-only image."""
    server = FakeApiServer()
    image = plain_registry.ref("unseen/app", "1")
    plain_registry.push_image("unseen/app", "1", "linux/amd64")
    for name, arch in (("amd-node", "amd64"), ("arm-node", "arm64")):
        server.put(f"/api/v1/nodes/{name}", {"metadata": {
            "name": name, "labels": {"kubernetes.io/arch": arch}}})
    for name, labels in (("shop", {}), ("quiet", {"archway.dev/mode": "off"}),
                         ("kube-system", {})):
        server.put(f"/api/v1/namespaces/{name}", {"metadata": {"name": name, "labels": labels}})
    config = config_from_dict({
        "kubernetes": {"kubeconfig": server.kubeconfig(str(tmp_path))},
        "registry": {"insecure_hosts": [plain_registry.host], "timeout_seconds": 5},
        "remediation": {"evict": getattr(request, "param", True), "read_logs": False}})

    def factory():
        return build_api_client(config.kubernetes)[0]
    caches = [NodeCache(factory), WorkloadCache(factory), NamespaceCache(factory),
              PolicyCache(factory, NAMESPACED_KIND)]
    nodes, workloads, namespaces, policies = caches
    api = KubeApi(factory())
    events = Events()
    policy = Policy.from_config(config)
    cluster = ClusterCaches(namespaces=namespaces, policies=policies)
    common = dict(api=api, settings=config.remediation, policy=policy,
                  events=events, workloads=workloads, namespaces=namespaces,
                  exclude_namespaces=config.admission.exclude_namespaces,
                  in_force=lambda ns, labels: cluster.policy_for_labels(policy, ns, labels).policy)
    unseen = UnseenPods(nodes=nodes, resolver=Resolver(config.registry),
                        pull_secrets=PullSecrets(factory(), source="test", cache_seconds=60),
                        clock=clock, **common)
    watch = FailingPods(Remediation(nodes=nodes, **common), factory, 5, unseen)

    def start():
        for cache in caches:
            cache.ensure_started()
            assert cache.wait_synced(30)
        watch.ensure_started()
        assert watch.wait_synced(30)
    try:
        yield server, unseen, events, image, start
    finally:
        watch.stop()
        for cache in caches:
            cache.stop()
        server.stop()


def test_an_unseen_pod_on_a_wrong_arch_node_is_evicted_once_the_others_are_only_recorded(leader):
    server, unseen, events, image, start = leader
    replicaset = workload(server, "shop")
    quiet = workload(server, "quiet")
    excluded = workload(server, "kube-system")
    pods = "/api/v1/namespaces/{}/pods/{}"
    server.put(pods.format("shop", "wrong"), pod("wrong", "arm-node", image, owner=replicaset))
    server.put(pods.format("shop", "decided"), pod("decided", "arm-node", image,
                                                   owner=replicaset, annotations=DECIDED))
    server.put(pods.format("shop", "fine"), pod("fine", "amd-node", image, owner=replicaset))
    server.put(pods.format("shop", "opted"), pod("opted", "arm-node", image, owner=replicaset,
                                                 labels={"app": "web",
                                                         "archway.dev/skip": "true"}))
    server.put(pods.format("quiet", "off"), pod("off", "arm-node", image, owner=quiet))
    server.put(pods.format("kube-system", "sys"), pod("sys", "arm-node", image,
                                                      owner=excluded))
    wrong_before, runs_before = counted("wrong_architecture"), counted("runs")
    start()

    unseen.revisit_all(unseen.take_due())
    assert server.get(pods.format("shop", "wrong")) is None, "evicted"
    evictions = [p for m, p in server.requests if m == "POST" and p.endswith("/eviction")]
    assert evictions == ["/api/v1/namespaces/shop/pods/wrong/eviction"]
    (on_pod, evicted) = events.about("wrong")
    assert on_pod[2] == REASON_UNSEEN and "node arm-node (arm64)" in on_pod[3], on_pod
    assert "run on amd64, not on arm64" in on_pod[3], on_pod
    assert evicted[2] == REASON_EVICTED and "Deployment web recreates it on amd64" in evicted[3]
    assert [e[:3] for e in events.about("web")] == [("Deployment", "web", REASON_UNSEEN)]
    (fine,) = events.about("fine")
    assert fine[2] == REASON_UNSEEN and "its images run on amd64" in fine[3]
    for untouched in ("decided", "opted", "off", "sys"):
        assert events.about(untouched) == [], untouched
    assert server.get(pods.format("shop", "fine")) is not None
    assert counted("wrong_architecture") - wrong_before == 1
    assert counted("runs") - runs_before == 1

    def present() -> float | None:
        unseen.revisit_all([])    # a pass with nothing due sets the gauge too
        return REGISTRY.get_sample_value("archway_unseen_pods_present")
    # "wrong" counts until the watch says it is gone; "fine" is still there.
    wait_until(lambda: present() == 1, timeout=10, what="one unseen pod present")

    # Revisited once: the next passes ask nothing, about no pod.
    sent, asked = len(events.sent), len(server.requests)
    for _ in range(3):
        unseen.revisit_all(unseen.take_due())
    assert len(events.sent) == sent
    assert [r for r in server.requests[asked:] if "/pods/" in r[1]] == []

    # A status update changes nothing; a pod that gains archway's decision is no longer counted.
    fine = server.get(pods.format("shop", "fine"))
    server.put(pods.format("shop", "fine"), {**fine, "status": {"phase": "Running"}})
    fine = server.put(pods.format("shop", "fine"), {**fine, "metadata": {
        **fine["metadata"], "annotations": DECIDED}})
    wait_until(lambda: present() == 0, timeout=10, what="no unseen pod present")
    assert len(events.sent) == sent


def test_placement_policy_modes_govern_the_revisit_as_they_govern_admission(leader):
    """mode off: no Event and no eviction; audit: recorded, never evicted; a policy's enforce
    in a namespace labelled off acts (the policy comes first, as at admission)."""
    server, unseen, events, image, start = leader
    policies = "/apis/archway.dev/v1alpha1/namespaces/{}/placementpolicies/{}"
    for namespace, name, mode, tier in (("shop", "hands-off", "off", "batch"),
                                        ("shop", "watch-only", "audit", "report"),
                                        ("quiet", "this-one", "enforce", "front")):
        server.put(policies.format(namespace, name), {
            "apiVersion": "archway.dev/v1alpha1", "kind": "PlacementPolicy",
            "metadata": {"name": name, "generation": 1},
            "spec": {"mode": mode, "podSelector": {"matchLabels": {"tier": tier}}}})
    replicaset, quiet = workload(server, "shop"), workload(server, "quiet")
    pods = "/api/v1/namespaces/{}/pods/{}"
    for namespace, name, tier in (("shop", "batch-1", "batch"), ("shop", "report-1", "report"),
                                  ("quiet", "web-1", "front")):
        server.put(pods.format(namespace, name), pod(
            name, "arm-node", image, owner=replicaset if namespace == "shop" else quiet,
            labels={"app": "web", "tier": tier}))
    start()
    unseen.revisit_all(unseen.take_due())
    assert events.about("batch-1") == []
    assert [e[2] for e in events.about("report-1")] == [REASON_UNSEEN]
    assert [e[2] for e in events.about("web-1")] == [REASON_UNSEEN, REASON_EVICTED]
    evictions = [p for m, p in server.requests if m == "POST" and p.endswith("/eviction")]
    assert evictions == ["/api/v1/namespaces/quiet/pods/web-1/eviction"]


def test_a_namespace_that_turns_archway_on_has_the_pods_it_was_off_for_revisited(leader):
    """Found on the two-architecture tier: pods created while their namespace said mode off,
    judged then and left, were never looked at again once the label went; the amd64 pod bound
    to the arm64 node crash-looped there for good."""
    server, unseen, events, image, start = leader
    replicaset = workload(server, "quiet")
    server.put("/api/v1/namespaces/quiet/pods/web-1", pod("web-1", "arm-node", image, owner=replicaset))
    start()
    unseen.revisit_all(unseen.take_due())
    assert events.about("web-1") == [] and unseen.reopen_left() == 0     # off: left alone
    server.put("/api/v1/namespaces/quiet", {"metadata": {"name": "quiet", "labels": {}}})
    wait_until(lambda: unseen.reopen_left() == 1, timeout=10, what="the pod judged again")
    unseen.revisit_all(unseen.take_due())
    assert [e[2] for e in events.about("web-1")] == [REASON_UNSEEN, REASON_EVICTED]


def test_a_bare_pod_is_recorded_not_evicted_and_a_replacement_without_a_decision_waits(
        leader, clock):
    server, unseen, events, image, start = leader
    replicaset = workload(server, "shop")
    start()
    pods = "/api/v1/namespaces/shop/pods/{}"
    # Arrive through the watch, after its first list.
    server.put(pods.format("bare"), pod("bare", "arm-node", image))
    server.put(pods.format("first"), pod("first", "arm-node", image, owner=replicaset))
    wait_until(lambda: len(unseen.take_due()) == 2, timeout=10, what="both pods in the watch")
    unseen.revisit_all(unseen.take_due())
    assert server.get(pods.format("bare")) is not None
    assert [e[2] for e in events.about("bare")] == [REASON_UNSEEN]
    assert server.get(pods.format("first")) is None

    # Its replacement came without archway's decision too (archway still bypassed): evicting
    # it at once would only repeat; it is recorded, and evicted after REPEAT_SECONDS (archway is
    # often away a moment only), its own bare replacement after twice as long.
    for name, wait in (("again", REPEAT_SECONDS), ("twice", 2 * REPEAT_SECONDS)):
        server.put(pods.format(name), pod(name, "arm-node", image, owner=replicaset))
        wait_until(lambda: unseen.take_due(), timeout=10, what=f"the replacement {name} in the watch")
        unseen.revisit_all(unseen.take_due())
        assert server.get(pods.format(name)) is not None
        assert [e[2] for e in events.about(name)] == [REASON_UNSEEN]
        clock.now += wait - 1
        assert unseen.take_due() == []
        clock.now += 1
        unseen.revisit_all(unseen.take_due())
        assert server.get(pods.format(name)) is None
        assert [e[2] for e in events.about(name)] == [REASON_UNSEEN, REASON_EVICTED]


def test_every_bare_pod_of_a_burst_on_a_wrong_architecture_is_evicted_once(leader):
    """A Deployment scaled to 12 while the webhook was bypassed: its 10 pods bound to arm64
    are all evicted in one pass (not one, with the rest taken for replacements), and the
    replacements that come bare again wait their turn."""
    server, unseen, events, image, start = leader
    replicaset = workload(server, "shop")
    pods = "/api/v1/namespaces/shop/pods/{}"
    for i in range(12):
        server.put(pods.format(f"web-{i}"), pod(f"web-{i}", "arm-node" if i < 10 else "amd-node",
                                                image, owner=replicaset))
    start()
    unseen.revisit_all(unseen.take_due())
    evicted = {p.rsplit("/", 2)[1] for m, p in server.requests if m == "POST" and p.endswith("/eviction")}
    assert evicted == {f"web-{i}" for i in range(10)}
    for i in range(10, 12):
        assert server.get(pods.format(f"web-{i}")) is not None
    for i in range(3):
        server.put(pods.format(f"again-{i}"), pod(f"again-{i}", "arm-node", image, owner=replicaset))
    wait_until(lambda: len(unseen.take_due()) == 3, timeout=10, what="the replacements in the watch")
    unseen.revisit_all(unseen.take_due())
    for i in range(3):
        assert server.get(pods.format(f"again-{i}")) is not None
        assert [e[2] for e in events.about(f"again-{i}")] == [REASON_UNSEEN]


def test_an_unseen_pods_image_volume_counts_and_a_windows_node_reads_windows_platforms(
        leader, plain_registry):
    server, unseen, events, image, start = leader
    replicaset = workload(server, "shop")
    server.put("/api/v1/nodes/win-node", {"metadata": {"name": "win-node", "labels": {
        "kubernetes.io/arch": "amd64", "kubernetes.io/os": "windows"}}})
    multi = plain_registry.ref("unseen/multi", "1")
    plain_registry.push_index("unseen/multi", "1", ["linux/amd64", "linux/arm64"])
    mixed = plain_registry.ref("unseen/mixed", "1")
    plain_registry.push_index("unseen/mixed", "1", ["linux/arm64", "windows/amd64"])
    pods = "/api/v1/namespaces/shop/pods/{}"
    with_volume = pod("volume", "arm-node", multi, owner=replicaset)
    with_volume["spec"]["volumes"] = [{"name": "tools", "image": {"reference": image}}]
    server.put(pods.format("volume"), with_volume)   # its amd64-only volume cannot be pulled
    # No spec.os, bound to a Windows node: the node's runtime pulls windows/amd64, which exists.
    server.put(pods.format("windows"), pod("windows", "win-node", mixed, owner=replicaset))
    start()
    unseen.revisit_all(unseen.take_due())
    assert server.get(pods.format("volume")) is None, "evicted"
    assert "run on amd64, not on arm64" in events.about("volume")[0][3]
    assert server.get(pods.format("windows")) is not None
    assert "its images run on amd64" in events.about("windows")[0][3]


@pytest.mark.parametrize("leader", [False], indirect=True)
def test_with_evict_off_an_unseen_pod_on_a_wrong_arch_node_is_only_recorded(leader):
    server, unseen, events, image, start = leader
    replicaset = workload(server, "shop")
    server.put("/api/v1/namespaces/shop/pods/wrong", pod("wrong", "arm-node", image,
                                                         owner=replicaset))
    start()
    unseen.revisit_all(unseen.take_due())
    assert [e[2] for e in events.about("wrong")] == [REASON_UNSEEN]
    assert server.get("/api/v1/namespaces/shop/pods/wrong") is not None
    assert not [p for m, p in server.requests if p.endswith("/eviction")]
    assert unseen.take_due() == []      # done: not looked at again


def test_what_the_watch_keeps_of_a_pod():
    bound = pod("p", "arm-node", "reg.example/app:1")
    bound["metadata"]["uid"] = "u1"
    assert unseen_pod(bound).uid == "u1"
    for change in ({"metadata": {"annotations": DECIDED}}, {"spec": {"nodeName": ""}},
                   {"status": {"phase": "Succeeded"}},
                   {"metadata": {"deletionTimestamp": "2026-01-01T00:00:00Z"}},
                   {"metadata": {"annotations": {"kubernetes.io/config.mirror": "x"}}},
                   {"metadata": {"annotations": {"archway.dev/skip": "true"}}}):
        changed = {k: {**bound[k], **v} for k, v in change.items()}
        assert unseen_pod({**bound, **changed}) is None, change


MWC_PATH = "/apis/admissionregistration.k8s.io/v1/mutatingwebhookconfigurations/archway"


def webhook_configuration(namespace_expressions: list, skip_label: str) -> dict:
    """archway's MutatingWebhookConfiguration as the chart renders it (its selectors)."""
    return {"apiVersion": "admissionregistration.k8s.io/v1",
            "kind": "MutatingWebhookConfiguration", "metadata": {"name": "archway"},
            "webhooks": [{
                "name": "pods.archway.dev",
                "rules": [{"operations": ["CREATE"], "apiGroups": [""], "apiVersions": ["v1"],
                           "resources": ["pods"], "scope": "Namespaced"}],
                "namespaceSelector": {"matchExpressions": [
                    {"key": "kubernetes.io/metadata.name", "operator": "NotIn",
                     "values": ["kube-system"]}, *namespace_expressions]},
                "objectSelector": {"matchExpressions": [
                    {"key": skip_label, "operator": "NotIn", "values": ["true"]}]}}]}


def test_pods_archway_s_webhook_selectors_never_send_it_are_left_alone(leader):
    server, unseen, events, image, start = leader
    unseen.coverage = WebhookCoverage(unseen.api.client, "archway")
    server.put(MWC_PATH, webhook_configuration(
        [{"key": "archway.dev/enabled", "operator": "In", "values": ["true"]}],
        skip_label="example.com/no-archway"))
    server.put("/api/v1/namespaces/team", {"metadata": {
        "name": "team", "labels": {"archway.dev/enabled": "true"}}})
    outside, inside = workload(server, "shop"), workload(server, "team")
    pods = "/api/v1/namespaces/{}/pods/{}"
    server.put(pods.format("shop", "outside"), pod("outside", "arm-node", image, owner=outside))
    server.put(pods.format("team", "inside"), pod("inside", "arm-node", image, owner=inside))
    server.put(pods.format("team", "skipped"), pod(
        "skipped", "arm-node", image, owner=inside,
        labels={"app": "web", "example.com/no-archway": "true"}))
    start()

    unseen.revisit_all(unseen.take_due())
    assert server.get(pods.format("team", "inside")) is None, "evicted"
    assert [e[2] for e in events.about("inside")] == [REASON_UNSEEN, REASON_EVICTED]
    for left in (("shop", "outside"), ("team", "skipped")):
        assert server.get(pods.format(*left)) is not None, left
        assert events.about(left[1]) == [], left
    evictions = [p for m, p in server.requests if m == "POST" and p.endswith("/eviction")]
    assert evictions == ["/api/v1/namespaces/team/pods/inside/eviction"]


def test_until_archway_s_webhook_configuration_is_read_no_unseen_pod_is_touched(leader):
    server, unseen, events, image, start = leader
    unseen.coverage = WebhookCoverage(unseen.api.client, "archway")   # not there: 404
    replicaset = workload(server, "shop")
    server.put("/api/v1/namespaces/shop/pods/wrong", pod("wrong", "arm-node", image,
                                                         owner=replicaset))
    start()
    unseen.revisit_all(unseen.take_due())
    assert server.get("/api/v1/namespaces/shop/pods/wrong") is not None
    assert events.sent == []
    assert unseen.take_due() == [], "looked at again later, not at once"
