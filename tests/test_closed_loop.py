"""The closed loop (gate/remediation.py) on the real control plane: real Deployments, ReplicaSets
and their pods (controller-manager, scheduler), the real authorizer, the audit log counting what
the loop asks, PodDisruptionBudgets enforced by the Eviction API.

No kubelet runs here, so the tests write container statuses through pods/status as a real one
writes them for a binary the kernel refuses (containerd 1.6.20 + runc 1.1.5, measured in issue
27): `terminated: {exitCode: 1, reason: Error}`, no message, then CrashLoopBackOff; the words
`exec format error` are only in the container's log. That log comes through the loop's log
interface (logreads.LogReader): the apiserver would ask the node's kubelet, which these API-only
nodes do not have (ApiLogReader's request itself is checked against the apiserver below). A
real node's e2e test reads it through the kubelet.

The loop is driven one round at a time (take_due, round) with a clock of the test's, so "once",
"never again" and "one read per round" are counted, not waited for."""
import datetime
import json

import pytest
from prometheus_client import REGISTRY

from archway.cluster.nodes import NodeCache
from archway.cluster.workloadcache import WorkloadCache
from archway.config import config_from_dict
from archway.gate.failingpods import failing_pod
from archway.gate.logreads import LOG_LIMIT_BYTES, LOG_TAIL_LINES, ApiLogReader
from archway.gate.podstatus import LogRead
from archway.gate.remediation import Remediation
from archway.kubeapi import ApiError, KubeApi
from archway.kubeclient import build_api_client
from archway.placement.policy import Policy
from lab.clock import ManualClock
from lab.kube import pod_path

pytestmark = pytest.mark.slow

FAILED = "archway.dev/failed-architectures"
EVIDENCE = "archway.dev/failed-images"
DIGEST = "sha256:" + "d" * 64
IMAGE = "registry.invalid/app:1"
# What the chart's gate controller role grants the closed loop (charts/archway/templates/rbac.yaml)
LOOP_RULES = [
    {"apiGroups": [""], "resources": ["pods", "nodes"], "verbs": ["get", "list", "watch"]},
    {"apiGroups": ["apps"], "resources": ["deployments", "statefulsets", "daemonsets",
                                          "replicasets"],
     "verbs": ["get", "list", "watch", "patch"]},
    {"apiGroups": ["batch"], "resources": ["jobs", "cronjobs"],
     "verbs": ["get", "list", "watch", "patch"]},
    {"apiGroups": ["apps"], "resources": ["deployments/status", "statefulsets/status",
                                          "daemonsets/status", "replicasets/status"],
     "verbs": ["patch"]},
    {"apiGroups": ["batch"], "resources": ["jobs/status"], "verbs": ["patch"]},
]
EVICT_RULE = {"apiGroups": [""], "resources": ["pods/eviction"], "verbs": ["create"]}
LOG_RULE = {"apiGroups": [""], "resources": ["pods/log"], "verbs": ["get"]}


def now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


class Events:
    """What the loop records (its EventSink's record), in order."""

    def __init__(self):
        self.sent: list[tuple[str, str, str, str]] = []

    def record(self, regarding, event_type, reason, action, note):
        self.sent.append((regarding["kind"], regarding["name"], reason, note))

    def of(self, reason: str, kind: str | None = None) -> list[tuple[str, str, str, str]]:
        return [e for e in self.sent if e[2] == reason and kind in (None, e[0])]


class Logs:
    """The loop's log interface, answering what a real node's container log tail holds."""

    def __init__(self, tail: str):
        self.tail = tail
        self.reads: list[tuple[str, str, bool]] = []

    def wording(self, namespace: str, pod: str, read: LogRead) -> str | None:
        from archway.gate.podstatus import log_wording
        self.reads.append((pod, read.container, read.previous))
        return log_wording(self.tail)


