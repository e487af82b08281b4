"""`kubectl debug` (the kubectl built with the control plane) against a pod bound to an amd64 Node,
with an arm64-only image in the real registry: the apiserver calls the chart's second webhook
(debug-containers.archway.dev, UPDATE of pods/ephemeralcontainers) and kubectl prints archway's
warning, or its refusal. The ephemeral container never needs to run for admission."""
import subprocess

from lab.kube import pod_path

from .workloads import create_pod, pod

NODE = "amd64-1"


def bound_pod(kube, namespace: str, image: str, name: str = "x") -> None:
    """A pod no scheduler takes, bound to the amd64 Node by a Binding (as a scheduler binds)."""
    create_pod(kube, namespace, pod(name, [image], schedulerName="nobody"))
    kube.create(f"{pod_path(namespace, name)}/binding",
                {"apiVersion": "v1", "kind": "Binding", "metadata": {"name": name},
                 "target": {"apiVersion": "v1", "kind": "Node", "name": NODE}})
    assert kube.get(pod_path(namespace, name))["spec"]["nodeName"] == NODE


def kubectl_debug(control_plane, namespace: str, name: str, image: str):
    return subprocess.run(
        [control_plane.binary("kubectl"), f"--kubeconfig={control_plane.admin_kubeconfig}",
         "-n", namespace, "debug", f"pod/{name}", f"--image={image}"],
        capture_output=True, text=True, timeout=60)


def ephemeral_images(kube, namespace: str, name: str) -> list[str]:
    spec = kube.get(pod_path(namespace, name))["spec"]
    return [c["image"] for c in spec.get("ephemeralContainers") or []]


def test_kubectl_debug_prints_archways_warning(archway, control_plane, kube, namespace, images):
    bound_pod(kube, namespace, images.ref("e2e/amd64"))
    arm64_only = images.ref("e2e/arm64")

    done = kubectl_debug(control_plane, namespace, "x", arm64_only)

    assert done.returncode == 0, done.stderr
    assert (f"Warning: debug image {arm64_only} cannot run on node {NODE} (linux/amd64): "
            "it has linux/arm64") in done.stderr, done.stderr
    assert ephemeral_images(kube, namespace, "x") == [arm64_only]   # warned, not refused
    events = kube.wait_for(lambda: [e for e in kube.events_for(namespace, "x")
                                    if e.get("reason") == "ArchwayDebugImageCannotRun"],
                           timeout=10, what="the ArchwayDebugImageCannotRun Event")
    assert arm64_only in events[0]["note"] and events[0]["type"] == "Warning"

    # An image with an amd64 build: no word from archway.
    done = kubectl_debug(control_plane, namespace, "x", images.ref("e2e/multi"))
    assert done.returncode == 0 and "Warning" not in done.stderr, done.stderr


def test_kubectl_debug_is_refused_with_deny(archway, control_plane, kube, namespace, images):
    bound_pod(kube, namespace, images.ref("e2e/amd64"))
    ppc64le_only = images.ref("e2e/ppc64le")
    archway.restart_webhook({"admission": {"debug_containers": "deny"}})
    try:
        done = kubectl_debug(control_plane, namespace, "x", ppc64le_only)
        again = kubectl_debug(control_plane, namespace, "x", images.ref("e2e/everywhere"))
    finally:
        archway.restart_webhook()
    assert done.returncode != 0
    assert 'admission webhook "debug-containers.archway.dev" denied the request' in done.stderr
    assert f"debug image {ppc64le_only} has no platform for node {NODE} (linux/amd64)" in done.stderr
    assert again.returncode == 0, again.stderr
    assert ephemeral_images(kube, namespace, "x") == [images.ref("e2e/everywhere")]
