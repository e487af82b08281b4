"""Placement through the real apiserver and scheduler: Deployments whose pods the
controller-manager creates, archway's webhook patches, and kube-scheduler binds to the Nodes of
the control plane (2 amd64, 2 arm64, 1 ppc64le)."""
import os
import subprocess

import pytest

from lab.kube import KubeError, pod_path

from .workloads import (
    arches_of,
    create_deployment,
    create_pod,
    deployment,
    pod,
    wait_bound,
)


@pytest.mark.parametrize("repo, allowed", [
    ("e2e/arm64", {"arm64"}),
    ("e2e/amd64", {"amd64"}),
    ("e2e/ppc64le", {"ppc64le"}),
    ("e2e/multi", {"amd64", "arm64"}),
])
def test_every_pod_of_a_deployment_lands_on_an_architecture_its_image_has(
        archway, kube, namespace, images, repo, allowed):
    create_deployment(kube, namespace, deployment("web", [images.ref(repo)], replicas=6))
    pods = wait_bound(kube, namespace, "web", 6)
    assert arches_of(kube, pods) <= allowed
    for p in pods:
        assert set(p["metadata"]["annotations"]["archway.dev/architectures"].split(",")) == allowed
        assert p["metadata"]["ownerReferences"][0]["kind"] == "ReplicaSet"


def test_an_init_container_image_narrows_the_pod_to_its_architectures(
        archway, kube, namespace, images):
    create_deployment(kube, namespace, deployment(
        "init", [images.ref("e2e/everywhere")], init=[images.ref("e2e/arm64")], replicas=4))
    pods = wait_bound(kube, namespace, "init", 4)
    assert arches_of(kube, pods) == {"arm64"}


def test_the_spread_over_two_architectures_uses_both(archway, kube, namespace, images):
    # The patch allows both architectures, it does not pick one: the scheduler's spreading puts
    # pods of one Deployment on nodes of each (4 nodes, 8 pods).
    create_deployment(kube, namespace, deployment("spread", [images.ref("e2e/multi")], replicas=8))
    pods = wait_bound(kube, namespace, "spread", 8)
    assert arches_of(kube, pods) == {"amd64", "arm64"}


def test_images_with_no_common_architecture_are_denied_with_the_reason(
        archway, kube, namespace, images):
    with pytest.raises(KubeError) as refused:
        create_pod(kube, namespace, pod("never", [images.ref("e2e/amd64"), images.ref("e2e/arm64")]))
    assert refused.value.status == 403   # denied by an admission webhook
    assert "archway" in refused.value.message
    assert "amd64" in refused.value.message and "arm64" in refused.value.message
    assert not kube.exists(pod_path(namespace, "never"))


def test_a_deployment_that_can_run_nowhere_shows_why_in_its_replicaset_events(
        archway, kube, namespace, images):
    create_deployment(kube, namespace, deployment(
        "nowhere", [images.ref("e2e/amd64")], init=[images.ref("e2e/ppc64le")], replicas=2))

    def failed_create():
        sets = kube.items(f"/apis/apps/v1/namespaces/{namespace}/replicasets")
        if not sets:
            return None
        events = kube.items(f"/api/v1/namespaces/{namespace}/events",
                            fieldSelector=f"involvedObject.name={sets[0]['metadata']['name']}")
        return [e for e in events if e.get("reason") == "FailedCreate"]
    (event, *_) = kube.wait_for(failed_create, timeout=30, what="a FailedCreate event")
    assert "archway" in event["message"] and "no common" in event["message"].lower() \
        or "share no" in event["message"], event["message"]
    assert kube.items(pod_path(namespace), labelSelector="app=nowhere") == []


def test_kubectl_describe_pod_shows_why_no_node_can_run_it(
        archway, control_plane, kube, namespace, images):
    """A pod created by its name: archway's Event is about the pod itself, and `kubectl describe
    pod` (which selects Events by the pod's uid, given only when the pod is stored, after
    admission) shows it."""
    image = images.ref("e2e/s390x", images.fresh("e2e/s390x", ["linux/s390x"]))
    create_pod(kube, namespace, pod("lonely", [image]))
    assert "s390x-only" in kube.last_warnings
    env = {k: v for k, v in os.environ.items() if "proxy" not in k.lower()}

    def described():
        done = subprocess.run([control_plane.binary("kubectl"), "--kubeconfig",
                               control_plane.admin_kubeconfig, "describe", "pod", "lonely",
                               "-n", namespace], capture_output=True, text=True, timeout=60,
                              env=env)
        assert done.returncode == 0, done.stderr
        return done.stdout if "ArchwayUnschedulable" in done.stdout else None
    text = kube.wait_for(described, timeout=30, what="archway's Event in kubectl describe pod")
    (line,) = [line for line in text.splitlines() if "ArchwayUnschedulable" in line]
    assert "Warning" in line and "images are s390x-only" in line, text


def test_a_pod_that_pins_its_own_architecture_keeps_it(archway, kube, namespace, images):
    create_pod(kube, namespace, pod("pinned", [images.ref("e2e/multi")],
                                    nodeSelector={"kubernetes.io/arch": "arm64"}))
    (bound,) = wait_bound(kube, namespace, "pinned", 1)
    assert arches_of(kube, [bound]) == {"arm64"}
