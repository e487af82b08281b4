"""The placement decision: which CPU architectures a pod's images share, and how to pin the pod.

A pure function of the pod, the per-image resolution results and the policy: no I/O, no clock.
The patch is computed with `jsonpatch.make_patch(original, mutated)` so JSON-pointer escaping
(`kubernetes.io~1arch`) and maps that do not exist yet are handled in one place.

Node affinity semantics this module relies on (k8s.io/component-helpers nodeaffinity):
nodeSelectorTerms are ORed, the requirements inside one term are ANDed, and a term with no
requirements matches no node. So an arch requirement is ADDED TO EVERY TERM; appending a new term
would widen where the pod may run instead of narrowing it.
"""
import copy
import re
from dataclasses import dataclass

import jsonpatch

from archway.errors import (ArchwayError, AuthError, CredentialProviderError, DeadlineExceeded,
                             HostRefused, InvalidReference, NotFound, RegistryError,
                             ResponseTooLarge, SIFError, TransportError, UnsupportedImage)
from archway.registry.model import ImageInfo

ARCH_LABEL = "kubernetes.io/arch"
# kubelet still sets the deprecated beta label; a pod selecting on it does constrain its arch.
ARCH_KEYS = (ARCH_LABEL, "beta.kubernetes.io/arch")
ANNOTATION_ARCHITECTURES = "archway.dev/architectures"
DEFAULT_SCHEDULER = "default-scheduler"

MAX_WARNINGS = 5          # kubectl prints every warning; a wall of them helps nobody
MAX_WARNING_CHARS = 120   # the Kubernetes API conventions ask for warnings under 120 characters
_MAX_IMAGE_CHARS = 60


class PodShapeError(ArchwayError):
    """The object under review is not shaped like a Pod (a list where a mapping belongs, ...)."""


@dataclass(frozen=True)
class Policy:
    fail_closed: bool = False        # deny pods with an image that could not be resolved
    deny_on_conflict: bool = False   # deny pods whose own arch constraint excludes every arch of S
    deny_on_empty: bool = True       # deny pods whose images share no architecture
    scheduler_name: str | None = None

    @classmethod
    def from_config(cls, config) -> "Policy":
        """From a `archway.config.Config` (its admission and placement sections)."""
        return cls(fail_closed=config.admission.fail_closed,
                   deny_on_conflict=config.admission.deny_on_conflict,
                   deny_on_empty=config.admission.deny_on_empty,
                   scheduler_name=config.placement.scheduler_name or None)


@dataclass(frozen=True)
class Decision:
    allowed: bool
    patch: tuple = ()                        # RFC 6902 operations (dicts); empty: no change
    warnings: tuple[str, ...] = ()
    message: str = ""                        # why the pod is denied (empty when allowed)
    architectures: frozenset[str] | None = None   # S; None when no image told its architectures
    outcome: str = "unchanged"               # mutated | unchanged | denied | fail_open
    reason: str = ""                         # one phrase for the log line


# --- reading the pod -----------------------------------------------------------------------

def pod_images(pod: dict) -> tuple[str, ...]:
    """The distinct images of the pod's containers and initContainers, in order.

    ephemeralContainers are left out on purpose: the apiserver rejects them at CREATE (they are
    only added later through the pods/ephemeralcontainers subresource, after scheduling), and
    they could not change where an already bound pod runs anyway.
    """
    spec = _mapping(pod.get("spec"), "spec")
    images: list[str] = []
    for field in ("initContainers", "containers"):
        containers = spec.get(field)
        if containers is None:
            continue
        if not isinstance(containers, list):
            raise PodShapeError(f"spec.{field} must be a list")
        for i, container in enumerate(containers):
            if not isinstance(container, dict):
                raise PodShapeError(f"spec.{field}[{i}] must be a mapping")
            image = container.get("image")
            if image is None or image == "":
                continue  # apiserver validation rejects it after us; nothing to resolve
            if not isinstance(image, str):
                raise PodShapeError(f"spec.{field}[{i}].image must be a string")
            if image not in images:
                images.append(image)
    return tuple(images)


