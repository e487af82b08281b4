"""The gate controller: places and releases the pods the webhook gated. Runs in its own process
beside `archway serve`'s gunicorn workers (process.py, restarted by supervisor.py when it dies)
whenever a Kubernetes API is configured; among the replicas only the holder of the Lease acts
(archway/lease.py).

    lead -> sweep every pod carrying the gate (paged list) -> watch the gated ones (label)
         -> per pod: resolve its images with its pull secrets, retrying with back-off
         -> plan_release (release.py, pure) -> ONE update (PUT at the resourceVersion read)
         -> an Event on the pod

Never stuck: a pod is released at admission.gate_max_seconds after its creation whatever the
registries do; an update the apiserver refuses is followed by the update that only removes the
gate, which is always valid; the chart's pre-delete hook and docs/gate.md's kubectl line cover a
controller that is gone.
"""
import logging
import random
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from archway import metrics
from archway.cluster.events import EventSink, pod_reference
from archway.kubeapi import LIST_PAGE_SIZE, ApiError, KubeApi
from archway.lease import parse_time
from archway.listwatch import ListWatch
from archway.placement.policy import Policy
from archway.podview import PodShapeError, PodView
from archway.vocabulary import GATED_LABEL

from .fairqueue import Candidate, FairShare, pod_hosts
from .put import put_release
from .release import Release, gate_only_release, is_gated, plan_release

log = logging.getLogger("archway.gate")

RETRY_MIN_SECONDS = 0.25      # first retry of a pod whose images did not resolve
RETRY_MAX_SECONDS = 1.0       # the back-off's cap: a registry that is back is seen within it
WATCH_SECONDS = 240


@dataclass
class Pending:
    obj: dict                 # the pod as last seen (its resourceVersion is the update's)
    created: float            # epoch seconds: when it was gated (gates exist only from creation)
    next_try: float = 0.0     # monotonic
    tries: int = 0
    busy: bool = False
    hosts: frozenset[str] = frozenset()   # the registries its images come from
    namespace: str = ""


