"""Pods archway never saw: bound pods in the namespaces archway covers that carry no decision of
its (no archway.dev/images nor archway.dev/architectures), admitted while its webhook was down,
bypassed or failing open. The leader revisits each one once, beside the closed loop and fed by
its watch of every pod (remediation.FailingPods: no watch of its own, no request per pod at rest).

    every pod update -> `unseen_pod`: annotated, unbound, finished, being deleted, a mirror pod
      or opted out (admission.opt_out_reason) -> nothing kept (almost every pod: a dict lookup)
    a pass every PASS_SECONDS, at most MAX_PER_PASS pods:
      -> its namespace's mode (the namespace label, admission.exclude_namespaces): off -> left
      -> not sent to archway's webhook (its namespaceSelector, objectSelector: coverage.py)
         -> left; not known yet (the configuration not read) -> looked at again
      -> its images resolved (the controller's resolver, its pull secrets), its node's arch
      -> Warning Event AdmittedWithoutArchway on the pod and its workload, the metric
      -> enforce mode, remediation.evict, a real controller (workloadcache.controlling_workload,
         not a DaemonSet: its pod can only come back to the same node), the node's architecture
         not one its images run on, one they run on left: evicted (eviction.py, the closed loop's
         rules: PodDisruptionBudgets hold, retries that end)

A replacement that again arrives without archway's decision (created bound, or archway still
bypassed) is not evicted at once, which would only repeat while archway is away: it is looked at
again after REPEAT_SECONDS, doubling for each of its workload's up to REPEAT_MAX_SECONDS, and
evicted then. archway is often away only a moment: a new leader acts before the apiserver reaches
its webhook, and a replacement made then came bare (measured on the real node: ~1 s); left, it
would stay on a node it cannot run on. A replacement is a pod first seen
after archway evicted one of its workload's, one per eviction: the rest of a burst that was
already there is evicted too (creation times have whole seconds, and a burst shares them).
"""
import itertools
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from archway import metrics
from archway.cluster.events import EventSink
from archway.cluster.workloadcache import WorkloadFacts, controlling_workload, workload_reference
from archway.errors import never_resolves
from archway.kubeapi import ApiError, KubeApi
from archway.placement.archset import ArchSet, pod_arch_constraint
from archway.placement.policy import opt_out_reason
from archway.podview import OwnerReference, PodShapeError, PodView
from archway.vocabulary import (
    ANNOTATION_ARCHITECTURES,
    ANNOTATION_IMAGES,
    common_architectures,
    join_architectures,
    told_architectures,
)

from .eviction import Evictions
from .leaderloop import LeaderLoop

log = logging.getLogger("archway.unseen")

REASON_UNSEEN = "AdmittedWithoutArchway"
REASON_EVICTED = "EvictedWrongArchitecture"
MIRROR_ANNOTATION = "kubernetes.io/config.mirror"   # a static pod's mirror: never admitted
FINISHED = ("Succeeded", "Failed")                  # phases with nothing left to repair
PASS_SECONDS = 1.0            # a pass over the pods found since the last one
MAX_PER_PASS = 20             # pods revisited per pass: a cluster full of them is worked off
MAX_TRACKED = 10_000          # unseen pods remembered at once (a few facts each)
RETRY_SECONDS = 30.0          # images that did not resolve, caches not synced: looked at again
OWNER_WAIT_SECONDS = 5.0      # a controller not in the workload cache yet: looked at again once
# Pods left alone because archway was off for them are judged again this often (in memory: their
# namespace's mode and the webhook's selectors): a namespace that turns archway on has them found.
LEFT_RECHECK_SECONDS = 10.0
MAX_RESOLVE_TRIES = 3         # then it is recorded without knowing where its images run
REPEAT_SECONDS = 30.0         # a replacement that came bare is evicted after this, doubling per
REPEAT_MAX_SECONDS = 600.0    # its workload's up to this: one eviction in 10 minutes at most


@dataclass(frozen=True)
class UnseenPod:
    """A bound pod without archway's decision: the few facts its revisit needs."""
    view: PodView                                # its images, pull secrets, service account
    owner: OwnerReference | None
    architectures: frozenset[str] | None = None  # what its images run on, once resolved

    @property
    def namespace(self) -> str:
        return self.view.namespace

    @property
    def name(self) -> str:
        return self.view.name

    @property
    def uid(self) -> str:
        return self.view.uid

    @property
    def node(self) -> str:
        return self.view.node_name

    @property
    def reference(self) -> dict:
        return {"apiVersion": "v1", "kind": "Pod", "namespace": self.namespace,
                "name": self.name, "uid": self.uid}

    @property
    def arch_constraint(self) -> ArchSet | None:
        """Its own (no archway patch is on it): its replacement keeps it."""
        return pod_arch_constraint(self.view)


