"""The cluster's workloads as archway needs them, from list + watch caches (archway.watchcache):
who controls whom (a Deployment's ReplicaSets, a CronJob's Jobs), what each learned
(learning.py), and the images of each pod template.

Admission finds a pod's workload through its ownerReferences here, never with a request of its
own; the leading gate controller uses the same caches to learn (remediation.py) and to find the
workloads a moved tag concerns. Only a few facts are kept per object, so a cluster of 10,000
ReplicaSets costs a few megabytes, not the objects.
"""
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from functools import cached_property

from archway import metrics
from archway.labelselector import Selector, compiled
from archway.placement.learning import Learned, learned_from
from archway.podview import OwnerReference, PodView
from archway.vocabulary import CONDITION_ARCHITECTURE_LEFT
from archway.watchcache import WatchCache

from .reads import WORKLOAD_LISTS
from .workloads import TEMPLATE_PATHS

# kind -> its collection (all namespaces)
COLLECTIONS = {kind: f"{prefix}/{plural}" for kind, (prefix, plural) in WORKLOAD_LISTS.items()
               if kind != "Pod"}
# What a workload's owner chain may pass through on the way to the top: a ReplicaSet
# (Deployment), a Job (CronJob). Nothing deeper exists among these kinds.
MAX_CHAIN = 3
# How often admission looks again for a controller its watch has not brought yet.
LINK_POLL_SECONDS = 0.01
# How many admissions of one process may wait for such a controller at once. Any pod's author
# can name a controller that never comes, and each wait holds a handler thread (the chart runs
# 8 per process) for the API's share of the deadline: the others are answered at once, as if
# their pod had no controller.
OWNER_WAITS_AT_ONCE = 2
# Controllers a whole wait missed, remembered (the most recent) so that the pods naming them
# again are answered at once: waiting again would buy nothing the first wait did not.
MISSED_OWNERS_KEPT = 1024
# The kinds whose controllers make pods: a pod's first link is one of them, never a Deployment or
# a CronJob (theirs are a ReplicaSet's, a Job's).
POD_CONTROLLERS = ("ReplicaSet", "Job", "StatefulSet", "DaemonSet")
# A label selector as requirements (key, operator, values); matchLabels are In requirements.


@dataclass(frozen=True)
class WorkloadFacts:
    name: str                              # namespace/name: the cache's key
    kind: str
    namespace: str
    object_name: str
    uid: str
    owner: tuple[str, str] | None          # its controller: (kind, name), same namespace
    annotations: tuple[tuple[str, str], ...]  # archway.dev/* only
    images: tuple[str, ...] = ()           # its pod template's: initContainers, containers, volumes
    service_account: str = ""              # the template's, for its pull credentials
    pull_secrets: tuple[str, ...] = ()
    owner_uid: str = ""                    # its controller's uid
    selector: Selector | None = None       # spec.selector; None: it has none
    labels: tuple[tuple[str, str], ...] = ()   # its pods' (the template's): their policy
    nowhere: bool = False                  # archway's condition says it can run nowhere

    @property
    def display_name(self) -> str:
        return f"{self.kind} {self.object_name}"

    @cached_property
    def learned(self) -> Learned | None:
        return learned_from(dict(self.annotations), self.display_name)

    def template_view(self) -> PodView:
        """A pod of its template as far as credentials and images go."""
        return PodView.of({"metadata": {"namespace": self.namespace},
                           "spec": {"serviceAccountName": self.service_account,
                                    "imagePullSecrets": [{"name": n} for n in self.pull_secrets],
                                    "containers": [{"name": f"c{i}", "image": image}
                                                   for i, image in enumerate(self.images)]}})


