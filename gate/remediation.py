"""The closed loop: what the leading gate controller learns from what actually runs. Runs beside
the gate controller's own work, in the same process and leadership (controller.py), as does
its other half, tagwatch.py (tags re-pushed without an architecture).

    every pod (paged list, then a watch; only failing pods are kept)
      -> a container status says exec format error on a node of arch X (node cache)
      -> Warning Event ExecFormatError on the pod and on its workload, the metric
      -> enforce mode, remediation.learn_failed_architectures: X merged into the workload's
         archway.dev/failed-architectures (its own metadata: no rollout), with the evidence
      -> remediation.evict: the failing pod evicted (Eviction API: PodDisruptionBudgets hold)

What a 10,000-pod cluster costs here: each status update is parsed once and its container
statuses scanned (docs/benchmarks.md, figure 22); only failing pods are remembered, as a few
facts each. The decisions are pure (learning.py, workloadcache.top_workload); this module is the
I/O around them.
"""
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from archway import metrics
from archway.kubeapi import ApiError, KubeApi
from archway.listwatch import ListWatch
from archway.vocabulary import ANNOTATION_ARCHITECTURES, ANNOTATION_FAILED, join_architectures
from archway.webhook.events import EventSink
from archway.webhook.learning import (
    Evidence,
    Failure,
    admitted_digests,
    exec_format_failures,
    merged_annotations,
)
from archway.webhook.namespaces import namespace_mode
from archway.webhook.workloadcache import (
    WorkloadFacts,
    top_workload,
    workload_facts,
    workload_path,
    workload_reference,
)

log = logging.getLogger("archway.remediation")

PAGE_SIZE = 500
EVICT_RETRY_MIN_SECONDS = 2.0     # a PodDisruptionBudget that refused is asked again after this,
EVICT_RETRY_MAX_SECONDS = 30.0    # doubling up to this
MAX_TRACKED = 10_000              # failing pods remembered at once (one of each is a few facts)
MAX_PATCH_ATTEMPTS = 4            # a workload changed meanwhile (409): read it again and merge
REASON_EXEC_FORMAT = "ExecFormatError"
REASON_EVICTED = "EvictedExecFormatError"
REASON_EVICTION_BLOCKED = "EvictionBlocked"


@dataclass(frozen=True)
class FailingPod:
    """What is kept of a pod whose container failed with exec format error."""
    namespace: str
    name: str
    uid: str
    node: str
    owner: tuple[str, str] | None
    architectures: frozenset[str] | None     # archway.dev/architectures: what its images claim
    digests: tuple[tuple[str, str], ...]     # image -> digest archway admitted it with
    failures: tuple[Failure, ...]

    @property
    def reference(self) -> dict:
        return {"apiVersion": "v1", "kind": "Pod", "namespace": self.namespace,
                "name": self.name, "uid": self.uid}

    def evidence(self, arch: str) -> list[Evidence]:
        admitted = dict(self.digests)
        return [Evidence(f.image, f.digest or admitted.get(f.image), arch) for f in self.failures]


def failing_pod(obj: dict) -> FailingPod | None:
    """The facts of a bound pod with an exec format error, not being deleted; None for every
    other pod (almost all of them: this runs on every status update of the cluster)."""
    failures = exec_format_failures(obj)
    meta = obj.get("metadata") or {}
    node = (obj.get("spec") or {}).get("nodeName")
    # A pod being deleted is on its way out (its namespace may be too: no Event would be taken).
    if not failures or not isinstance(node, str) or not node or meta.get("deletionTimestamp"):
        return None
    owner = next((ref for ref in meta.get("ownerReferences") or ()
                  if isinstance(ref, dict) and ref.get("controller")), None)
    annotations = meta.get("annotations")
    annotations = annotations if isinstance(annotations, dict) else {}
    claimed = annotations.get(ANNOTATION_ARCHITECTURES)
    return FailingPod(
        namespace=str(meta.get("namespace") or ""), name=str(meta.get("name") or ""),
        uid=str(meta.get("uid") or ""), node=node,
        owner=(str(owner.get("kind")), str(owner.get("name"))) if owner else None,
        architectures=frozenset(a for a in claimed.split(",") if a) if isinstance(claimed, str)
        else None,
        digests=tuple(sorted(admitted_digests(annotations).items())), failures=failures)


