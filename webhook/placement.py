"""The placement decision: which CPU architectures a pod's images share, and how to pin the pod.

A pure function of the pod (an archway.podview.PodView), the per-image resolution results and
the policy: no I/O, no clock. The patch is the difference (`json_patch`) between the part of
the pod a decision may change and its changed copy, so JSON-pointer escaping
(`kubernetes.io~1arch`) and maps that do not exist yet are handled in one place.

Node affinity semantics this module relies on (k8s.io/component-helpers nodeaffinity):
nodeSelectorTerms are ORed, the requirements inside one term are ANDed, and a term with no
requirements matches no node. So an arch requirement is ADDED TO EVERY TERM; appending a new term
would widen where the pod may run instead of narrowing it.
"""
import json
import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol

from archway.errors import classify_error
from archway.logsafe import redact_url
from archway.podview import NodeSelectorTerm, PodView, Requirement, Toleration
from archway.registry.model import ImageInfo

from .learning import ANNOTATION_EXCLUDED, Exclusion, Learned, exclusion

ARCH_LABEL = "kubernetes.io/arch"
# kubelet still sets the deprecated beta label; a pod selecting on it does constrain its arch.
ARCH_KEYS = (ARCH_LABEL, "beta.kubernetes.io/arch")
ANNOTATION_ARCHITECTURES = "archway.dev/architectures"
ANNOTATION_IMAGES = "archway.dev/images"
DEFAULT_SCHEDULER = "default-scheduler"
MODES = ("enforce", "audit", "off")

_MAX_IMAGE_CHARS = 60
# archway.dev/images stays well inside the apiserver's 256 KiB for all annotations together.
MAX_IMAGES_ANNOTATION_CHARS = 4096
_MAX_ANNOTATED_IMAGE_CHARS = 256


@dataclass(frozen=True)
class Policy:
    fail_closed: bool = False        # deny pods with an image that could not be resolved
    deny_on_conflict: bool = False   # deny pods whose own arch constraint excludes every arch of S
    deny_on_empty: bool = True       # deny pods whose images share no architecture
    scheduler_name: str | None = None
    mode: str = "enforce"            # audit: annotate only; Decision.would says what enforce does
    deny_unschedulable: bool = False  # deny pods whose archs no node they tolerate has
    preferred: tuple[tuple[str, int], ...] = ()     # (arch, weight 1..100), heaviest first
    tolerations: tuple[tuple[str, tuple[dict, ...]], ...] = ()   # (arch, tolerations to add)

    @classmethod
    def from_config(cls, config) -> "Policy":
        """From a `archway.config.Config` (its admission and placement sections)."""
        return cls(fail_closed=config.admission.unresolved == "deny",
                   deny_on_conflict=config.admission.deny_on_conflict,
                   deny_on_empty=config.admission.deny_on_empty,
                   scheduler_name=config.placement.scheduler_name or None,
                   mode=config.admission.mode,
                   deny_unschedulable=config.admission.deny_unschedulable,
                   preferred=config.placement.preferred_architectures,
                   tolerations=config.placement.tolerations)


class NodeLike(Protocol):
    """What the decision reads of a node (extender.nodes.NodeFacts has it)."""
    @property
    def arch(self) -> str | None: ...
    @property
    def taints(self) -> tuple[tuple[str, str, str], ...]: ...   # (key, value, effect)


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


# --- the pod's own arch constraint ------------------------------------------------------

@dataclass(frozen=True)
class ArchSet:
    """A set of architectures that may be co-finite: `NotIn [s390x]` allows every arch but one."""
    values: frozenset[str]
    complement: bool = False

    def __and__(self, other: "ArchSet") -> "ArchSet":
        if not self.complement and not other.complement:
            return ArchSet(self.values & other.values)
        if self.complement and other.complement:
            return ArchSet(self.values | other.values, True)
        finite, cofinite = (other, self) if self.complement else (self, other)
        return ArchSet(finite.values - cofinite.values)

    def __or__(self, other: "ArchSet") -> "ArchSet":
        if not self.complement and not other.complement:
            return ArchSet(self.values | other.values)
        if self.complement and other.complement:
            return ArchSet(self.values & other.values, True)
        finite, cofinite = (other, self) if self.complement else (self, other)
        return ArchSet(cofinite.values - finite.values, True)

    def within(self, archs: frozenset[str]) -> frozenset[str]:
        """The members of `archs` this set allows."""
        return archs - self.values if self.complement else archs & self.values

    def exceeds(self, archs: frozenset[str]) -> bool:
        """True when this set allows some architecture outside `archs`."""
        return self.complement or bool(self.values - archs)

    def describe(self) -> str:
        listed = ", ".join(sorted(self.values)) or "nothing"
        return f"any but {listed}" if self.complement else listed


