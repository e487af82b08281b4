"""The closed loop against a real kubelet, archway installed in the cluster: containerd + runc
report a binary the kernel refuses as `terminated: {exitCode: 1, reason: Error}` with no message
(test_runtime.py), so archway must read the words in the container's log through `pods/log`.
A Deployment of an image whose index claims this machine's architecture (a refused binary) and
arm64 lands on the real node, fails there for real, and archway learns it from the log, says so
in the Event, counts the read, reads each failed instance once with a bounded query, evicts the
pod (`remediation.evict`) and its replacement goes to arm64 (an API-only node: it never runs)."""
import json
import time
from urllib.parse import parse_qs, urlsplit

import pytest
import requests
import urllib3

from lab.cluster.nodeimages import (
    EM_IA_64,
    OCI_INDEX,
    OCI_MANIFEST,
    OciImage,
    go_binary,
    machine_arch,
    with_machine,
)
from lab.kube import pod_path
from tests.e2e.loop import app_pods, deployment_path, events
from tests.e2e.workloads import create_deployment, deployment, node_arch

from .test_incluster import fresh_namespace

FAILED = "archway.dev/failed-architectures"
MATCHED = ("archway_remediation_log_reads_total", "matched")
OUTCOMES = ("matched", "unmatched", "failed")


def refused_multiarch_image(registry, repo: str, never_run: bytes = b"never run") -> str:
    """An index: this machine's architecture -> a binary the kernel refuses (ENOEXEC), arm64 ->
    an image that is never run (no arm64 node runs pods here; `never_run` its content: another
    content, another index around the same refused image)."""
    with open(go_binary("hello"), "rb") as f:
        refused = OciImage.of({"/hello": with_machine(f.read(), EM_IA_64)}, entrypoint=["/hello"])
    other = OciImage.of({"/hello": never_run}, entrypoint=["/hello"], arch="arm64")
    entries = []
    for image, arch in ((refused, machine_arch()), (other, "arm64")):
        image.push(registry, repo, f"only-{arch}")
        entries.append({"mediaType": OCI_MANIFEST, "digest": image.digest,
                        "size": len(image.manifest),
                        "platform": {"architecture": arch, "os": "linux"}})
    index = json.dumps({"schemaVersion": 2, "mediaType": OCI_INDEX, "manifests": entries}).encode()
    registry.push_manifest(repo, "multi", index, OCI_INDEX)
    return f"{registry.host}/{repo}:multi"


def preferring(body: dict, arch: str) -> dict:
    """`body` (a workload) whose pods prefer `arch`'s nodes: the real node first, until archway
    keeps them off it."""
    template = body["spec"]["template"] if "template" in body["spec"] else \
        body["spec"]["jobTemplate"]["spec"]["template"]
    template["spec"]["affinity"] = {"nodeAffinity": {
        "preferredDuringSchedulingIgnoredDuringExecution": [{"weight": 100, "preference": {
            "matchExpressions": [{"key": "kubernetes.io/arch", "operator": "In",
                                  "values": [arch]}]}}]}}
    return body


def ready(pod: dict) -> bool:
    return any(c["type"] == "Ready" and c["status"] == "True"
               for c in pod["status"].get("conditions") or [])


def webhook_metric(install, name: str, outcome: str) -> float:
    """The counter summed over archway's webhook pods (the leader's gate controller counts)."""
    return sum(float(line.rsplit(" ", 1)[1]) for text in install.webhook_metrics()
               for line in text.splitlines()
               if line.startswith(name + "{") and f'outcome="{outcome}"' in line)


def failed_instances(pod: dict) -> int:
    """How many instances of the pod's container have failed at most: every restart followed a
    failed one, and the current one may have failed too (this image never succeeds)."""
    return max((s.get("restartCount", 0) + 1 for s in pod["status"].get("containerStatuses")
                or []), default=0)