@pytest.fixture
def closed_loop(control_plane):
    """make(namespace, rules=..., **remediation) -> (Remediation, Events, clock, user): the
    loop as the leader runs it, as a ServiceAccount with the chart's rules, its caches synced."""
    caches = []

    def make(namespace: str, *, rules=(), log_reader=None, **remediation):
        if log_reader is None:    # no kubelet here to ask for a log
            remediation.setdefault("read_logs", False)
        # Eviction is on by default; the tests of learning alone leave it off, those that evict
        # say so and grant it (EVICT_RULE), as the chart does.
        remediation.setdefault("evict", False)
        name = f"loop-{len(caches)}"
        kubeconfig = control_plane.identity(namespace, name,
                                            cluster_rules=LOOP_RULES + list(rules))
        config = config_from_dict({"kubernetes": {"kubeconfig": kubeconfig},
                                   "remediation": remediation})

        def factory():
            return build_api_client(config.kubernetes)[0]
        nodes, workloads = NodeCache(factory), WorkloadCache(factory)
        for cache in (nodes, workloads):
            cache.ensure_started()
            caches.append(cache)
        assert nodes.wait_synced(30) and workloads.wait_synced(30)
        clock, events = ManualClock(), Events()
        loop = Remediation(api=KubeApi(factory()), settings=config.remediation,
                           policy=Policy.from_config(config), events=events, nodes=nodes,
                           workloads=workloads, log_reader=log_reader, clock=clock)
        return loop, events, clock, f"system:serviceaccount:{namespace}:{name}"
    yield make
    for cache in caches:
        cache.stop()


def own_namespace(control_plane, name: str) -> str:
    """A namespace the archway that the e2e tier installs on this session's control plane leaves
    alone (archway.dev/mode: off): its webhook would gate these pods (their registry does not
    resolve) and its leader would act on their failures beside the loop under test. The loop
    here keeps no namespace cache: the label does not change what it does."""
    return control_plane.new_namespace(name, labels={"archway.dev/mode": "off"})


def deployment(kube, namespace: str, name: str, replicas: int, arch: str = "arm64",
               pinned: bool = False, claimed: str = "amd64,arm64") -> list:
    """A Deployment whose pods claim `claimed` (as archway's admission annotates them)
    and all land on `arch`'s first node (by its name: no arch constraint of their own, as
    archway leaves them), or with `pinned` by a kubernetes.io/arch nodeSelector of their own;
    its pods once bound."""
    labels = {"app": name}
    where = {"kubernetes.io/arch": arch} if pinned else {"kubernetes.io/hostname": f"{arch}-1"}
    kube.create(f"/apis/apps/v1/namespaces/{namespace}/deployments", {
        "apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": name},
        "spec": {"replicas": replicas, "selector": {"matchLabels": labels},
                 "template": {"metadata": {"labels": labels, "annotations": {
                     "archway.dev/architectures": claimed,
                     "archway.dev/images": json.dumps([{"image": IMAGE, "digest": DIGEST}])}},
                     "spec": {"nodeSelector": where,
                              "terminationGracePeriodSeconds": 0,
                              "containers": [{"name": "c", "image": IMAGE}]}}}})
    return kube.wait_for(lambda: (pods := [
        p for p in kube.items(pod_path(namespace), labelSelector=f"app={name}")
        if p["spec"].get("nodeName")]) and len(pods) == replicas and pods,
        timeout=60, what=f"{replicas} pods of {name} bound")


def crash_loop(kube, namespace: str, pod: dict, *, restarts: int = 3, message: str | None = None):
    """What a real kubelet writes for a container whose binary is for another CPU, restarting
    (restartPolicy Always): its last instance terminated with exit code 1, reason Error, and no
    message; backing off now. `message`: a runtime that puts the words in the status."""
    uid = pod["metadata"]["uid"].replace("-", "")
    last = {"exitCode": 1, "reason": "Error", "startedAt": now(), "finishedAt": now(),
            "containerID": f"containerd://{uid}{restarts:04d}"}
    if message:
        last["message"] = message
    kube.patch(pod_path(namespace, pod["metadata"]["name"]) + "/status", {"status": {
        "phase": "Running", "containerStatuses": [{
            "name": "c", "image": IMAGE, "imageID": f"registry.invalid/app@{DIGEST}",
            "ready": False, "restartCount": restarts, "started": False,
            "state": {"waiting": {"reason": "CrashLoopBackOff",
                                  "message": f"back-off 1m20s restarting failed container=c "
                                             f"pod={pod['metadata']['name']}"}},
            "lastState": {"terminated": last}}]}})