NO_ARCH = ArchSet(frozenset())


def _requirement_allows(requirement: Requirement) -> ArchSet | None:
    """What one matchExpression allows of the arch label; None when it is about another key."""
    if requirement.key not in ARCH_KEYS:
        return None
    values = frozenset(requirement.values)
    if requirement.operator == "In":
        return ArchSet(values)
    if requirement.operator == "NotIn":
        return ArchSet(values, True)
    if requirement.operator == "Exists":
        return None  # every node carries the label: no restriction
    # DoesNotExist matches no node (all carry the label); Gt/Lt need integers, arch values are not.
    return NO_ARCH


def _term_allows(term: NodeSelectorTerm) -> ArchSet | None:
    """The archs a term allows; None when the term says nothing about arch.

    matchFields can only name nodes (metadata.name), which says nothing about their arch, so a
    term made only of matchFields (DaemonSet pods) does not constrain arch and gains the arch
    requirement: the pod then stays Pending on a node of the wrong arch instead of crash-looping
    with "exec format error".
    """
    allowed = None
    for requirement in term.match_expressions:
        this = _requirement_allows(requirement)
        if this is not None:
            allowed = this if allowed is None else allowed & this
    return allowed


def pod_arch_constraint(pod: PodView) -> ArchSet | None:
    """The archs the pod itself already restricts itself to; None when it does not restrict.

    nodeSelector and required node affinity are ANDed. The affinity restricts arch only when
    EVERY term does: one term without an arch requirement lets the pod onto any arch.
    """
    constraint = None
    for key in ARCH_KEYS:
        if key in pod.node_selector:
            this = ArchSet(frozenset([pod.node_selector[key]]))
            constraint = this if constraint is None else constraint & this
    # A term with no requirements matches no node, so it adds nothing to the ORed terms.
    terms = [t for t in pod.required_terms or () if not t.matches_nothing]
    if terms:
        allowed = [a for a in map(_term_allows, terms) if a is not None]
        if len(allowed) == len(terms):
            union = NO_ARCH
            for a in allowed:
                union = union | a
            constraint = union if constraint is None else constraint & union
    return constraint


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


def told_architectures(results: dict) -> dict[str, frozenset[str]]:
    """image -> its architectures, for the images whose result names some: a failure or an
    image that records no architecture says nothing about where the pod can run."""
    return {image: result.architectures for image, result in results.items()
            if isinstance(result, ImageInfo) and result.architectures}


def common_architectures(told: dict[str, frozenset[str]]) -> frozenset[str] | None:
    """S, the architectures every image of `told` runs on; None when no image told any."""
    return frozenset.intersection(*told.values()) if told else None


def decide(pod: PodView, results: dict, policy: Policy, *,
           nodes: Iterable[NodeLike] | None = None, learned: Learned | None = None) -> Decision:
    """Decide how to place `pod` given `results` (image -> ImageInfo | ArchwayError).

    An image missing from `results` counts as unresolved (the resolver ran out of time).
    `nodes`: the cluster's nodes when known (the node cache); None: the cluster is not consulted.
    `learned`: what its workload learned from exec format errors (learning.exclusion).
    In audit mode the decision is made in full, then only its annotations are applied.
    """
    decision = _enforce(pod, results, policy, nodes, learned)
    return _audited(pod, results, decision) if policy.mode == "audit" else decision


