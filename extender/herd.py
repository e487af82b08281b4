"""Herd control: the pods placed on each node since the last traffic sample.

Between two Prometheus samples every score is frozen, so a burst of pods would all land on the
one quietest node. Like Trimaran and Koordinator, archway counts what was placed since the
sample and adds an estimate of its traffic to the node until a newer sample measures it:

- where a pod went: the pod watch (`PodWatch`, when a cluster is configured) sees spec.nodeName
  set by the scheduler's bind; the extender's own prioritize answer (the node it scored highest)
  stands in until then, and is all there is without a cluster: an estimate;
- how much traffic: the pod's `archway.dev/expected-bandwidth` annotation, else the node's
  average traffic per running pod (the pod watch counts them), else
  extender.default_pod_bytes_per_second.

The arithmetic (`parse_bandwidth`, `added_traffic`) is pure; `Herd` holds the placements.
"""
import logging
import re
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

from archway.listwatch import ListWatch

log = logging.getLogger("archway.herd")

ANNOTATION_BANDWIDTH = "archway.dev/expected-bandwidth"
_QUANTITY = re.compile(r"\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*([kMGTP]i?|Ki)?\s*")
_FACTORS = {None: 1.0, "k": 1e3, "K": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "P": 1e15,
            "Ki": 2.0 ** 10, "Mi": 2.0 ** 20, "Gi": 2.0 ** 30, "Ti": 2.0 ** 40, "Pi": 2.0 ** 50}
# Placements are dropped as samples cover them; while no sample comes (Prometheus down) this
# bounds them, the oldest going first.
MAX_PLACEMENTS = 20_000
# Pods in these phases run nothing: they neither count as running nor add traffic.
_DONE_PHASES = ("Succeeded", "Failed")


def parse_bandwidth(value: object) -> float | None:
    """Bytes/s from a Kubernetes-style quantity: "2500000", "10M", "1.5Gi", "800k".
    None when absent or unreadable (the next estimate then applies)."""
    if not isinstance(value, str):
        return None
    match = _QUANTITY.fullmatch(value)
    if match is None:
        return None
    return float(match.group(1)) * _FACTORS[match.group(2)]


@dataclass(frozen=True)
class Placement:
    pod: str                         # pod_key()
    node: str
    at: float                        # wall-clock time archway learned of it
    bytes_per_second: float | None   # from the annotation; None: estimate from the node
    confirmed: bool                  # seen bound by the pod watch, not only guessed


def added_traffic(placements: Iterable[Placement], node_traffic: Mapping[str, float],
                  running: Mapping[str, int], default: float) -> dict[str, float]:
    """node -> bytes/s the placements add. A pod without an annotation is worth its node's
    average traffic per running pod, when the node has traffic and running pods, else
    `default`."""
    added: dict[str, float] = {}
    for p in placements:
        estimate = p.bytes_per_second
        if estimate is None:
            pods = running.get(p.node, 0)
            traffic = node_traffic.get(p.node)
            estimate = traffic / pods if pods > 0 and traffic else default
        added[p.node] = added.get(p.node, 0.0) + estimate
    return added


def pod_key(pod: Mapping) -> str | None:
    """The pod's uid, else namespace/name: what identifies one placement."""
    meta = pod.get("metadata")
    if not isinstance(meta, dict):
        return None
    uid = meta.get("uid")
    if isinstance(uid, str) and uid:
        return uid
    name = meta.get("name")
    return f"{meta.get('namespace') or 'default'}/{name}" if isinstance(name, str) and name else None


def pod_bandwidth(pod: Mapping) -> float | None:
    meta = pod.get("metadata")
    annotations = meta.get("annotations") if isinstance(meta, dict) else None
    return parse_bandwidth(annotations.get(ANNOTATION_BANDWIDTH)) \
        if isinstance(annotations, dict) else None


