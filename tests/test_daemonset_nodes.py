"""A DaemonSet whose images cannot run on some of its nodes is told so on itself (gate/
daemonsets.py): the DaemonSet controller's pods for those nodes stay Pending for ever, and
admission's warnings about them go to that controller. Pure decisions, then the leader's loop
against the API stand-in (lab/servers/apiserver.py): its list + watch of unbound pods, the node
and workload caches, the real EventSink posting validated Events."""
import threading

import pytest

from archway.cluster.events import EventSink
from archway.cluster.nodes import NodeCache
from archway.cluster.workloadcache import WorkloadCache
from archway.config import config_from_dict
from archway.gate import daemonsets
from archway.gate.daemonsets import REASON_NODES, DaemonSetNodes, note, stranded_pod
from archway.kubeapi import KubeApi
from archway.kubeclient import api_client_factory
from archway.placement.policy import Policy
from lab.procs import wait_until
from lab.servers.apiserver import FakeApiServer

NS = "agents"
DS_UID = "ds-uid-1"
NODES = {"amd64-1": "amd64", "arm64-1": "arm64", "arm64-2": "arm64", "ppc64le-1": "ppc64le"}
EVENTS = f"/apis/events.k8s.io/v1/namespaces/{NS}/events"


def daemon_pod(node: str, *, archs: str = "arm64", bound: bool = False, uid: str = "",
               owner_uid: str = DS_UID, excluded: str = "", gated: bool = False) -> dict:
    """A pod as the DaemonSet controller makes it (pinned by matchFields) and archway's admission
    annotated it."""
    annotations = {"archway.dev/architectures": archs}
    if excluded:
        annotations["archway.dev/excluded-architectures"] = excluded
    spec = {"containers": [{"name": "c0", "image": "reg/agent:1"}],
            "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
                "nodeSelectorTerms": [{
                    "matchFields": [{"key": "metadata.name", "operator": "In",
                                     "values": [node]}],
                    "matchExpressions": [{"key": "kubernetes.io/arch", "operator": "In",
                                          "values": archs.split(",")}]}]}}}}
    if bound:
        spec["nodeName"] = node
    if gated:
        spec["schedulingGates"] = [{"name": "archway.dev/resolving"}]
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {
        "name": f"agent-{node}", "namespace": NS, "uid": uid or f"pod-{node}",
        "labels": {"app": "agent"}, "annotations": annotations,
        "ownerReferences": [{"apiVersion": "apps/v1", "kind": "DaemonSet", "name": "agent",
                             "uid": owner_uid, "controller": True}]},
        "spec": spec, "status": {"phase": "Pending"}}


# --- what is kept of a pod, and what is said -------------------------------------------------

def test_an_unbound_daemonset_pod_pinned_to_a_node_is_kept_with_where_it_may_run():
    pod = stranded_pod(daemon_pod("amd64-1", archs="amd64,arm64", excluded="amd64"))
    assert pod is not None and pod.node == "amd64-1" and pod.owner.uid == DS_UID
    assert pod.runs_on == {"arm64"} and pod.excluded == {"amd64"}


@pytest.mark.parametrize("obj", [
    daemon_pod("amd64-1", bound=True),                 # the scheduler placed it
    daemon_pod("amd64-1", gated=True),                 # archway still reads its images
    daemon_pod("amd64-1", archs=""),                   # archway did not place it
    {**daemon_pod("amd64-1"), "metadata": {**daemon_pod("amd64-1")["metadata"],
                                           "ownerReferences": []}},   # no DaemonSet's
    {**daemon_pod("amd64-1"), "spec": {"containers": [{"name": "c", "image": "x"}]}},  # no pin
    {"metadata": "not a pod"},
])
def test_other_pods_are_not_kept(obj):
    assert stranded_pod(obj) is None


def test_the_note_names_the_nodes_their_architectures_and_why():
    said = note(frozenset({"arm64"}), frozenset(), {"ppc64le-1": "ppc64le", "amd64-1": "amd64"})
    assert said.startswith("its images run on arm64 only: its pods for 2 nodes stay Pending")
    assert "amd64-1 (amd64), ppc64le-1 (ppc64le)" in said
    many = note(frozenset({"arm64"}), frozenset({"amd64"}),
                {f"n{i:02d}": "amd64" for i in range(25)})
    assert "and 15 more" in many and "n09 (amd64)" in many and "n10" not in many
    assert "where its pods failed with exec format error" in many


# --- the leader's loop against the API stand-in ----------------------------------------------

