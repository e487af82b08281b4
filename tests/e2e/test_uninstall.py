"""`helm uninstall` with the chart's pre-delete hook (run as its own ServiceAccount) leaves no
pod gated by an archway that is gone, and its post-delete hook no Lease of archway's processes.
Runs last: it reinstalls archway afterwards."""
from lab.kube import pod_path

from .workloads import create_pod, describe, gated, pod


def test_uninstall_releases_every_gated_pod(archway, kube, namespace, images):
    image = images.ref("e2e/arm64", images.fresh("e2e/arm64"), via="dead")
    for i in range(3):
        created = create_pod(kube, namespace, pod(f"gated-{i}", [image]))
        assert gated(created), describe(kube, namespace, f"gated-{i}")
    leases = f"/apis/coordination.k8s.io/v1/namespaces/{archway.namespace}/leases"
    kube.wait_for(lambda: kube.items(leases), timeout=60, what="the gate controller's Lease")
    try:
        archway.uninstall()
        assert kube.items(leases) == []       # made by archway's processes, not by helm
        assert not [c for c in kube.items("/apis/scheduling.k8s.io/v1/priorityclasses")
                    if c["metadata"]["name"].startswith(archway.release)]
        for i in range(3):
            left = kube.get(pod_path(namespace, f"gated-{i}"))
            assert not gated(left), describe(kube, namespace, f"gated-{i}")
            assert "archway.dev/gated" not in left["metadata"].get("labels", {})
        every_pod = kube.items("/api/v1/pods")
        assert not [p["metadata"]["name"] for p in every_pod if gated(p)]
        assert not kube.items("/apis/admissionregistration.k8s.io/v1/mutatingwebhookconfigurations")
        # Pods created now are not sent to a webhook that no longer exists.
        plain = create_pod(kube, namespace, pod("after", [images.ref("e2e/arm64")]))
        assert not gated(plain) and "archway.dev/architectures" not in (
            plain["metadata"].get("annotations") or {})
    finally:
        archway.install()