def check_pod_shape(pod: dict) -> None:
    """Raise PodShapeError unless every field the decision reads has the type a Pod gives it."""
    pod_images(pod)
    pod_arch_constraint(pod)
    spec = _mapping(pod.get("spec"), "spec")
    if not isinstance(spec.get("schedulerName"), (str, type(None))):
        raise PodShapeError("spec.schedulerName must be a string")
    if not isinstance(spec.get("affinity"), (dict, type(None))):
        raise PodShapeError("spec.affinity must be a mapping")


def _mapping(value, where: str) -> dict:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise PodShapeError(f"{where} must be a mapping")
    return value


def _list(value, where: str) -> list:
    if value is None:
        return []
    if not isinstance(value, list):
        raise PodShapeError(f"{where} must be a list")
    return value


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


def _expression_allows(expr: dict, where: str) -> ArchSet | None:
    """What one matchExpression allows of the arch label; None when it is about another key."""
    expr = _mapping(expr, where)
    if expr.get("key") not in ARCH_KEYS:
        return None
    values = frozenset(v for v in _list(expr.get("values"), f"{where}.values") if isinstance(v, str))
    operator = expr.get("operator")
    if operator == "In":
        return ArchSet(values)
    if operator == "NotIn":
        return ArchSet(values, True)
    if operator == "Exists":
        return None  # every node carries the label: no restriction
    # DoesNotExist matches no node (all carry the label); Gt/Lt need integers, arch values are not.
    return NO_ARCH


def _term_requirements(term: dict, where: str) -> tuple[list, list]:
    term = _mapping(term, where)
    return (_list(term.get("matchExpressions"), f"{where}.matchExpressions"),
            _list(term.get("matchFields"), f"{where}.matchFields"))


def _term_allows(term: dict, where: str) -> ArchSet | None:
    """The archs a term allows; None when the term says nothing about arch.

    matchFields can only name nodes (metadata.name), which says nothing about their arch, so a
    term made only of matchFields (DaemonSet pods) does not constrain arch and gains the arch
    requirement: the pod then stays Pending on a node of the wrong arch instead of crash-looping
    with "exec format error".
    """
    expressions, _ = _term_requirements(term, where)
    allowed = None
    for i, expr in enumerate(expressions):
        this = _expression_allows(expr, f"{where}.matchExpressions[{i}]")
        if this is not None:
            allowed = this if allowed is None else allowed & this
    return allowed


def _matches_nothing(term) -> bool:
    expressions, fields = _term_requirements(term, "nodeSelectorTerm")
    return not expressions and not fields


def _required_terms(spec: dict) -> list | None:
    """The required nodeSelectorTerms; None when the pod has no required node affinity."""
    affinity = _mapping(spec.get("affinity"), "spec.affinity")
    node_affinity = _mapping(affinity.get("nodeAffinity"), "spec.affinity.nodeAffinity")
    required = node_affinity.get("requiredDuringSchedulingIgnoredDuringExecution")
    if required is None:
        return None
    required = _mapping(required, "nodeAffinity.requiredDuringSchedulingIgnoredDuringExecution")
    return _list(required.get("nodeSelectorTerms"), "nodeAffinity.required.nodeSelectorTerms")


def pod_arch_constraint(pod: dict) -> ArchSet | None:
    """The archs the pod itself already restricts itself to; None when it does not restrict.

    nodeSelector and required node affinity are ANDed. The affinity restricts arch only when
    EVERY term does: one term without an arch requirement lets the pod onto any arch.
    """
    spec = _mapping(pod.get("spec"), "spec")
    constraint = None
    selector = _mapping(spec.get("nodeSelector"), "spec.nodeSelector")
    for key in ARCH_KEYS:
        if key in selector:
            value = selector[key]
            this = ArchSet(frozenset([value]) if isinstance(value, str) else frozenset())
            constraint = this if constraint is None else constraint & this
    # A term with no requirements matches no node, so it adds nothing to the ORed terms.
    terms = [t for t in _required_terms(spec) or () if not _matches_nothing(t)]
    if terms:
        allowed = [_term_allows(t, f"nodeSelectorTerms[{i}]") for i, t in enumerate(terms)]
        if all(a is not None for a in allowed):
            union = NO_ARCH
            for a in allowed:
                union = union | a
            constraint = union if constraint is None else constraint & union
    return constraint


# --- the decision ----------------------------------------------------------------------------