def running(kube, namespace: str, pod: dict) -> None:
    kube.patch(pod_path(namespace, pod["metadata"]["name"]) + "/status", {"status": {
        "phase": "Running", "containerStatuses": [{
            "name": "c", "image": IMAGE, "imageID": "", "ready": True, "restartCount": 0,
            "started": True, "state": {"running": {"startedAt": now()}}}]}})


def look(loop: Remediation, kube, namespace: str) -> None:
    """One round over the namespace's pods, each passed on as the loop's pod watch does."""
    for obj in kube.items(pod_path(namespace)):
        failing = failing_pod(obj)
        if failing is not None:
            loop.failing(failing)
    loop.round(loop.take_due())


def wait_cached(kube, loop: Remediation, namespace: str, pods: list) -> None:
    """The workload cache holds the pods' ReplicaSet (it is news to a cache started just now)."""
    owner = pods[0]["metadata"]["ownerReferences"][0]
    kube.wait_for(lambda: loop.workloads.lookup("ReplicaSet", namespace, owner["name"]),
                  timeout=30, what="the ReplicaSet in the loop's cache")


def deployment_annotations(kube, namespace: str, name: str) -> dict:
    path = f"/apis/apps/v1/namespaces/{namespace}/deployments/{name}"
    return kube.get(path)["metadata"].get("annotations") or {}


def reads_of(plane, mark: int, user: str, path: str) -> list[str]:
    return [verb for verb, uri in plane.requests_since(mark, user=user)
            if uri.split("?")[0] == path]


def metric(name: str, **labels) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


# --- the log path --------------------------------------------------------------------------

def test_a_silent_exit_1_is_learned_from_the_log_tail_once_per_failed_instance(
        control_plane, closed_loop):
    kube = control_plane.kube
    namespace = own_namespace(control_plane, "loop-log")
    logs = Logs("panic: listen tcp :80: bind: address already in use\n")
    loop, events, clock, _ = closed_loop(namespace, log_reader=logs)
    pods = deployment(kube, namespace, "web", replicas=2)
    (calm,) = deployment(kube, namespace, "calm", replicas=1)
    wait_cached(kube, loop, namespace, pods)
    running(kube, namespace, calm)
    for pod in pods:
        crash_loop(kube, namespace, pod)
    names = [p["metadata"]["name"] for p in pods]

    # Another failure: each failing container's previous instance (it restarted) read once,
    # the healthy pod never; nothing learned, and the same instances are not read again.
    look(loop, kube, namespace)
    assert sorted(logs.reads) == sorted((name, "c", True) for name in names)
    clock.now += 120
    look(loop, kube, namespace)
    assert len(logs.reads) == 2 and events.sent == []
    assert FAILED not in deployment_annotations(kube, namespace, "web")

    # A new failed instance, whose log says it: read once, learned.
    logs.tail = "token=s3cr3t\nexec /srv/server: exec format error\n"
    crash_loop(kube, namespace, pods[0], restarts=4)
    look(loop, kube, namespace)
    assert logs.reads[2:] == [(names[0], "c", True)]
    annotations = deployment_annotations(kube, namespace, "web")
    assert annotations.get(FAILED) == "arm64"
    assert json.loads(annotations[EVIDENCE]) == [{"image": IMAGE, "digest": DIGEST,
                                                  "architecture": "arm64"}]
    (on_pod,) = events.of("ExecFormatError", "Pod")
    assert on_pod[1] == names[0] and 'read in its log: it says "exec format error"' in on_pod[3]
    # No log text in an Event, only the words matched.
    assert not [e for e in events.sent if "s3cr3t" in e[3] or "/srv/server" in e[3]]
    # A container known to fail so is not read again at its next instance.
    crash_loop(kube, namespace, pods[0], restarts=5)
    look(loop, kube, namespace)
    assert len(logs.reads) == 3