def _enforce(pod: PodView, results: dict, policy: Policy,
             nodes: Iterable[NodeLike] | None, learned: Learned | None = None) -> Decision:
    images = pod.images
    known = told_architectures({image: results.get(image) for image in images})
    warnings: list[str] = []
    failed: list[str] = []
    for image in images:
        result = results.get(image)
        if isinstance(result, ImageInfo):
            if not result.architectures:
                warnings.append(f"{_short(image)} records no CPU architecture; "
                                "it does not restrict placement")
        else:
            failed.append(image)
            warnings.append(f"could not inspect {_short(image)} ({classify_error(result).words}); "
                            + UNREAD_ADMITTED)

    if failed and policy.fail_closed:
        listed = "; ".join(f"{display_image(image)}: {classify_error(results.get(image)).words}"
                           for image in failed)
        return _deny(f"archway could not read the architectures of {listed} "
                     "(admission.unresolved is deny)", warnings, None)

    archs = common_architectures(known)
    # Copy and diff only what a decision can change, at the same paths: the same patch as
    # between whole pods, without deep-copying and walking every container and volume.
    mutated = pod.patchable_copy()
    spec = mutated.get("spec", {})
    reason = "no image told its architectures" if images else "pod has no images"
    unschedulable = conflict = ""
    learned_on = Exclusion()

    if archs is not None and not archs:
        message = "the pod's images share no CPU architecture: " + "; ".join(
            f"{display_image(image)} ({', '.join(sorted(a))})" for image, a in known.items())
        if policy.deny_on_empty:
            return _deny(message, warnings, archs)
        warnings.insert(0, "the images share no CPU architecture; admitted without an arch "
                           "constraint")
        reason = "no common architecture"
        _annotate(mutated, pod, results, archs)
    elif archs:
        learned_on = exclusion(archs, learned, pod.images, results)
        placed = archs - learned_on.excluded   # S without where its workload failed
        allowed = placed           # where the pod may run: that, within its own constraint
        existing = pod_arch_constraint(pod)
        if existing is not None:
            reason = "pod already constrains kubernetes.io/arch"
            allowed = existing.within(placed)
            if not allowed:
                conflict = (f"the pod's own kubernetes.io/arch constraint ({existing.describe()}) "
                            f"excludes every architecture its images support ({_join(placed)})")
                if policy.deny_on_conflict:
                    return _deny(conflict, warnings, archs, conflict=conflict)
                warnings.insert(0, f"the pod's arch constraint ({existing.describe()}) "
                                   f"excludes its images' architectures ({_join(placed)})")
            elif existing.exceeds(placed):
                warnings.insert(0, f"the pod's arch constraint also allows archs its "
                                   f"images lack; they support only {_join(placed)}")
        else:
            reason = _constrain(mutated.setdefault("spec", spec), pod.required_terms, placed)
        if allowed:
            spec = mutated.setdefault("spec", spec)
            _prefer(spec, pod, allowed, policy.preferred)
            added = _tolerate(spec, pod, allowed, policy.tolerations)
            if nodes is not None:
                unschedulable = unschedulable_reason(placed, allowed, nodes,
                                                     pod.tolerations + added)
            if unschedulable:
                if policy.deny_unschedulable:
                    return _deny(unschedulable + " (admission.deny_unschedulable is true)",
                                 warnings, archs, unschedulable=unschedulable)
                warnings.insert(0, unschedulable + "; the pod would stay Pending")
        warnings[:0] = learned_on.warnings
        _annotate(mutated, pod, results, archs, learned_on.excluded)

    if policy.scheduler_name and pod.scheduler_name in ("", DEFAULT_SCHEDULER):
        mutated.setdefault("spec", spec)["schedulerName"] = policy.scheduler_name

    patch = json_patch(dict(pod.patchable), mutated)
    if failed:
        outcome = "fail_open"
    else:
        outcome = "mutated" if patch else "unchanged"
    return Decision(allowed=True, patch=patch, warnings=tuple(warnings), architectures=archs,
                    outcome=outcome, reason=reason, unschedulable=unschedulable,
                    conflict=conflict, excluded=learned_on.excluded, learned=learned_on.note)


def _audited(pod: PodView, results: dict, decision: Decision) -> Decision:
    """Audit mode: keep only the annotations of `decision`; say what enforce would have done."""
    mutated = pod.patchable_copy()
    if decision.architectures is not None:
        _annotate(mutated, pod, results, decision.architectures)
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


# --- what the policy adds: preferences, tolerations, the images' story ----------------------------

_PREFERRED = "preferredDuringSchedulingIgnoredDuringExecution"


def _node_affinity(spec: dict) -> dict:
    """spec.affinity.nodeAffinity of the patchable copy, created when absent."""
    affinity = spec.get("affinity")
    if not isinstance(affinity, dict):
        affinity = spec["affinity"] = {}
    node_affinity = affinity.get("nodeAffinity")
    if not isinstance(node_affinity, dict):
        node_affinity = affinity["nodeAffinity"] = {}
    return node_affinity


def states_arch_preference(pod: PodView) -> bool:
    return any(r.key in ARCH_KEYS for term in pod.preferred_terms
               for r in term.preference.match_expressions)


def preferred_terms(allowed: frozenset[str], preferred) -> list[dict]:
    """The preferred node affinity terms for the archs the pod may run on. A pod that can run
    on one arch only is pinned there already: preferring it would add nothing."""
    if len(allowed) < 2:
        return []
    return [{"weight": weight, "preference": {"matchExpressions": [
        {"key": ARCH_LABEL, "operator": "In", "values": [arch]}]}}
        for arch, weight in preferred if arch in allowed]


