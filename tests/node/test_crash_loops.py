"""Crash loops end with archway's DEFAULT configuration, on the real node (issue 38, finding 6).

A Deployment whose image's index claims this machine's architecture (a binary the kernel
refuses: a real `exec format error`, written by containerd + runc only to the container's log)
and arm64 lands on the real node and crash-loops there for real. archway learns it, evicts the
failing pods (remediation.evict, on by default) and their replacements go to arm64 (API-only
Nodes: bound there, never run); a scale-up meanwhile does not go to the failing architecture,
though the node holds the same refused image under another repository pulled before (containerd
then names that one in the container's imageID: issue 38's scale-up that went back).
An arm64-only DaemonSet: its pods for the real node and the ppc64le Node stay Pending for ever,
and the DaemonSet itself gets one Event naming those nodes and why."""
import time

import pytest

from lab.cluster.nodeimages import OciImage, go_binary, machine_arch
from lab.kube import pod_path
from tests.e2e.loop import app_pods, deployment_path, events, placed_on, probe, replica_sets
from tests.e2e.workloads import create_deployment, deployment, node_arch

from .test_closed_loop import preferring, ready, refused_multiarch_image
from .test_incluster import fresh_namespace

FAILED = "archway.dev/failed-architectures"
EXCLUDED = "archway.dev/excluded-architectures"
REPLICAS = 6
SCALED = REPLICAS + 3
REASON_NODES = "ImagesCannotRunOnNodes"
PROBES = 8     # dry runs in a row that must agree (two replicas behind one Service)


def default_remediation(install) -> None:
    """The install as the chart ships it: a test before may have set remediation keys."""
    if install.archway_config.pop("remediation", None) is not None:
        install.upgrade({})


def pulled_before(kube, install, namespace: str, image: str) -> None:
    """`image` pulled onto the real node and run once there, by a bare pod: an earlier workload
    of the same binary under another repository (sorted first among containerd's references)."""
    kube.create(pod_path(namespace), {"metadata": {"name": "before"}, "spec": {
        "nodeName": install.node.name, "restartPolicy": "Never",
        "containers": [{"name": "c0", "image": image}]}})
    kube.wait_for(lambda: any(s.get("imageID") for s in kube.get(pod_path(
        namespace, "before"))["status"].get("containerStatuses") or []),
        timeout=120, what="the earlier image pulled and run")


def every_replica_places(kube, namespace: str, image: str, arch: str) -> None:
    """Until admission places the Deployment's next pod on `arch` alone in PROBES dry runs in a
    row (each goes to any of the webhook's replicas, whose caches may lag the API apart)."""
    (replica_set,) = [r for r in replica_sets(kube, namespace)
                      if int(r["spec"].get("replicas") or 0) > 0]
    row = 0

    def placed() -> bool:
        nonlocal row
        row = row + 1 if placed_on(probe(kube, namespace, image, replica_set)) == {arch} else 0
        return row >= PROBES
    kube.wait_for(placed, timeout=60, what=f"every webhook replica placing the next pod on {arch}")


def restarts_of(pod: dict) -> int:
    return sum(s.get("restartCount", 0) for s in pod["status"].get("containerStatuses") or [])


