"""Exec format errors teach placement, through the real apiserver, controller-manager and
scheduler: the test writes the container statuses a real kubelet would (through pods/status: no
kubelet runs here; tests/e2e/loop.py says which statuses, and why they carry a message), and
looks at what an operator sees: Events, the Deployment's annotations, where the next pods go,
`archway explain`, the metric. What depends on the statuses a kubelet really writes (the
FallbackToLogsOnError message, an init container's failure, StatefulSets and CronJobs learning,
audit mode, a gated pod of a workload that learned) is proven on the real node:
tests/node/test_closed_loop_cases.py."""
import json
import time

import pytest

from lab.kube import pod_path

from .loop import (
    admission_places,
    app_pods,
    crash_with_exec_format_error,
    deployment_path,
    events,
    metric,
    on_arch,
    placed_on,
    preferring_arm64,
    probe,
    replica_sets,
)
from .test_rbac import identity_of
from .test_tools import run_archway
from .workloads import arches_of, create_deployment, node_arch, wait_bound

FAILED = "archway.dev/failed-architectures"
EVIDENCE = "archway.dev/failed-images"


@pytest.fixture
def app(kube, namespace, images):
    """A Deployment of an image whose index claims amd64 and arm64, every pod on arm64."""
    image = images.ref("e2e/multi", images.fresh("e2e/multi"))
    create_deployment(kube, namespace, preferring_arm64("app", image, replicas=2))
    pods = wait_bound(kube, namespace, "app", 2)
    (replica_set,) = replica_sets(kube, namespace)
    return image, pods, replica_set


def replaced(kube, namespace: str, gone: dict, count: int = 2) -> list[dict]:
    """The Deployment's pods once `gone` was replaced and every pod is bound."""
    def ready():
        pods = app_pods(kube, namespace, "app")
        names = {p["metadata"]["name"] for p in pods}
        return len(pods) == count and gone["metadata"]["name"] not in names \
            and all(p["spec"].get("nodeName") for p in pods) and pods
    return kube.wait_for(ready, timeout=30, what=f"a replacement of {gone['metadata']['name']}")


def learned(kube, namespace: str) -> dict:
    return kube.get(deployment_path(namespace, "app"))["metadata"].get("annotations") or {}


def test_an_exec_format_error_on_arm64_keeps_the_deployments_next_pods_off_arm64(
        archway, control_plane, kube, namespace, images, app, tmp_path):
    image, pods, replica_set = app
    (failing, *_) = on_arch(kube, pods, "arm64") or pytest.fail(f"no pod on arm64: {pods}")
    node = failing["spec"]["nodeName"]
    before = kube.get(deployment_path(namespace, "app"))
    counted = metric(archway, "archway_exec_format_errors_total", architecture="arm64")
    assert placed_on(probe(kube, namespace, image, replica_set)) == {"amd64", "arm64"}

    crash_with_exec_format_error(kube, namespace, failing)

    # The pod's Event names the image, the node and its architecture...
    (on_pod,) = kube.wait_for(lambda: events(kube, namespace, "ExecFormatError", "Pod",
                                             failing["metadata"]["name"]), timeout=20,
                              what="an ExecFormatError Event on the pod")
    assert on_pod["type"] == "Warning"
    assert image in on_pod["note"] and node in on_pod["note"] and "arm64" in on_pod["note"]
    # ... the Deployment's too (not its ReplicaSet's), once.
    (on_workload,) = kube.wait_for(lambda: events(kube, namespace, "ExecFormatError", "Deployment",
                                                  "app"), timeout=20, what="the Deployment's Event")
    assert image in on_workload["note"] and "arm64" in on_workload["note"]

    # What was learned is on the Deployment's own metadata, never its template: no rollout.
    annotations = kube.wait_for(lambda: (a := learned(kube, namespace)).get(FAILED) and a,
                                timeout=20, what="the learned annotation")
    assert annotations[FAILED] == "arm64"
    (evidence,) = json.loads(annotations[EVIDENCE])
    admitted = json.loads(failing["metadata"]["annotations"]["archway.dev/images"])
    assert evidence == {"image": image, "digest": admitted[0]["digest"], "architecture": "arm64"}
    # An annotation of a Deployment bumps its generation (the controller copies annotations to
    # its ReplicaSets): once the controller has seen it, still the one ReplicaSet, same template.
    after = kube.wait_for(lambda: (d := kube.get(deployment_path(namespace, "app")))["status"].get(
        "observedGeneration") == d["metadata"]["generation"] and d, timeout=20,
        what="the deployment controller to see the annotation")
    assert after["spec"]["template"] == before["spec"]["template"]
    assert [rs["metadata"]["name"] for rs in replica_sets(kube, namespace)] == \
        [replica_set["metadata"]["name"]]
    assert {p["metadata"]["uid"] for p in app_pods(kube, namespace, "app")} == \
        {p["metadata"]["uid"] for p in pods}
    assert metric(archway, "archway_exec_format_errors_total", architecture="arm64") == counted + 1

    # The next pod of the Deployment is placed on amd64 only, though its image claims arm64
    # (once the webhook's workload cache, a watch, has the annotation).
    admission_places(kube, namespace, image, replica_set, {"amd64"},
                     what="admission to apply the learned exclusion")
    kube.delete(pod_path(namespace, failing["metadata"]["name"]))
    pods = replaced(kube, namespace, failing)
    (replacement,) = [p for p in pods if p["metadata"]["name"]
                      not in {q["metadata"]["name"] for q in app[1]}]
    assert node_arch(kube, replacement["spec"]["nodeName"]) == "amd64"
    assert replacement["metadata"]["annotations"]["archway.dev/excluded-architectures"] == "arm64"
    assert replacement["metadata"]["annotations"]["archway.dev/architectures"] == "amd64,arm64"
    assert placed_on(replacement) == {"amd64"}
    # The healthy replica is left where it runs (remediation.evict is off in this install).
    assert len(on_arch(kube, pods, "arm64")) == 1

    # explain shows the exclusion and why.
    done = run_archway(control_plane, tmp_path, images, "explain",
                       f"pod/{replacement['metadata']['name']}", "-n", namespace, "--json")
    assert done.returncode == 0, done.stderr
    (explained,) = json.loads(done.stdout)
    assert explained["learned"]["workload"] == "Deployment app"
    assert explained["learned"]["architectures"] == ["arm64"]
    assert explained["learned"]["excluded"] == ["arm64"]
    assert explained["learned"]["evidence"] == [evidence]
    assert "ExecFormatError" in {e["reason"] for e in explained["events"]}
    text = run_archway(control_plane, tmp_path, images, "explain",
                       f"pod/{replacement['metadata']['name']}", "-n", namespace).stdout
    assert "learned: Deployment app failed with exec format error on arm64" in text
    assert "kept off: arm64" in text

    # Removing the annotation ends it: the next pod may go to arm64 again.
    kube.patch(deployment_path(namespace, "app"), {"metadata": {"annotations": {
        FAILED: None, EVIDENCE: None}}})
    admission_places(kube, namespace, image, replica_set, {"amd64", "arm64"},
                     what="admission to forget the exclusion")
    kube.delete(pod_path(namespace, replacement["metadata"]["name"]))
    pods = replaced(kube, namespace, replacement)
    assert arches_of(kube, pods) == {"arm64"}
    assert not any("archway.dev/excluded-architectures" in p["metadata"]["annotations"]
                   for p in pods)


