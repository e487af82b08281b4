"""The closed loop: what the leading gate controller learns from what actually runs. Runs beside
the gate controller's own work, in the same process and leadership (controller.py), as does
its other half, tagwatch.py (tags re-pushed without an architecture).

    every pod (paged list, then a watch; only failing pods are kept: failingpods.py)
      -> a container status says exec format error on a node of arch X (node cache), or a
         failed container whose status says nothing has it in its log's tail (logreads.py), or
         its workload learned already that its image at this digest fails on X (its evidence:
         failingpods.explained_failures; no log read)
      -> Warning Event ExecFormatError on the pod and on its workload, the metric
      -> enforce mode, remediation.learn_failed_architectures: X merged into the workload's
         archway.dev/failed-architectures (its own metadata: no rollout), with the evidence;
         only from a pod its workload made (workloadcache.controlling_workload)
      -> remediation.evict (on by default): the failing pod evicted (Eviction API:
         PodDisruptionBudgets hold), so its workload makes it again where it runs

What a 10,000-pod cluster costs here: each status update is parsed once and its container
statuses scanned (docs/benchmarks.md, figure 22); only failing pods are remembered, as a few
facts each. The pods that came due together are one round: each workload is read (and patched)
once per round, however many of its replicas fail. The decisions are pure (podstatus.py,
failingpods.py, learning.py, workloadcache.controlling_workload); this module is the I/O around
them, sharing with tagwatch.py how a workload's annotations are changed (leaderloop.py).
"""
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial

from archway import metrics
from archway.cluster.events import EventSink
from archway.cluster.workloadcache import (
    WorkloadFacts,
    controlling_workload,
    workload_path,
    workload_reference,
)
from archway.kubeapi import LIST_PAGE_SIZE, ApiError, KubeApi
from archway.listwatch import ListWatch
from archway.placement.learning import Evidence, merged_annotations
from archway.vocabulary import (
    ANNOTATION_EVIDENCE,
    ANNOTATION_FAILED,
    CONDITION_ARCHITECTURE_LEFT,
    join_architectures,
)

from . import conditions
from .eviction import Evictions
from .failingpods import FailingPod, explained_failures, failing_pod
from .leaderloop import MAX_PATCH_ATTEMPTS, KeptChanging, LeaderLoop
from .logreads import ApiLogReader, LogReadBudget, LogReader
from .podstatus import Failure
from .unseen import UnseenPods

log = logging.getLogger("archway.remediation")

RETRY_SECONDS = 30.0              # a workload that could not be read or written: looked at again
MAX_TRACKED = 10_000              # failing pods remembered at once (one of each is a few facts)
MAX_EPISODES = 16                 # failed instances remembered per pod as read
REASON_EXEC_FORMAT = "ExecFormatError"
REASON_NOWHERE = "NoArchitectureLeft"
# A pod is evicted once the leader's own workload cache shows what was just learned of its
# workload: the webhook's caches are watches of the same objects, so its replacement is admitted
# with the exclusion, not sent to the same architecture again. Waited for at most this long.
SEEN_WITHIN_SECONDS = 5.0
SEEN_POLL_SECONDS = 0.25
# A pod whose log waits for the read budget is looked at again this often: once its workload
# has learned (another replica's log said it), its evidence explains the pod without a read.
UNREAD_LOOK_SECONDS = 5.0
# How often the workloads told they can run nowhere are looked at again (conditions.py).
CONDITION_LOOK_SECONDS = 30.0


@dataclass
class _Tracked:
    pod: FailingPod
    handled: frozenset[tuple[str, str]] = frozenset()   # (container, image) reported
    due: bool = True
    next_look: float | None = None    # monotonic time to look again (an eviction to retry...)
    learned: bool = False             # its failures are merged into its workload
    read: tuple[str, ...] = ()        # the failed instances whose log was read
    log_failures: tuple[Failure, ...] = ()     # what their logs said
    evict_tries: int = 0
    evict_done: bool = False          # evicted, or given up: never asked again
    learned_at: float | None = None   # when archway wrote what it taught

    @property
    def failures(self) -> tuple[Failure, ...]:
        return self.pod.failures + self.log_failures

    def unread(self) -> list:
        said = {f.container for f in self.failures}
        return [r for r in self.pod.log_reads if r.episode not in self.read
                and r.container not in said]