@dataclass
class _Tracked:
    pod: FailingPod
    handled: frozenset[tuple[str, str]] = frozenset()   # (container, image) reported
    due: bool = True
    next_look: float | None = None    # monotonic time to look again (an eviction to retry...)
    learned: bool = False             # its failures are merged into its workload
    evict_tries: int = 0


class FailingPods(ListWatch):
    """Every pod of the cluster, one page at a time, then a watch; only failing pods are
    passed on (`failing_pod`)."""
    what = "exec format error watch"
    path = "/api/v1/pods"
    page_size = PAGE_SIZE

    def __init__(self, remediation: "Remediation", api_client_factory, watch_seconds: int):
        super().__init__(api_client_factory, thread_name="archway-exec-format-watch",
                         watch_timeout_seconds=watch_seconds, request_timeout_seconds=60,
                         max_backoff_seconds=10)
        self.remediation = remediation

    def _slim(self, obj: dict):
        return failing_pod(obj)

    def _on_list(self, items: list) -> None:
        self.remediation.found(items)

    def _on_event(self, kind: str, obj: dict) -> None:
        if kind == "DELETED":
            self.remediation.gone(str((obj.get("metadata") or {}).get("uid") or ""))
            return
        failing = failing_pod(obj)
        if failing is None:
            self.remediation.gone(str((obj.get("metadata") or {}).get("uid") or ""))
        else:
            self.remediation.failing(failing)


