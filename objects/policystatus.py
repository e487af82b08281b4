"""The status of PlacementPolicies and ClusterPlacementPolicies, written by the leading gate
controller (one writer): conditions Ready, Invalid and Conflicting with their reason, message
and observedGeneration, through the status subresource, and one Warning Event per problem.

It reads the policies from the leadership's list + watch caches and writes only a status that
differs from the stored one: a leadership that starts writes nothing for policies whose status
is already right, and a change is looked at within a second.
"""
import logging
import threading
from datetime import UTC, datetime

from archway.kubeapi import ApiError, KubeApi
from archway.placement.policies import PolicyObject, conflicts_of, unsupported

from .policies import CLUSTER_PLURAL, GROUP, NAMESPACED_KIND, NAMESPACED_PLURAL, VERSION

log = logging.getLogger("archway.gate.policies")

LOOK_SECONDS = 0.5
REASON_INVALID = "InvalidPlacementPolicy"
REASON_CONFLICTING = "ConflictingPlacementPolicy"
_MESSAGE_CHARS = 900


def wanted_conditions(policy: PolicyObject, conflicts: tuple[PolicyObject, ...],
                      archway_scheduler: str | None) -> list[tuple[str, str, str, str]]:
    """(type, status, reason, message) of Ready, Invalid and Conflicting. Pure."""
    problems = list(policy.problems)
    why_not = unsupported(policy, archway_scheduler)
    if why_not:
        problems.append(why_not)
    if problems:
        said = "; ".join(problems)[:_MESSAGE_CHARS]
        return [("Ready", "False", "Invalid", "archway skips this policy: " + said),
                ("Invalid", "True", "Invalid", said),
                ("Conflicting", "False", "NoConflict", "")]
    if conflicts:
        names = ", ".join(o.display for o in conflicts)
        said = (f"same priority ({policy.priority}) as {names}, which says different things "
                f"and may select the same pods: neither applies to a pod both select")[:_MESSAGE_CHARS]
        return [("Ready", "False", "Conflicting", said),
                ("Invalid", "False", "Valid", ""),
                ("Conflicting", "True", "SamePriority", said)]
    return [("Ready", "True", "Applied", "archway applies this policy to the pods it selects"),
            ("Invalid", "False", "Valid", ""),
            ("Conflicting", "False", "NoConflict", "")]


def status_body(policy: PolicyObject, wanted, now: str) -> dict:
    """The object to PUT to .../status: the conditions, each transition time kept while its
    status stays."""
    stored = {c[0]: c for c in policy.conditions}
    conditions = []
    for kind, status, reason, message in wanted:
        old = stored.get(kind)
        since = old[4] if old is not None and old[1] == status and old[4] else now
        conditions.append({"type": kind, "status": status, "reason": reason,
                           "message": message, "lastTransitionTime": since,
                           "observedGeneration": policy.generation})
    meta = {"name": policy.object_name, "resourceVersion": policy.resource_version}
    if policy.namespace:
        meta["namespace"] = policy.namespace
    return {"apiVersion": f"{GROUP}/{VERSION}", "kind": policy.kind, "metadata": meta,
            "status": {"observedGeneration": policy.generation, "conditions": conditions}}


def up_to_date(policy: PolicyObject, wanted) -> bool:
    stored = {c[:4] for c in policy.conditions}
    return policy.observed_generation == policy.generation and stored == set(wanted)


def status_path(policy: PolicyObject) -> str:
    if policy.kind == NAMESPACED_KIND:
        return (f"/apis/{GROUP}/{VERSION}/namespaces/{policy.namespace}/{NAMESPACED_PLURAL}/"
                f"{policy.object_name}/status")
    return f"/apis/{GROUP}/{VERSION}/{CLUSTER_PLURAL}/{policy.object_name}/status"


class PolicyStatus:
    """One leadership's writer: `lead(stop)` looks at the caches every LOOK_SECONDS."""

    def __init__(self, *, api: KubeApi, policies, cluster_policies, events,
                 archway_scheduler: str | None = None):
        self.api = api
        self.caches = [c for c in (policies, cluster_policies) if c is not None]
        self.events = events
        self.archway_scheduler = archway_scheduler
        self._seen: tuple = ()
        self._told: set[tuple[str, int, str]] = set()   # (uid, generation, reason): one Event
        self._overlaps: dict = {}    # conflicts_of's memory: a change costs only its own pairs

    def lead(self, stop: threading.Event) -> None:
        for cache in self.caches:
            cache.ensure_started()
        while not stop.is_set():
            try:
                self.look()
            except Exception:   # a bug here must not end the leadership's other loops
                log.exception("placement policy status: a look failed")
            stop.wait(LOOK_SECONDS)

    def look(self) -> int:
        """Write the statuses that differ; returns how many were written."""
        if not all(cache.synced for cache in self.caches):
            return 0
        seen = tuple(cache.version for cache in self.caches)
        if seen == self._seen:
            return 0
        policies = [p for cache in self.caches for p in cache.items.values()]
        conflicts = conflicts_of(policies, self.archway_scheduler, self._overlaps)
        written = 0
        all_written = True
        now = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        for policy in policies:
            wanted = wanted_conditions(policy, conflicts.get(policy.name, ()),
                                       self.archway_scheduler)
            self._tell(policy, wanted)
            if up_to_date(policy, wanted):
                continue
            try:
                self.api.request("PUT", status_path(policy), body=status_body(policy, wanted, now))
                written += 1
            except ApiError as e:
                # 409: changed meanwhile, the watch brings it back: try again at the next look.
                # Anything else waits for the next change of the policies (no retry storm).
                all_written = all_written and e.status != 409
                (log.info if e.status == 409 else log.warning)(
                    "placement policy %s: status not written: %s", policy.display, e)
        if all_written:
            self._seen = seen
        return written

    def _tell(self, policy: PolicyObject, wanted) -> None:
        """One Warning Event per problem (per generation of the policy)."""
        if self.events is None:
            return
        for kind, status, _reason, message in wanted:
            if status != "True" or kind not in ("Invalid", "Conflicting"):
                continue
            reason = REASON_INVALID if kind == "Invalid" else REASON_CONFLICTING
            key = (policy.uid, policy.generation, reason)
            if key in self._told:
                continue
            self._told.add(key)
            regarding = {"apiVersion": f"{GROUP}/{VERSION}", "kind": policy.kind,
                         "name": policy.object_name, "namespace": policy.namespace,
                         "uid": policy.uid}
            self.events.record(regarding, "Warning", reason, "Apply", message)