def workload_facts(kind: str) -> Callable[[dict], WorkloadFacts | None]:
    """The facts of an object of `kind` (None when it is no such object), for a WatchCache."""
    def facts(obj: dict) -> WorkloadFacts | None:
        meta = obj.get("metadata") if isinstance(obj, dict) else None
        if not isinstance(meta, dict) or not meta.get("name") or not meta.get("namespace"):
            return None
        template = _template(kind, obj)
        spec = _mapping(template.get("spec"))
        return WorkloadFacts(
            name=f"{meta['namespace']}/{meta['name']}", kind=kind, namespace=meta["namespace"],
            object_name=meta["name"], uid=str(meta.get("uid") or ""), owner=_controller(meta),
            annotations=_archway_annotations(_mapping(meta.get("annotations"))),
            images=_images(spec),
            service_account=str(spec.get("serviceAccountName") or spec.get("serviceAccount") or ""),
            pull_secrets=tuple(s["name"] for s in _list(spec.get("imagePullSecrets"))
                               if isinstance(s, dict) and isinstance(s.get("name"), str)),
            owner_uid=_controller_uid(meta),
            selector=_selector(_mapping(obj.get("spec")).get("selector")),
            labels=_labels(template), nowhere=_told_nowhere(obj))
    return facts


def _told_nowhere(obj: dict) -> bool:
    return any(isinstance(c, dict) and c.get("type") == CONDITION_ARCHITECTURE_LEFT
               and c.get("status") == "False"
               for c in _list(_mapping(obj.get("status")).get("conditions")))


def _controller_uid(meta: dict) -> str:
    owner = next((ref for ref in _list(meta.get("ownerReferences"))
                  if isinstance(ref, dict) and ref.get("controller")), None)
    return str(owner.get("uid") or "") if owner else ""


def _selector(selector: object) -> Selector | None:
    return compiled(selector) if isinstance(selector, dict) else None


def selector_matches(selector: Selector | None, labels: Mapping[str, str]) -> bool:
    """Whether a workload's spec.selector selects these labels; no selector selects nothing
    (unlike a policy's)."""
    return selector is not None and selector.matches(labels)


def _controller(meta: dict) -> tuple[str, str] | None:
    owner = next((ref for ref in _list(meta.get("ownerReferences"))
                  if isinstance(ref, dict) and ref.get("controller")), None)
    return (str(owner.get("kind")), str(owner.get("name"))) if owner else None


def _archway_annotations(annotations: dict) -> tuple[tuple[str, str], ...]:
    return tuple(sorted((k, v) for k, v in annotations.items()
                        if isinstance(k, str) and k.startswith("archway.dev/")
                        and isinstance(v, str)))


def _template(kind: str, obj: dict) -> dict:
    template: object = obj
    for key in TEMPLATE_PATHS[kind]:
        template = template.get(key) if isinstance(template, dict) else None
    return _mapping(template)


def _labels(template: dict) -> tuple[tuple[str, str], ...]:
    labels = _mapping(_mapping(template.get("metadata")).get("labels"))
    return tuple(sorted((str(k), str(v)) for k, v in labels.items()))


def _images(spec: dict) -> tuple[str, ...]:
    """The template's distinct images, initContainers first, then its image volumes' (as
    PodView.images orders them)."""
    containers = (c.get("image") for key in ("initContainers", "containers")
                  for c in _list(spec.get(key)) if isinstance(c, dict))
    volumes = (v["image"].get("reference") for v in _list(spec.get("volumes"))
               if isinstance(v, dict) and isinstance(v.get("image"), dict))
    return tuple(dict.fromkeys(image for image in (*containers, *volumes)
                               if isinstance(image, str) and image))


def workload_path(kind: str, namespace: str, name: str) -> str:
    prefix, plural = WORKLOAD_LISTS[kind]
    return f"{prefix}/namespaces/{namespace}/{plural}/{name}"


def workload_reference(facts: WorkloadFacts) -> dict:
    """The workload as what an Event is about."""
    return {"apiVersion": WORKLOAD_LISTS[facts.kind][0].removeprefix("/apis/"),
            "kind": facts.kind, "namespace": facts.namespace, "name": facts.object_name,
            "uid": facts.uid}


def _mapping(value: object) -> dict:
    return value if isinstance(value, dict) else {}


def _list(value: object) -> list:
    return value if isinstance(value, list) else []


Lookup = Callable[[str, str, str], "WorkloadFacts | None"]   # (kind, namespace, name)


