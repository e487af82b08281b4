"""The placement decision: which CPU architectures a pod's images share, and how to pin the pod.

A pure function of the pod (an archway.podview.PodView), the per-image resolution results and
the policy (policy.py): no I/O, no clock. What it changes on the pod is built by patches.py; the
pod's own arch constraint is read by archset.py.
"""
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Protocol

from archway.errors import classify_error
from archway.logsafe import clip, redact_url
from archway.podview import PodView, Toleration
from archway.registry.model import ImageInfo
from archway.vocabulary import (
    OS_LABEL,
    common_architectures,
    join_architectures,
    no_platform_for,
    share_no_architecture,
    told_architectures,
)

from .archset import pod_arch_constraint
from .learning import Exclusion, Learned, exclusion
from .patches import annotate, constrain, json_patch, name_policy, prefer, require_no_node, tolerate
from .policy import DEFAULT_SCHEDULER, Policy

_MAX_IMAGE_CHARS = 60


class NodeLike(Protocol):
    """What the decision reads of a node (archway.cluster.nodes.NodeFacts has it)."""
    @property
    def arch(self) -> str | None: ...
    @property
    def taints(self) -> tuple[tuple[str, str, str], ...]: ...   # (key, value, effect)
    @property
    def os(self) -> str: ...                                       # kubernetes.io/os


@dataclass(frozen=True)
class Decision:
    allowed: bool
    patch: tuple = ()                        # RFC 6902 operations (dicts); empty: no change
    warnings: tuple[str, ...] = ()           # in order of importance; the reply caps them
    message: str = ""                        # why the pod is denied (empty when allowed)
    architectures: frozenset[str] | None = None   # S; None when no image told its architectures
    outcome: str = "unchanged"               # mutated | unchanged | denied | fail_open | audited
    reason: str = ""                         # one phrase for the log line
    would: str = ""                          # audited: the outcome enforce mode would have had
    unschedulable: str = ""                  # why no current node can run the pod ("": fine/unknown)
    conflict: str = ""                       # why the pod's own arch pin excludes its images ("": none)
    excluded: frozenset[str] = frozenset()   # archs of S the pod was kept off (learned failures)
    learned: str = ""                        # what the learned exclusion did, or why it did not



# --- the decision ----------------------------------------------------------------------------

# What an image that could not be read means for the pod, said after "could not inspect X (why); ":
# admitted as is, it does not restrict placement; gated (admission.unresolved: gate), the gate
# controller reads it again and places the pod.
UNREAD_ADMITTED = "it does not restrict placement"
UNREAD_GATED = "archway reads it again and places the pod before it is scheduled"


def gated_warnings(warnings: tuple[str, ...]) -> tuple[str, ...]:
    """The warnings of a decision whose pod is gated: an unread image is read again."""
    return tuple(w.removesuffix(UNREAD_ADMITTED) + UNREAD_GATED
                 if w.startswith("could not inspect ") and w.endswith(UNREAD_ADMITTED) else w
                 for w in warnings)



def decide(pod: PodView, results: dict, policy: Policy, *,
           nodes: Iterable[NodeLike] | None = None, learned: Learned | None = None,
           node_oses: frozenset[str] | None = None) -> Decision:
    """Decide how to place `pod` given `results` (image -> ImageInfo | ArchwayError).

    An image missing from `results` counts as unresolved (the resolver ran out of time).
    `nodes`: the cluster's nodes when known (the node cache); None: the cluster is not consulted.
    `learned`: what its workload learned from exec format errors (learning.exclusion).
    `node_oses`: the OSes of those nodes (None: not known).
    In audit mode the decision is made in full, then only its annotations are applied.
    """
    decision = _enforce(pod, results, policy, nodes, learned, node_oses)
    return _audited(pod, results, decision, policy) if policy.mode == "audit" else decision


