"""Every image a pod pulls, on its OS (issue 36), through the real apiserver and scheduler: image
volumes (KEP-4639, GA and locked on since 1.36) placed by like container images, an OCI artifact
volume that constrains nothing, a Windows pod with a mixed-OS index on API-only Windows Nodes,
and a Linux pod with a Windows-only image refused."""
import json

import pytest

from lab.kube import KubeError, pod_path
from lab.servers.registry import OCI_MANIFEST

from .workloads import arches_of, create_pod, pod, wait_bound

OS_TAINT = {"key": "node.kubernetes.io/os", "value": "windows", "effect": "NoSchedule"}
WINDOWS_NODES = ("win-amd64-1", "win-amd64-2")


@pytest.fixture(scope="module")
def os_images(images):
    """A linux/arm64 + windows/amd64 index, a Windows-only image (its config says windows) and
    an OCI artifact (artifactType, empty config), pushed once."""
    reg = images.registry
    child = reg.push_image("e2e/mixed-os", None, "windows/amd64",
                           config_extra={"os.version": "10.0.20348.2340"})
    entry = {"mediaType": OCI_MANIFEST, "digest": child,
             "size": len(reg.get_manifest("e2e/mixed-os", child).content),
             "platform": {"architecture": "amd64", "os": "windows", "os.version": "10.0.20348.2340"}}
    reg.push_index("e2e/mixed-os", "1", ["linux/arm64"], extra_entries=[entry])
    reg.push_image("e2e/windows-only", "1", "windows/amd64")
    reg.push_artifact("e2e/model", "1", "application/vnd.example.model.v1")
    return images


@pytest.fixture(scope="module")
def windows_nodes(control_plane):
    """Two amd64 Windows Nodes (API objects, no kubelet), tainted as Windows pools are, so the
    other tests' Linux pods never land there; deleted afterwards."""
    for i, name in enumerate(WINDOWS_NODES):
        control_plane.add_node(name, "amd64", address=f"10.244.9.{i + 1}",
                               labels={"kubernetes.io/os": "windows"})
        control_plane.kube.patch(f"/api/v1/nodes/{name}", {"spec": {"taints": [OS_TAINT]}})
    yield WINDOWS_NODES
    for name in WINDOWS_NODES:
        control_plane.kube.delete(f"/api/v1/nodes/{name}")


def image_volume(name: str, reference: str) -> dict:
    return {"name": name, "image": {"reference": reference, "pullPolicy": "IfNotPresent"}}


def with_volumes(body: dict, *volumes: dict) -> dict:
    body["spec"]["volumes"] = list(volumes)
    body["spec"]["containers"][0]["volumeMounts"] = [
        {"name": v["name"], "mountPath": f"/mnt/{v['name']}", "readOnly": True} for v in volumes]
    return body


def test_an_amd64_only_image_volume_pins_the_pod_to_amd64(archway, kube, namespace, os_images):
    body = with_volumes(pod("vol", [os_images.ref("e2e/multi")]),
                        image_volume("tools", os_images.ref("e2e/amd64")))
    create_pod(kube, namespace, body)
    (bound,) = wait_bound(kube, namespace, "vol", 1)
    assert bound["spec"]["nodeSelector"] == {"kubernetes.io/arch": "amd64"}
    assert arches_of(kube, [bound]) == {"amd64"}
    annotations = bound["metadata"]["annotations"]
    assert annotations["archway.dev/architectures"] == "amd64"
    entries = json.loads(annotations["archway.dev/images"])
    assert [(e.get("volume"), e["architectures"]) for e in entries] == \
        [(None, ["amd64", "arm64"]), ("tools", ["amd64"])]


def test_an_artifact_image_volume_constrains_nothing(archway, kube, namespace, os_images):
    body = with_volumes(pod("model", [os_images.ref("e2e/arm64")]),
                        image_volume("models", os_images.ref("e2e/model")))
    create_pod(kube, namespace, body)
    assert "(image volume 'models') is an OCI artifact, no image" in kube.last_warnings
    (bound,) = wait_bound(kube, namespace, "model", 1)
    assert arches_of(kube, [bound]) == {"arm64"}
    annotations = bound["metadata"]["annotations"]
    assert annotations["archway.dev/architectures"] == "arm64"
    (_, model) = json.loads(annotations["archway.dev/images"])
    assert model["volume"] == "models" and model["architectures"] == []
    assert model["source"] == "oci-artifact" and "vnd.example.model.v1" in model["note"]


def test_a_windows_pod_with_a_mixed_os_index_is_placed_on_windows_amd64(
        archway, kube, namespace, os_images, windows_nodes):
    body = pod("win", [os_images.ref("e2e/mixed-os")], os={"name": "windows"},
               nodeSelector={"kubernetes.io/os": "windows"},
               tolerations=[{**OS_TAINT, "operator": "Equal"}])
    create_pod(kube, namespace, body)
    (bound,) = wait_bound(kube, namespace, "win", 1)
    assert bound["spec"]["nodeSelector"] == {"kubernetes.io/os": "windows",
                                             "kubernetes.io/arch": "amd64"}
    assert bound["spec"]["nodeName"] in windows_nodes
    assert bound["metadata"]["annotations"]["archway.dev/architectures"] == "amd64"
    assert "Pending" not in kube.last_warnings


def test_a_linux_pod_with_a_windows_only_image_is_refused(archway, kube, namespace, os_images):
    image = os_images.ref("e2e/windows-only")
    with pytest.raises(KubeError) as refused:
        create_pod(kube, namespace, pod("nowin", [image]))
    assert refused.value.status == 403
    assert f"{image} has no linux platform: windows/amd64 only" in refused.value.message
    assert not kube.exists(pod_path(namespace, "nowin"))


def test_a_pod_gated_on_its_image_volume_is_placed_by_it_once_the_registry_answers(
        archway, kube, namespace, os_images, slow_registry):
    """The webhook cannot read the volume's image in time: the pod is gated, and the gate
    controller reads that image (not only the containers') and places the pod by it."""
    tag = os_images.fresh("e2e/amd64")
    body = with_volumes(pod("gated-vol", [os_images.ref("e2e/multi")]),
                        image_volume("tools", os_images.ref("e2e/amd64", tag, via="slow")))
    created = create_pod(kube, namespace, body)
    assert any(g["name"] == "archway.dev/resolving" for g in created["spec"]["schedulingGates"])
    slow_registry.delay = 0.0
    (bound,) = wait_bound(kube, namespace, "gated-vol", 1, timeout=60)
    assert arches_of(kube, [bound]) == {"amd64"}
    assert bound["metadata"]["annotations"]["archway.dev/architectures"] == "amd64"
