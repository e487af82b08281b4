"""The closed loop with an operator's `helm upgrade --set config.remediation.evict=true` (and tags
checked every 2 s), through the real apiserver: the RBAC it grants, a tag re-pushed without an
architecture raising the alarm before a reschedule breaks, and pods admitted while archway was
down revisited and moved. What depends on a kubelet's statuses (an eviction a
PodDisruptionBudget holds, a learned exclusion reset by a re-push and the pod then running) is
proven on the real node: tests/node/test_closed_loop_cases.py."""
import json
import time

import pytest

from lab.cluster.chart import CHART
from lab.cluster.processes import stop_process
from lab.kube import pod_path

from .loop import events, metric, on_arch, preferring_arm64
from .test_rbac import identity_of
from .test_tools import run_archway
from .workloads import create_deployment, node_arch, pods_of, wait_bound

TAG_TTL = 2


@pytest.fixture(scope="module")
def evicting(archway):
    """The chart upgraded with remediation.evict (its RBAC grants pods/eviction create) and a
    short tag TTL, the webhook restarted on it as a rollout would; put back afterwards."""
    def upgrade(*values: str) -> None:
        archway.helm("upgrade", archway.release, CHART, "--no-hooks", *values)
        archway.restart_webhook()

    # The session's processes run with eviction off over the chart's config (conftest).
    remediation = archway.archway_config["remediation"]
    remediation["evict"] = True
    upgrade("--reuse-values", "--set", "config.remediation.evict=true",
            "--set", f"config.registry.cache.tag_ttl_seconds={TAG_TTL}")
    assert archway.chart_config("webhook.yaml")["remediation"]["evict"] is True
    yield archway
    remediation["evict"] = False
    upgrade("--reset-values", "--values", archway.plane.path("values.yaml"))


def test_with_evict_on_the_chart_grants_evictions_and_nothing_more(evicting, kube):
    client, _ = identity_of(evicting, kube, "webhook")
    assert client.can_i("create", "pods/eviction", namespace="default")
    assert not client.can_i("delete", "pods", namespace="default")


def test_a_tag_repushed_without_arm64_raises_the_alarm_before_a_reschedule_breaks(
        evicting, control_plane, kube, namespace, images, tmp_path):
    """The Deployment's pods run on arm64; its tag is re-pushed for amd64 only: the leader's
    check of the tag raises ArchitecturesDropped, and `archway report` says so. (A re-push that
    resets a learned exclusion is proven on the real node, where the pod really failed and its
    replacement really runs: tests/node/test_closed_loop_cases.py.)"""
    registry = images.registry
    tag = images.fresh("e2e/multi")
    image = images.ref("e2e/multi", tag)
    create_deployment(kube, namespace, preferring_arm64("app", image, replicas=2))
    pods = wait_bound(kube, namespace, "app", 2)
    assert "arm64" in {node_arch(kube, p["spec"]["nodeName"]) for p in pods}
    # The leader has read the tag once it checks it at the registry (a HEAD per round).
    mark = registry.mark()
    kube.wait_for(lambda: any(e.method == "HEAD" and f"/e2e/multi/manifests/{tag}" in e.path
                              for e in registry.requests_since(mark)), timeout=10 * TAG_TTL,
                  what="the leader's check of the tag")

    dropped = metric(evicting, "archway_image_architectures_dropped_total", architecture="arm64")
    amd64_only = registry.push_image("e2e/multi", tag, "linux/amd64")
    (alarm,) = kube.wait_for(lambda: events(kube, namespace, "ArchitecturesDropped", "Deployment",
                                            "app"), timeout=10 * TAG_TTL,
                             what="an ArchitecturesDropped Event on the Deployment")
    assert alarm["type"] == "Warning"
    assert image in alarm["note"] and "arm64" in alarm["note"] and amd64_only[:19] in alarm["note"]
    assert metric(evicting, "archway_image_architectures_dropped_total",
                  architecture="arm64") == dropped + 1

    # archway report: the Deployment runs on an architecture its tag no longer offers.
    done = run_archway(control_plane, tmp_path, images, "report", "-n", namespace, "--json")
    assert done.returncode == 0, done.stderr
    (row,) = json.loads(done.stdout)["workloads"]
    assert (row["kind"], row["name"], row["architectures"]) == ("Deployment", "app", ["amd64"])
    assert row["not_offered"] == ["arm64"] and "arm64" in row["running_architectures"]
    assert "no longer offer" in done.stderr
    table = run_archway(control_plane, tmp_path, images, "report", "-n", namespace).stdout
    assert "NOT OFFERED: arm64" in table


def test_pods_admitted_while_archway_was_down_are_revisited_and_moved(
        evicting, kube, namespace, images):
    """archway's webhook (and with it the leader) stopped: the apiserver fails open, the pods of
    an amd64-only Deployment that prefers arm64 are bound without archway's decision, on arm64
    (a replica the scheduler spreads to amd64 runs where it is). archway back: each gets
    AdmittedWithoutArchway, those on arm64 are evicted, and their replacements are admitted by
    archway and placed on amd64 (gate/unseen.py)."""
    image = images.ref("e2e/amd64", images.fresh("e2e/amd64"))
    stop_process(evicting.webhook.process)
    create_deployment(kube, namespace, preferring_arm64("app", image, replicas=2))
    bare = wait_bound(kube, namespace, "app", 2)
    assert all("archway.dev/images" not in (p["metadata"].get("annotations") or {})
               for p in bare)
    wrong = {p["metadata"]["name"] for p in on_arch(kube, bare, "arm64")} \
        or pytest.fail("no pod on arm64")
    right = {p["metadata"]["name"] for p in bare} - wrong

    back = time.monotonic()
    evicting.restart_webhook()

    def placed():
        pods = pods_of(kube, namespace, "app")
        if wrong & {p["metadata"]["name"] for p in pods} or len(pods) != 2:
            return None
        found = [p for p in pods if p["metadata"]["name"] not in right and p["spec"].get(
            "nodeName") and "archway.dev/images" in (p["metadata"].get("annotations") or {})]
        return found if len(found) == len(wrong) else None
    replacements = kube.wait_for(placed, timeout=60, what="the pods on arm64 evicted and replaced")
    repaired = time.monotonic() - back
    assert len(on_arch(kube, replacements, "amd64")) == len(wrong)

    def recorded(reason: str, kind: str, name: str) -> list[dict]:
        return kube.wait_for(lambda: events(kube, namespace, reason, kind, name), timeout=10,
                             what=f"{reason} on {kind} {name}")
    for name in sorted(wrong):
        (seen,) = recorded("AdmittedWithoutArchway", "Pod", name)
        assert "its images run on amd64, not on arm64" in seen["note"], seen["note"]
        assert recorded("EvictedWrongArchitecture", "Pod", name)
    for name in right:       # runs where it is: recorded, left
        (seen,) = recorded("AdmittedWithoutArchway", "Pod", name)
        assert "its images run on amd64" in seen["note"], seen["note"]
        assert kube.exists(pod_path(namespace, name))
    assert recorded("AdmittedWithoutArchway", "Deployment", "app")
    assert kube.wait_for(lambda: metric(evicting, "archway_unseen_pods_total",
                                        placement="wrong_architecture") >= len(wrong) or None,
                         timeout=10, what="archway_unseen_pods_total")
    print(f"archway back to {len(wrong)} pod(s) on arm64 replaced on amd64: {repaired:.1f} s")