def top_workload(namespace: str, owner: tuple[str, str] | None,
                 lookup: Lookup) -> WorkloadFacts | None:
    """The workload at the top of an owner chain starting at `owner` (a pod's controller):
    a Deployment through its ReplicaSet, a CronJob through its Job, or the StatefulSet,
    DaemonSet, Job or ReplicaSet itself. None when the chain leaves these kinds at once or a
    link is not known (yet)."""
    if owner is None or owner[0] not in COLLECTIONS:
        return None
    facts = lookup(owner[0], namespace, owner[1])
    for _ in range(MAX_CHAIN):
        if facts is None:
            return None
        if facts.owner is None or facts.owner[0] not in COLLECTIONS:
            return facts   # the top, or controlled by a kind archway does not know (kept)
        facts = lookup(facts.owner[0], namespace, facts.owner[1])
    return None


def controlling_workload(namespace: str, owner: OwnerReference | None,
                         labels: Mapping[str, str], lookup: Lookup) -> WorkloadFacts | None:
    """The top of a pod's controller chain when the chain is real, None otherwise: the pod's
    controller is a ReplicaSet, Job, StatefulSet or DaemonSet that exists with the uid the pod
    names and a selector that selects the pod's labels, and each link above it has the uid its
    child names. Anyone who may create a pod may write any ownerReference on it: what a pod
    teaches its workload must come from a pod that workload made."""
    if owner is None or owner.kind not in POD_CONTROLLERS or not owner.uid:
        return None
    facts = lookup(owner.kind, namespace, owner.name)
    if facts is None or facts.uid != owner.uid or not selector_matches(facts.selector, labels):
        return None
    for _ in range(MAX_CHAIN):
        if facts.owner is None or facts.owner[0] not in COLLECTIONS:
            return facts
        above = lookup(facts.owner[0], namespace, facts.owner[1])
        if above is None or above.uid != facts.owner_uid:
            return None
        facts = above
    return None


def pod_owner(pod: PodView) -> tuple[str, str] | None:
    owner = next((o for o in pod.owner_references if o.controller), None)
    return (owner.kind, owner.name) if owner is not None else None


def _owner_key(pod: PodView) -> tuple[str, str, str, str]:
    owner = next(o for o in pod.owner_references if o.controller)
    return (pod.namespace, owner.kind, owner.name, owner.uid)


class OwnerWaits:
    """Which admissions may wait for a controller the watch has not brought: at most
    `at_once` at a time (taken without blocking), never for a controller a whole wait already
    missed. archway_admission_owner_waits_total counts each wait and each skip by its result.
    As many slots again are kept for controllers whose own parent is known (a Deployment's new
    ReplicaSet, a CronJob's Job: a rollout): pods naming owners that never come (a flood of
    ghosts) cannot take them."""

    def __init__(self, at_once: int = OWNER_WAITS_AT_ONCE, kept: int = MISSED_OWNERS_KEPT):
        self._slots = threading.BoundedSemaphore(max(1, at_once))
        self._rollout_slots = threading.BoundedSemaphore(max(1, at_once))
        self._missed: OrderedDict[tuple, None] = OrderedDict()
        self._lock = threading.Lock()
        self._kept = kept

    def begin(self, rollout: bool = False) -> threading.BoundedSemaphore | None:
        """The slot taken, for `end`; None: none free (`rollout`: a controller whose parent is
        known may take a kept one)."""
        for slots in ((self._rollout_slots, self._slots) if rollout else (self._slots,)):
            if slots.acquire(blocking=False):
                return slots
        return None

    def end(self, slot: threading.BoundedSemaphore, key: tuple, *, found: bool,
            trusted: bool) -> None:
        """A wait is over. A miss is remembered only when the watches follow the API at its end
        (`trusted`): a list or a retry in progress may yet bring the controller."""
        slot.release()
        metrics.OWNER_WAITS.labels("found" if found else "missed").inc()
        if not found and trusted:
            with self._lock:
                self._missed[key] = None
                self._missed.move_to_end(key)
                while len(self._missed) > self._kept:
                    self._missed.popitem(last=False)

    def missed_before(self, key: tuple) -> bool:
        with self._lock:
            return key in self._missed


