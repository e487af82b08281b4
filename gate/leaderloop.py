"""What the leader's loops of the closed loop share (remediation.py: exec format errors;
tagwatch.py: re-pushed tags; unseen.py, daemonsets.py): who they answer to (the mode of the
policy in force for the pods, as admission reads it), the Events they write,
and how they change a workload's annotations: read, merge, PATCH at the resourceVersion read,
read again when it changed meanwhile (409).
"""
from collections.abc import Callable, Mapping

from archway.cluster.events import EventSink
from archway.kubeapi import ApiError, KubeApi
from archway.placement.namespaces import namespace_mode

MAX_PATCH_ATTEMPTS = 4            # a workload changed meanwhile (409): read it again and merge


class KeptChanging(Exception):
    """The object changed under every one of MAX_PATCH_ATTEMPTS patches."""


class LeaderLoop:
    def __init__(self, *, api: KubeApi, settings, policy, events: EventSink | None, workloads,
                 namespaces=None, exclude_namespaces=(), in_force=None):
        self.api = api
        self.settings = settings           # config.RemediationSettings
        self.policy = policy               # placement.Policy: its mode, per namespace below
        self.events = events
        self.workloads = workloads         # workloadcache.WorkloadCache
        self.namespaces = namespaces       # NamespaceCache or None
        self.exclude_namespaces = frozenset(exclude_namespaces)
        # (namespace, labels) -> the placement.Policy in force (ClusterCaches.policy_for_labels);
        # None: the Namespace's and the config's alone.
        self.in_force = in_force

    def mode_of(self, namespace: str, labels: Mapping[str, str] | None = None) -> str:
        """enforce | audit | off for a pod of `namespace` with `labels` (a workload's: its
        template's), exactly as admission decides it, PlacementPolicies included; off in an
        excluded or terminating namespace whatever a policy says."""
        if self.in_force is None:
            return namespace_mode(namespace, self.policy, self.namespaces, self.exclude_namespaces)
        if namespace in self.exclude_namespaces or self._terminating(namespace):
            return "off"
        return self.in_force(namespace, dict(labels or {})).mode

    def _terminating(self, namespace: str) -> bool:
        facts = self.namespaces.items.get(namespace) if self.namespaces is not None else None
        return facts is not None and facts.terminating

    def event(self, regarding: dict, event_type: str, reason: str, action: str,
              note: str) -> None:
        if self.events is not None:
            self.events.record(regarding, event_type, reason, action, note)

    def patch_annotations(self, path: str, change: Callable[[dict], dict | None], *,
                          gone_is_nothing: bool = False) -> dict | None:
        """Read the object at `path` and PATCH the annotations `change(obj)` gives (None:
        nothing to write) at the resourceVersion read; read again when it changed meanwhile.
        Returns the annotations written, None when there was nothing to write; KeptChanging
        after MAX_PATCH_ATTEMPTS conflicts. `gone_is_nothing`: a read answered 404 is nothing
        to write, not an ApiError."""
        for _ in range(MAX_PATCH_ATTEMPTS):
            try:
                obj = self.api.request("GET", path)
            except ApiError as e:
                if gone_is_nothing and e.status == 404:
                    return None
                raise
            annotations = change(obj)
            if annotations is None:
                return None
            version = (obj.get("metadata") or {}).get("resourceVersion")
            try:
                self.api.request("PATCH", path, content_type="application/merge-patch+json",
                                 body={"metadata": {"resourceVersion": version,
                                                    "annotations": annotations}})
            except ApiError as e:
                if e.status == 409:
                    continue
                raise
            return annotations
        raise KeptChanging(path)