@pytest.mark.timeout(1200)     # the session's install (first use), then minutes of crash loop
def test_with_the_default_config_a_crash_loop_ends_and_a_scale_up_avoids_the_arch(
        in_cluster, node_registry):
    install, plane = in_cluster, in_cluster.plane
    kube = plane.kube
    arch = machine_arch()
    default_remediation(install)
    namespace = fresh_namespace(plane, "crash")
    image = refused_multiarch_image(node_registry, f"node/refused-{namespace}")
    pulled_before(kube, install, namespace, refused_multiarch_image(
        node_registry, f"node/a-pulled-before-{namespace}", never_run=namespace.encode()))

    body = preferring(deployment("app", [image], replicas=REPLICAS,
                                 terminationGracePeriodSeconds=0), arch)
    started = time.monotonic()
    create_deployment(kube, namespace, body)
    first = kube.wait_for(lambda: (pods := [p for p in app_pods(kube, namespace, "app")
                                            if p["spec"].get("nodeName")])
                          and len(pods) == REPLICAS and pods,
                          timeout=120, what="the Deployment's pods bound")
    assert {p["spec"]["nodeName"] for p in first} == {install.node.name}

    # The most restarts each pod on the real node was seen with, until it was gone.
    restarts: dict[str, int] = {}

    def on_real_node() -> list[dict]:
        pods = app_pods(kube, namespace, "app")
        for pod in pods:
            if pod["spec"].get("nodeName") == install.node.name:
                name = pod["metadata"]["name"]
                restarts[name] = max(restarts.get(name, 0), restarts_of(pod))
        return [p for p in pods if p["spec"].get("nodeName") == install.node.name]

    kube.wait_for(lambda: (on_real_node() or True) and (
        kube.get(deployment_path(namespace, "app"))["metadata"].get("annotations") or {}
    ).get(FAILED), timeout=180, what="the exec format error learned")
    learned_after = time.monotonic() - started
    print("imageIDs on the real node: " + str({s.get("imageID") for p in on_real_node()
                                               for s in p["status"].get("containerStatuses") or []}))

    # A scale-up once learned: none of its pods goes to the failing architecture, once every
    # webhook replica's workload cache (a watch) shows the annotation.
    every_replica_places(kube, namespace, image, "arm64")
    before = {p["metadata"]["name"] for p in app_pods(kube, namespace, "app")}
    kube.patch(deployment_path(namespace, "app"), {"spec": {"replicas": SCALED}})
    added = kube.wait_for(lambda: (new := [
        p for p in app_pods(kube, namespace, "app")
        if p["metadata"]["name"] not in before and p["spec"].get("nodeName")
    ]) and len(new) >= SCALED - REPLICAS and new, timeout=90, what="the scale-up's pods bound")
    placed = {p["metadata"]["name"]: (node_arch(kube, p["spec"]["nodeName"]),
                                      p["metadata"].get("annotations", {}).get(EXCLUDED))
              for p in added}
    print(f"pods created after learning: {placed}")
    assert all(where == "arm64" for where, _ in placed.values()), placed

    # The crash loop ends: every pod on the real node evicted, replaced on arm64.
    try:
        kube.wait_for(lambda: not on_real_node(), timeout=300,
                      what="every failing pod evicted (remediation.evict, on by default)")
    finally:
        print(f"after {time.monotonic() - started:.0f} s: {len(on_real_node())} pods on the real "
              f"node, restarts so far: {sum(restarts.values())} ({restarts})")
    stopped_after = time.monotonic() - started
    final = kube.wait_for(lambda: (pods := [p for p in app_pods(kube, namespace, "app")
                                            if p["spec"].get("nodeName")])
                          and len(pods) == SCALED and pods,
                          timeout=90, what="every replica bound again")
    assert {node_arch(kube, p["spec"]["nodeName"]) for p in final} == {"arm64"}
    assert all(p["metadata"]["annotations"].get(EXCLUDED) == arch for p in final)
    evicted = events(kube, namespace, "EvictedExecFormatError", "Pod")
    assert len({e["regarding"]["name"] for e in evicted}) == REPLICAS, evicted
    print(f"{REPLICAS} replicas on the real node: learned after {learned_after:.0f} s, crash "
          f"loop ended after {stopped_after:.0f} s, restarts before it ended: "
          f"{sum(restarts.values())} ({restarts})")


@pytest.mark.timeout(900)
def test_an_arm64_only_daemonset_is_told_which_nodes_cannot_run_it(in_cluster, node_registry):
    install, plane = in_cluster, in_cluster.plane
    kube = plane.kube
    default_remediation(install)
    namespace = fresh_namespace(plane, "daemons")
    node_registry.push_image("node/arm64-only", "1", "linux/arm64")
    image = f"{node_registry.host}/node/arm64-only:1"

    def daemonset(name: str) -> dict:
        labels = {"app": name}
        return kube.create(f"/apis/apps/v1/namespaces/{namespace}/daemonsets", {
            "apiVersion": "apps/v1", "kind": "DaemonSet", "metadata": {"name": name},
            "spec": {"selector": {"matchLabels": labels}, "template": {
                "metadata": {"labels": labels},
                "spec": {"containers": [{"name": "c0", "image": image}]}}}})
    created = daemonset("agent")
    nodes = {n["metadata"]["name"]: n["metadata"]["labels"]["kubernetes.io/arch"]
             for n in kube.items("/api/v1/nodes")}
    cannot = sorted(name for name, a in nodes.items() if a != "arm64")
    assert install.node.name in cannot and len(cannot) >= 2, nodes

    (told,) = kube.wait_for(lambda: events(kube, namespace, REASON_NODES, "DaemonSet", "agent"),
                            timeout=120, what="an Event on the DaemonSet naming the nodes")
    print(f"the DaemonSet's Event: {told['note']}")
    assert told["type"] == "Warning"
    assert told["regarding"]["uid"] == created["metadata"]["uid"]
    for name in cannot:
        assert name in told["note"] and nodes[name] in told["note"], (name, told["note"])
    assert "arm64" in told["note"]
    # Its pods for those nodes stay Pending; bounded: one Event, however many pods and admissions.
    pending = kube.wait_for(lambda: (pods := app_pods(kube, namespace, "agent")) and len(
        pods) == len(nodes) and [p for p in pods if not p["spec"].get("nodeName")],
        timeout=60, what="the DaemonSet's pods bound where they can be")
    assert sorted(p["spec"]["affinity"]["nodeAffinity"][
        "requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"][0][
        "matchFields"][0]["values"][0] for p in pending) == cannot
    # Bounded: its stranded pods made and admitted again are not told again. The leader watches
    # pods in the order they were made: once it tells a DaemonSet made after them, its rounds
    # have looked at them.
    for pod in pending:
        kube.delete(pod_path(namespace, pod["metadata"]["name"]))
    gone = {p["metadata"]["uid"] for p in pending}
    kube.wait_for(lambda: len([p for p in app_pods(kube, namespace, "agent")
                               if p["metadata"]["uid"] not in gone
                               and not p["spec"].get("nodeName")]) == len(pending),
                  timeout=60, what="the DaemonSet's stranded pods made again")
    daemonset("later")
    kube.wait_for(lambda: events(kube, namespace, REASON_NODES, "DaemonSet", "later"),
                  timeout=120, what="an Event on the DaemonSet made after them")
    assert len(events(kube, namespace, REASON_NODES, "DaemonSet", "agent")) == 1


