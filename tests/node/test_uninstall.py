"""`helm uninstall --wait` on a node with no room for one more pod (the kubelet's maxPods
reached by ordinary, priority-0 workloads): the chart's hook Jobs still run (their own
PriorityClass preempts a workload pod), the uninstall ends in bounded time, and nothing of
archway's is left in the cluster, the Leases its processes made included. It uninstalls the
session's install: the next test to ask for one installs again."""
import time

import pytest

from lab.kube import pod_path
from tests.e2e.workloads import create_deployment, deployment, pods_of

from .test_incluster import fresh_namespace, pause_image

UNINSTALL_TIMEOUT = "3m"    # where the issue saw `helm uninstall --wait` give up
# What the release namespace may hold once archway is gone: what the cluster puts in every one.
CLUSTER_OWNED = {"ConfigMap/kube-root-ca.crt", "ServiceAccount/default"}
NAMESPACED = (("apps/v1", "deployments", "Deployment"), ("batch/v1", "jobs", "Job"),
              ("batch/v1", "cronjobs", "CronJob"), ("v1", "pods", "Pod"),
              ("v1", "secrets", "Secret"), ("v1", "configmaps", "ConfigMap"),
              ("v1", "serviceaccounts", "ServiceAccount"), ("v1", "services", "Service"),
              ("rbac.authorization.k8s.io/v1", "roles", "Role"),
              ("rbac.authorization.k8s.io/v1", "rolebindings", "RoleBinding"),
              ("coordination.k8s.io/v1", "leases", "Lease"),
              ("policy/v1", "poddisruptionbudgets", "PodDisruptionBudget"))
CLUSTER_SCOPED = (("admissionregistration.k8s.io/v1", "mutatingwebhookconfigurations",
                   "MutatingWebhookConfiguration"),
                  ("rbac.authorization.k8s.io/v1", "clusterroles", "ClusterRole"),
                  ("rbac.authorization.k8s.io/v1", "clusterrolebindings", "ClusterRoleBinding"),
                  ("scheduling.k8s.io/v1", "priorityclasses", "PriorityClass"))


def _api(group_version: str) -> str:
    return f"/api/{group_version}" if "/" not in group_version else f"/apis/{group_version}"


def archway_objects(kube, release: str, namespace: str) -> list[str]:
    """Kind/name of everything of the release left: every object in its namespace but what the
    cluster makes there, and the cluster-scoped objects named after it."""
    left = [f"{kind}/{o['metadata']['name']}" for group_version, plural, kind in NAMESPACED
            for o in kube.items(f"{_api(group_version)}/namespaces/{namespace}/{plural}")]
    left += [f"{kind}/{o['metadata']['name']}" for group_version, plural, kind in CLUSTER_SCOPED
             for o in kube.items(f"{_api(group_version)}/{plural}")
             if o["metadata"]["name"].startswith(release)]
    return sorted(set(left) - CLUSTER_OWNED)


def pods_on(kube, node: str) -> list[dict]:
    """The pods that take one of the node's pod slots (bound, not finished)."""
    return [p for p in kube.items("/api/v1/pods", fieldSelector=f"spec.nodeName={node}")
            if p["status"].get("phase") not in ("Succeeded", "Failed")]


def fill(kube, node: str, namespace: str, image: str) -> int:
    """A priority-0 Deployment taking every free pod slot of `node` and asking for more; returns
    the slots it holds once one of its pods waits with "Too many pods"."""
    capacity = int(kube.get(f"/api/v1/nodes/{node}")["status"]["allocatable"]["pods"])
    free = capacity - len(pods_on(kube, node))
    create_deployment(kube, namespace, deployment(
        "filler", [image], replicas=free + 2, terminationGracePeriodSeconds=1,
        nodeSelector={"kubernetes.io/hostname": node}))

    def full():
        waiting = [p for p in pods_of(kube, namespace, "filler") if not p["spec"].get("nodeName")
                   and any("Too many pods" in (c.get("message") or "")
                           for c in p["status"].get("conditions") or [])]
        return len(pods_on(kube, node)) >= capacity and waiting
    kube.wait_for(full, timeout=600, what=f"node {node} full ({capacity} pods)")
    return capacity


@pytest.mark.timeout(1800)     # the session's install when first, ~110 pods started and removed
def test_helm_uninstall_finishes_on_a_full_node_and_leaves_nothing(in_cluster, node_registry):
    plane, node = in_cluster.plane, in_cluster.node
    kube = plane.kube
    release, home = in_cluster.release, in_cluster.namespace
    # The Leases exist: archway's gate controller and second scheduler are leading.
    kube.wait_for(lambda: len(kube.items(
        f"/apis/coordination.k8s.io/v1/namespaces/{home}/leases")) >= 2,
        timeout=120, what="archway's Leases")
    namespace = fresh_namespace(plane, "full")
    try:
        capacity = fill(kube, node.name, namespace, pause_image(node_registry))
        started = time.monotonic()
        in_cluster.uninstall(timeout=UNINSTALL_TIMEOUT)
        took = time.monotonic() - started
        # Secrets go with their owner (the webhook configuration) by the garbage collector,
        # and pods end their grace period: a moment after helm returns.
        deadline = time.monotonic() + 90
        while (left := archway_objects(kube, release, home)) and time.monotonic() < deadline:
            time.sleep(2)
        print(f"node of {capacity} pods full: helm uninstall --wait took {took:.0f} s")
        assert left == []
    finally:
        kube.delete(f"/api/v1/namespaces/{namespace}")
        kube.wait_for(lambda: not kube.items(pod_path(namespace)) or None, timeout=300,
                      what="the filler pods gone")