class GateController:
    """What the leader does. `resolver` and `pull_secrets` are the webhook's interfaces."""

    def __init__(self, *, api: KubeApi, resolver, pull_secrets, policy: Policy,
                 max_seconds: float, fallback: tuple[str, ...] = (), events: EventSink | None,
                 resolve_timeout: float = 5.0, workers: int = 8, wall=time.time,
                 clock=time.monotonic, watch_seconds: int = WATCH_SECONDS,
                 workloads=None):
        self.api = api
        self.resolver = resolver
        self.pull_secrets = pull_secrets
        self.policy = policy
        self.max_seconds = max_seconds
        self.fallback = fallback
        self.events = events
        self.resolve_timeout = resolve_timeout
        self.watch_seconds = watch_seconds
        self.workloads = workloads   # learned exclusions (workloadcache.WorkloadCache) or None
        # PodView -> the policy in force for it (a leadership's caches: its PlacementPolicy, its
        # Namespace's label); None: `policy`, the config's, for every pod
        self.policy_of: Callable[[PodView], Policy] | None = None
        self.sweeps = 0
        self.pending: dict[str, Pending] = {}
        self._wall = wall
        self._clock = clock
        self._lock = threading.Condition()
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="gate")
        self._fair = FairShare(workers)   # a pod starts only on a free thread, in its order

    # --- leading --------------------------------------------------------------------------
    def lead(self, stop: threading.Event) -> None:
        """Act until `stop` is set (leadership lost or the server stopping), fed by a watch of
        this leadership's own."""
        GatedPods(self).feeding(lambda: self._work_loop(stop), self._forget)

    def _forget(self) -> None:
        with self._lock:
            self.pending.clear()
            self._lock.notify_all()
        metrics.GATED_PODS.set(0)
        metrics.GATE_OLDEST.set(0)

    def found(self, gated: list[dict]) -> None:
        """A full list: every pod carrying archway's gate, label or not (what a leader starts
        from, and where it starts again after 410 Gone)."""
        found = {_uid(pod): pod for pod in gated}
        with self._lock:
            for uid in list(self.pending):
                if uid not in found:
                    del self.pending[uid]
            for uid, pod in found.items():
                self._upsert(uid, pod)
            self._lock.notify_all()
        self.sweeps += 1
        log.info("gate controller: %d gated pod(s) found", len(found))

    def changed(self, kind: str, pod: dict) -> None:
        """A watch event of a gated (labelled) pod."""
        uid = _uid(pod)
        with self._lock:
            if kind in ("ADDED", "MODIFIED") and is_gated(pod):
                self._upsert(uid, pod)
            elif uid in self.pending:
                del self.pending[uid]
                if kind == "DELETED" and is_gated(pod):  # deleted while gated
                    metrics.GATE_RELEASES.labels("deleted").inc()
            self._lock.notify_all()
        metrics.GATED_PODS.set(len(self.pending))

    def _upsert(self, uid: str, pod: dict) -> None:
        current = self.pending.get(uid)
        if current is None:
            created = parse_time((pod.get("metadata") or {}).get("creationTimestamp"))
            self.pending[uid] = Pending(pod, created if created is not None else self._wall(),
                                        hosts=pod_hosts(pod), namespace=_name(pod).split("/")[0])
        else:
            current.obj = pod
        metrics.GATED_PODS.set(len(self.pending))

    def _work_loop(self, stop: threading.Event) -> None:
        while not stop.is_set():
            now = self._clock()
            with self._lock:
                oldest = min((p.created for p in self.pending.values()), default=None)
                metrics.GATE_OLDEST.set(0 if oldest is None else max(0.0, self._wall() - oldest))
                started = self._start_due(now)
                if not started:
                    # Until a pod arrives, a try ends (a free thread, a host under its cap) or
                    # a back-off ends; due pods held back by those are not a reason to spin.
                    waits = [p.next_try - now for p in self.pending.values()
                             if not p.busy and p.next_try > now]
                    self._lock.wait(min([0.5] + [max(0.01, w) for w in waits]))
                    continue
            for uid, p in started:
                self._pool.submit(self._attempt, uid, p)

    def _start_due(self, now: float) -> list[tuple[str, Pending]]:
        """The due pods to try now, as many as threads are free, in fairqueue's order (under
        the lock)."""
        chosen = self._fair.start(
            Candidate(uid, p.namespace, p.hosts, (p.next_try, p.created), self._expired(p))
            for uid, p in self.pending.items() if not p.busy and p.next_try <= now)
        started = [(c.key, self.pending[c.key]) for c in chosen]
        for _, p in started:
            p.busy = True
        return started

    def _expired(self, p: Pending) -> bool:
        return self._wall() - p.created >= self.max_seconds

    # --- one pod ----------------------------------------------------------------------------
    def _attempt(self, uid: str, p: Pending) -> None:
        try:
            done = self._try_release(uid, p)
        except ApiError as e:   # the API is down or refuses: retried with the back-off
            log.warning("gate controller: releasing %s failed: %s", _name(p.obj), e)
            done = False
        except Exception:
            log.exception("gate controller: releasing %s failed", _name(p.obj))
            done = False
        with self._lock:
            p.busy = False
            self._fair.finish(p.hosts, p.namespace)
            if done:
                self.pending.pop(uid, None)
            else:
                p.tries += 1
                delay = min(RETRY_MAX_SECONDS, RETRY_MIN_SECONDS * 2 ** (p.tries - 1))
                p.next_try = self._clock() + delay * random.uniform(0.8, 1.0)
            self._lock.notify_all()
        metrics.GATED_PODS.set(len(self.pending))

    def _try_release(self, uid: str, p: Pending) -> bool:
        """True when the pod needs nothing more from this controller."""
        try:
            view = PodView.of(p.obj)
        except PodShapeError as e:
            log.warning("gated pod %s is malformed (%s): releasing its gate only", _name(p.obj), e)
            return self._update(p, gate_only_release(p.obj), None, "unplaced")
        expired = self._expired(p)
        remaining = p.created + self.max_seconds - self._wall()
        timeout = max(0.05, min(self.resolve_timeout, remaining)) if not expired else 0.05
        start = time.monotonic()
        credentials = self.pull_secrets.credentials_for(view, start + timeout * 0.4)
        results = self.resolver.resolve_many(view.images, keyring=credentials.keyring,
                                             timeout=max(0.05, start + timeout - time.monotonic()),
                                             scope=view.namespace)
        self._heard(results)
        waited = max(0.0, self._wall() - p.created)
        top = None
        if self.workloads is not None and view.owner_references:
            # A new leader's caches may still be listing: wait for them as admission does.
            self.workloads.wait_synced(max(0.0, min(timeout, remaining)) * 0.4)
            top = self.workloads.top_of(view)
        policy_of = self.policy_of
        policy = policy_of(view) if policy_of is not None else self.policy
        release = plan_release(p.obj, results, policy, expired=expired,
                               fallback=() if policy_of is not None else self.fallback,
                               waited=waited,
                               learned=top.learned if top is not None else None)
        if release is None:
            return False
        return self._update(p, release.pod, release, release.outcome, waited)

    def _heard(self, results: dict) -> None:
        """Which registries answered this try and which did not (fairqueue orders and caps
        pods by it). A registry that gave no answer before and answers now is back: every pod
        waiting on it retries now instead of at the end of its back-off."""
        with self._lock:
            back = self._fair.heard(results, lambda: set().union(
                *(p.hosts for p in self.pending.values())))
            for p in self.pending.values() if back else ():
                if not p.busy and p.next_try > 0 and p.hosts & back:
                    p.next_try = 0.0
            self._lock.notify_all()

    def _update(self, p: Pending, updated: dict, release, outcome: str, waited: float = 0.0) -> bool:
        try:
            put = put_release(self.api, p.obj, updated)
        except ApiError as e:
            if e.status == 422 and release is not None and updated != gate_only_release(p.obj):
                log.error("the apiserver refused archway's release of %s (%s): removing the "
                          "gate only", _name(p.obj), e.message)
                refused = Release(gate_only_release(p.obj), "unplaced", "Warning",
                                  "ReleasedUnplaced", "released without placement: the apiserver "
                                  f"refused archway's placement ({e.message[:300]})")
                return self._update(p, refused.pod, refused, "unplaced", waited)
            raise
        if put.stored is None:
            if put.fresh is None:
                return True   # deleted or released meanwhile: nothing left to release
            p.obj = put.fresh   # changed since read: decide anew at once
            p.next_try = 0.0
            return False
        stored = put.stored
        metrics.GATE_RELEASES.labels(outcome).inc()
        metrics.GATE_WAIT.observe(waited)
        log.info("gate controller: %s %s after %.1f s%s", outcome, _name(p.obj), waited,
                 f": {release.note}" if release is not None and release.event_type != "Normal"
                 else "")
        if self.events is not None and release is not None:
            self.events.record(pod_reference(stored), release.event_type, release.reason,
                               "Release", release.note)
        return True


class GatedPods(ListWatch):
    """The pods a leader acts on: a paged list of every pod, keeping those gated by archway
    (with the label or not), then a watch of the labelled ones."""
    what = "gate controller's pod watch"
    path = "/api/v1/pods"
    page_size = LIST_PAGE_SIZE
    watch_query = {"labelSelector": GATED_LABEL}

    def __init__(self, controller: GateController):
        super().__init__(lambda: controller.api.client, thread_name="archway-gate-watch",
                         watch_timeout_seconds=controller.watch_seconds,
                         request_timeout_seconds=60, max_backoff_seconds=10)
        self.controller = controller

    def _slim(self, obj: dict) -> dict | None:
        return obj if is_gated(obj) else None

    def _on_list(self, items: list) -> None:
        self.controller.found(items)

    def _on_event(self, kind: str, obj: dict) -> None:
        self.controller.changed(kind, obj)


def _uid(pod: dict) -> str:
    meta = pod.get("metadata") or {}
    return meta.get("uid") or f"{meta.get('namespace')}/{meta.get('name')}"


def _name(pod: dict) -> str:
    meta = pod.get("metadata") or {}
    return f"{meta.get('namespace')}/{meta.get('name')}"