@pytest.mark.timeout(900)
def test_a_crash_loop_with_no_architecture_left_tells_its_workload_it_can_run_nowhere(
        in_cluster, node_registry):
    """The image's only architecture is the one it fails on (a real exec format error from the
    real node's kubelet): learning and evicting cannot help, and the Deployment is told so,
    once (hardening round 6, finding 7)."""
    install, plane = in_cluster, in_cluster.plane
    kube = plane.kube
    arch = machine_arch()
    default_remediation(install)
    namespace = fresh_namespace(plane, "nowhere")
    refused_multiarch_image(node_registry, f"node/nowhere-{namespace}")
    image = f"{node_registry.host}/node/nowhere-{namespace}:only-{arch}"   # that one alone
    create_deployment(kube, namespace, deployment("app", [image], replicas=1,
                                                  terminationGracePeriodSeconds=0))
    (told,) = kube.wait_for(lambda: events(kube, namespace, "NoArchitectureLeft", "Deployment"),
                            timeout=240, what="the Deployment told it can run nowhere")
    print(f"the Deployment's Event: {told['note']}")
    assert told["type"] == "Warning" and f"claim {arch} only" in told["note"]
    assert "no architecture is left" in told["note"]
    (condition,) = kube.wait_for(lambda: [
        c for c in kube.get(deployment_path(namespace, "app"))["status"].get("conditions") or []
        if c["type"] == "archway.dev/ArchitectureLeft"], timeout=60,
        what="the Deployment's condition archway.dev/ArchitectureLeft")
    print(f"the Deployment's condition: {condition}")
    assert condition["status"] == "False" and condition["reason"] == "NoArchitectureLeft"
    (pod,) = app_pods(kube, namespace, "app")
    assert pod["spec"]["nodeName"] == install.node.name    # still where its image claims to run
    assert not events(kube, namespace, "EvictedExecFormatError", "Pod")   # no churn of archway's
    # The owner does what the Event says: an image that has a build here, rolled out. The lesson
    # ends with the failed image gone from the template, and the condition with it. (Removing
    # the annotation by hand while the pod still fails is tested round by round in
    # tests/test_closed_loop.py: here a leader elected meanwhile would learn it again, rightly.)
    runs = OciImage.of({"/pause": go_binary("pause"), "/build": namespace.encode()},
                       entrypoint=["/pause"])
    runs.push(node_registry, f"node/nowhere-{namespace}", "runs")
    kube.patch(deployment_path(namespace, "app"), {"spec": {"template": {"spec": {"containers": [
        {"name": "c0", "image": f"{node_registry.host}/node/nowhere-{namespace}:runs"}]}}}},
        kind="strategic")
    kube.wait_for(lambda: not [
        c for c in kube.get(deployment_path(namespace, "app"))["status"].get("conditions") or []
        if c["type"] == "archway.dev/ArchitectureLeft"], timeout=120,
        what="the condition removed once its lesson ended")
    running = kube.wait_for(lambda: [
        p for p in app_pods(kube, namespace, "app") if p["status"].get("phase") == "Running"
        and ready(p) and p["spec"]["containers"][0]["image"].endswith(":runs")], timeout=180,
        what="the rolled-out pod Running")
    assert [p["spec"]["nodeName"] for p in running] == [install.node.name]