def decide(pod: dict, results: dict, policy: Policy) -> Decision:
    """Decide how to place `pod` given `results` (image -> ImageInfo | ArchwayError).

    An image missing from `results` counts as unresolved (the resolver ran out of time).
    Raises PodShapeError when the pod is not shaped like a Pod.
    """
    images = pod_images(pod)
    known: dict[str, frozenset[str]] = {}
    warnings: list[str] = []
    failed: list[str] = []
    for image in images:
        result = results.get(image)
        if isinstance(result, ImageInfo):
            if result.architectures:
                known[image] = result.architectures
            else:
                warnings.append(f"{_short(image)} records no CPU architecture; "
                                "it does not restrict placement")
        else:
            failed.append(image)
            warnings.append(f"could not inspect {_short(image)} ({describe_error(result)}); "
                            "it does not restrict placement")

    if failed and policy.fail_closed:
        listed = "; ".join(f"{display_image(image)}: {describe_error(results.get(image))}"
                           for image in failed)
        return _deny(f"archway could not read the architectures of {listed} "
                     "(admission.fail_closed is true)", warnings, None)

    archs = frozenset.intersection(*known.values()) if known else None
    # Copy and diff only what a decision can change, at the same paths: the same patch as
    # between whole pods, without deep-copying and walking every container and volume.
    original = _changeable_part(pod)
    mutated = copy.deepcopy(original)
    spec = mutated.get("spec") if isinstance(mutated.get("spec"), dict) else {}
    reason = "no image told its architectures" if images else "pod has no images"

    if archs is not None and not archs:
        message = "the pod's images share no CPU architecture: " + "; ".join(
            f"{display_image(image)} ({', '.join(sorted(a))})" for image, a in known.items())
        if policy.deny_on_empty:
            return _deny(message, warnings, archs)
        warnings.insert(0, "the images share no CPU architecture; admitted without an arch "
                           "constraint")
        reason = "no common architecture"
    elif archs:
        existing = pod_arch_constraint(pod)
        if existing is not None:
            reason = "pod already constrains kubernetes.io/arch"
            overlap = existing.within(archs)
            if not overlap:
                message = (f"the pod's own kubernetes.io/arch constraint ({existing.describe()}) "
                           f"excludes every architecture its images support ({_join(archs)})")
                if policy.deny_on_conflict:
                    return _deny(message, warnings, archs)
                warnings.insert(0, _clip(f"the pod's arch constraint ({existing.describe()}) "
                                         f"excludes its images' architectures ({_join(archs)})"))
            elif existing.exceeds(archs):
                warnings.insert(0, _clip(f"the pod's arch constraint also allows archs its "
                                         f"images lack; they support only {_join(archs)}"))
        else:
            reason = _constrain(spec, archs)
        metadata = mutated.setdefault("metadata", {})
        if not isinstance(metadata.get("annotations"), dict):
            metadata["annotations"] = {}
        metadata["annotations"][ANNOTATION_ARCHITECTURES] = ",".join(sorted(archs))

    if policy.scheduler_name and spec.get("schedulerName") in (None, "", DEFAULT_SCHEDULER):
        spec["schedulerName"] = policy.scheduler_name

    patch = tuple(jsonpatch.make_patch(original, mutated).patch)
    if failed:
        outcome = "fail_open"
    else:
        outcome = "mutated" if patch else "unchanged"
    return Decision(allowed=True, patch=patch, warnings=cap_warnings(warnings), architectures=archs,
                    outcome=outcome, reason=reason)


# What decide() may change: metadata.annotations and these members of spec.
_CHANGEABLE_SPEC = ("affinity", "nodeSelector", "schedulerName")


def _changeable_part(pod: dict) -> dict:
    """`pod` reduced to the members decide() may change, at the same paths (the values are the
    pod's own objects: copy before changing them)."""
    part = {}
    if "metadata" in pod:
        metadata = pod["metadata"]
        part["metadata"] = ({"annotations": metadata["annotations"]} if "annotations" in metadata
                            else {}) if isinstance(metadata, dict) else metadata
    if "spec" in pod:
        spec = pod["spec"]
        part["spec"] = ({k: spec[k] for k in _CHANGEABLE_SPEC if k in spec}
                        if isinstance(spec, dict) else spec)
    return part