def _enforce(pod: PodView, results: dict, policy: Policy, nodes: Iterable[NodeLike] | None,
             learned: Learned | None = None, node_oses: frozenset[str] | None = None
             ) -> Decision:
    warnings, failed = _read(pod, results)
    if failed and policy.fail_closed:
        listed = "; ".join(f"{display_image(image)}: {classify_error(results.get(image)).words}"
                           for image in failed)
        return _deny(f"archway could not read the architectures of {listed} "
                     "(admission.unresolved is deny)", warnings, None)

    known = _told(pod, results, failed, policy, warnings)
    archs = common_architectures(known)
    # Copy and diff only what a decision can change, at the same paths: the same patch as
    # between whole pods, without deep-copying and walking every container and volume.
    mutated = pod.patchable_copy()
    if archs is None:
        placed = _Placed("no image told its architectures" if pod.images else "pod has no images")
    elif not archs:
        if policy.deny_on_empty:
            return _deny(share_no_architecture(known, results, pod.os,
                                               name=lambda image: named(pod, image)),
                         warnings, archs)
        warnings.insert(0, _nothing_shared(pod, known, results, pod.os))
        annotate(mutated, pod, results, archs)
        placed = _Placed("no common architecture")
    elif not policy.within(archs):
        forbidden = _forbidden(mutated, pod, results, archs, policy, warnings)
        if isinstance(forbidden, Decision):
            return forbidden
        placed = forbidden
    else:
        placing = _place(mutated, pod, results, archs, policy, nodes, learned, warnings)
        if isinstance(placing, Decision):
            return placing   # denied
        placed = placing

    reason = placed.reason
    if policy.scheduler_name and pod.scheduler_name in ("", DEFAULT_SCHEDULER):
        # An image not read yet may still be read at scheduling time (or at a gated pod's release).
        if not policy.scheduler_only_when_needed or failed or not _pinned(placed, pod, node_oses):
            mutated.setdefault("spec", {})["schedulerName"] = policy.scheduler_name
        else:
            reason += f"; {PINNED_SCHEDULER}"

    changed = mutated != pod.patchable   # the placement changed the pod, not only named it
    if policy.source and changed:   # a pod archway left as it was has nothing to name
        name_policy(mutated, policy.source)
    patch = json_patch(dict(pod.patchable), mutated)
    if failed:
        outcome = "fail_open"
    else:
        outcome = "mutated" if changed else "unchanged"
    return Decision(allowed=True, patch=patch, warnings=tuple(warnings), architectures=archs,
                    outcome=outcome, reason=reason, unschedulable=placed.unschedulable,
                    conflict=placed.conflict, excluded=placed.exclusion.excluded,
                    learned=placed.exclusion.note)


PINNED_SCHEDULER = "schedulerName left as is: the default scheduler keeps it where its images run"


def _pinned(placed: "_Placed", pod: PodView, node_oses: frozenset[str] | None) -> bool:
    """Whether any scheduler keeps the pod where its images run, so archway's extender could
    not change its node: its required constraints pin the images' architectures and no node
    of another OS can take it (it pins its OS, or every node runs that OS)."""
    return placed.pinned and (pod.os_pinned or node_oses == {pod.os})


def _told(pod: PodView, results: dict, failed: list[str], policy: Policy,
          warnings: list[str]) -> dict:
    """image -> the architectures it has for the pod's OS; an unread image is taken to have the
    policy's fallback architectures, when it names some."""
    known = told_architectures({image: results.get(image) for image in pod.images}, pod.os)
    if failed and policy.fallback:
        known.update((image, frozenset(policy.fallback)) for image in failed)
        warnings.append(f"unread images taken to run on {join_architectures(policy.fallback)} "
                        "(the policy's fallback architectures)")
    return known


def _nothing_shared(pod: PodView, known: dict, results: dict, os: str) -> str:
    """The warning of a pod admitted although its images share no architecture."""
    lacking = [image for image, told in known.items() if not told]
    return (no_platform_for(_named(pod, lacking[0]), results.get(lacking[0]), os)
            if lacking else "the images share no CPU architecture") \
        + "; admitted without an arch constraint"


def _read(pod: PodView, results: dict) -> tuple[list[str], list[str]]:
    """(warnings, the images that could not be read) of the pod's images' results."""
    warnings: list[str] = []
    hints: list[str] = []
    failed: list[str] = []
    for image in pod.images:
        result = results.get(image)
        if isinstance(result, ImageInfo):
            if not result.platforms:   # the annotation holds its note
                what = "is an OCI artifact, no image" if result.is_artifact \
                    else "records no CPU architecture"
                warnings.append(f"{_named(pod, image)} {what}; it does not restrict placement")
        else:
            failed.append(image)
            named_as = classify_error(result)
            warnings.append(f"could not inspect {_named(pod, image)} "
                            f"({named_as.words}); " + UNREAD_ADMITTED)
            if named_as.hint:
                hints.append(named_as.hint)
    return warnings + list(dict.fromkeys(hints)), failed   # a rule's hint once, after the images