def test_a_pod_that_runs_again_between_two_failures_is_reported_once(control_plane, closed_loop):
    """A real kubelet restarts a crash-looping container after each back-off: between two
    failures the pod runs, and the pod watch drops it as not failing. Its next failure is the
    same error of the same container: no second ExecFormatError Event on it."""
    kube = control_plane.kube
    namespace = own_namespace(control_plane, "loop-twice")
    loop, events, clock, _ = closed_loop(namespace)
    (pod,) = deployment(kube, namespace, "twice", replicas=1)
    wait_cached(kube, loop, namespace, [pod])
    crash_loop(kube, namespace, pod, restarts=1, message="exec /app: exec format error")
    look(loop, kube, namespace)
    assert len(events.of("ExecFormatError", "Pod")) == 1
    running(kube, namespace, pod)             # the next instance, started after the back-off
    assert failing_pod(kube.get(pod_path(namespace, pod["metadata"]["name"]))) is None
    loop.gone(pod["metadata"]["uid"])        # as the pod watch passes that change on
    crash_loop(kube, namespace, pod, restarts=2, message="exec /app: exec format error")
    clock.now += 60
    look(loop, kube, namespace)
    assert len(events.of("ExecFormatError", "Pod")) == 1


def test_log_reads_are_capped_per_workload_and_none_without_learning(control_plane, closed_loop):
    kube = control_plane.kube
    namespace = own_namespace(control_plane, "loop-log-cap")
    logs = Logs("bash: /app: cannot execute binary file: Exec format error\n")
    loop, events, clock, _ = closed_loop(namespace, log_reader=logs)
    pods = deployment(kube, namespace, "many", replicas=6)
    wait_cached(kube, loop, namespace, pods)
    # Its cache never shows what is learned: no evidence explains the others (the next test),
    # each is read.
    loop.workloads.caches["Deployment"].stop()
    for pod in pods:
        crash_loop(kube, namespace, pod)
    look(loop, kube, namespace)
    assert len(logs.reads) == 3                  # READS_PER_WORKLOAD_PER_MINUTE
    assert deployment_annotations(kube, namespace, "many").get(FAILED) == "arm64"
    clock.now += 61
    look(loop, kube, namespace)
    assert len(logs.reads) == 6                  # the rest a minute later, each once
    clock.now += 61
    look(loop, kube, namespace)
    assert len(logs.reads) == 6

    # With learning off, or read_logs off, nothing is read (the chart grants pods/log only
    # while both are on).
    for switch in ({"learn_failed_architectures": False}, {"read_logs": False}):
        quiet = Logs("exec format error")
        off, _, _, _ = closed_loop(namespace, log_reader=quiet, **switch)
        look(off, kube, namespace)
        assert quiet.reads == [] and off.log_reader is None


def test_the_log_request_through_the_apiserver(control_plane):
    """ApiLogReader's request as the apiserver authorizes and validates it. The pod is not bound:
    the apiserver then answers an empty log itself, without asking any kubelet."""
    kube = control_plane.kube
    namespace = own_namespace(control_plane, "loop-log-api")
    kube.create(pod_path(namespace), {"apiVersion": "v1", "kind": "Pod",
                                      "metadata": {"name": "unbound"},
                                      "spec": {"schedulerName": "nobody",
                                               "containers": [{"name": "c", "image": IMAGE}]}})
    allowed = control_plane.identity(namespace, "reader", cluster_rules=[LOG_RULE])
    refused = control_plane.identity(namespace, "no-reader", cluster_rules=[])

    def reader(kubeconfig: str) -> ApiLogReader:
        config = config_from_dict({"kubernetes": {"kubeconfig": kubeconfig}})
        return ApiLogReader(KubeApi(build_api_client(config.kubernetes)[0]))
    read = LogRead("c", IMAGE, None, previous=True, episode="e")
    unmatched, failed = (metric("archway_remediation_log_reads_total", outcome=o)
                         for o in ("unmatched", "failed"))
    mark = control_plane.audit_mark()
    assert reader(allowed).wording(namespace, "unbound", read) is None
    asked = control_plane.requests_since(mark, user=f"system:serviceaccount:{namespace}:reader")
    # One request (a streamed answer is audited as it starts and as it ends).
    (uri,) = {uri for verb, uri in asked if verb == "get"}
    assert uri.startswith(f"/api/v1/namespaces/{namespace}/pods/unbound/log?")
    query = dict(part.split("=") for part in uri.split("?")[1].split("&"))
    assert query == {"container": "c", "previous": "true", "tailLines": str(LOG_TAIL_LINES),
                     "limitBytes": str(LOG_LIMIT_BYTES)}
    assert metric("archway_remediation_log_reads_total", outcome="unmatched") == unmatched + 1
    with pytest.raises(ApiError) as refusal:
        reader(refused).wording(namespace, "unbound", read)
    assert refusal.value.status == 403
    with pytest.raises(ApiError) as unknown:
        reader(allowed).wording(namespace, "unbound", LogRead("nope", IMAGE, None, False, "e"))
    assert unknown.value.status == 400
    assert metric("archway_remediation_log_reads_total", outcome="failed") == failed + 2


