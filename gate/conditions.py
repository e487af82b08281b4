"""The condition a workload that can run nowhere carries (remediation.py tells it so: its images
claim only architectures its pods failed on with exec format error), and when it is taken away.

    status.conditions: [{type: archway.dev/ArchitectureLeft, status: "False",
                         reason: NoArchitectureLeft, message: ...}]

`kubectl wait --for=condition=archway.dev/ArchitectureLeft=false deploy/NAME` waits for it. The
Deployment, StatefulSet, DaemonSet, ReplicaSet and Job controllers copy conditions they do not
own into every status they write, so it stays beside theirs; a CronJob's status has no
conditions (the Event alone tells it). A strategic-merge patch by type sets or removes this one
condition and no other.

It holds while what archway learned holds: the workload's archway.dev/failed-architectures is
still there (removed by hand or by the tag watch when a tag moved) and every image that failed
is still in its template (a rollout of another image ends it). A leader checks the workloads its
cache shows with it, including those a predecessor told.
"""
import time

from archway.cluster.workloadcache import WorkloadFacts
from archway.vocabulary import CONDITION_ARCHITECTURE_LEFT

REASON = "NoArchitectureLeft"
WITH_CONDITIONS = frozenset({"Deployment", "StatefulSet", "DaemonSet", "ReplicaSet", "Job"})
STRATEGIC = "application/strategic-merge-patch+json"


def setting(kind: str, message: str, now: float) -> dict:
    """The patch of `kind`'s status that says it can run nowhere (`now`: seconds since 1970)."""
    at = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(now))
    condition = {"type": CONDITION_ARCHITECTURE_LEFT, "status": "False", "reason": REASON,
                 "message": message, "lastTransitionTime": at}
    if kind == "Deployment":     # the one kind whose conditions carry it
        condition["lastUpdateTime"] = at
    return {"status": {"conditions": [condition]}}


CLEARING = {"status": {"conditions": [{"type": CONDITION_ARCHITECTURE_LEFT, "$patch": "delete"}]}}


def holds_no_more(top: WorkloadFacts) -> str:
    """Why the workload's condition no longer holds ("" while it does)."""
    learned = top.learned
    if learned is None:
        return "its archway.dev/failed-architectures was removed"
    gone = sorted({e.image for e in learned.evidence} - set(top.images))
    if gone:
        return f"{gone[0]}, which failed, is no longer among its images"
    return ""