def _named(pod: PodView, image: str) -> str:
    """The image as a warning names it (clipped), and the image volume it is pulled for."""
    return named(pod, image, _short(image))


def named(pod: PodView, image: str, shown: str | None = None) -> str:
    """`shown` (the image, redacted) and, for an image volume's image, the volume it is for:
    a message names what the user wrote."""
    volume = pod.volume_name(image)
    shown = display_image(image) if shown is None else shown
    return shown + (f" (image volume '{clip(volume, 63)}')" if volume else "")


@dataclass(frozen=True)
class _Placed:
    """How a pod was placed, for its Decision."""
    reason: str
    unschedulable: str = ""
    conflict: str = ""
    exclusion: Exclusion = field(default_factory=Exclusion)
    pinned: bool = False   # its required constraints keep it on the images' architectures


def _place(mutated: dict, pod: PodView, results: dict, archs: frozenset[str], policy: Policy,
           nodes: Iterable[NodeLike] | None, learned: Learned | None,
           warnings: list[str]) -> "_Placed | Decision":
    """Pin the pod (its patchable copy `mutated`) to S, `archs`, without where its workload
    failed and within its own constraint; add the policy's preferences and tolerations and the
    annotations. A Decision when the policy denies the pod instead."""
    within = policy.within(archs)    # S where the policy lets the pod run
    learned_on = exclusion(within, learned, pod.images, results)
    placed = within - learned_on.excluded   # ... without where its workload failed
    allowed = placed           # where the pod may run: that, within its own constraint
    conflict = unschedulable = ""
    existing = pod_arch_constraint(pod)
    if existing is None:
        reason = constrain(mutated.setdefault("spec", {}), pod.required_terms, placed)
    else:
        reason = "pod already constrains kubernetes.io/arch"
        allowed = existing.within(placed)
        if not allowed:
            conflict = (f"the pod's own kubernetes.io/arch constraint ({existing.describe()}) "
                        f"excludes every architecture its images support "
                        f"({join_architectures(placed)})")
            if policy.deny_on_conflict:
                return _deny(conflict, warnings, archs, conflict=conflict)
            warnings.insert(0, f"the pod's arch constraint ({existing.describe()}) "
                               f"excludes its images' architectures ({join_architectures(placed)})")
        elif existing.exceeds(placed):
            # Narrowed, never widened: the pod's own terms stay, archway's requirement is ANDed
            # in, so it runs only where it allowed AND its images run (left as it was, an amd64
            # image allowed onto arm64 crash-looped there, learned exclusion or not).
            reason = ("the pod's own kubernetes.io/arch constraint narrowed: "
                      + constrain(mutated.setdefault("spec", {}), pod.required_terms, placed))
            warnings.insert(0, f"the pod's arch constraint also allows archs its images lack; "
                               f"archway keeps it to {join_architectures(allowed)}")
    if allowed:
        spec = mutated.setdefault("spec", {})
        if pod.os != "linux" and not pod.os_pinned:
            # Its architectures are those of its OS: only nodes of that OS can run it.
            spec.setdefault("nodeSelector", {})[OS_LABEL] = pod.os
        prefer(spec, pod, allowed, policy.preferred)
        added = tolerate(spec, pod, allowed, policy.tolerations)
        if nodes is not None:
            unschedulable = unschedulable_reason(placed, allowed, nodes, pod.tolerations + added,
                                                 pod.os)
        if unschedulable:
            if policy.deny_unschedulable:
                return _deny(unschedulable + " (admission.deny_unschedulable is true)",
                             warnings, archs, unschedulable=unschedulable)
            warnings.insert(0, unschedulable + "; the pod would stay Pending")
    warnings[:0] = learned_on.warnings
    annotate(mutated, pod, results, archs, learned_on.excluded)
    pinned = bool(allowed)
    return _Placed(reason, unschedulable, conflict, learned_on, pinned)