@dataclass
class _Lesson:
    """What one round learned about one workload: written with one read and one patch."""
    top: WorkloadFacts
    evidence: dict[str, list[Evidence]] = field(default_factory=dict)   # arch -> evidence
    pods: list[tuple[_Tracked, str]] = field(default_factory=list)      # (pod, its node's arch)
    nowhere: str = ""     # it can run nowhere: the condition's message, set once it is learned


class FailingPods(ListWatch):
    """Every pod of the cluster, one page at a time, then a watch; only failing pods are
    passed on (`failing_pod`), and every pod to the revisit of pods archway never saw
    (unseen.py), which keeps only those."""
    what = "exec format error watch"
    path = "/api/v1/pods"
    page_size = LIST_PAGE_SIZE

    def __init__(self, remediation: "Remediation", api_client_factory, watch_seconds: int,
                 unseen: UnseenPods | None = None):
        super().__init__(api_client_factory, thread_name="archway-exec-format-watch",
                         watch_timeout_seconds=watch_seconds, request_timeout_seconds=60,
                         max_backoff_seconds=10)
        self.remediation = remediation
        self.unseen = unseen

    def _slim(self, obj: dict):
        if self.unseen is not None:
            self.unseen.listing(obj)
        return failing_pod(obj)

    def _on_list(self, items: list) -> None:
        if self.unseen is not None:
            self.unseen.listed()
        self.remediation.found(items)

    def _on_event(self, kind: str, obj: dict) -> None:
        if self.unseen is not None:
            self.unseen.changed(kind, obj)
        if kind == "DELETED":
            self.remediation.gone(str((obj.get("metadata") or {}).get("uid") or ""), deleted=True)
            return
        failing = failing_pod(obj)
        if failing is None:
            self.remediation.gone(str((obj.get("metadata") or {}).get("uid") or ""))
        else:
            self.remediation.failing(failing)