def _prefer(spec: dict, pod: PodView, allowed: frozenset[str], preferred) -> None:
    terms = preferred_terms(allowed, preferred)
    if not terms or states_arch_preference(pod):
        return
    node_affinity = _node_affinity(spec)
    if not isinstance(node_affinity.get(_PREFERRED), list):
        node_affinity[_PREFERRED] = []
    node_affinity[_PREFERRED].extend(terms)


def _as_toleration(raw: dict) -> Toleration:
    return Toleration(raw.get("key", ""), raw.get("operator", ""), raw.get("value", ""),
                      raw.get("effect", ""))


def _same_toleration(a: Toleration, b: Toleration) -> bool:
    return ((a.key, a.operator or "Equal", a.value, a.effect)
            == (b.key, b.operator or "Equal", b.value, b.effect))


def _tolerate(spec: dict, pod: PodView, allowed: frozenset[str],
              tolerations) -> tuple[Toleration, ...]:
    """Add the configured tolerations of the archs the pod may run on, each once; returns them."""
    added: list[Toleration] = []
    for arch, raws in tolerations:
        if arch not in allowed:
            continue
        for raw in raws:
            toleration = _as_toleration(raw)
            if any(_same_toleration(toleration, t) for t in (*pod.tolerations, *added)):
                continue
            if not isinstance(spec.get("tolerations"), list):
                spec["tolerations"] = []
            spec["tolerations"].append(dict(raw))
            added.append(toleration)
    return tuple(added)


# Taints that keep a pod off a node; PreferNoSchedule only discourages.
_HARD_EFFECTS = ("NoSchedule", "NoExecute")


def _may_schedule(node: NodeLike, tolerations: tuple[Toleration, ...]) -> bool:
    """False when a NoSchedule/NoExecute taint of `node` (a cordon included) is not tolerated."""
    return all(any(t.tolerates(key, value, effect) for t in tolerations)
               for key, value, effect in node.taints if effect in _HARD_EFFECTS)


def unschedulable_reason(archs: frozenset[str], allowed: frozenset[str],
                         nodes: Iterable[NodeLike], tolerations: tuple[Toleration, ...]) -> str:
    """Why no current node can run a pod restricted to `allowed` ("" when one can, or when no
    node is known: an empty cache says nothing about the cluster). Stops at the first node
    that can: in a healthy cluster that is one of the first few."""
    available: set[str] = set()
    known = False
    for node in nodes:
        if node.arch is None:
            continue
        known = True
        if node.arch in available or not _may_schedule(node, tolerations):
            continue
        if node.arch in allowed:
            return ""
        available.add(node.arch)
    if not known:
        return ""
    return (f"images are {'/'.join(sorted(archs))}-only; nodes: "
            f"{_join(available) or 'none the pod tolerates'}")


def images_annotation(images, results: dict) -> str:
    """archway.dev/images: per image its digest, architectures and source (or the error kind),
    as JSON; at most MAX_IMAGES_ANNOTATION_CHARS, the images left out counted in a last
    {"truncated": N} entry."""
    entries = []
    for image in images:
        result = results.get(image)
        entry: dict = {"image": _clip(display_image(image), _MAX_ANNOTATED_IMAGE_CHARS)}
        if isinstance(result, ImageInfo):
            entry.update(digest=result.digest, architectures=sorted(result.architectures),
                         source=result.source)
        else:
            entry["error"] = classify_error(result).words
        entries.append(entry)
    text = json.dumps(entries, separators=(",", ":"))
    kept = len(entries)
    while len(text) > MAX_IMAGES_ANNOTATION_CHARS and kept > 0:
        kept -= 1
        text = json.dumps(entries[:kept] + [{"truncated": len(entries) - kept}],
                          separators=(",", ":"))
    return text


def _annotate(mutated: dict, pod: PodView, results: dict, archs: frozenset[str],
              excluded: frozenset[str] = frozenset()) -> None:
    metadata = mutated.setdefault("metadata", {})
    if not isinstance(metadata.get("annotations"), dict):
        metadata["annotations"] = {}
    if archs:
        metadata["annotations"][ANNOTATION_ARCHITECTURES] = ",".join(sorted(archs))
    metadata["annotations"][ANNOTATION_IMAGES] = images_annotation(pod.images, results)
    if excluded:
        metadata["annotations"][ANNOTATION_EXCLUDED] = ",".join(sorted(excluded))