@pytest.fixture
def cluster(tmp_path, monkeypatch):
    """The stand-in with four Nodes, the DaemonSet and its pods as the controller made them
    (the one for arm64-1 bound); `run(**remediation)` starts the loop as a leader does and
    returns the Events posted about the DaemonSet (a function)."""
    monkeypatch.setattr(daemonsets, "ROUND_SECONDS", 0.05)
    api = FakeApiServer()
    for name, arch in NODES.items():
        api.put(f"/api/v1/nodes/{name}", {"metadata": {"name": name, "labels": {
            "kubernetes.io/arch": arch}}})
    api.put(f"/api/v1/namespaces/{NS}", {"metadata": {"name": NS}})
    api.put(f"/apis/apps/v1/namespaces/{NS}/daemonsets/agent", {
        "apiVersion": "apps/v1", "kind": "DaemonSet",
        "metadata": {"name": "agent", "namespace": NS, "uid": DS_UID},
        "spec": {"selector": {"matchLabels": {"app": "agent"}},
                 "template": {"spec": {"containers": [{"name": "c0", "image": "reg/agent:1"}]}}}})
    for node in NODES:
        api.put(f"/api/v1/namespaces/{NS}/pods/agent-{node}",
                daemon_pod(node, bound=node == "arm64-1"))
    stops, caches = [], []

    def run(**settings):
        config = config_from_dict({"kubernetes": {"kubeconfig": api.kubeconfig(str(tmp_path))},
                                   **settings})
        factory = api_client_factory(config.kubernetes)
        nodes, workloads = NodeCache(factory), WorkloadCache(factory)
        for cache in (nodes, workloads):
            cache.ensure_started()
            caches.append(cache)
        assert nodes.wait_synced(10) and workloads.wait_synced(10)
        kube = KubeApi(factory())
        loop = DaemonSetNodes(api=kube, settings=config.remediation,
                              policy=Policy.from_config(config),
                              events=EventSink(kube, instance="leader-0"), nodes=nodes,
                              workloads=workloads,
                              exclude_namespaces=config.admission.exclude_namespaces)
        stop = threading.Event()
        stops.append(stop)
        threading.Thread(target=loop.lead, args=(stop, factory), daemon=True).start()
        return lambda: [e for e in (api.get(p) for p in list(api.objects)
                                    if p.startswith(EVENTS + "/")) if e["reason"] == REASON_NODES]
    yield api, run
    for stop in stops:
        stop.set()
    for cache in caches:
        cache.stop()
    api.stop()


def test_the_daemonset_is_told_once_which_nodes_cannot_run_it(cluster):
    api, run = cluster
    told = run()
    wait_until(lambda: told(), timeout=10, what="the DaemonSet's Event")
    (event,) = told()
    assert event["type"] == "Warning" and event["regarding"] == {
        "apiVersion": "apps/v1", "kind": "DaemonSet", "namespace": NS, "name": "agent",
        "uid": DS_UID}
    assert "amd64-1 (amd64), arm64-2 (arm64), ppc64le-1 (ppc64le)" not in event["note"]
    assert "its pods for 2 nodes stay Pending" in event["note"]
    assert "amd64-1 (amd64), ppc64le-1 (ppc64le)" in event["note"]
    assert not api.rejections
    # The unbound pod on arm64-2 is not stranded; nor is a bound one. Only unbound pods are
    # listed and watched.
    lists = [p for m, p in api.requests if m == "GET" and p.startswith("/api/v1/pods")]
    assert lists and all("fieldSelector=spec.nodeName%3D" in p for p in lists), lists

    # The controller's pods change, one is made anew: rounds go on, nothing more is said.
    for node in ("amd64-1", "ppc64le-1"):
        api.put(f"/api/v1/namespaces/{NS}/pods/agent-{node}",
                daemon_pod(node, uid=f"again-{node}"))
    # And the scheduler binds the arm64-2 pod: it leaves the watch (a DELETED event).
    api.put(f"/api/v1/namespaces/{NS}/pods/agent-arm64-2", daemon_pod("arm64-2", bound=True))
    threading.Event().wait(0.5)
    assert len(told()) == 1


def test_a_node_that_joins_is_told_at_most_once_a_minute(cluster, monkeypatch):
    api, run = cluster
    monkeypatch.setattr(daemonsets, "RETELL_SECONDS", 0.3)
    told = run()
    wait_until(lambda: told(), timeout=10, what="the DaemonSet's first Event")
    api.put("/api/v1/nodes/amd64-2", {"metadata": {"name": "amd64-2", "labels": {
        "kubernetes.io/arch": "amd64"}}})
    api.put(f"/api/v1/namespaces/{NS}/pods/agent-amd64-2", daemon_pod("amd64-2"))
    wait_until(lambda: len(told()) == 2, timeout=10, what="the Event naming the new node too")
    assert "its pods for 3 nodes" in sorted(e["note"] for e in told())[-1]


def test_a_forged_owner_is_told_nothing(cluster):
    api, run = cluster
    for node in NODES:    # pods naming the DaemonSet with another uid than its own
        api.put(f"/api/v1/namespaces/{NS}/pods/agent-{node}",
                daemon_pod(node, owner_uid="forged"))
    told = run()
    threading.Event().wait(0.5)
    assert told() == []


@pytest.mark.parametrize("admission", [{"exclude_namespaces": [NS]}, {"mode": "audit"}])
def test_a_namespace_archway_does_not_place_in_is_told_nothing(cluster, admission):
    api, run = cluster
    told = run(admission=admission)
    threading.Event().wait(0.5)
    assert told() == []
