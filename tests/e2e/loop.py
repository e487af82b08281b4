"""What the closed-loop tests write in place of a kubelet (these nodes have none), and how they look
at what archway did: container statuses through pods/status, dry-run probes of admission,
archway's metrics.

A real kubelet with containerd + runc writes no message for an exec format error (`terminated:
{exitCode: 1, reason: Error}`; the words are in the container's log), except for a container
with `terminationMessagePolicy: FallbackToLogsOnError`, whose last log lines become the message:
the pods here ask for that (preferring_arm64), so the status carries the words as a real
kubelet's would. The path with no message (archway reads the log) is tests/test_closed_loop.py's.
What a real kubelet writes, and archway's answer to it (a real log read, the FallbackToLogsOnError
message, init containers, a disruption budget holding an eviction, StatefulSets, CronJobs, audit
mode, a re-pushed tag, a gated pod released), is proven on the real node: tests/node/test_closed_loop.py and
test_closed_loop_cases.py."""
import datetime
import json
import re

from lab.kube import Kube, pod_path

from .workloads import deployment, node_arch, pods_of

EXEC_FORMAT = "exec /bin/app: exec format error\n"   # runc, in the container's log


def now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def crash_with_exec_format_error(kube: Kube, namespace: str, pod: dict, *, restarts: int = 3,
                                 message: str = EXEC_FORMAT) -> dict:
    """What a real kubelet writes for a container whose binary is for another CPU and whose
    terminationMessagePolicy is FallbackToLogsOnError: the last run terminated with exit code 1,
    reason Error, its log's last lines (`message`) as the message; the container now backing
    off. The image ID names the digest archway admitted the pod with. The phase is Running (the
    kubelet's for a restarting container)."""
    container = pod["spec"]["containers"][0]
    admitted = json.loads(pod["metadata"]["annotations"]["archway.dev/images"])
    digest = next(e["digest"] for e in admitted if e["image"] == container["image"])
    repository = container["image"].rsplit(":", 1)[0]
    status = {"status": {"phase": "Running", "containerStatuses": [{
        "name": container["name"], "image": container["image"],
        "imageID": f"{repository}@{digest}", "ready": False, "restartCount": restarts,
        "started": False,
        "state": {"waiting": {"reason": "CrashLoopBackOff",
                              "message": f"back-off 40s restarting failed container="
                                         f"{container['name']} pod={pod['metadata']['name']}"}},
        "lastState": {"terminated": {"exitCode": 1, "reason": "Error", "message": message,
                                     "startedAt": now(), "finishedAt": now()}}}]}}
    return kube.patch(pod_path(namespace, pod["metadata"]["name"]) + "/status", status)


def preferring_arm64(name: str, image: str, replicas: int) -> dict:
    """A Deployment whose pods prefer arm64 nodes (cheaper, say): every replica lands there while
    nothing keeps it off. No grace period: with no kubelet, an evicted pod goes at once. Its
    containers' failures leave their last log lines as the status' message
    (FallbackToLogsOnError: see crash_with_exec_format_error)."""
    body = deployment(name, [image], replicas=replicas, terminationGracePeriodSeconds=0)
    for container in body["spec"]["template"]["spec"]["containers"]:
        container["terminationMessagePolicy"] = "FallbackToLogsOnError"
    body["spec"]["template"]["spec"]["affinity"] = {"nodeAffinity": {
        "preferredDuringSchedulingIgnoredDuringExecution": [{"weight": 100, "preference": {
            "matchExpressions": [{"key": "kubernetes.io/arch", "operator": "In",
                                  "values": ["arm64"]}]}}]}}
    return body


def on_arch(kube: Kube, pods: list[dict], arch: str) -> list[dict]:
    return [p for p in pods if p["spec"].get("nodeName") and node_arch(kube, p["spec"]["nodeName"]) == arch]


def deployment_path(namespace: str, name: str = "") -> str:
    return f"/apis/apps/v1/namespaces/{namespace}/deployments" + (f"/{name}" if name else "")


def replica_sets(kube: Kube, namespace: str) -> list[dict]:
    return kube.items(f"/apis/apps/v1/namespaces/{namespace}/replicasets")


def probe(kube: Kube, namespace: str, image: str, owner: dict) -> dict:
    """A dry-run pod create as `owner` (a ReplicaSet, a Job...) would send it: what archway's admission
    does with the next pod of that workload now, without creating one."""
    body = {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"generateName": "probe-", "ownerReferences": [{
                "apiVersion": owner.get("apiVersion", "apps/v1"),
                "kind": owner.get("kind", "ReplicaSet"),
                "name": owner["metadata"]["name"],
                "uid": owner["metadata"]["uid"], "controller": True}]},
            "spec": {"containers": [{"name": "c0", "image": image}]}}
    return kube.create(pod_path(namespace), body, dryRun="All")


def placed_on(pod: dict) -> set[str] | None:
    """The architectures archway's patch allows the pod (nodeSelector or required affinity)."""
    selector = (pod["spec"].get("nodeSelector") or {}).get("kubernetes.io/arch")
    if selector:
        return {selector}
    required = ((pod["spec"].get("affinity") or {}).get("nodeAffinity") or {}).get(
        "requiredDuringSchedulingIgnoredDuringExecution")
    if not required:
        return None
    values = [set(e["values"]) for t in required["nodeSelectorTerms"]
              for e in t.get("matchExpressions", []) if e["key"] == "kubernetes.io/arch"]
    return set.intersection(*values) if values else None


def admission_places(kube: Kube, namespace: str, image: str, owner: dict,
                     architectures: set[str], *, what: str, timeout: float = 30.0) -> None:
    """Until admission places the next pod of `owner` on `architectures` (probe): the webhook
    reads what a workload learned from its workload cache, a watch that may lag the API."""
    kube.wait_for(lambda: placed_on(probe(kube, namespace, image, owner)) == architectures,
                  timeout=timeout, what=what)


def events(kube: Kube, namespace: str, reason: str, kind: str | None = None,
           name: str | None = None) -> list[dict]:
    found = kube.items(f"/apis/events.k8s.io/v1/namespaces/{namespace}/events",
                       fieldSelector=f"reason={reason}")
    return [e for e in found if (kind is None or e["regarding"].get("kind") == kind)
            and (name is None or e["regarding"].get("name") == name)]


def metric(archway, name: str, **labels) -> float:
    """A counter as the webhook's /metrics shows it (the gate controller's process included)."""
    text = archway.webhook.get("/metrics").text
    total = 0.0
    for line in text.splitlines():
        match = re.match(rf"^{name}\{{(.*)\}} (\S+)$", line)
        if match and all(f'{k}="{v}"' in match.group(1) for k, v in labels.items()):
            total += float(match.group(2))
    return total


def app_pods(kube: Kube, namespace: str, app: str) -> list[dict]:
    return [p for p in pods_of(kube, namespace, app) if not p["metadata"].get("deletionTimestamp")]