class WorkloadCache:
    """One WatchCache per workload kind, started together."""

    def __init__(self, api_client_factory, kinds: Iterable[str] = tuple(COLLECTIONS),
                 waits_at_once: int = OWNER_WAITS_AT_ONCE, **kwargs):
        self.caches: dict[str, WatchCache[WorkloadFacts]] = {
            kind: WatchCache(api_client_factory, what=f"{kind.lower()}",
                             path=COLLECTIONS[kind], facts=workload_facts(kind), **kwargs)
            for kind in kinds}
        self.owner_waits = OwnerWaits(waits_at_once)

    def ensure_started(self) -> None:
        for cache in self.caches.values():
            cache.ensure_started()

    def wait_synced(self, timeout: float) -> bool:
        end = time.monotonic() + max(0.0, timeout)
        return all([cache.wait_synced(end - time.monotonic()) for cache in self.caches.values()])

    @property
    def synced(self) -> bool:
        return all(cache.synced for cache in self.caches.values())

    @property
    def settled(self) -> bool:
        """wait_synced would return at once."""
        return all(cache.settled for cache in self.caches.values())

    @property
    def current(self) -> bool:
        """Every watch follows the API now: a controller made now may arrive any moment."""
        return all(cache.current for cache in self.caches.values())

    def stop(self) -> None:
        for cache in self.caches.values():
            cache.stop()

    def lookup(self, kind: str, namespace: str, name: str) -> WorkloadFacts | None:
        cache = self.caches.get(kind)
        return cache.items.get(f"{namespace}/{name}") if cache is not None else None

    def would_wait_for(self, pod: PodView) -> bool:
        """Whether top_of(pod, timeout) would wait for a link of the pod's chain (a few pods at
        once aside: OwnerWaits' slots are taken only by a wait itself)."""
        owner = pod_owner(pod)
        return (top_workload(pod.namespace, owner, self.lookup) is None
                and self._why_not_wait(pod, owner) is None)

    def _why_not_wait(self, pod: PodView, owner: tuple[str, str] | None) -> str | None:
        """Why a missing link of the pod's chain is not waited for; None: it may be."""
        if owner is None or owner[0] not in self.caches:
            return "untracked"
        if not self.current:
            return "not_watching"
        return "missed_before" if self.owner_waits.missed_before(_owner_key(pod)) else None

    def _parent_known(self, namespace: str, owner: tuple[str, str]) -> bool:
        """Whether the owner's name is its parent's and a hash (`web-7d9f8c` of Deployment
        `web`, `nightly-29040` of CronJob `nightly`) and that parent is in the cache."""
        parent_kind = {"ReplicaSet": "Deployment", "Job": "CronJob"}.get(owner[0])
        stem, dash, _ = owner[1].rpartition("-")
        return bool(parent_kind and dash and self.lookup(parent_kind, namespace, stem))

    def top_of(self, pod: PodView, timeout: float = 0.0) -> WorkloadFacts | None:
        """The top of the pod's owner chain. A controller is created a moment before its pods (a
        Deployment's new ReplicaSet, a CronJob's Job) and its first pods may be admitted before
        the watch has brought it: while a link of a chain archway follows is missing, the watch
        gets up to `timeout` seconds to bring it -- only while every watch follows the API (a
        list in progress brings nothing sooner), for a few pods at once and not again for a
        controller a whole wait missed (OwnerWaits)."""
        owner = pod_owner(pod)
        top = top_workload(pod.namespace, owner, self.lookup)
        if top is not None or owner is None or owner[0] not in self.caches or timeout <= 0:
            return top
        key = _owner_key(pod)
        skip = self._why_not_wait(pod, owner)
        slot = self.owner_waits.begin(self._parent_known(pod.namespace, owner)) if skip is None else None
        if slot is None:
            metrics.OWNER_WAITS.labels(skip or "busy").inc()
            return None
        try:
            top = self._poll(pod.namespace, owner, time.monotonic() + timeout)
        finally:
            self.owner_waits.end(slot, key, found=top is not None, trusted=self.current)
        return top

    def _poll(self, namespace: str, owner: tuple[str, str],
              until: float) -> WorkloadFacts | None:
        while time.monotonic() < until:
            time.sleep(LINK_POLL_SECONDS)
            top = top_workload(namespace, owner, self.lookup)
            if top is not None:
                return top
        return None

    def tops(self) -> Iterable[WorkloadFacts]:
        """Every workload at the top of its chain (what carries a template that matters)."""
        for cache in self.caches.values():
            for facts in cache.items.values():
                if facts.owner is None or facts.owner[0] not in self.caches:
                    yield facts

    def items(self) -> Mapping[str, Mapping[str, WorkloadFacts]]:
        return {kind: cache.items for kind, cache in self.caches.items()}
