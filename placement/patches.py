"""The changes a placement makes to a pod, built on its patchable copy, and the JSON patch between
the two. Pure.

An arch requirement is ADDED TO EVERY required node affinity term (terms are ORed: a new term
would widen where the pod may run instead of narrowing it). The patch is the difference
(`json_patch`) between the part of the pod a decision may change and its changed copy, so
JSON-pointer escaping (`kubernetes.io~1arch`) and maps that do not exist yet are handled in one
place.
"""
import json

from archway.errors import classify_error
from archway.logsafe import clip, redact_url
from archway.podview import NodeSelectorTerm, PodView, Requirement, Toleration
from archway.registry.model import ImageInfo
from archway.vocabulary import (
    ANNOTATION_ARCHITECTURES,
    ANNOTATION_EXCLUDED,
    ANNOTATION_IMAGES,
    ANNOTATION_POLICY,
    ARCH_KEYS,
    ARCH_LABEL,
    GATE,
    GATED_LABEL,
    PREFERRED_AFFINITY,
    REQUIRED_AFFINITY,
    join_architectures,
)

# archway.dev/images stays well inside the apiserver's 256 KiB for all annotations together.
MAX_IMAGES_ANNOTATION_CHARS = 4096
_MAX_ANNOTATED_IMAGE_CHARS = 256
# The value of an arch requirement no node matches: keeps a pod that can never run off every node.
NO_ARCHITECTURE = "no-common-architecture"
POLICY_ANNOTATION_PATH = "/metadata/annotations/" + ANNOTATION_POLICY.replace("/", "~1")


def node_affinity_of(spec: dict) -> dict:
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
    """The preferred node affinity terms for the archs the pod may run on, heaviest first. A pod
    that can run on one arch only is pinned there already: preferring it would add nothing.
    Archs of equal weight share one term, and equal weights for every arch the pod can run on
    are no term at all: the scheduler scores nodes the same either way, but Karpenter takes a
    pod's heaviest term as a requirement, and of one term per arch it would take the first
    listed instead of the cheapest (docs/benchmarks.md, figure 29e)."""
    if len(allowed) < 2:
        return []
    by_weight: dict[int, list[str]] = {}
    for arch, weight in preferred:
        if arch in allowed:
            by_weight.setdefault(weight, []).append(arch)
    if len(by_weight) == 1 and set(*by_weight.values()) == allowed:
        return []
    return [{"weight": weight, "preference": {"matchExpressions": [
        {"key": ARCH_LABEL, "operator": "In", "values": sorted(archs)}]}}
        for weight, archs in sorted(by_weight.items(), reverse=True)]


def prefer(spec: dict, pod: PodView, allowed: frozenset[str], preferred) -> None:
    terms = preferred_terms(allowed, preferred)
    if not terms or states_arch_preference(pod):
        return
    node_affinity = node_affinity_of(spec)
    if not isinstance(node_affinity.get(PREFERRED_AFFINITY), list):
        node_affinity[PREFERRED_AFFINITY] = []
    node_affinity[PREFERRED_AFFINITY].extend(terms)


def _as_toleration(raw: dict) -> Toleration:
    return Toleration(raw.get("key", ""), raw.get("operator", ""), raw.get("value", ""),
                      raw.get("effect", ""))


def _same_toleration(a: Toleration, b: Toleration) -> bool:
    return ((a.key, a.operator or "Equal", a.value, a.effect)
            == (b.key, b.operator or "Equal", b.value, b.effect))