def unseen_pod(obj: dict) -> UnseenPod | None:
    """The facts of a bound, live pod with no archway decision that did not opt out; None for
    every other pod. The namespace's coverage is judged in the pass (its mode may change)."""
    meta = obj.get("metadata") if isinstance(obj, dict) else None
    if _decided_or_mirror((meta or {}).get("annotations") or {}):
        return None
    if not (obj.get("spec") or {}).get("nodeName") \
            or (obj.get("status") or {}).get("phase") in FINISHED:
        return None
    try:
        pod = PodView.of(obj)
    except PodShapeError:
        return None
    if pod.being_deleted or not pod.uid or opt_out_reason(pod, ()) is not None:
        return None
    return UnseenPod(view=pod, owner=next((o for o in pod.owner_references if o.controller),
                                          None))


def _decided_or_mirror(annotations: object) -> bool:
    """archway decided on the pod (or its annotations are not a map), or it is a static pod's
    mirror, which no webhook is asked about."""
    return not isinstance(annotations, dict) or ANNOTATION_IMAGES in annotations \
        or ANNOTATION_ARCHITECTURES in annotations or MIRROR_ANNOTATION in annotations


_SEEN = itertools.count(1)     # the order in which the watch first brought pods


@dataclass
class _Revisit:
    """One unseen pod's revisit; the fields Evictions reads are the closed loop's."""
    pod: UnseenPod
    seen: int = field(default_factory=lambda: next(_SEEN))
    covered: bool | None = None       # None: not judged yet; False: archway leaves it alone
                                      # (off for it, or not sent to it: judged again, LEFT_RECHECK_SECONDS)
    recorded: bool = False            # its Events sent and counted
    done: bool = False                # nothing left to do: never revisited
    resolve_tries: int = 0
    owner_waited: bool = False        # its controller, not in the cache at first, waited for
    next_look: float | None = None
    evict_tries: int = 0
    evict_done: bool = False
    waited: bool = False              # a bare replacement that waited its turn (REPEAT_SECONDS)


