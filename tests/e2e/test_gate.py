"""Gate on a miss through the real apiserver: the webhook gates a pod whose images it could not
read in time, the real apiserver validates archway's release (KEP-3838: a gated pod's placement
may only be narrowed) and the real scheduler binds the released pod — or, when the images share
no architecture, never does."""
import re
import time

import pytest

from lab.kube import pod_path

from .conftest import DEADLINE
from .workloads import arches_of, create_pod, describe, gated, metric, pod, wait_bound

ARCH = "kubernetes.io/arch"


def events(kube, namespace, name):
    """archway's Events on the pod (the scheduler's own, e.g. Scheduled, are left out)."""
    return kube.wait_for(lambda: archways(kube.events_for(namespace, name)), timeout=10,
                         what=f"archway's Event on {name}")


def archways(found: list[dict]) -> list[dict]:
    return [e for e in found if e.get("reportingController") == "archway.dev/archway"]


def required_terms(pod_obj: dict) -> list:
    return pod_obj["spec"]["affinity"]["nodeAffinity"][
        "requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]


def test_a_pod_gated_on_a_slow_registry_is_placed_and_bound_once_the_registry_is_back(
        archway, kube, namespace, images, slow_registry):
    tag = images.fresh("e2e/multi")
    created = create_pod(kube, namespace, pod("slow", [images.ref("e2e/multi", tag, via="slow")]))
    assert "waits (SchedulingGated)" in kube.last_warnings      # kubectl shows it
    assert gated(created), describe(kube, namespace, "slow")
    assert created["metadata"]["labels"]["archway.dev/gated"] == "true"
    assert ARCH not in str(created["spec"])
    time.sleep(2 * DEADLINE)
    still = kube.get(pod_path(namespace, "slow"))
    assert gated(still) and not still["spec"].get("nodeName"), "a gated pod must not be bound"
    # the gate controller's gauge, set once its watch has seen the pod
    kube.wait_for(lambda: metric(archway.webhook, "archway_gated_pods") >= 1, timeout=30,
                  what="archway_gated_pods counting the pod")

    slow_registry.delay = 0.0
    (bound,) = wait_bound(kube, namespace, "slow", 1, timeout=30)
    assert "schedulingGates" not in bound["spec"] and "archway.dev/gated" not in bound["metadata"]["labels"]
    assert required_terms(bound) == [
        {"matchExpressions": [{"key": ARCH, "operator": "In", "values": ["amd64", "arm64"]}]}]
    assert arches_of(kube, [bound]) <= {"amd64", "arm64"}
    assert bound["metadata"]["annotations"]["archway.dev/architectures"] == "amd64,arm64"
    (event,) = events(kube, namespace, "slow")
    assert (event["type"], event["reason"]) == ("Normal", "Placed")
    assert "amd64, arm64" in event["note"] and "waiting" in event["note"]
    # counted by the controller's process around the release: waited for, not assumed
    kube.wait_for(lambda: metric(archway.webhook, "archway_gate_releases_total",
                                 outcome="placed") >= 1
                  and metric(archway.webhook, "archway_gate_wait_seconds_count") >= 1,
                  timeout=30, what="the release counted")


def test_another_controllers_gate_stays_when_archway_releases_its_own(
        archway, kube, namespace, images, slow_registry):
    tag = images.fresh("e2e/multi")
    created = create_pod(kube, namespace, pod(
        "two-gates", [images.ref("e2e/multi", tag, via="slow")],
        schedulingGates=[{"name": "example.com/quota"}]))
    assert [g["name"] for g in created["spec"]["schedulingGates"]] == [
        "example.com/quota", "archway.dev/resolving"]
    slow_registry.delay = 0.0
    released = kube.wait_for(lambda: (p := kube.get(pod_path(namespace, "two-gates")))
                             and not gated(p) and p, timeout=30, what="archway's release")
    assert [g["name"] for g in released["spec"]["schedulingGates"]] == ["example.com/quota"]
    assert not released["spec"].get("nodeName")   # the other gate still holds it
    assert released["metadata"]["annotations"]["archway.dev/architectures"] == "amd64,arm64"


def test_images_that_turn_out_to_share_no_architecture_keep_the_pod_off_every_node(
        archway, kube, namespace, images, slow_registry):
    amd, arm = (images.ref(repo, images.fresh(repo), via="slow") for repo in ("e2e/amd64", "e2e/arm64"))
    assert gated(create_pod(kube, namespace, pod("never", [amd, arm])))
    slow_registry.delay = 0.0
    released = kube.wait_for(lambda: (p := kube.get(pod_path(namespace, "never")))
                             and not gated(p) and p, timeout=30, what="archway's release")
    assert required_terms(released) == [{"matchExpressions": [
        {"key": ARCH, "operator": "In", "values": ["no-common-architecture"]}]}]
    (event,) = events(kube, namespace, "never")
    assert (event["type"], event["reason"]) == ("Warning", "NoCommonArchitecture")
    assert f"{amd} (amd64)" in event["note"] and f"{arm} (arm64)" in event["note"]
    # The real scheduler finds no node for it, and says so.
    failed = kube.wait_for(lambda: [e for e in kube.items(
        f"/api/v1/namespaces/{namespace}/events", fieldSelector="involvedObject.name=never")
        if e["reason"] == "FailedScheduling"], timeout=30, what="FailedScheduling")
    assert "node affinity" in failed[0]["message"].lower()
    assert not kube.get(pod_path(namespace, "never"))["spec"].get("nodeName")


def test_a_gated_pod_deleted_before_its_release_is_forgotten(
        archway, kube, namespace, images, slow_registry):
    created = create_pod(kube, namespace, pod("deleted", [
        images.ref("e2e/arm64", images.fresh("e2e/arm64"), via="slow")]))
    assert gated(created)
    before = metric(archway.webhook, "archway_gate_releases_total", outcome="deleted")
    kube.delete(pod_path(namespace, "deleted"), gracePeriodSeconds=0)
    kube.wait_for(lambda: metric(archway.webhook, "archway_gate_releases_total",
                                 outcome="deleted") > before, timeout=15, what="the deletion seen")
    slow_registry.delay = 0.0
    time.sleep(2)
    assert archways(kube.events_for(namespace, "deleted")) == []
    assert not re.search(rf"gate controller: \w+ {namespace}/deleted", archway.webhook.log(5000))


@pytest.fixture
def short_gate(archway):
    """The webhook restarted with a gate that ends after 6 s, and put back after the test."""
    webhook = archway.restart_webhook({"admission": {"gate_max_seconds": 6}})
    yield webhook
    archway.restart_webhook()


def test_a_pod_gated_on_a_registry_that_never_answers_is_released_at_gate_max_seconds(
        archway, kube, namespace, images, short_gate):
    image = images.ref("e2e/arm64", images.fresh("e2e/arm64"), via="dead")
    created = create_pod(kube, namespace, pod("dead", [image]))
    assert gated(created), describe(kube, namespace, "dead")
    start = time.monotonic()
    released = kube.wait_for(lambda: (p := kube.get(pod_path(namespace, "dead"))) and not gated(p) and p,
                             timeout=30, what="the release at gate_max_seconds")
    assert 6 - 1.5 <= time.monotonic() - start <= 15     # creationTimestamp has 1 s granularity
    assert ARCH not in str(released["spec"])
    assert "archway.dev/architectures" not in (released["metadata"].get("annotations") or {})
    kube.wait_for(lambda: kube.get(pod_path(namespace, "dead"))["spec"].get("nodeName"), timeout=30,
                  what="the released pod to be bound")
    (event,) = events(kube, namespace, "dead")
    assert (event["type"], event["reason"]) == ("Warning", "ReleasedUnplaced")
    assert image in event["note"]
    kube.wait_for(lambda: metric(short_gate, "archway_gate_releases_total",
                                 outcome="unplaced") == 1, timeout=30,
                  what="the unplaced release counted")
