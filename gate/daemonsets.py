"""DaemonSets whose images cannot run on some of the nodes they target, told on the DaemonSet.

The DaemonSet controller makes one pod per node it targets, pinned there by a required node
affinity term `matchFields: metadata.name In [node]`. It judges the template, not the pod archway
placed, so it makes pods for nodes of every architecture; archway's admission keeps a pod off an
architecture its images lack, and the pod for such a node stays Pending for ever. Admission
cannot say so where anyone reads it: its warnings go to the DaemonSet controller, and each
admission sees one node. The leader sees them all:

    the pods no node was given (a list, then a watch, of spec.nodeName="")
      -> those of a DaemonSet (its real controller, when the workload cache can tell), pinned to
         one node, whose archway.dev/architectures (without archway.dev/excluded-architectures,
         where its workload failed) lack that node's architecture (node cache)
      -> one Warning Event on the DaemonSet per cause (the architectures its images run on),
         naming the nodes and their architectures; told again only when the nodes change, at
         most once a minute: never an Event per pod or per admission

Pure decisions (`stranded_pod`, `note`) apart from the I/O around them.
"""
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from archway.cluster.workloadcache import controlling_workload
from archway.kubeapi import LIST_PAGE_SIZE
from archway.listwatch import ListWatch
from archway.podview import OwnerReference, PodShapeError, PodView
from archway.vocabulary import (
    ANNOTATION_ARCHITECTURES,
    ANNOTATION_EXCLUDED,
    join_architectures,
    parse_architectures,
)

from .leaderloop import LeaderLoop

REASON_NODES = "ImagesCannotRunOnNodes"
ROUND_SECONDS = 5.0        # how often the pods kept are looked at (the controller makes them in
                           # a burst: one round tells them together)
RETELL_SECONDS = 60.0      # a DaemonSet is told again (its nodes changed) at most this often
MAX_TRACKED = 10_000       # pending DaemonSet pods remembered at once (a few facts each)
MAX_NAMED = 10             # nodes named in one Event; the rest counted
NODE_NAME_FIELD = "metadata.name"


@dataclass(frozen=True)
class StrandedPod:
    """A pod of a DaemonSet, not bound, pinned to one node; `runs_on`: where archway placed it
    (its images' architectures without those its workload failed on)."""
    uid: str
    namespace: str
    owner: OwnerReference
    labels: tuple[tuple[str, str], ...]
    node: str
    runs_on: frozenset[str]
    excluded: frozenset[str]


def pinned_node(pod: PodView) -> str | None:
    """The one node a pod's required node affinity names by `metadata.name` in every term (how
    the DaemonSet controller pins its pods); None when it is not pinned to exactly one."""
    terms = pod.required_terms or ()
    names: set[str] = set()
    for term in terms:
        named = [r for r in term.match_fields if r.key == NODE_NAME_FIELD and r.operator == "In"]
        if not named:
            return None
        names.update(v for r in named for v in r.values)
    return next(iter(names)) if len(names) == 1 else None


def stranded_pod(obj: dict) -> StrandedPod | None:
    """The facts of a DaemonSet's pod that no node was given and archway placed; None for any
    other pod."""
    try:
        pod = PodView.of(obj)
    except PodShapeError:
        return None
    if pod.node_name or pod.being_deleted or pod.scheduling_gates:
        return None     # bound, leaving, or not yet placed (gated: archway reads it again)
    owner = next((o for o in pod.owner_references if o.controller), None)
    if owner is None or owner.kind != "DaemonSet" or not owner.uid:
        return None
    node = pinned_node(pod)
    claimed = parse_architectures(pod.annotations.get(ANNOTATION_ARCHITECTURES, ""))
    if node is None or not claimed:
        return None
    excluded = parse_architectures(pod.annotations.get(ANNOTATION_EXCLUDED, ""))
    return StrandedPod(pod.uid, pod.namespace, owner, tuple(sorted(pod.labels.items())), node,
                       claimed - excluded, excluded & claimed)


def note(runs_on: frozenset[str], excluded: frozenset[str], nodes: dict[str, str]) -> str:
    """The Event's words: where the images run, and the nodes (name -> architecture) where the
    DaemonSet's pods cannot."""
    named = sorted(nodes)[:MAX_NAMED]
    listed = ", ".join(f"{name} ({nodes[name]})" for name in named)
    if len(nodes) > len(named):
        listed += f" and {len(nodes) - len(named)} more"
    why = f"its images run on {join_architectures(runs_on) or 'no architecture'} only"
    if excluded:
        why += (f" (archway keeps it off {join_architectures(excluded)}, where its pods failed "
                f"with exec format error)")
    count = f"{len(nodes)} node" + ("s" if len(nodes) != 1 else "")
    return (f"{why}: its pods for {count} stay Pending, no node there can run them: {listed}. "
            f"Add images for {join_architectures(set(nodes.values()))}, or keep the DaemonSet "
            f"off those nodes (a nodeSelector or node affinity on kubernetes.io/arch)")