def tolerate(spec: dict, pod: PodView, allowed: frozenset[str],
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




def images_annotation(images, results: dict, pod: PodView | None = None) -> str:
    """archway.dev/images: per image its digest, architectures (for the pod's OS) and source, why
    one without a platform was ignored (`note`: an OCI artifact), the image volume it is (`volume`),
    or the error kind, as JSON; at most MAX_IMAGES_ANNOTATION_CHARS, the images left out counted
    in a last {"truncated": N} entry."""
    entries = []
    for image in images:
        result = results.get(image)
        entry: dict = {"image": clip(redact_url(image), _MAX_ANNOTATED_IMAGE_CHARS)}
        volume = pod.volume_name(image) if pod is not None else ""
        if volume:
            entry["volume"] = clip(volume, _MAX_ANNOTATED_IMAGE_CHARS)
        if isinstance(result, ImageInfo):
            archs = result.architectures_for(pod.os) if pod is not None else result.architectures
            entry.update(digest=result.digest, architectures=sorted(archs), source=result.source)
            if not result.platforms and result.note:
                entry["note"] = clip(result.note, _MAX_ANNOTATED_IMAGE_CHARS)
            elif result.platforms and not archs and pod is not None:
                entry["note"] = f"no {pod.os} platform"
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


def annotate(mutated: dict, pod: PodView, results: dict, archs: frozenset[str],
              excluded: frozenset[str] = frozenset()) -> None:
    metadata = mutated.setdefault("metadata", {})
    if not isinstance(metadata.get("annotations"), dict):
        metadata["annotations"] = {}
    if archs:
        metadata["annotations"][ANNOTATION_ARCHITECTURES] = ",".join(sorted(archs))
    metadata["annotations"][ANNOTATION_IMAGES] = images_annotation(pod.images, results, pod)
    if excluded:
        metadata["annotations"][ANNOTATION_EXCLUDED] = ",".join(sorted(excluded))


def name_policy(mutated: dict, source: str) -> None:
    """archway.dev/policy: what shaped the policy the pod was admitted under (a PlacementPolicy
    `PlacementPolicy ns/name`, `ClusterPlacementPolicy name`, `namespace label` or `config`)."""
    metadata = mutated.setdefault("metadata", {})
    if not isinstance(metadata.get("annotations"), dict):
        metadata["annotations"] = {}
    metadata["annotations"][ANNOTATION_POLICY] = source


def constrain(spec: dict, terms: tuple[NodeSelectorTerm, ...] | None,
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
        node_affinity_of(spec)[REQUIRED_AFFINITY] = {"nodeSelectorTerms": [{"matchExpressions": [requirement]}]}
        return f"required node affinity {ARCH_LABEL} In {join_architectures(archs)}"
    changed = 0
    raw_terms = spec["affinity"]["nodeAffinity"][REQUIRED_AFFINITY]["nodeSelectorTerms"] if terms else []
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
    return f"{ARCH_LABEL} In {join_architectures(archs)} added to {changed} of {len(terms)} node affinity terms"


def _same_requirement(requirement: Requirement, archs: frozenset[str]) -> bool:
    return (requirement.key == ARCH_LABEL and requirement.operator == "In"
            and frozenset(requirement.values) == archs)


def gate_patch(pod: PodView, unplaced: tuple[dict, ...], source: str = "") -> tuple[dict, ...]:
    """JSON patch ops that gate `pod` at admission. `unplaced`: the patch of the admission's
    decision, made before the images were known; of it only the schedulerName is set now (it
    may not change once the pod exists; the placement comes with the release), and `source`
    names the policy it is admitted under (archway.dev/policy). Empty when
    archway's gate is there already (a reinvocation)."""
    if GATE in pod.scheduling_gates:
        return ()
    ops = [op for op in unplaced if op["path"] == "/spec/schedulerName"]
    if source and pod.annotations:
        ops.append({"op": "add", "path": POLICY_ANNOTATION_PATH, "value": source})
    elif source:
        ops.append({"op": "add", "path": "/metadata/annotations", "value": {ANNOTATION_POLICY: source}})
    gates = [{"name": name} for name in pod.scheduling_gates] + [{"name": GATE}]
    ops.append({"op": "add", "path": "/spec/schedulingGates", "value": gates})
    if pod.labels:
        ops.append({"op": "add", "path": "/metadata/labels/" + GATED_LABEL.replace("/", "~1"),
                    "value": "true"})
    else:
        ops.append({"op": "add", "path": "/metadata/labels", "value": {GATED_LABEL: "true"}})
    return tuple(ops)


def require_no_node(spec: dict) -> None:
    """Add an arch requirement no node meets: to every existing required term (ANDed there, so
    each term then matches nothing), or as the only term when there is none."""
    requirement = {"key": ARCH_LABEL, "operator": "In", "values": [NO_ARCHITECTURE]}
    affinity = spec.setdefault("affinity", {})
    node_affinity = affinity.setdefault("nodeAffinity", {})
    required = node_affinity.get(REQUIRED_AFFINITY)
    terms = required.get("nodeSelectorTerms") if isinstance(required, dict) else None
    if terms:
        for term in terms:
            term.setdefault("matchExpressions", []).append(dict(requirement))
    else:
        node_affinity[REQUIRED_AFFINITY] = {"nodeSelectorTerms": [{"matchExpressions": [requirement]}]}


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