# --- whom a pod may teach -------------------------------------------------------------------

def test_a_forged_bare_pod_teaches_another_teams_deployment_nothing(control_plane, closed_loop):
    kube = control_plane.kube
    namespace = own_namespace(control_plane, "loop-forged")
    loop, events, _, _ = closed_loop(namespace)
    (victim,) = deployment(kube, namespace, "payments", replicas=1, arch="amd64")
    wait_cached(kube, loop, namespace, [victim])
    running(kube, namespace, victim)
    dep = kube.get(f"/apis/apps/v1/namespaces/{namespace}/deployments/payments")
    rs_ref = victim["metadata"]["ownerReferences"][0]

    def forged(name: str, ref: dict, labels: dict) -> dict:
        return kube.create(pod_path(namespace), {
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "labels": labels, "ownerReferences": [ref]},
            "spec": {"nodeName": "arm64-1", "containers": [{"name": "c", "image": IMAGE}]}})
    pods = [
        # naming the Deployment itself (no pod is a Deployment's own)
        forged("names-the-deployment", {"apiVersion": "apps/v1", "kind": "Deployment",
                                        "name": "payments", "uid": dep["metadata"]["uid"],
                                        "controller": True}, {"app": "mine"}),
        # naming its ReplicaSet, uid and all, with labels its selector does not select
        forged("names-the-replicaset", dict(rs_ref), {"app": "mine"}),
    ]
    for pod in pods:
        crash_loop(kube, namespace, pod, message="exec /app: exec format error")
    look(loop, kube, namespace)
    assert FAILED not in deployment_annotations(kube, namespace, "payments")
    assert events.of("ExecFormatError", "Deployment") == []
    # What they report is about themselves.
    assert {e[1] for e in events.of("ExecFormatError", "Pod")} <= {p["metadata"]["name"]
                                                                 for p in pods}


# --- what a round costs --------------------------------------------------------------------

def test_a_crash_loop_of_silent_replicas_ends_after_one_minutes_log_reads(
        control_plane, closed_loop):
    """Six replicas failing silently (containerd + runc): the read budget lets three logs be
    read in the first minute, and the first teaches the workload. The other three are looked at
    again within seconds, and what the workload learned (the same image at the same digest
    failed on this architecture) explains them without reading their logs: all six evicted, not
    three now and three a budget's minute later (30 replicas: ten minutes)."""
    kube = control_plane.kube
    namespace = own_namespace(control_plane, "loop-silent")
    logs = Logs("exec /app: exec format error\n")
    loop, events, clock, user = closed_loop(namespace, rules=[EVICT_RULE], log_reader=logs,
                                            evict=True)
    pods = deployment(kube, namespace, "silent", replicas=6)
    wait_cached(kube, loop, namespace, pods)
    for pod in pods:
        crash_loop(kube, namespace, pod)
    mark = control_plane.audit_mark()
    look(loop, kube, namespace)
    assert len(logs.reads) == 3 and deployment_annotations(
        kube, namespace, "silent").get(FAILED) == "arm64"
    kube.wait_for(lambda: (top := loop.workloads.lookup("Deployment", namespace, "silent"))
                  and top.learned and "arm64" in top.learned.architectures,
                  timeout=30, what="the loop's cache to show the learned architecture")
    clock.now += 5
    look(loop, kube, namespace)
    assert len(logs.reads) == 3
    assert [p["metadata"]["name"] for p in pods if evictions_of(control_plane, mark, user, p)
            == ["create"]] == [p["metadata"]["name"] for p in pods]
    explained = [e for e in events.of("ExecFormatError", "Pod") if "not read again" in e[3]]
    assert len(explained) == 3
    # The workload is told once (the EventSink sends the same note once; none for the three
    # explained by what it knows).
    assert len({e[3] for e in events.of("ExecFormatError", "Deployment")}) == 1