class Remediation:
    def __init__(self, *, api: KubeApi, settings, policy, events: EventSink | None,
                 nodes, workloads, namespaces=None, exclude_namespaces=(),
                 watch_seconds: int = 240, clock: Callable[[], float] = time.monotonic):
        self.api = api
        self.settings = settings           # config.RemediationSettings
        self.policy = policy               # placement.Policy: its mode, per namespace below
        self.events = events
        self.nodes = nodes                 # name -> NodeFacts (.items)
        self.workloads = workloads         # workloadcache.WorkloadCache; None: GETs only
        self.namespaces = namespaces       # NamespaceCache or None
        self.exclude_namespaces = frozenset(exclude_namespaces)
        self.watch_seconds = watch_seconds
        self._clock = clock
        self._lock = threading.Condition()
        self._tracked: dict[str, _Tracked] = {}
        self._full_logged = False

    # --- leading ---------------------------------------------------------------------------
    def lead(self, stop: threading.Event, api_client_factory) -> None:
        """Watch and act until `stop`, fed by a watch of this leadership's own."""
        FailingPods(self, api_client_factory, self.watch_seconds).feeding(
            lambda: self._work_loop(stop), self._forget)

    def _forget(self) -> None:
        with self._lock:
            self._tracked.clear()
            self._lock.notify_all()

    def found(self, pods: list) -> None:
        """A full list: the failing pods of the cluster now."""
        with self._lock:
            seen = {p.uid for p in pods}
            for uid in [u for u in self._tracked if u not in seen]:
                del self._tracked[uid]
        for pod in pods:
            self.failing(pod)

    def failing(self, pod: FailingPod) -> None:
        with self._lock:
            tracked = self._tracked.get(pod.uid)
            if tracked is None:
                if len(self._tracked) >= MAX_TRACKED:
                    if not self._full_logged:
                        self._full_logged = True
                        log.warning("more than %d pods fail with exec format error: the others "
                                    "are looked at once some of these are gone", MAX_TRACKED)
                    return
                tracked = self._tracked[pod.uid] = _Tracked(pod)
            tracked.pod = pod
            if {(f.container, f.image) for f in pod.failures} - tracked.handled:
                tracked.due = True
                self._lock.notify_all()

    def gone(self, uid: str) -> None:
        with self._lock:
            self._tracked.pop(uid, None)

    def _work_loop(self, stop: threading.Event) -> None:
        while not stop.is_set():
            with self._lock:
                now = self._clock()
                due = [t for t in self._tracked.values()
                       if t.due or (t.next_look is not None and t.next_look <= now)]
                if not due:
                    waits = [t.next_look - now for t in self._tracked.values()
                             if t.next_look is not None]
                    self._lock.wait(min([0.5] + [max(0.01, w) for w in waits]))
                    continue
                for t in due:
                    t.due = False
            for tracked in due:
                try:
                    self._handle(tracked)
                except ApiError as e:
                    log.warning("exec format error of pod %s/%s: %s", tracked.pod.namespace,
                                tracked.pod.name, e)
                except Exception:
                    log.exception("exec format error of pod %s/%s", tracked.pod.namespace,
                                  tracked.pod.name)

    # --- one failing pod ---------------------------------------------------------------------
    def mode_of(self, namespace: str) -> str:
        return namespace_mode(namespace, self.policy, self.namespaces, self.exclude_namespaces)

    def _handle(self, tracked: _Tracked) -> None:
        pod = tracked.pod
        if not self.nodes.wait_synced(10.0):
            tracked.next_look = self._clock() + EVICT_RETRY_MAX_SECONDS   # no node cache yet
            return
        if self.namespaces is not None:
            self.namespaces.wait_synced(10.0)   # their mode; without it the config's
        tracked.next_look = None
        arch = getattr(self.nodes.items.get(pod.node), "arch", None)
        mode = self.mode_of(pod.namespace)
        new = [f for f in pod.failures if (f.container, f.image) not in tracked.handled]
        tracked.handled |= {(f.container, f.image) for f in new}
        if new:
            tracked.learned = False
        if arch is None or mode == "off":
            if arch is None and new:
                log.warning("pod %s/%s fails with exec format error on node %s, whose "
                            "architecture archway does not know: nothing learned", pod.namespace,
                            pod.name, pod.node)
            return
        learn = self.settings.learn_failed_architectures and mode == "enforce"
        try:
            top = self.top_workload(pod)
        except ApiError as e:   # Events on the pod still go out; the rest is tried again
            log.warning("pod %s/%s: its workload could not be read: %s", pod.namespace, pod.name,
                        e)
            top, tracked.next_look = None, self._clock() + EVICT_RETRY_MAX_SECONDS
        for failure in new:
            self._report(pod, failure, arch, top, _consequence(arch, mode, learn))
        if learn and top is not None:
            self._learn_and_evict(tracked, arch, top)

    def _report(self, pod: FailingPod, failure: Failure, arch: str, top: WorkloadFacts | None,
                consequence: str) -> None:
        """The metric, a log line, the Events on the pod and on its workload."""
        metrics.EXEC_FORMAT_ERRORS.labels(arch).inc()
        log.warning("pod %s/%s: container %s (image %s) failed on node %s (%s) with exec "
                    "format error: %s", pod.namespace, pod.name, failure.container,
                    failure.image, pod.node, arch, failure.message)
        self._event(pod.reference, "Warning", REASON_EXEC_FORMAT, "Detect",
                    f"container {failure.container} (image {failure.image}) failed on node "
                    f"{pod.node} ({arch}) with exec format error: its binaries are not "
                    f"{arch} binaries ({failure.message})")
        if top is not None:
            self._event(workload_reference(top), "Warning", REASON_EXEC_FORMAT, "Detect",
                        f"pods of image {failure.image} fail on {arch} with exec format "
                        f"error: {consequence}")

    def _learn_and_evict(self, tracked: _Tracked, arch: str, top: WorkloadFacts) -> None:
        if not tracked.learned:
            try:
                self.learn(top, arch, tracked.pod.evidence(arch))
                tracked.learned = True
            except ApiError as e:   # the apiserver is away: merged at the next look
                log.warning("%s %s/%s: could not record what its pods taught: %s", top.kind,
                            top.namespace, top.object_name, e)
                tracked.next_look = self._clock() + EVICT_RETRY_MAX_SECONDS
        if self.settings.evict and tracked.learned:
            self._maybe_evict(tracked, arch, top)

    def top_workload(self, pod: FailingPod) -> WorkloadFacts | None:
        """The pod's workload, from the caches; a link they do not hold yet is read."""
        def lookup(kind: str, namespace: str, name: str) -> WorkloadFacts | None:
            found = self.workloads.lookup(kind, namespace, name) \
                if self.workloads is not None else None
            if found is not None:
                return found
            try:
                obj = self.api.request("GET", workload_path(kind, namespace, name))
            except ApiError as e:
                if e.status == 404:
                    return None
                raise
            return workload_facts(kind)(obj)
        return top_workload(pod.namespace, pod.owner, lookup)

    def learn(self, top: WorkloadFacts, arch: str, evidence: list[Evidence]) -> bool:
        """Merge `arch` and its evidence into the workload's own annotations (never its pod
        template: no rollout); True when something was written."""
        path = workload_path(top.kind, top.namespace, top.object_name)
        for _ in range(MAX_PATCH_ATTEMPTS):
            obj = self.api.request("GET", path)
            meta = obj.get("metadata") or {}
            merged = merged_annotations(meta.get("annotations") or {}, arch, evidence)
            if merged is None:
                return False
            try:
                self.api.request("PATCH", path, content_type="application/merge-patch+json",
                                 body={"metadata": {"resourceVersion": meta.get("resourceVersion"),
                                                    "annotations": merged}})
            except ApiError as e:
                if e.status == 409:
                    continue
                raise
            log.warning("%s %s/%s: learned that its pods fail on %s; new pods are kept off it "
                        "(%s=%s)", top.kind, top.namespace, top.object_name, arch,
                        ANNOTATION_FAILED, merged[ANNOTATION_FAILED])
            return True
        log.warning("%s %s/%s changed %d times while archway merged %s into %s: tried again at "
                    "the next failure", top.kind, top.namespace, top.object_name,
                    MAX_PATCH_ATTEMPTS, arch, ANNOTATION_FAILED)
        return False

    def _maybe_evict(self, tracked: _Tracked, arch: str, top: WorkloadFacts) -> None:
        pod = tracked.pod
        learned = top.learned
        failed = (learned.architectures if learned is not None else frozenset()) | {arch}
        if pod.architectures is None or not pod.architectures - failed:
            return   # no architecture left to recreate it on: evicting would only repeat this
        if tracked.next_look is not None and tracked.next_look > self._clock():
            return
        path = f"/api/v1/namespaces/{pod.namespace}/pods/{pod.name}/eviction"
        body = {"apiVersion": "policy/v1", "kind": "Eviction",
                "metadata": {"name": pod.name, "namespace": pod.namespace},
                # This pod, not one recreated under its name since (StatefulSets reuse names).
                "deleteOptions": {"preconditions": {"uid": pod.uid}}}
        try:
            self.api.request("POST", path, body=body)
        except ApiError as e:
            if e.status in (404, 409):     # gone, or replaced meanwhile
                tracked.next_look = None
                return
            outcome = "blocked" if e.status == 429 else "failed"
            metrics.REMEDIATION_EVICTIONS.labels(outcome).inc()
            delay = min(EVICT_RETRY_MAX_SECONDS, EVICT_RETRY_MIN_SECONDS * 2 ** tracked.evict_tries)
            tracked.evict_tries += 1
            tracked.next_look = self._clock() + delay
            if e.status == 429:
                self._event(pod.reference, "Warning", REASON_EVICTION_BLOCKED, "Evict",
                            f"not evicted yet ({e.message[:300] or 'disruption budget'}): "
                            f"archway asks again, at most every {EVICT_RETRY_MAX_SECONDS:g} s")
            else:
                log.warning("evicting pod %s/%s failed: %s", pod.namespace, pod.name, e)
            return
        tracked.next_look = None
        metrics.REMEDIATION_EVICTIONS.labels("evicted").inc()
        log.warning("pod %s/%s evicted: it fails on %s; %s recreates it elsewhere", pod.namespace,
                    pod.name, arch, top.display_name)
        self._event(pod.reference, "Normal", REASON_EVICTED, "Evict",
                    f"evicted (remediation.evict): it fails on {arch} with exec format error; "
                    f"{top.display_name} recreates it on {join_architectures(pod.architectures - failed)}")

    def _event(self, regarding: dict, event_type: str, reason: str, action: str,
               note: str) -> None:
        if self.events is not None:
            self.events.record(regarding, event_type, reason, action, note)


def _consequence(arch: str, mode: str, learn: bool) -> str:
    if mode != "enforce":
        return "audit mode: archway only reports it"
    if not learn:
        return "remediation.learn_failed_architectures is off: archway only reports it"
    return (f"archway keeps its new pods off {arch} (annotation {ANNOTATION_FAILED}; remove it, "
            f"or change the image, to undo)")
