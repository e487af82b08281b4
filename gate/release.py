"""Gating a pod archway could not place in time, and the one update that releases it. Pure.

The webhook admits such a pod with archway's scheduling gate and a label the controller selects
on (placement/patches.py `gate_patch`). Once its images are known, or when admission.gate_max_seconds has passed, the
controller sends ONE update (`plan_release`) that the apiserver accepts for a gated pod
(KEP-3838, pkg/apis/core/validation ValidatePodUpdate): placement through `placement.decide`,
the same decision as the webhook's, which only ever adds nodeSelector keys, sets required node
affinity where there was none or adds a matchExpression to every existing term, and writes
annotations; archway's gate removed and no other; archway's label removed. Nothing else in the
spec changes: schedulerName, which may not change after creation, is set by the webhook at once.
"""
import copy
from dataclasses import dataclass, replace

import jsonpatch

from archway.errors import classify_error, never_resolves
from archway.placement.decision import Decision, decide, display_image, named
from archway.placement.learning import Learned
from archway.placement.patches import require_no_node
from archway.placement.policy import Policy
from archway.podview import PodView
from archway.registry.model import ImageInfo
from archway.registry.platforms import Platform
from archway.vocabulary import (
    GATE,
    GATED_LABEL,
    join_architectures,
    share_no_architecture,
    told_architectures,
)


def is_gated(pod: dict) -> bool:
    gates = (pod.get("spec") or {}).get("schedulingGates") or []
    return any(isinstance(g, dict) and g.get("name") == GATE for g in gates)


@dataclass(frozen=True)
class Release:
    pod: dict               # the whole updated pod, to PUT with the resourceVersion it was read at
    outcome: str            # placed | fallback | unplaced | no_common_arch
    event_type: str         # Normal | Warning
    reason: str             # the Event's reason
    note: str               # the Event's note
    architectures: frozenset[str] | None = None


def unresolved(pod: PodView, results: dict) -> list[str]:
    """The pod's images without an answer (an error or none at all)."""
    return [image for image in pod.images if not isinstance(results.get(image), ImageInfo)]


def plan_release(obj: dict, results: dict, policy: Policy, *, expired: bool,
                 fallback: tuple[str, ...] = (), waited: float = 0.0,
                 learned: Learned | None = None) -> Release | None:
    """The release of gated pod `obj` given its images' `results`; None: keep waiting (an image
    is unresolved, may still be read, and the pod has not waited admission.gate_max_seconds
    yet). An image that can never be read (errors.never_resolves) is not waited for. `learned`:
    what its workload learned from exec format errors, as at admission."""
    pod = PodView.of(obj)
    fallback = fallback or policy.fallback
    # A gated pod exists: it can no longer be denied; its fallback is assumed below, if at all.
    policy = replace(policy, fail_closed=False, fallback=())
    failed = unresolved(pod, results)
    decision = decide(pod, results, policy, learned=learned)
    if not decision.allowed or decision.architectures == frozenset():
        # More answers cannot help: a common architecture only ever shrinks as images are added.
        return _hold(obj, pod, results, decision)
    hopeless = bool(failed) and all(never_resolves(results.get(image)) for image in failed)
    if failed and not expired and not hopeless:
        return None
    if not failed:
        archs = decision.architectures
        if archs and decision.excluded:
            archs = archs - decision.excluded
        where = f"on {join_architectures(archs)}" if archs else "without an arch constraint (no image told one)"
        return Release(_released(obj, decision), "placed", "Normal", "Placed",
                       f"placed {where} after waiting {waited:.1f} s for its images", archs)
    why = _unresolved_why(failed, results)
    when = (f"released after {waited:.0f} s (admission.gate_max_seconds)" if expired else
            "released at once (an image can never be read)")
    if fallback:
        assumed = dict(results, **{image: _fallback_info(image, fallback) for image in failed})
        with_fallback = decide(pod, assumed, policy, learned=learned)
        if with_fallback.allowed and with_fallback.architectures:
            archs = with_fallback.architectures
            return Release(_released(obj, with_fallback), "fallback", "Warning",
                           "ReleasedOnFallback",
                           f"{when} placed on "
                           f"{join_architectures(archs)} (placement.fallback_architectures); unresolved: {why}",
                           archs)
    return Release(_released(obj, decision), "unplaced", "Warning", "ReleasedUnplaced",
                   f"{when} "
                   f"{'placed on ' + join_architectures(decision.architectures) + ' by the images it read' if decision.architectures else 'without placement'}"
                   f"; unresolved: {why}", decision.architectures)


def _unresolved_why(failed, results: dict) -> str:
    """Each unread image in a few words, then each host-policy rule's hint once."""
    named_as = {image: classify_error(results.get(image)) for image in failed}
    return "; ".join([f"{display_image(image)}: {named_as[image].words}" for image in failed]
                     + list(dict.fromkeys(c.hint for c in named_as.values() if c.hint)))


def gate_only_release(obj: dict) -> dict:
    """The pod with archway's gate and label removed and nothing else: the update that is
    always valid, for when a placing update was refused."""
    return _released(obj, Decision(allowed=True))


def _hold(obj: dict, pod: PodView, results: dict, decision: Decision) -> Release:
    known = told_architectures({image: results.get(image) for image in pod.images}, pod.os)
    if decision.architectures == frozenset():
        note = share_no_architecture(known, results, pod.os, name=lambda image: named(pod, image))
    else:
        note = decision.message
    updated = _released(obj, Decision(allowed=True))
    require_no_node(updated["spec"])
    return Release(updated, "no_common_arch", "Warning", "NoCommonArchitecture",
                   note + "; it could never run, so it is kept off every node", frozenset())


def _released(obj: dict, decision: Decision) -> dict:
    updated = jsonpatch.apply_patch(obj, list(decision.patch)) if decision.patch \
        else copy.deepcopy(obj)
    spec = updated.setdefault("spec", {})
    gates = [g for g in spec.get("schedulingGates") or [] if g.get("name") != GATE]
    if gates:
        spec["schedulingGates"] = gates
    else:
        spec.pop("schedulingGates", None)
    labels = (updated.get("metadata") or {}).get("labels")
    if isinstance(labels, dict):
        labels.pop(GATED_LABEL, None)
    return updated


def _fallback_info(image: str, archs: tuple[str, ...]) -> ImageInfo:
    return ImageInfo(image, frozenset(Platform("linux", a) for a in archs), None, "fallback")