def test_many_failing_replicas_cost_one_read_of_their_workload_per_round(
        control_plane, closed_loop):
    kube = control_plane.kube
    namespace = own_namespace(control_plane, "loop-reads")
    loop, events, clock, user = closed_loop(namespace)
    pods = deployment(kube, namespace, "wide", replicas=12)
    wait_cached(kube, loop, namespace, pods)
    for pod in pods:
        crash_loop(kube, namespace, pod, message="exec /app: exec format error")
    path = f"/apis/apps/v1/namespaces/{namespace}/deployments/wide"
    mark = control_plane.audit_mark()
    look(loop, kube, namespace)
    assert sorted(reads_of(control_plane, mark, user, path)) == ["get", "patch"]
    assert deployment_annotations(kube, namespace, "wide").get(FAILED) == "arm64"
    assert len(events.of("ExecFormatError", "Pod")) == 12


# --- evictions that end ---------------------------------------------------------------------

def evicting(control_plane, closed_loop, app: str, *, rules=(EVICT_RULE,), pinned=False):
    """The loop with `evict` on, and one pod of Deployment `app` (in a namespace of its own)
    in its cache: (loop, events, clock, user, pod); crash_loop makes the pod fail."""
    namespace = own_namespace(control_plane, f"loop-{app}")
    loop, events, clock, user = closed_loop(namespace, rules=list(rules), evict=True)
    (pod,) = deployment(control_plane.kube, namespace, app, replicas=1, pinned=pinned)
    wait_cached(control_plane.kube, loop, namespace, [pod])
    return loop, events, clock, user, pod


def evictions_of(plane, mark: int, user: str, pod: dict) -> list[str]:
    return reads_of(plane, mark, user, pod_path(pod["metadata"]["namespace"],
                                                pod["metadata"]["name"]) + "/eviction")


def test_a_pod_is_evicted_once_the_workload_cache_shows_what_was_learned(
        control_plane, closed_loop):
    """The webhook admits the replacement with what its own workload cache says: evicted before
    such a cache shows the exclusion, the pod could be made again on the same architecture."""
    kube = control_plane.kube
    loop, events, clock, user, pod = evicting(control_plane, closed_loop, "seen")
    namespace = pod["metadata"]["namespace"]
    crash_loop(kube, namespace, pod, message="exec /app: exec format error")
    mark = control_plane.audit_mark()
    look(loop, kube, namespace)      # learns; its cache has not seen the patch yet
    assert deployment_annotations(kube, namespace, "seen")[FAILED] == "arm64"
    assert evictions_of(control_plane, mark, user, pod) == []
    kube.wait_for(lambda: (top := loop.workloads.lookup("Deployment", namespace, "seen"))
                  and top.learned and "arm64" in top.learned.architectures,
                  timeout=30, what="the loop's cache to show the learned architecture")
    clock.now += 0.5                 # the next look, well before it would stop waiting
    look(loop, kube, namespace)
    assert evictions_of(control_plane, mark, user, pod) == ["create"]


