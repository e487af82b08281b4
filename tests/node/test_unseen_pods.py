"""Pods admitted while archway was down are revisited (gate/unseen.py), on the real node with
archway installed by its chart: archway's webhook Deployment scaled to 0 (webhook and leader
gone, as when both pods were force-deleted: the apiserver fails open, failurePolicy Ignore), a
Deployment of an image of this machine's architecture only is created and its pods, preferring
arm64, are bound to the API-only arm64 Node, which their images cannot run on. archway comes
back: each pod gets AdmittedWithoutArchway, so does the Deployment, the leader counts them, and
evicts them (remediation.evict) so that their replacements are admitted by archway and placed on
the real node. The time from archway's return to the repair is printed."""
import base64
import threading
import time

import pytest
import requests
import urllib3

from archway.certs import x509 as cx
from lab.cluster.nodeimages import machine_arch
from lab.kube import pod_path
from tests.e2e.loop import app_pods, events, preferring_arm64
from tests.e2e.workloads import create_deployment, node_arch, pods_of

from .test_crash_loops import default_remediation
from .test_incluster import ARCH_ANNOTATION, fresh_namespace, pause_image
from .test_trust_path import ca_bundles, created_annotations, webhook_configuration_path

UNSEEN = "AdmittedWithoutArchway"
EVICTED = "EvictedWrongArchitecture"
WEBHOOK_PODS = "app.kubernetes.io/component=webhook"


def unseen_counted(install) -> float:
    """archway_unseen_pods_total{placement="wrong_architecture"} summed over archway's pods."""
    return sum(float(line.rsplit(" ", 1)[1]) for text in install.webhook_metrics()
               for line in text.splitlines()
               if line.startswith('archway_unseen_pods_total{placement="wrong_architecture"}'))


def webhook_deployment(install) -> str:
    kube = install.kube
    for name in install.resource_names()["Deployment"]:
        path = f"/apis/apps/v1/namespaces/{install.namespace}/deployments/{name}"
        if kube.get(path)["metadata"]["labels"].get("app.kubernetes.io/component") == "webhook":
            return path
    raise AssertionError("the chart installed no webhook Deployment")


@pytest.mark.timeout(1200)
def test_pods_admitted_while_archway_was_down_are_revisited_and_moved(in_cluster,
                                                                       node_registry):
    install, plane = in_cluster, in_cluster.plane
    kube = plane.kube
    arch = machine_arch()
    install.upgrade({"remediation": {"evict": True}})
    namespace = fresh_namespace(plane, "unseen")
    image = pause_image(node_registry)
    webhook = webhook_deployment(install)
    replicas = kube.get(webhook)["spec"]["replicas"]

    # archway down: no webhook pod, no leader.
    kube.patch(webhook, {"spec": {"replicas": 0}})
    kube.wait_for(lambda: not kube.items(pod_path(install.namespace),
                                         labelSelector=WEBHOOK_PODS) or None,
                  timeout=120, what="archway's webhook pods gone")
    counted_before = 0.0     # archway's pods are new: their counters start at 0
    create_deployment(kube, namespace, preferring_arm64("app", image, replicas=2))
    bare = kube.wait_for(lambda: (lambda pods: pods if len(pods) == 2 and all(
        p["spec"].get("nodeName") for p in pods) else None)(app_pods(kube, namespace, "app")),
        timeout=90, what="the Deployment's pods bound while archway is down")
    for pod in bare:
        assert ARCH_ANNOTATION not in (pod["metadata"].get("annotations") or {}), pod["metadata"]
    # Where the scheduler put them (arm64, as preferred; a replica spread to the real node runs
    # there, and is recorded and left).
    wrong = {p["metadata"]["name"]: node_arch(kube, p["spec"]["nodeName"]) for p in bare
             if p["spec"]["nodeName"] != install.node.name}
    assert wrong, "no pod on an API-only Node"
    names = set(wrong)
    bare_uids = {p["metadata"]["uid"] for p in bare}

    # archway back.
    back = time.monotonic()
    kube.patch(webhook, {"spec": {"replicas": replicas}})
    install.wait_until_webhook_acts(timeout=180)
    serving = time.monotonic() - back

    def repaired():
        pods = pods_of(kube, namespace, "app")
        if any(p["metadata"]["name"] in names and not p["metadata"].get("deletionTimestamp")
               for p in pods):
            return None      # not evicted yet
        placed = [p for p in pods if p["metadata"]["name"] not in names
                  and p["spec"].get("nodeName") and p["metadata"].get("uid") not in bare_uids
                  and (p["metadata"].get("annotations") or {}).get(ARCH_ANNOTATION) == arch]
        return placed if len(placed) == len(names) else None
    replacements = kube.wait_for(repaired, timeout=180,
                                 what="the bare pods evicted, their replacements placed")
    repair = time.monotonic() - back
    for pod in replacements:
        assert pod["spec"]["nodeName"] == install.node.name, pod["spec"]["nodeName"]

    def recorded(reason: str, kind: str, name: str) -> list[dict]:
        return kube.wait_for(lambda: events(kube, namespace, reason, kind, name), timeout=30,
                             what=f"{reason} on {kind} {name}")
    for name, wrong_arch in sorted(wrong.items()):
        (on_pod,) = recorded(UNSEEN, "Pod", name)
        assert f"({wrong_arch}): its images run on {arch}, not on {wrong_arch}" \
            in on_pod["note"], on_pod
        assert recorded(EVICTED, "Pod", name)
    assert recorded(UNSEEN, "Deployment", "app")
    assert kube.wait_for(lambda: unseen_counted(install) - counted_before >= len(names) or None,
                         timeout=60, what="archway_unseen_pods_total counting the pods")
    print(f"archway back: webhook acting after {serving:.1f} s; {len(names)} bare pod(s) on "
          f"{sorted(set(wrong.values()))} evicted and "
          f"replaced on {install.node.name} {repair:.1f} s after archway was scaled back up "
          f"({repair - serving:.1f} s after its webhook acted)")