_REQUIRED = "requiredDuringSchedulingIgnoredDuringExecution"


def _constrain(spec: dict, terms: tuple[NodeSelectorTerm, ...] | None,
               archs: frozenset[str]) -> str:
    """Pin the pod to `archs` by changing `spec` (its patchable copy) in place; `terms` are the
    pod's required node affinity terms, read. Returns a phrase saying how."""
    if terms is None and len(archs) == 1:
        if not isinstance(spec.get("nodeSelector"), dict):
            spec["nodeSelector"] = {}
        spec["nodeSelector"][ARCH_LABEL] = next(iter(archs))
        return f"nodeSelector {ARCH_LABEL}={next(iter(archs))}"
    requirement = {"key": ARCH_LABEL, "operator": "In", "values": sorted(archs)}
    if terms is None:
        _node_affinity(spec)[_REQUIRED] = {"nodeSelectorTerms": [{"matchExpressions": [requirement]}]}
        return f"required node affinity {ARCH_LABEL} In {_join(archs)}"
    changed = 0
    raw_terms = spec["affinity"]["nodeAffinity"][_REQUIRED]["nodeSelectorTerms"] if terms else []
    for i, term in enumerate(terms):
        if term.matches_nothing:
            continue  # a requirement would make it match some nodes: widening, not narrowing
        if any(_same_requirement(r, archs) for r in term.match_expressions):
            continue
        raw = raw_terms[i]
        if not isinstance(raw.get("matchExpressions"), list):
            raw["matchExpressions"] = []
        raw["matchExpressions"].append(dict(requirement, values=list(requirement["values"])))
        changed += 1
    return f"{ARCH_LABEL} In {_join(archs)} added to {changed} of {len(terms)} node affinity terms"


def _same_requirement(requirement: Requirement, archs: frozenset[str]) -> bool:
    return (requirement.key == ARCH_LABEL and requirement.operator == "In"
            and frozenset(requirement.values) == archs)


def _deny(message: str, warnings: list[str], archs, *, unschedulable: str = "",
          conflict: str = "") -> Decision:
    return Decision(allowed=False, message=message, warnings=tuple(warnings),
                    architectures=archs, outcome="denied", reason="denied",
                    unschedulable=unschedulable, conflict=conflict)


# --- wording -------------------------------------------------------------------------------------

_UNPRINTABLE = re.compile(r"[^\x20-\x7e]")


def display_image(image: str) -> str:
    """The image as shown in warnings and messages: a password in an https:// SIF URL
    (https://user:pw@host/x.sif) is replaced by ***."""
    return redact_url(image)


def _short(image: str) -> str:
    return _clip(display_image(image), _MAX_IMAGE_CHARS)


def _clip(text: str, limit: int) -> str:
    text = _UNPRINTABLE.sub("?", text)
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _join(archs) -> str:
    return ", ".join(sorted(archs))


def json_patch(old: dict, new: dict) -> tuple[dict, ...]:
    """RFC 6902 operations turning `old` into `new`: maps are compared member by member, a list
    item by item when it kept its first items (what a decision does: requirements appended to
    every node selector term), anything else that differs is replaced. jsonpatch.make_patch
    gives the same operations here at 4 times the cost on the warm admission path
    (docs/benchmarks.md, figure 1)."""
    ops: list[dict] = []
    _diff(old, new, "", ops)
    return tuple(ops)


def _diff(old, new, path: str, ops: list[dict]) -> None:
    if isinstance(old, dict) and isinstance(new, dict):
        for key, value in old.items():
            if key not in new:
                ops.append({"op": "remove", "path": f"{path}/{_pointer_token(key)}"})
            else:
                _diff(value, new[key], f"{path}/{_pointer_token(key)}", ops)
        for key, value in new.items():
            if key not in old:
                ops.append({"op": "add", "path": f"{path}/{_pointer_token(key)}", "value": value})
    elif isinstance(old, list) and isinstance(new, list) and len(new) >= len(old) and path:
        for i, value in enumerate(old):
            _diff(value, new[i], f"{path}/{i}", ops)
        for i in range(len(old), len(new)):
            ops.append({"op": "add", "path": f"{path}/{i}", "value": new[i]})
    elif type(old) is not type(new) or old != new:   # JSON's true is not 1
        ops.append({"op": "replace", "path": path, "value": new})


def _pointer_token(key: str) -> str:
    """A map key as one JSON pointer token (RFC 6901): ~ and / escaped."""
    return key.replace("~", "~0").replace("/", "~1")
