"""Gate on a miss through the real apiserver: the webhook gates a pod whose images it could not
read in time, the real apiserver validates archway's release (KEP-3838: a gated pod's placement
may only be narrowed) and the real scheduler binds the released pod."""
import time

import pytest

from tests.infra.kube import pod_path

from .conftest import DEADLINE
from .workloads import (
    arches_of,
    create_pod,
    describe,
    event_reasons,
    gated,
    pod,
    wait_bound,
)


@pytest.fixture
def slow_registry(images):
    """The registry as archway reaches it through `images.slow`: slower than any lookup may
    take, until the test sets the delay back to 0."""
    images.slow.delay = 3.0
    yield images.slow
    images.slow.delay = 0.0


def test_a_pod_gated_on_a_slow_registry_is_placed_and_bound_once_the_registry_is_back(
        archway, kube, namespace, images, slow_registry):
    tag = images.fresh("e2e/arm64")
    created = create_pod(kube, namespace, pod("slow", [images.ref("e2e/arm64", tag, via="slow")]))
    assert gated(created), describe(kube, namespace, "slow")
    assert created["metadata"]["labels"]["archway.dev/gated"] == "true"
    time.sleep(2 * DEADLINE)
    still = kube.get(pod_path(namespace, "slow"))
    assert gated(still) and not still["spec"].get("nodeName"), "a gated pod must not be bound"

    slow_registry.delay = 0.0
    (bound,) = wait_bound(kube, namespace, "slow", 1, timeout=30)
    assert not gated(bound) and "archway.dev/gated" not in bound["metadata"]["labels"]
    assert arches_of(kube, [bound]) == {"arm64"}
    assert bound["metadata"]["annotations"]["archway.dev/architectures"] == "arm64"
    assert "Placed" in event_reasons(kube, namespace, "slow")


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


@pytest.fixture
def short_gate(archway):
    """The webhook restarted with a gate that ends after 6 s, and put back after the test."""
    webhook = archway.restart_webhook({"admission": {"gate_max_seconds": 6}})
    yield webhook
    archway.restart_webhook()


def test_a_pod_gated_on_a_registry_that_never_answers_is_released_at_gate_max_seconds(
        archway, kube, namespace, images, short_gate):
    image = images.ref("e2e/arm64", images.fresh("e2e/arm64"), via="dead")
    name = "dead"
    created = create_pod(kube, namespace, pod(name, [image]))
    assert gated(created), describe(kube, namespace, name)
    start = time.monotonic()
    released = kube.wait_for(lambda: (p := kube.get(pod_path(namespace, name))) and not gated(p) and p,
                             timeout=30, what="the release at gate_max_seconds")
    waited = time.monotonic() - start
    assert 3 <= waited <= 15, waited
    assert "archway.dev/architectures" not in (released["metadata"].get("annotations") or {})
    kube.wait_for(lambda: kube.get(pod_path(namespace, name))["spec"].get("nodeName"), timeout=30,
                  what="the released pod to be bound")
    assert "ReleasedUnplaced" in event_reasons(kube, namespace, name)