class UnseenPods(LeaderLoop):
    def __init__(self, *, api: KubeApi, settings, policy, events: EventSink | None, nodes,
                 workloads, resolver, pull_secrets, namespaces=None, exclude_namespaces=(),
                 in_force=None, coverage=None, resolve_timeout: float = 5.0,
                 clock: Callable[[], float] = time.monotonic):
        super().__init__(api=api, settings=settings, policy=policy, events=events,
                         workloads=workloads, namespaces=namespaces,
                         exclude_namespaces=exclude_namespaces, in_force=in_force)
        self.nodes = nodes
        self.resolver = resolver
        self.pull_secrets = pull_secrets
        self.coverage = coverage      # coverage.WebhookCoverage; None: every pod (no chart)
        self.resolve_timeout = resolve_timeout
        self.evictions = Evictions(api, self.event, clock)
        self._clock = clock
        self._lock = threading.Lock()
        self._pods: dict[str, _Revisit] = {}
        self._listing: dict[str, UnseenPod] = {}
        # workload uid -> the evictions no replacement has answered yet (the _SEEN count then)
        self._unanswered: dict[str, list[int]] = {}
        self._repeats: dict[str, int] = {}        # workload uid -> its replacements that came bare
        self._told: set[str] = set()              # workload uids given their Event
        self._full_logged = False
        self._left_checked = clock()

    # --- fed by the closed loop's pod watch ------------------------------------------------
    def _unseen(self, obj: dict) -> UnseenPod | None:
        meta = obj.get("metadata") if isinstance(obj, dict) else None
        if (meta or {}).get("namespace") in self.exclude_namespaces:
            return None   # never archway's (config): not even read
        return unseen_pod(obj)

    def listing(self, obj: dict) -> None:
        """A pod of a full list being read (before `listed`)."""
        pod = self._unseen(obj)
        if pod is not None and len(self._listing) < MAX_TRACKED:
            self._listing[pod.uid] = pod

    def listed(self) -> None:
        """The full list is in: the unseen pods now are those it held."""
        with self._lock:
            found, self._listing = self._listing, {}
            self._pods = {uid: self._pods.get(uid) or _Revisit(pod)
                          for uid, pod in found.items()}

    def changed(self, kind: str, obj: dict) -> None:
        """A watch event. A pod already known costs only a look at what could end its
        unseen state: most events are status updates of pods that stay as they are."""
        meta = (obj or {}).get("metadata") or {}
        uid = str(meta.get("uid") or "")
        with self._lock:
            known = uid in self._pods
        if known and kind != "DELETED" and not meta.get("deletionTimestamp") \
                and not _decided_or_mirror(meta.get("annotations") or {}) \
                and ((obj.get("status") or {}).get("phase") not in FINISHED):
            return
        pod = self._unseen(obj) if kind != "DELETED" else None
        with self._lock:
            if pod is None:
                self._pods.pop(uid, None)
            elif uid not in self._pods:
                if len(self._pods) >= MAX_TRACKED:
                    if not self._full_logged:
                        self._full_logged = True
                        log.warning("more than %d pods without archway's decision: the others "
                                    "are revisited at the next list", MAX_TRACKED)
                    return
                self._pods[uid] = _Revisit(pod)

    # --- leading ---------------------------------------------------------------------------
    def lead(self, stop: threading.Event) -> None:
        """A pass every PASS_SECONDS until `stop`: at most MAX_PER_PASS pods each."""
        while not stop.is_set():
            if self._clock() - self._left_checked >= LEFT_RECHECK_SECONDS:
                self.reopen_left()
            due = self.take_due()
            if due:
                self.revisit_all(due)
            stop.wait(PASS_SECONDS)

    def take_due(self) -> list[_Revisit]:
        """At most MAX_PER_PASS pods to revisit now."""
        with self._lock:
            return self._due()

    def _due(self) -> list[_Revisit]:
        now = self._clock()
        due = []
        for revisit in self._pods.values():
            if not revisit.done and (revisit.next_look is None or revisit.next_look <= now):
                due.append(revisit)
                if len(due) >= MAX_PER_PASS:
                    break
        return due

    def reopen_left(self) -> int:
        """The pods left alone because archway was off for them, judged again: those it now
        covers (their namespace's label removed, a policy changed) are revisited. How many."""
        self._left_checked = self._clock()
        with self._lock:
            left = [r for r in self._pods.values() if r.covered is False]
        reopened = 0
        for revisit in left:
            pod = revisit.pod
            if self.mode_of(pod.namespace, dict(pod.view.labels)) != "off" and self._sent_to_webhook(pod):
                revisit.covered, revisit.done = None, False
                reopened += 1
        return reopened

    def revisit_all(self, due: list[_Revisit]) -> None:
        for revisit in due:
            pod = revisit.pod
            try:
                self.revisit(revisit)
            except ApiError as e:
                log.warning("pod %s/%s without archway's decision: %s", pod.namespace, pod.name,
                            e)
                revisit.next_look = self._clock() + RETRY_SECONDS
            except Exception:
                log.exception("pod %s/%s without archway's decision", pod.namespace, pod.name)
                revisit.done = True
        with self._lock:
            present = sum(1 for r in self._pods.values() if r.covered)
        metrics.UNSEEN_PODS_PRESENT.set(present)

    # --- one pod ---------------------------------------------------------------------------
    def revisit(self, revisit: _Revisit) -> None:
        """Judge, record and (where it helps) evict one unseen pod, once."""
        pod = revisit.pod
        if not self.nodes.wait_synced(10.0) or not self._workloads_synced():
            revisit.next_look = self._clock() + RETRY_SECONDS
            return
        if self.namespaces is not None:
            self.namespaces.wait_synced(10.0)   # their mode; without it the config's
        mode = self.mode_of(pod.namespace, dict(pod.view.labels))
        sent = self._sent_to_webhook(pod)
        if sent is None:
            revisit.next_look = self._clock() + RETRY_SECONDS
            return
        if mode == "off" or not sent:
            revisit.covered, revisit.done = False, True
            return
        revisit.covered = True
        top = self._top(pod)
        if top is None and pod.owner is not None and not revisit.owner_waited:
            # A controller made a moment before its pod may not be in the cache yet.
            revisit.owner_waited = True
            revisit.next_look = self._clock() + OWNER_WAIT_SECONDS
            return
        if not revisit.recorded:
            if not self._resolve(revisit):
                return    # looked at again
            self._record(revisit, top)
        arch = getattr(self.nodes.items.get(pod.node), "arch", None)
        revisit.next_look = None     # due now: only what follows sets when to look again
        if not self._evictable(revisit, arch, top, mode):
            revisit.done = revisit.next_look is None   # else a replacement waiting its turn
            return
        assert top is not None and arch is not None
        evicted = self.evictions.maybe_evict(
            revisit, arch, top, reason=REASON_EVICTED,
            because=f"admitted without archway's decision, it is bound to node {pod.node} "
                    f"({arch}), which its images cannot run on")
        if evicted and (top.uid in self._unanswered or len(self._unanswered) < MAX_TRACKED):
            self._unanswered.setdefault(top.uid, []).append(next(_SEEN))
        # Evicted or given up; or nothing to ask again (no architecture would be left to it).
        revisit.done = revisit.evict_done or revisit.next_look is None

    def _resolve(self, revisit: _Revisit) -> bool:
        """What its images run on, into revisit.pod.architectures; False: try again later."""
        view = revisit.pod.view
        credentials = self.pull_secrets.credentials_for(
            view, time.monotonic() + self.resolve_timeout / 2)
        results = self.resolver.resolve_many(view.images, keyring=credentials.keyring,
                                             timeout=self.resolve_timeout, scope=view.namespace)
        unread = [image for image in view.images
                  if not hasattr(results.get(image), "architectures")]
        revisit.resolve_tries += 1
        if unread and revisit.resolve_tries < MAX_RESOLVE_TRIES \
                and not any(never_resolves(results.get(image)) for image in unread):
            revisit.next_look = self._clock() + RETRY_SECONDS
            return False
        revisit.next_look = None
        # The runtime of the node it is bound to picks the platforms of the node's OS.
        node_os = getattr(self.nodes.items.get(revisit.pod.node), "os", view.os)
        told = told_architectures(results, node_os)
        # An image that told nothing leaves the pod's architectures unknown: never judged. An
        # OCI artifact (an image volume's model) runs everywhere: it tells nothing by nature.
        silent = [image for image in view.images if image not in told
                  and not getattr(results.get(image), "is_artifact", False)]
        archs = common_architectures(told) if not unread and not silent else None
        revisit.pod = replace(revisit.pod, architectures=archs)
        return True

    def _record(self, revisit: _Revisit, top: WorkloadFacts | None) -> None:
        """The metric, a log line, the Events on the pod and on its workload."""
        pod = revisit.pod
        arch = getattr(self.nodes.items.get(pod.node), "arch", None)
        archs = pod.architectures
        if archs is None or arch is None:
            placement, said = "unknown", "archway could not tell whether its images run there"
        elif arch in archs:
            placement, said = "runs", f"its images run on {arch}"
        else:
            placement = "wrong_architecture"
            said = (f"its images run on {join_architectures(archs) or 'no common architecture'}"
                    f", not on {arch}")
        revisit.recorded = True
        metrics.UNSEEN_PODS.labels(placement).inc()
        (log.warning if placement == "wrong_architecture" else log.info)(
            "pod %s/%s on node %s (%s) was admitted without archway's decision: %s",
            pod.namespace, pod.name, pod.node, arch or "architecture unknown", said)
        self.event(pod.reference, "Warning", REASON_UNSEEN, "Revisit",
                   f"admitted without archway's decision (no {ANNOTATION_IMAGES} annotation: "
                   f"archway's webhook was down, bypassed or failing open, or read none of its "
                   f"images); bound to node {pod.node} ({arch or 'architecture unknown'}): "
                   f"{said}")
        if top is not None and top.uid not in self._told:   # once per workload and leadership
            if len(self._told) < MAX_TRACKED:
                self._told.add(top.uid)
            self.event(workload_reference(top), "Warning", REASON_UNSEEN, "Revisit",
                       "pods of it were admitted without archway's decision (archway's webhook "
                       "was down, bypassed or failing open); their Events say where they run")

    def _evictable(self, revisit: _Revisit, arch: str | None, top: WorkloadFacts | None,
                   mode: str) -> bool:
        """Whether evicting the pod lets its controller's replacement be placed."""
        pod = revisit.pod
        if not self.settings.evict or mode != "enforce" or revisit.evict_done:
            return False
        if arch is None or pod.architectures is None or arch in pod.architectures:
            return False
        if top is None or top.kind == "DaemonSet":
            return False    # nobody recreates it, or only on the same node
        unanswered = self._unanswered.get(top.uid)
        if unanswered and revisit.seen > unanswered[0] and not revisit.waited:
            unanswered.pop(0)
            repeats = self._repeats.get(top.uid, 0)
            if top.uid in self._repeats or len(self._repeats) < MAX_TRACKED:
                self._repeats[top.uid] = repeats + 1
            wait = min(REPEAT_MAX_SECONDS, REPEAT_SECONDS * 2 ** repeats)
            revisit.waited, revisit.next_look = True, self._clock() + wait
            log.warning("pod %s/%s, made after archway evicted a pod of %s, came without "
                        "archway's decision too: evicted in %.0f s if it is still there",
                        pod.namespace, pod.name, top.display_name, wait)
            return False
        return True

    def _sent_to_webhook(self, pod: UnseenPod) -> bool | None:
        """Whether the apiserver would send archway's webhook this pod; None: not known yet."""
        if self.coverage is None:
            return True
        facts = self.namespaces.items.get(pod.namespace) if self.namespaces is not None else None
        return self.coverage.covers(pod.namespace, dict(facts.labels) if facts else None,
                                    dict(pod.view.labels))

    def _top(self, pod: UnseenPod) -> WorkloadFacts | None:
        if self.workloads is None:
            return None
        return controlling_workload(pod.namespace, pod.owner, pod.view.labels,
                                    self.workloads.lookup)

    def _workloads_synced(self) -> bool:
        return self.workloads is None or self.workloads.wait_synced(10.0)

