"""A burst of pods on a slow registry through the real apiserver (issue 30): archway's threads
are each held for a deadline by a lookup, the rest of the burst waits in its queue, and the
apiserver gives up on a call after the webhook's timeoutSeconds (5 s) and, failurePolicy Ignore,
admits the pod with no gate and no placement: it "fails open", and the pod may land on any
architecture. Every pod of the burst must come back gated or placed, and the apiserver's own
count of fail-opens must not move."""
from concurrent.futures import ThreadPoolExecutor

from lab.kube import Kube, pod_path

from .workloads import create_pod, gated, pod

ARCH = "kubernetes.io/arch"
BURST = 100
REGISTRY_SECONDS = 10.0    # each answer of the registry, well past any deadline


def fail_opens(kube: Kube) -> float:
    """apiserver_admission_webhook_fail_open_count, summed over webhooks, from the apiserver's
    own /metrics (k8s.io/apiserver/pkg/admission/metrics)."""
    text = kube.session.get(kube.server + "/metrics", timeout=30).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("apiserver_admission_webhook_fail_open_count{"))


def test_a_burst_on_a_slow_registry_is_gated_or_placed_never_failed_open(
        archway, kube, namespace, images):
    image = images.ref("e2e/amd64", images.fresh("e2e/amd64"), via="slow")
    clients = [kube.as_user(kube.token) for _ in range(BURST)]   # a connection each
    images.slow.delay = REGISTRY_SECONDS
    try:
        before = fail_opens(kube)
        with ThreadPoolExecutor(BURST) as pool:
            created = list(pool.map(
                lambda i: create_pod(clients[i], namespace, pod(f"burst-{i}", [image])),
                range(BURST)))
        failed_open = fail_opens(kube) - before
        unplaced = [p["metadata"]["name"] for p in created
                    if not gated(p) and ARCH not in str(p["spec"])]
        assert (failed_open, unplaced) == (0, []), (
            f"{failed_open:g} calls failed open; pods with neither archway's gate nor its "
            f"placement: {unplaced}")
    finally:
        kube.delete(pod_path(namespace), gracePeriodSeconds=0)   # none left for the scheduler
        images.slow.delay = 0.0
        for client in clients:
            client.session.close()