BURST = 12


@pytest.mark.timeout(900)
def test_every_bare_pod_of_a_burst_is_evicted_while_the_leader_lives(in_cluster, node_registry):
    """Hardening round 6, finding 2, as it was found: a broken caBundle under a running archway
    (its leader alive) and a Deployment of 12 made meanwhile. Every pod of the burst bound bare
    to a wrong architecture is evicted, none taken for the replacement of another (before, one
    was evicted and the rest logged as made after that eviction and left there)."""
    install, plane = in_cluster, in_cluster.plane
    kube = plane.kube
    default_remediation(install)
    namespace = fresh_namespace(plane, "burst")
    image = pause_image(node_registry)
    configuration = webhook_configuration_path(install)
    good = ca_bundles(install)
    foreign = base64.b64encode(cx.issue_ca("not archway's CA", days=30).cert_pem).decode()
    breaking = threading.Event()

    def keep_breaking() -> None:
        """The leader repairs the caBundle within seconds: broken again until the burst is in."""
        while breaking.is_set():
            if ca_bundles(install) != [foreign] * len(good):
                kube.patch(configuration, [
                    {"op": "replace", "path": f"/webhooks/{i}/clientConfig/caBundle",
                     "value": foreign} for i in range(len(good))], kind="json")
            time.sleep(0.2)     # pacing the breaker, not waiting for anything
    breaking.set()
    breaker = threading.Thread(target=keep_breaking, daemon=True)
    breaker.start()
    try:
        kube.wait_for(lambda: ARCH_ANNOTATION not in created_annotations(
            kube, namespace, f"probe-{time.monotonic_ns()}", image), timeout=60,
            what="the webhook bypassed (a pod admitted bare)")
        create_deployment(kube, namespace, preferring_arm64("app", image, replicas=BURST))
        burst = kube.wait_for(lambda: (pods := app_pods(kube, namespace, "app")) and len(
            pods) == BURST and all(p["spec"].get("nodeName") for p in pods) and pods,
            timeout=120, what="the burst's pods bound")
    finally:
        breaking.clear()
        breaker.join(timeout=30)
    wrong = {p["metadata"]["name"] for p in burst
             if ARCH_ANNOTATION not in (p["metadata"].get("annotations") or {})
             and p["spec"]["nodeName"] != install.node.name}
    print(f"{len(wrong)} of the burst's {BURST} pods bound bare to a wrong architecture")
    assert len(wrong) >= 2, burst

    def evicted() -> set[str]:
        return {e["regarding"]["name"] for e in events(kube, namespace, EVICTED, "Pod")}
    started = time.monotonic()
    kube.wait_for(lambda: wrong <= evicted(), timeout=180,
                  what=f"every bare pod of the burst on a wrong architecture evicted ({wrong})")
    print(f"all {len(wrong)} evicted {time.monotonic() - started:.1f} s after the burst was in")
    kube.wait_for(lambda: ca_bundles(install) == good, timeout=60, what="the caBundle repaired")