class Remediation(LeaderLoop):
    def __init__(self, *, api: KubeApi, settings, policy, events: EventSink | None,
                 nodes, workloads, namespaces=None, exclude_namespaces=(), in_force=None,
                 watch_seconds: int = 240, log_reader: LogReader | None = None,
                 clock: Callable[[], float] = time.monotonic):
        super().__init__(api=api, settings=settings, policy=policy, events=events,
                         workloads=workloads,   # None: GETs only
                         namespaces=namespaces, exclude_namespaces=exclude_namespaces, in_force=in_force)
        self.nodes = nodes                 # name -> NodeFacts (.items)
        self.watch_seconds = watch_seconds
        # Logs are read only while learning is on (the chart grants pods/log get only then).
        self.log_reader = (log_reader or ApiLogReader(api)) \
            if settings.learn_failed_architectures and settings.read_logs else None
        self.log_budget = LogReadBudget(clock=clock)
        self.evictions = Evictions(api, self.event, clock)
        self._clock = clock
        self._lock = threading.Condition()
        self._tracked: dict[str, _Tracked] = {}
        # What was reported of pods dropped while they run again between two failures (a
        # restart after its back-off): their next failure is not reported a second time.
        self._reported: OrderedDict[str, frozenset[tuple[str, str]]] = OrderedDict()
        self._full_logged = False
        self._nowhere: set[tuple[str, str]] = set()   # (workload or pod uid, arch) told so

    # --- leading ---------------------------------------------------------------------------
    def lead(self, stop: threading.Event, api_client_factory,
             unseen: UnseenPods | None = None) -> None:
        """Watch and act until `stop`, fed by a watch of this leadership's own, which feeds
        `unseen` too (its passes run in a thread of their own)."""
        FailingPods(self, api_client_factory, self.watch_seconds, unseen).feeding(
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
                self._drop(uid)
        for pod in pods:
            self.failing(pod)

    def failing(self, pod: FailingPod) -> None:
        if not pod.failures and self.log_reader is None:
            self.gone(pod.uid)   # a failure whose words are only in a log no one reads
            return
        with self._lock:
            tracked = self._tracked.get(pod.uid)
            if tracked is None:
                if len(self._tracked) >= MAX_TRACKED:
                    if not self._full_logged:
                        self._full_logged = True
                        log.warning("more than %d pods fail: the others are looked at once some "
                                    "of these are gone", MAX_TRACKED)
                    return
                tracked = self._tracked[pod.uid] = _Tracked(
                    pod, handled=self._reported.pop(pod.uid, frozenset()))
            tracked.pod = pod
            if {(f.container, f.image) for f in pod.failures} - tracked.handled \
                    or (self.log_reader is not None and tracked.unread()):
                tracked.due = True
                self._lock.notify_all()

    def gone(self, uid: str, deleted: bool = False) -> None:
        """The pod does not fail now (`deleted`: it is no more)."""
        with self._lock:
            self._drop(uid)
            if deleted:
                self._reported.pop(uid, None)

    def _drop(self, uid: str) -> None:
        tracked = self._tracked.pop(uid, None)
        if tracked is not None and tracked.handled:
            self._reported[uid] = tracked.handled
            while len(self._reported) > MAX_TRACKED:
                self._reported.popitem(last=False)

    def _work_loop(self, stop: threading.Event) -> None:
        next_clearing = self._clock()
        while not stop.is_set():
            due = self.take_due(wait=True)
            if due:
                self.round(due)
            if self._clock() >= next_clearing:
                next_clearing = self._clock() + CONDITION_LOOK_SECONDS
                self._guarded_clearing()

    def _guarded_clearing(self) -> None:
        try:
            self.clear_stale_conditions()
        except Exception:
            log.exception("removing conditions that no longer hold")

    def take_due(self, wait: bool = False) -> list[_Tracked]:
        """The tracked pods to look at now; with `wait`, none after waiting a little for one."""
        with self._lock:
            now = self._clock()
            due = [t for t in self._tracked.values()
                   if t.due or (t.next_look is not None and t.next_look <= now)]
            if not due and wait:
                waits = [t.next_look - now for t in self._tracked.values()
                         if t.next_look is not None]
                self._lock.wait(min([0.5] + [max(0.01, w) for w in waits]))
            for t in due:
                t.due = False
            return due

    def round(self, due: list[_Tracked]) -> None:
        """The pods due now: each reported, then what they taught written, one read and at most
        one patch per workload, then evicted."""
        lessons: dict[str, _Lesson] = {}
        for tracked in due:
            self._guarded(tracked.pod, partial(self._handle, tracked, lessons))
        for lesson in lessons.values():
            self._guarded(lesson.pods[0][0].pod, partial(self._apply, lesson))

    @staticmethod
    def _guarded(pod: FailingPod, work: Callable[[], None]) -> None:
        try:
            work()
        except ApiError as e:
            log.warning("failing pod %s/%s: %s", pod.namespace, pod.name, e)
        except Exception:
            log.exception("failing pod %s/%s", pod.namespace, pod.name)

    # --- one failing pod ---------------------------------------------------------------------
    def _handle(self, tracked: _Tracked, lessons: dict[str, _Lesson]) -> None:
        pod = tracked.pod
        arch = self._arch_to_act_on(tracked)
        if arch is None:
            return
        top = self.top_workload(pod)
        if top is None and pod.owner is not None and not self.workloads_synced():
            tracked.next_look = self._clock() + RETRY_SECONDS   # its controller may be news
            return
        if top is not None:    # what its workload learned already spares reading its log
            tracked.log_failures += explained_failures(pod, tracked.unread(), top.learned, arch)
        if self.log_reader is not None:
            self._read_logs(tracked, top.name if top is not None else f"pod {pod.uid}")
        new = [f for f in tracked.failures if (f.container, f.image) not in tracked.handled]
        tracked.handled |= {(f.container, f.image) for f in new}
        if new:
            tracked.learned = False
        mode = self.mode_of(pod.namespace, dict(pod.labels))
        learn = self.settings.learn_failed_architectures and mode == "enforce"
        for failure in new:
            self._report(pod, failure, arch, top, _consequence(arch, mode, learn))
        nowhere = self._tell_if_nowhere(pod, arch, top) if new else ""
        if learn and top is not None and tracked.failures:
            self._add_lesson(lessons, tracked, arch, top, nowhere)

    def _arch_to_act_on(self, tracked: _Tracked) -> str | None:
        """The architecture of the pod's node, when the pod is to be acted on at all."""
        pod = tracked.pod
        if not self.nodes.wait_synced(10.0):
            tracked.next_look = self._clock() + RETRY_SECONDS   # no node cache yet
            return None
        if self.namespaces is not None:
            self.namespaces.wait_synced(10.0)   # their mode; without it the config's
        tracked.next_look = None
        arch = getattr(self.nodes.items.get(pod.node), "arch", None)
        if arch is None and tracked.failures:
            log.warning("pod %s/%s fails on node %s, whose architecture archway does not know: "
                        "nothing learned", pod.namespace, pod.name, pod.node)
        return arch if self.mode_of(pod.namespace, dict(pod.labels)) != "off" else None

    def _add_lesson(self, lessons: dict[str, _Lesson], tracked: _Tracked, arch: str,
                    top: WorkloadFacts, nowhere: str) -> None:
        if tracked.learned and (tracked.evict_done or not self.settings.evict):
            return   # nothing left to do for it
        lesson = lessons.setdefault(f"{top.kind}/{top.name}", _Lesson(top))
        lesson.nowhere = lesson.nowhere or nowhere
        if not tracked.learned:
            lesson.evidence.setdefault(arch, []).extend(tracked.pod.evidence(arch,
                                                                             tracked.failures))
        lesson.pods.append((tracked, arch))

    def _read_logs(self, tracked: _Tracked, workload: str) -> None:
        """The log tails of its failed containers whose status says nothing, each failed
        instance once, within the budget (a read over it waits for the next look)."""
        pod = tracked.pod
        for read in tracked.unread():
            wait = self.log_budget.take(workload)
            if wait:   # looked at again before then: what its workload learns may explain it
                tracked.next_look = self._clock() + min(wait, UNREAD_LOOK_SECONDS)
                return
            tracked.read = (tracked.read + (read.episode,))[-MAX_EPISODES:]
            try:
                wording = self.log_reader.wording(pod.namespace, pod.name, read)  # type: ignore[union-attr]
            except ApiError as e:
                if e.status == 403:   # not granted (the chart's rbac off?): asked no more
                    log.warning("archway may not read pods/log (%s): exec format errors are "
                                "read in statuses only until the leader starts again", e)
                    self.log_reader = None
                    return
                log.warning("pod %s/%s: the log of its failed container %s could not be read: "
                            "%s", pod.namespace, pod.name, read.container, e)
                continue
            if wording is not None:
                tracked.log_failures += (Failure(read.container, read.image, read.digest,
                                                 wording, source="log"),)

    def _report(self, pod: FailingPod, failure: Failure, arch: str, top: WorkloadFacts | None,
                consequence: str) -> None:
        """The metric, a log line, the Events on the pod and on its workload."""
        metrics.EXEC_FORMAT_ERRORS.labels(arch).inc()
        log.warning("pod %s/%s: container %s (image %s) failed on node %s (%s) with exec "
                    "format error (read in its %s)", pod.namespace, pod.name, failure.container,
                    failure.image, pod.node, arch, failure.source)
        self.event(pod.reference, "Warning", REASON_EXEC_FORMAT, "Detect",
                   f"container {failure.container} (image {failure.image}) failed on node "
                   f"{pod.node} ({arch}) with exec format error: its binaries are not "
                   f"{arch} binaries ({failure.where})")
        if top is not None and failure.source != "evidence":   # it knows: its evidence says so
            self.event(workload_reference(top), "Warning", REASON_EXEC_FORMAT, "Detect",
                       f"pods of image {failure.image} fail on {arch} with exec format "
                       f"error (read in their {failure.source}): {consequence}")

    def _tell_if_nowhere(self, pod: FailingPod, arch: str, top: WorkloadFacts | None) -> str:
        """When `arch` was the last architecture its images claim that its workload has not
        failed on, no node can run it: learning and evicting would change nothing. One Warning
        Event on the workload (or the bare pod) says so, and what would help; returns what its
        condition is to say ("" when it was told before or it can run somewhere)."""
        if pod.architectures is None:
            return ""   # admitted without archway's decision: what its images claim is unknown
        failed = top.learned.architectures if top is not None and top.learned is not None else frozenset()
        if pod.architectures - failed - {arch}:
            return ""
        regarding = workload_reference(top) if top is not None else pod.reference
        key = (regarding["uid"] or regarding["name"], arch)
        if key in self._nowhere or len(self._nowhere) >= MAX_TRACKED:
            return ""
        self._nowhere.add(key)
        claimed = join_architectures(pod.architectures)
        log.warning("%s/%s: its images claim only %s and fail on %s with exec format error: it "
                    "can run nowhere", pod.namespace, regarding["name"], claimed, arch)
        self.event(regarding, "Warning", REASON_NOWHERE, "Detect",
                   f"its images claim {claimed} only and fail on {arch} with exec format error: "
                   f"no architecture is left where its pods could run, so archway evicts none of "
                   f"them (that would only repeat the failure) and the kubelet's restarts go on, "
                   f"backing off; rebuild the image for the architectures it claims, or use an "
                   f"image that has another")
        return (f"its images claim {claimed} only and its pods failed on {join_architectures(failed | {arch})} "
                f"with exec format error: no architecture is left where they could run")

    def _say_nowhere(self, top: WorkloadFacts, message: str) -> None:
        """Its condition set (the kinds whose status has conditions), beside the Event."""
        if top.kind in conditions.WITH_CONDITIONS:
            self._patch_condition(top, conditions.setting(top.kind, message, time.time()), "set")

    def _patch_condition(self, top: WorkloadFacts, body: dict, doing: str) -> bool:
        """A strategic-merge patch of its status: True when written (a workload gone is not)."""
        path = workload_path(top.kind, top.namespace, top.object_name) + "/status"
        try:
            self.api.request("PATCH", path, content_type=conditions.STRATEGIC, body=body)
        except ApiError as e:
            if e.status != 404:
                log.warning("%s %s/%s: could not %s its condition %s: %s", top.kind,
                            top.namespace, top.object_name, doing, CONDITION_ARCHITECTURE_LEFT, e)
            return False
        return True

    def clear_stale_conditions(self) -> None:
        """Each workload told it can run nowhere (by this leader or one before) whose lesson no
        longer holds gets its condition removed, and may be told again."""
        if self.workloads is None:
            return
        for top in [t for t in self.workloads.tops() if t.nowhere]:
            why = conditions.holds_no_more(top)
            if not why:
                continue
            if not self._patch_condition(top, conditions.CLEARING, "remove"):
                continue
            self._nowhere = {k for k in self._nowhere if k[0] != top.uid}
            log.info("%s %s/%s may run again: %s (condition %s removed)", top.kind,
                     top.namespace, top.object_name, why, CONDITION_ARCHITECTURE_LEFT)

    def _apply(self, lesson: _Lesson) -> None:
        top = lesson.top
        wrote = False
        if lesson.evidence:
            try:
                wrote = self.learn(top, lesson.evidence)
            except ApiError as e:   # the apiserver is away: merged at the next look
                log.warning("%s %s/%s: could not record what its pods taught: %s", top.kind,
                            top.namespace, top.object_name, e)
                for tracked, _ in lesson.pods:
                    tracked.next_look = self._clock() + RETRY_SECONDS
                return
        if lesson.nowhere:    # after what it learned: a cache shows the two in that order
            self._say_nowhere(top, lesson.nowhere)
        now = self._clock()
        for tracked, arch in lesson.pods:
            tracked.learned = True
            if wrote:
                tracked.learned_at = now
            if not self.settings.evict or tracked.evict_done:
                continue
            if not _seen(top, arch) and tracked.learned_at is not None \
                    and now - tracked.learned_at < SEEN_WITHIN_SECONDS:
                tracked.next_look = now + SEEN_POLL_SECONDS
                continue
            self.evictions.maybe_evict(tracked, arch, top)

    def top_workload(self, pod: FailingPod) -> WorkloadFacts | None:
        """The pod's workload, from the caches, when its controller chain is real
        (controlling_workload): a pod anyone may create names whom it likes."""
        if self.workloads is None:
            return None
        return controlling_workload(pod.namespace, pod.owner, dict(pod.labels),
                                    self.workloads.lookup)

    def workloads_synced(self) -> bool:
        return self.workloads is None or self.workloads.wait_synced(10.0)

    def learn(self, top: WorkloadFacts, evidence: dict[str, list[Evidence]]) -> bool:
        """Merge each architecture and its evidence into the workload's own annotations (never
        its pod template: no rollout); True when something was written. Nothing is read when
        the cache's copy holds it all already."""
        if _merged(dict(top.annotations), evidence) is None:
            return False
        path = workload_path(top.kind, top.namespace, top.object_name)

        def merge(obj: dict) -> dict | None:
            meta = obj.get("metadata") or {}
            if (meta.get("uid") or "") != top.uid:
                return None    # another object under its name now: it taught nothing
            return _merged(meta.get("annotations") or {}, evidence)

        try:
            merged = self.patch_annotations(path, merge)
        except KeptChanging:
            log.warning("%s %s/%s changed %d times while archway merged what it learned into "
                        "%s: tried again at the next failure", top.kind, top.namespace,
                        top.object_name, MAX_PATCH_ATTEMPTS, ANNOTATION_FAILED)
            return False
        if merged is None:
            return False
        log.warning("%s %s/%s: learned that its pods fail on %s; new pods are kept off it "
                    "(%s=%s)", top.kind, top.namespace, top.object_name,
                    ",".join(sorted(evidence)), ANNOTATION_FAILED, merged[ANNOTATION_FAILED])
        return True


def _merged(annotations: dict, evidence: dict[str, list[Evidence]]) -> dict[str, str] | None:
    """The annotations with every architecture's evidence merged in; None: nothing new."""
    changed = None
    for arch, found in sorted(evidence.items()):
        merged = merged_annotations(annotations, arch, found)
        if merged is not None:
            annotations = changed = {**annotations, **merged}
    return None if changed is None else {k: changed[k] for k in (ANNOTATION_FAILED,
                                                                  ANNOTATION_EVIDENCE)}


def _seen(top: WorkloadFacts, arch: str) -> bool:
    """The workload, as the cache has it, already carries `arch` as learned."""
    return top.learned is not None and arch in top.learned.architectures


def _consequence(arch: str, mode: str, learn: bool) -> str:
    if mode != "enforce":
        return "audit mode: archway only reports it"
    if not learn:
        return "remediation.learn_failed_architectures is off: archway only reports it"
    return (f"archway keeps its new pods off {arch} (annotation {ANNOTATION_FAILED}; remove it, "
            f"or change the image, to undo)")