def test_a_pod_pinned_by_its_own_template_to_the_failing_architecture_is_not_evicted(
        control_plane, closed_loop):
    """Its replacement would be pinned to the same architecture and fail again: with eviction
    on by default that would be an eviction loop. It is learned and left to its crash loop."""
    kube = control_plane.kube
    loop, events, clock, user, pod = evicting(control_plane, closed_loop, "pinned", pinned=True)
    namespace = pod["metadata"]["namespace"]
    crash_loop(kube, namespace, pod, message="exec /app: exec format error")
    mark = control_plane.audit_mark()
    look(loop, kube, namespace)
    assert deployment_annotations(kube, namespace, "pinned")[FAILED] == "arm64"
    kube.wait_for(lambda: (top := loop.workloads.lookup("Deployment", namespace, "pinned"))
                  and top.learned and "arm64" in top.learned.architectures,
                  timeout=30, what="the loop's cache to show the learned architecture")
    for _ in range(3):
        clock.now += 60
        look(loop, kube, namespace)
    assert evictions_of(control_plane, mark, user, pod) == []


def test_a_cache_that_never_shows_what_was_learned_delays_the_eviction_a_bounded_time(
        control_plane, closed_loop):
    from archway.gate.remediation import SEEN_WITHIN_SECONDS
    kube = control_plane.kube
    loop, events, clock, user, pod = evicting(control_plane, closed_loop, "unseen")
    namespace = pod["metadata"]["namespace"]
    loop.workloads.caches["Deployment"].stop()     # its watch ends: the patch is never seen
    crash_loop(kube, namespace, pod, message="exec /app: exec format error")
    mark = control_plane.audit_mark()
    for _ in range(3):
        look(loop, kube, namespace)
        clock.now += SEEN_WITHIN_SECONDS / 4
    assert deployment_annotations(kube, namespace, "unseen")[FAILED] == "arm64"
    assert evictions_of(control_plane, mark, user, pod) == []
    clock.now += SEEN_WITHIN_SECONDS
    look(loop, kube, namespace)
    assert evictions_of(control_plane, mark, user, pod) == ["create"]


def test_an_eviction_refused_with_403_ends_with_one_event_and_the_metric(
        control_plane, closed_loop):
    kube = control_plane.kube
    loop, events, clock, user, pod = evicting(control_plane, closed_loop, "refused",
                                              rules=())      # no pods/eviction right
    namespace = pod["metadata"]["namespace"]
    crash_loop(kube, namespace, pod, message="exec /app: exec format error")
    refused = metric("archway_remediation_evictions_total", outcome="refused")
    mark = control_plane.audit_mark()
    for _ in range(4):
        look(loop, kube, namespace)
        clock.now += 120
    assert len(evictions_of(control_plane, mark, user, pod)) == 1
    (note,) = [e[3] for e in events.of("NotEvicted")]
    assert "403" in note and "not asked again" in note
    assert metric("archway_remediation_evictions_total", outcome="refused") == refused + 1


def test_a_disruption_budget_that_never_allows_is_asked_a_bounded_number_of_times(
        control_plane, closed_loop):
    from archway.gate.eviction import MAX_TRIES
    kube = control_plane.kube
    loop, events, clock, user, pod = evicting(control_plane, closed_loop, "guarded")
    namespace = pod["metadata"]["namespace"]
    kube.create(f"/apis/policy/v1/namespaces/{namespace}/poddisruptionbudgets", {
        "apiVersion": "policy/v1", "kind": "PodDisruptionBudget", "metadata": {"name": "all"},
        "spec": {"minAvailable": "100%", "selector": {"matchLabels": {"app": "guarded"}}}})
    crash_loop(kube, namespace, pod, message="exec /app: exec format error")
    mark = control_plane.audit_mark()
    for _ in range(MAX_TRIES + 5):
        look(loop, kube, namespace)
        clock.now += 60
    assert len(evictions_of(control_plane, mark, user, pod)) == MAX_TRIES
    assert len(events.of("EvictionBlocked")) == 1
    (note,) = [e[3] for e in events.of("NotEvicted")]
    assert f"still refused after {MAX_TRIES} asks" in note
    assert kube.get(pod_path(namespace, pod["metadata"]["name"]))    # never evicted