def _forbidden(mutated: dict, pod: PodView, results: dict, archs: frozenset[str],
               policy: Policy, warnings: list[str]) -> "_Placed | Decision":
    """The images run only where the placement policy does not let the pod run: denied as a
    pod whose images share no architecture is (admission.deny_on_empty), else kept off every
    node (it must not run where the policy forbids, and cannot run anywhere else)."""
    why = (f"the images run only on {join_architectures(archs)}, where the placement policy "
           f"({policy.source or 'config'}: {policy.describe_limits()}) does not let the pod run")
    if policy.deny_on_empty:
        return _deny(why, warnings, archs)
    warnings.insert(0, why + "; kept off every node")
    require_no_node(mutated.setdefault("spec", {}))
    annotate(mutated, pod, results, archs)
    return _Placed("the placement policy allows none of the images' architectures")


def _audited(pod: PodView, results: dict, decision: Decision, policy: Policy) -> Decision:
    """Audit mode: keep only the annotations of `decision`; say what enforce would have done."""
    mutated = pod.patchable_copy()
    if decision.architectures is not None:
        annotate(mutated, pod, results, decision.architectures)
    if policy.source and mutated != pod.patchable:
        name_policy(mutated, policy.source)
    patch = json_patch(dict(pod.patchable), mutated)
    if decision.allowed:
        said = f"audit mode: archway would have {_WOULD.get(decision.outcome, decision.outcome)}" \
               + (f" ({decision.reason})" if decision.outcome == "mutated" else "")
    else:
        said = f"audit mode: archway would have denied this pod: {decision.message}"
    return Decision(allowed=True, patch=patch, warnings=(said, *decision.warnings),
                    architectures=decision.architectures, outcome="audited",
                    reason=f"audit: {decision.reason}", would=decision.outcome,
                    unschedulable=decision.unschedulable, conflict=decision.conflict,
                    excluded=decision.excluded, learned=decision.learned)


_WOULD = {"mutated": "placed it", "unchanged": "left it unchanged",
          "fail_open": "admitted it without knowing every image"}




_HARD_EFFECTS = ("NoSchedule", "NoExecute")


def _may_schedule(node: NodeLike, tolerations: tuple[Toleration, ...]) -> bool:
    """False when a NoSchedule/NoExecute taint of `node` (a cordon included) is not tolerated."""
    return all(any(t.tolerates(key, value, effect) for t in tolerations)
               for key, value, effect in node.taints if effect in _HARD_EFFECTS)


def unschedulable_reason(archs: frozenset[str], allowed: frozenset[str],
                         nodes: Iterable[NodeLike], tolerations: tuple[Toleration, ...],
                         os: str = "linux") -> str:
    """Why no current node of the pod's OS `os` can run a pod restricted to `allowed` ("" when
    one can, or when no node is known: an empty cache says nothing about the cluster). Stops at
    the first node that can: in a healthy cluster that is one of the first few."""
    available: set[str] = set()
    known = any_node = of_os = False
    for node in nodes:
        any_node = True
        if node.os != os:
            continue
        of_os = True
        if node.arch is None:
            continue
        known = True
        if node.arch in available or not _may_schedule(node, tolerations):
            continue
        if node.arch in allowed:
            return ""
        available.add(node.arch)
    if not known:
        return f"no {os} node is in the cluster (the pod runs on {os})" \
            if any_node and not of_os else ""
    where = "nodes" if os == "linux" else f"{os} nodes"
    return (f"images are {'/'.join(sorted(archs))}-only; {where}: "
            f"{join_architectures(available) or 'none the pod tolerates'}")



def _deny(message: str, warnings: list[str], archs, *, unschedulable: str = "",
          conflict: str = "") -> Decision:
    return Decision(allowed=False, message=message, warnings=tuple(warnings),
                    architectures=archs, outcome="denied", reason="denied",
                    unschedulable=unschedulable, conflict=conflict)


def display_image(image: str) -> str:
    """The image as shown in warnings and messages: a password in an https:// SIF URL
    (https://user:pw@host/x.sif) is replaced by ***."""
    return redact_url(image)


def _short(image: str) -> str:
    return clip(display_image(image), _MAX_IMAGE_CHARS)