@pytest.fixture
def not_learning(archway):
    webhook = archway.restart_webhook({"remediation": {"learn_failed_architectures": False}})
    yield webhook
    archway.restart_webhook()


def test_with_learning_off_the_events_come_and_nothing_is_learned_or_applied(
        archway, kube, namespace, images, app, not_learning):
    image, pods, replica_set = app
    (pod, *_) = on_arch(kube, pods, "arm64")
    crash_with_exec_format_error(kube, namespace, pod)
    (event,) = kube.wait_for(lambda: events(kube, namespace, "ExecFormatError", "Deployment",
                                            "app"), timeout=30, what="the Deployment's Event")
    assert "learn_failed_architectures is off" in event["note"]
    assert FAILED not in learned(kube, namespace)
    # An exclusion written by hand is not applied either: the webhook keeps no workload caches.
    kube.patch(deployment_path(namespace, "app"), {"metadata": {"annotations": {FAILED: "arm64"}}})
    time.sleep(2)   # what a watch would take to see it, many times over
    assert placed_on(probe(kube, namespace, image, replica_set)) == {"amd64", "arm64"}


def test_the_webhooks_account_may_learn_but_not_rewrite_workloads(archway, kube):
    """What the closed loop needs of RBAC, and no more (the chart's defaults)."""
    client, _ = identity_of(archway, kube, "webhook")
    for verb, resource, group in (("watch", "replicasets", "apps"), ("watch", "cronjobs", "batch"),
                                  ("get", "replicasets", "apps"), ("get", "jobs", "batch"),
                                  ("patch", "deployments", "apps"), ("patch", "cronjobs", "batch"),
                                  ("patch", "statefulsets", "apps"),
                                  ("get", "pods/log", "")):   # a failed container's log tail
        assert client.can_i(verb, resource, group=group, namespace="default"), (verb, resource)
    for verb, resource, group in (("update", "deployments", "apps"),
                                  ("delete", "deployments", "apps"),
                                  ("update", "jobs", "batch"), ("create", "deployments", "apps")):
        assert not client.can_i(verb, resource, group=group, namespace="default"), (verb, resource)
    # Evicting is granted with remediation.evict, on by default in the chart (the processes
    # here run with it off: conftest.archway_config; test_remediation.py turns it on).
    assert client.can_i("create", "pods/eviction", namespace="default")