class Herd:
    """Placements since the last sample, keyed by pod."""

    def __init__(self, wall: Callable[[], float] = time.time):
        self.wall = wall
        self.running: dict[str, int] = {}    # node -> running pods (pod watch only)
        self._placed: dict[str, Placement] = {}
        self._lock = threading.Lock()

    def guess(self, key: str, node: str, bytes_per_second: float | None) -> None:
        """The extender's own answer: the pod probably goes to `node`. A bind the watch
        already saw is not overridden."""
        with self._lock:
            current = self._placed.get(key)
            if current is not None and (current.confirmed or current.node == node):
                return
            self._put(Placement(key, node, self.wall(), bytes_per_second, False))

    def bound(self, key: str, node: str, bytes_per_second: float | None) -> None:
        """The pod watch saw the pod bound to `node`."""
        with self._lock:
            self._put(Placement(key, node, self.wall(), bytes_per_second, True))

    def _put(self, placement: Placement) -> None:
        placed = self._placed
        placed.pop(placement.pod, None)   # re-inserted: the dict stays ordered by time
        placed[placement.pod] = placement
        if len(placed) > MAX_PLACEMENTS:
            for key in list(placed)[:len(placed) - MAX_PLACEMENTS]:
                del placed[key]

    def forget(self, key: str) -> None:
        with self._lock:
            self._placed.pop(key, None)

    def since(self, sampled_at: float, exclude: str | None = None) -> list[Placement]:
        """The placements after `sampled_at` (but `exclude`'s: a pod scored again, after a
        failed bind, must not count against the node it was guessed on); older ones are in that
        sample already and go."""
        with self._lock:
            old = [k for k, p in self._placed.items() if p.at <= sampled_at]
            for key in old:
                del self._placed[key]
            return [p for p in self._placed.values() if p.pod != exclude]

    def placement(self, key: str) -> Placement | None:
        return self._placed.get(key)


class PodWatch(ListWatch):
    """List + watch of all Pods, keeping only which node each running pod is on: it tells the
    Herd about binds and counts running pods per node."""
    what = "pod watch"
    path = "/api/v1/pods"
    page_size = 500

    def __init__(self, api_client_factory, herd: Herd, **kwargs):
        super().__init__(api_client_factory, thread_name="archway-pod-watch", **kwargs)
        self.herd = herd
        self._nodes: dict[str, str] = {}    # pod key -> node, for pods that run (or will)

    def _on_no_cluster(self) -> None:
        log.debug("no Kubernetes cluster configured: herd control estimates placements from "
                  "archway's own prioritize answers")   # said once by `archway serve`

    def _slim(self, obj: dict) -> dict:
        meta, spec, status = (_part(obj, k) for k in ("metadata", "spec", "status"))
        bandwidth = (meta.get("annotations") or {}).get(ANNOTATION_BANDWIDTH)
        return {"metadata": {k: meta[k] for k in ("uid", "name", "namespace") if k in meta}
                | ({"annotations": {ANNOTATION_BANDWIDTH: bandwidth}} if bandwidth else {}),
                "spec": {"nodeName": spec.get("nodeName")}, "status": {"phase": status.get("phase")}}

    def _on_list(self, items: list) -> None:
        first = not self.synced
        known, self._nodes = self._nodes, {}
        for pod in items:
            key, node = _running_on(pod)
            if key is not None and node is not None:
                self._nodes[key] = node
                # After a re-list, a pod bound while the watch was down is a new placement.
                if not first and known.get(key) != node:
                    self.herd.bound(key, node, pod_bandwidth(pod))
        self._count()
        if first:
            log.info("pod watch synced: %d running pods", len(self._nodes))

    def _on_event(self, kind: str, obj: dict) -> None:
        key, node = _running_on(obj)
        if key is None:
            return
        before = self._nodes.get(key)
        if kind == "DELETED" or node is None:
            if before is not None:
                del self._nodes[key]
                self._add(before, -1)
            if kind == "DELETED":
                self.herd.forget(key)
            return
        if before != node:
            self._nodes[key] = node
            if before is not None:
                self._add(before, -1)
            self._add(node, 1)
            self.herd.bound(key, node, pod_bandwidth(obj))

    def _count(self) -> None:
        counts: dict[str, int] = {}
        for node in self._nodes.values():
            counts[node] = counts.get(node, 0) + 1
        self.herd.running = counts   # replaced whole: request threads read it without a lock

    def _add(self, node: str, delta: int) -> None:
        # In place: one key's update is atomic for readers, and a watch event stays O(1).
        running = self.herd.running
        left = running.get(node, 0) + delta
        if left > 0:
            running[node] = left
        else:
            running.pop(node, None)


def _part(obj: dict, key: str) -> dict:
    value = obj.get(key)
    return value if isinstance(value, dict) else {}


def _running_on(pod: dict) -> tuple[str | None, str | None]:
    """(key, node) of a pod bound to a node and not finished; node None otherwise."""
    key = pod_key(pod)
    spec, status = pod.get("spec"), pod.get("status")
    node = spec.get("nodeName") if isinstance(spec, dict) else None
    phase = status.get("phase") if isinstance(status, dict) else None
    if not isinstance(node, str) or not node or phase in _DONE_PHASES:
        return key, None
    return key, node