def test_without_the_pods_log_grant_the_loop_asks_once_and_reads_statuses_only(
        control_plane, closed_loop):
    """The real reader, refused by the real authorizer (the chart's rbac.create off, say): one
    refusal, then no more asking. RBAC refuses before the apiserver would ask any kubelet."""
    kube = control_plane.kube
    namespace = own_namespace(control_plane, "loop-log-refused")
    loop, events, clock, user = closed_loop(namespace, read_logs=True)   # no pods/log rule
    pods = deployment(kube, namespace, "ungranted", replicas=2)
    wait_cached(kube, loop, namespace, pods)
    for pod in pods:
        crash_loop(kube, namespace, pod)
    failed = metric("archway_remediation_log_reads_total", outcome="failed")
    mark = control_plane.audit_mark()
    look(loop, kube, namespace)
    clock.now += 120
    crash_loop(kube, namespace, pods[1], restarts=4)
    look(loop, kube, namespace)
    asked = {uri for _, uri in control_plane.requests_since(mark, user=user) if "/log?" in uri}
    assert len(asked) == 1 and loop.log_reader is None    # one pod's log asked, once
    assert metric("archway_remediation_log_reads_total", outcome="failed") == failed + 1
    # A status that says it is still read.
    crash_loop(kube, namespace, pods[0], restarts=5, message="exec /app: exec format error")
    look(loop, kube, namespace)
    assert deployment_annotations(kube, namespace, "ungranted").get(FAILED) == "arm64"


def test_a_workload_that_can_run_nowhere_gets_a_condition_until_its_lesson_ends(
        control_plane, closed_loop):
    """Its images claim arm64 only and it fails there: one Event, and the condition
    archway.dev/ArchitectureLeft=False on the Deployment, which its controller keeps while it
    writes its own; not evicted. Once what was learned is removed, the condition goes and the
    controller's conditions stay (gate/conditions.py)."""
    from archway.gate import conditions
    kube = control_plane.kube
    namespace = own_namespace(control_plane, "loop-nowhere")
    loop, events, clock, user = closed_loop(namespace, evict=True, rules=[EVICT_RULE])
    (pod,) = deployment(kube, namespace, "only", replicas=1, claimed="arm64")
    wait_cached(kube, loop, namespace, [pod])
    path = f"/apis/apps/v1/namespaces/{namespace}/deployments/only"

    def ours() -> list[dict]:
        return [c for c in kube.get(path)["status"].get("conditions") or []
                if c["type"] == "archway.dev/ArchitectureLeft"]
    crash_loop(kube, namespace, pod, message="exec /app: exec format error")
    mark = control_plane.audit_mark()
    look(loop, kube, namespace)
    (told,) = events.of("NoArchitectureLeft", "Deployment")
    assert "claim arm64 only" in told[3]
    (condition,) = ours()
    assert condition["status"] == "False" and condition["reason"] == "NoArchitectureLeft"
    assert "no architecture is left" in condition["message"]
    assert evictions_of(control_plane, mark, user, pod) == []
    # The controller writes its status again (a scale-up) and keeps archway's condition.
    kube.patch(path, {"spec": {"replicas": 2}})
    kube.wait_for(lambda: kube.get(path)["status"].get("replicas") == 2, timeout=60,
                  what="the Deployment's controller to write its status")
    assert ours() == [condition]
    kube.wait_for(lambda: (top := loop.workloads.lookup("Deployment", namespace, "only"))
                  and top.nowhere, timeout=30, what="the loop's cache to show the condition")
    loop.clear_stale_conditions()
    assert ours() == [condition]          # its lesson holds: it stays

    kube.patch(path, {"metadata": {"annotations": {FAILED: None, EVIDENCE: None}}})
    kube.wait_for(lambda: (top := loop.workloads.lookup("Deployment", namespace, "only"))
                  and top.learned is None, timeout=30, what="the loop's cache to show it unlearned")
    loop.clear_stale_conditions()
    assert ours() == []
    assert {c["type"] for c in kube.get(path)["status"]["conditions"]} >= {"Progressing"}
    assert conditions.holds_no_more(loop.workloads.lookup("Deployment", namespace, "only"))
