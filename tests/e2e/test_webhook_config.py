"""The chart's MutatingWebhookConfiguration as the real apiserver evaluates it: matchConditions
(CEL), the object and namespace selectors, and failurePolicy Ignore with archway gone."""
import time

from lab.cluster.controlplane import stop_process
from lab.kube import pod_path

from .workloads import create_pod, pod, wait_bound


def admitted_by_archway(archway, namespace: str, name: str) -> bool:
    """Did archway's webhook see this pod? (it logs every admission in the e2e config)"""
    return f"admission {namespace}/{name} " in archway.webhook.log(5000)


def test_pods_the_match_conditions_exclude_never_reach_archway(archway, kube, namespace, images):
    image = images.ref("e2e/arm64")
    create_pod(kube, namespace, pod("seen", [image]))
    skipped = pod("skip-annotation", [image])
    skipped["metadata"]["annotations"] = {"archway.dev/skip": "true"}
    create_pod(kube, namespace, skipped)
    labelled = pod("skip-label", [image])
    labelled["metadata"]["labels"]["archway.dev/skip"] = "true"
    create_pod(kube, namespace, labelled)
    create_pod(kube, namespace, pod("bound", [image], nodeName="amd64-1"))

    # The last pod archway sees, so the log is complete for the ones before it.
    create_pod(kube, namespace, pod("last", [image]))
    archway_sees = lambda name: admitted_by_archway(archway, namespace, name)  # noqa: E731
    kube.wait_for(lambda: archway_sees("last"), timeout=10, what="archway's admission log line")
    assert archway_sees("seen")
    for name in ("skip-annotation", "skip-label", "bound"):
        assert not archway_sees(name), name
        annotations = kube.get(pod_path(namespace, name))["metadata"].get("annotations") or {}
        assert "archway.dev/architectures" not in annotations
    assert kube.get(pod_path(namespace, "bound"))["spec"]["nodeName"] == "amd64-1"


def test_pods_of_archways_own_namespace_are_not_sent_to_it(archway, kube, images):
    body = pod("own", [images.ref("e2e/arm64")])
    create_pod(kube, archway.namespace, body)
    try:
        time.sleep(0.5)
        assert not admitted_by_archway(archway, archway.namespace, "own")
    finally:
        kube.delete(pod_path(archway.namespace, "own"))


def test_with_archway_stopped_pods_are_still_created(archway, kube, namespace, images):
    stop_process(archway.webhook.process)
    try:
        start = time.monotonic()
        created = create_pod(kube, namespace, pod("unplaced", [images.ref("e2e/arm64")]))
        # Connection refused: the apiserver gives up at once, not at the webhook's timeout.
        assert time.monotonic() - start < 3
        assert "archway.dev/architectures" not in (created["metadata"].get("annotations") or {})
        wait_bound(kube, namespace, "unplaced", 1)
    finally:
        archway.restart_webhook()


def test_the_apiserver_stores_the_selection_the_chart_recorded(archway, kube):
    """The trust path compares the live configuration with the chart's record of it
    (certs/trustpath.py): as the real apiserver stores (and defaults) it, nothing differs."""
    from archway.certs.trustpath import INSTALLED_SELECTION, selection_problems
    configurations = [c for c in kube.items(
        "/apis/admissionregistration.k8s.io/v1/mutatingwebhookconfigurations")
        if INSTALLED_SELECTION in (c["metadata"].get("annotations") or {})]
    assert configurations, "no configuration carries the chart's record"
    for configuration in configurations:
        assert selection_problems(configuration) == [], configuration["metadata"]["name"]
        first = dict(configuration["webhooks"][0], failurePolicy="Fail")
        edited = dict(configuration, webhooks=[first, *configuration["webhooks"][1:]])
        assert selection_problems(edited) == [
            f"webhook {first['name']}: failurePolicy not as the chart installed it, so the "
            f"apiserver may not send archway the pods it should (helm upgrade restores it)"]