class UnboundPods(ListWatch):
    """The pods no node was given yet: the scheduler's queue, few at rest."""
    what = "unbound pod watch"
    path = "/api/v1/pods"
    page_size = LIST_PAGE_SIZE
    list_query = watch_query = {"fieldSelector": "spec.nodeName="}

    def __init__(self, loop: "DaemonSetNodes", api_client_factory, watch_seconds: int):
        super().__init__(api_client_factory, thread_name="archway-daemonset-watch",
                         watch_timeout_seconds=watch_seconds, request_timeout_seconds=60,
                         max_backoff_seconds=10)
        self.loop = loop

    def _slim(self, obj: dict):
        return stranded_pod(obj)

    def _on_list(self, items: list) -> None:
        self.loop.found(items)

    def _on_event(self, kind: str, obj: dict) -> None:
        uid = str((obj.get("metadata") or {}).get("uid") or "")
        pod = None if kind == "DELETED" else stranded_pod(obj)
        if pod is None:
            self.loop.gone(uid)
        else:
            self.loop.pending(pod)


@dataclass
class _Told:
    nodes: frozenset[str]
    at: float


class DaemonSetNodes(LeaderLoop):
    """Tells each DaemonSet the nodes its images cannot run on (see the module's words)."""

    def __init__(self, *, api, settings, policy, events, nodes, workloads=None,
                 namespaces=None, exclude_namespaces=(), in_force=None, watch_seconds: int = 240,
                 clock: Callable[[], float] = time.monotonic):
        super().__init__(api=api, settings=settings, policy=policy, events=events,
                         workloads=workloads, namespaces=namespaces,
                         exclude_namespaces=exclude_namespaces, in_force=in_force)
        self.nodes = nodes                 # name -> NodeFacts (.items)
        self.watch_seconds = watch_seconds
        self._clock = clock
        self._lock = threading.Lock()
        self._pods: dict[str, StrandedPod] = {}
        self._told: dict[tuple, _Told] = {}

    def lead(self, stop: threading.Event, api_client_factory) -> None:
        UnboundPods(self, api_client_factory, self.watch_seconds).feeding(
            lambda: self._work_loop(stop), self._forget)

    def _work_loop(self, stop: threading.Event) -> None:
        while not stop.wait(ROUND_SECONDS):
            self.round()

    def _forget(self) -> None:
        with self._lock:
            self._pods.clear()

    def found(self, pods: list) -> None:
        with self._lock:
            self._pods = {p.uid: p for p in pods[:MAX_TRACKED]}

    def pending(self, pod: StrandedPod) -> None:
        with self._lock:
            if pod.uid in self._pods or len(self._pods) < MAX_TRACKED:
                self._pods[pod.uid] = pod

    def gone(self, uid: str) -> None:
        with self._lock:
            self._pods.pop(uid, None)

    def round(self) -> None:
        """Tell each DaemonSet whose stranded nodes changed since it was last told."""
        if not self.nodes.wait_synced(0):
            return
        with self._lock:
            pods = list(self._pods.values())
        now = self._clock()
        causes = self.stranded(pods)
        for key in [k for k in self._told if k not in causes]:
            del self._told[key]      # its pods were placed, or are gone: told anew if they return
        for key, (pod, nodes) in causes.items():
            told = self._told.get(key)
            if told is not None and (told.nodes == frozenset(nodes)
                                     or now - told.at < RETELL_SECONDS):
                continue
            self._told[key] = _Told(frozenset(nodes), now)
            owner = pod.owner
            self.event({"apiVersion": "apps/v1", "kind": "DaemonSet", "namespace": pod.namespace,
                        "name": owner.name, "uid": owner.uid}, "Warning", REASON_NODES, "Place",
                       note(pod.runs_on, pod.excluded, nodes))

    def stranded(self, pods: Iterable[StrandedPod]) -> dict[tuple, tuple[StrandedPod, dict]]:
        """(namespace, DaemonSet uid, runs_on) -> (a pod of it, {node: its architecture}) for the
        pods pinned to a node whose architecture is not one they run on."""
        causes: dict[tuple, tuple[StrandedPod, dict]] = {}
        for pod in pods:
            arch = getattr(self.nodes.items.get(pod.node), "arch", None)
            # Only enforce mode keeps a pod off a node (audit's are scheduled as they are).
            if arch is None or arch in pod.runs_on or self.mode_of(pod.namespace, dict(pod.labels)) != "enforce" \
                    or not self._made_by_its_owner(pod):
                continue
            key = (pod.namespace, pod.owner.uid, pod.runs_on)
            causes.setdefault(key, (pod, {}))[1][pod.node] = arch
        return causes

    def _made_by_its_owner(self, pod: StrandedPod) -> bool:
        """The DaemonSet the pod names made it (its uid and selector), when the workload cache
        can tell: anyone who may create a pod may name any owner. Without the cache: as named."""
        if self.workloads is None or not self.workloads.synced:
            return self.workloads is None
        top = controlling_workload(pod.namespace, pod.owner, dict(pod.labels),
                                   self.workloads.lookup)
        return top is not None and top.kind == "DaemonSet" and top.uid == pod.owner.uid