def _constrain(spec: dict, archs: frozenset[str]) -> str:
    """Pin the pod (spec, mutated in place) to `archs`; return a phrase saying how."""
    terms = _required_terms(spec)
    if terms is None and len(archs) == 1:
        if not isinstance(spec.get("nodeSelector"), dict):
            spec["nodeSelector"] = {}
        spec["nodeSelector"][ARCH_LABEL] = next(iter(archs))
        return f"nodeSelector {ARCH_LABEL}={next(iter(archs))}"
    requirement = {"key": ARCH_LABEL, "operator": "In", "values": sorted(archs)}
    if terms is None:
        affinity = spec.get("affinity")
        if not isinstance(affinity, dict):
            affinity = spec["affinity"] = {}
        node_affinity = affinity.get("nodeAffinity")
        if not isinstance(node_affinity, dict):
            node_affinity = affinity["nodeAffinity"] = {}
        node_affinity["requiredDuringSchedulingIgnoredDuringExecution"] = {
            "nodeSelectorTerms": [{"matchExpressions": [requirement]}]}
        return f"required node affinity {ARCH_LABEL} In {_join(archs)}"
    changed = 0
    for term in terms:
        if _matches_nothing(term):
            continue  # a requirement would make it match some nodes: widening, not narrowing
        if any(_same_requirement(e, archs) for e in term.get("matchExpressions") or ()):
            continue
        if not isinstance(term.get("matchExpressions"), list):
            term["matchExpressions"] = []
        term["matchExpressions"].append(dict(requirement, values=list(requirement["values"])))
        changed += 1
    return f"{ARCH_LABEL} In {_join(archs)} added to {changed} of {len(terms)} node affinity terms"


def _same_requirement(expr, archs: frozenset[str]) -> bool:
    return (isinstance(expr, dict) and expr.get("key") == ARCH_LABEL
            and expr.get("operator") == "In" and isinstance(expr.get("values"), list)
            and frozenset(expr["values"]) == archs)


def _deny(message: str, warnings: list[str], archs) -> Decision:
    return Decision(allowed=False, message=message, warnings=cap_warnings(warnings), architectures=archs,
                    outcome="denied", reason="denied")


# --- wording -------------------------------------------------------------------------------------

_ERROR_WORDS = (  # most specific first: the classes form a hierarchy
    (DeadlineExceeded, "timed out"),
    (CredentialProviderError, "credential provider failed"),
    (AuthError, "registry refused the credentials"),
    (NotFound, "not found"),
    (ResponseTooLarge, "registry response too large"),
    (UnsupportedImage, "unsupported image format"),
    (TransportError, "registry unreachable"),
    (HostRefused, "host not allowed by archway's config"),
    (InvalidReference, "invalid image reference"),
    (SIFError, "unreadable SIF image"),
)


def describe_error(error) -> str:
    """A few words for a warning; never the full message (it can hold URLs with parameters)."""
    if error is None:
        return "no answer before the deadline"
    for cls, words in _ERROR_WORDS:
        if isinstance(error, cls):
            return words
    if isinstance(error, RegistryError) and error.status:
        return f"registry answered HTTP {error.status}"
    return "registry error" if isinstance(error, RegistryError) else "resolver error"


_UNPRINTABLE = re.compile(r"[^\x20-\x7e]")
_USERINFO = re.compile(r"(?<=://)[^/@]*@")


def display_image(image: str) -> str:
    """The image as shown in warnings and messages: a password in an https:// SIF URL
    (https://user:pw@host/x.sif) is replaced by ***."""
    return _USERINFO.sub("***@", image)


def _short(image: str) -> str:
    image = _UNPRINTABLE.sub("?", display_image(image))
    return image if len(image) <= _MAX_IMAGE_CHARS else image[:_MAX_IMAGE_CHARS - 3] + "..."


def _join(archs) -> str:
    return ", ".join(sorted(archs))


def _clip(text: str) -> str:
    text = _UNPRINTABLE.sub("?", text)
    return text if len(text) <= MAX_WARNING_CHARS else text[:MAX_WARNING_CHARS - 3] + "..."


def cap_warnings(warnings) -> tuple[str, ...]:
    warnings = [_clip(w) for w in warnings]
    if len(warnings) > MAX_WARNINGS:
        more = len(warnings) - (MAX_WARNINGS - 1)
        warnings = warnings[:MAX_WARNINGS - 1] + [f"... and {more} more warnings from archway"]
    return tuple(warnings)