def log_reads(plane, mark: int, namespace: str) -> dict[str, list[dict]]:
    """pod name -> the query of every `pods/log` request in `namespace` since `mark`, from the
    audit log. A log is streamed: the apiserver audits it at ResponseStarted and again at
    ResponseComplete; the latter is the one request."""
    plane.requests_since(mark)          # waits until the audit log has stopped growing
    prefix = f"/api/v1/namespaces/{namespace}/pods/"
    reads: dict[str, list[dict]] = {}
    for event in plane.audit_events(mark):
        parts = urlsplit(event["requestURI"])
        if event["stage"] == "ResponseComplete" and event["verb"] == "get" \
                and parts.path.startswith(prefix) and parts.path.endswith("/log"):
            reads.setdefault(parts.path[len(prefix):-len("/log")], []).append(
                {k: v[0] for k, v in parse_qs(parts.query).items()})
    return reads


@pytest.mark.timeout(900)      # the session's install (first use) and a `helm upgrade --wait`
def test_an_exec_format_error_only_in_the_log_is_learned_and_the_pod_moves_off_the_arch(
        in_cluster, node_registry):
    install, plane = in_cluster, in_cluster.plane
    kube = plane.kube
    arch = machine_arch()
    started = time.monotonic()
    install.upgrade({"remediation": {"evict": True, "read_logs": True}})
    print(f"helm upgrade --wait (evict on): {time.monotonic() - started:.0f} s")
    namespace = fresh_namespace(plane, "loop")
    image = refused_multiarch_image(node_registry, f"node/refused-{namespace}")
    matched_before = webhook_metric(install, *MATCHED)
    mark = plane.audit_mark()

    body = preferring(deployment("app", [image], replicas=1, terminationGracePeriodSeconds=0),
                      arch)
    assert "terminationMessagePolicy" not in body["spec"]["template"]["spec"]["containers"][0]
    create_deployment(kube, namespace, body)
    (first,) = kube.wait_for(lambda: [p for p in app_pods(kube, namespace, "app")
                                      if p["spec"].get("nodeName")] or None,
                             timeout=90, what="the Deployment's pod bound")
    name = first["metadata"]["name"]
    assert first["spec"]["nodeName"] == install.node.name

    # Until it is evicted: how many of its instances failed (the kubelet restarts it meanwhile;
    # a restart follows a failure at once, the next after a 10 s back-off).
    instances = 0

    def moved():
        nonlocal instances
        pods = app_pods(kube, namespace, "app")
        for pod in pods:
            if pod["metadata"]["name"] == name:
                instances = max(instances, failed_instances(pod))
        replacements = [p for p in pods if p["metadata"]["name"] != name
                        and p["spec"].get("nodeName")]
        return replacements if replacements and name not in {
            p["metadata"]["name"] for p in pods} else None
    (replacement,) = kube.wait_for(moved, timeout=240, what="the failing pod evicted and replaced")
    assert node_arch(kube, replacement["spec"]["nodeName"]) == "arm64"

    annotations = kube.get(deployment_path(namespace, "app"))["metadata"]["annotations"]
    assert annotations[FAILED].split(",") == [arch]
    (on_pod,) = kube.wait_for(lambda: events(kube, namespace, "ExecFormatError", "Pod", name),
                              timeout=30, what="the pod's ExecFormatError Event")
    assert "read in its log" in on_pod["note"] and arch in on_pod["note"], on_pod["note"]
    assert kube.wait_for(lambda: events(kube, namespace, "ExecFormatError", "Deployment", "app"),
                         timeout=30, what="the Deployment's ExecFormatError Event")
    assert webhook_metric(install, *MATCHED) > matched_before

    reads = log_reads(plane, mark, namespace)
    for query in reads[name]:
        assert query["container"] == "c0" and query["tailLines"] == "10", query
        assert query["limitBytes"] == "2048" and query.get("previous", "true") == "true", query
    # One read per failed instance at most (each instance lasts a back-off: 10 s and more).
    assert 1 <= len(reads[name]) <= instances, (reads, instances)
    print(f"log reads of {name}: {reads[name]}; failed instances at most: {instances}; "
          f"outcomes: {[(o, webhook_metric(install, MATCHED[0], o)) for o in OUTCOMES]}")

