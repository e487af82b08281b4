"""A Pod, read once: the fields archway decides on, type-checked in this one place.

The admission webhook, the placement decision, the pull-secret lookup and the scheduler extender
all read pods. They read them through `PodView.of(obj)`, which walks the object once and raises
PodShapeError naming the first field whose type is not the one a Pod gives it (a list where a
mapping belongs, a number where an image belongs). After that nobody re-checks or re-walks the
dict: the view holds tuples and read-only mappings.

The apiserver and kube-scheduler only ever send pods decoded into Go structs, so a shape error
means a client that is not one of them; each caller turns it into its own 400.
"""
from collections.abc import Mapping
from dataclasses import dataclass
from functools import cached_property
from types import MappingProxyType
from typing import Any

from archway.errors import ArchwayError
from archway.vocabulary import OS_LABEL, PREFERRED_AFFINITY, REQUIRED_AFFINITY

_EMPTY: Mapping[str, str] = MappingProxyType({})

# What a placement decision may change: metadata.annotations and these members of spec. The view
# keeps them as sent (see `patchable`) so the patch is a diff at the pod's own paths.
PATCHABLE_SPEC = ("affinity", "nodeSelector", "schedulerName", "schedulingGates", "tolerations")


class PodShapeError(ArchwayError):
    """The object is not shaped like a Pod; the message names the field."""


@dataclass(frozen=True)
class Container:
    name: str
    image: str                  # "" when absent (apiserver validation rejects it after us)
    pull_policy: str            # imagePullPolicy; "" when absent
    init: bool                  # an initContainer


@dataclass(frozen=True)
class ImageVolume:
    """One spec.volumes[].image (KEP-4639): the kubelet pulls `reference` for the node's platform
    and mounts it, so it is an image of the pod like a container's."""
    name: str
    reference: str              # "" when absent (apiserver validation rejects it after us)
    pull_policy: str            # pullPolicy; "" when absent


@dataclass(frozen=True)
class Requirement:
    """One NodeSelectorRequirement (of matchExpressions or matchFields)."""
    key: str
    operator: str
    values: tuple[str, ...]


@dataclass(frozen=True)
class NodeSelectorTerm:
    """Requirements ANDed; the terms of a selector are ORed. A term with no requirement at all
    matches no node (k8s.io/component-helpers nodeaffinity)."""
    match_expressions: tuple[Requirement, ...]
    match_fields: tuple[Requirement, ...]

    @property
    def matches_nothing(self) -> bool:
        return not self.match_expressions and not self.match_fields


@dataclass(frozen=True)
class PreferredTerm:
    weight: int
    preference: NodeSelectorTerm


@dataclass(frozen=True)
class Toleration:
    """One spec.tolerations entry; "" for an absent field (operator "" means Equal)."""
    key: str
    operator: str
    value: str
    effect: str

    def tolerates(self, key: str, value: str, effect: str) -> bool:
        """Whether this toleration tolerates the taint key=value:effect
        (k8s.io/api/core/v1 Toleration.ToleratesTaint)."""
        if self.effect and self.effect != effect:
            return False
        if self.key and self.key != key:
            return False
        if self.operator == "Exists":
            return True   # an empty key with Exists tolerates everything
        return self.operator in ("", "Equal") and self.value == value


@dataclass(frozen=True)
class OwnerReference:
    api_version: str
    kind: str
    name: str
    uid: str
    controller: bool


@dataclass(frozen=True)
class PodView:
    namespace: str
    name: str
    generate_name: str
    annotations: Mapping[str, str]
    labels: Mapping[str, str]
    owner_references: tuple[OwnerReference, ...]
    containers: tuple[Container, ...]          # initContainers first, then containers
    pull_secret_names: tuple[str, ...]         # spec.imagePullSecrets, in order, no blanks
    service_account: str                       # serviceAccountName (or the deprecated alias)
    node_name: str
    scheduler_name: str
    scheduling_gates: tuple[str, ...]
    node_selector: Mapping[str, str]
    required_terms: tuple[NodeSelectorTerm, ...] | None   # None: no required node affinity
    preferred_terms: tuple[PreferredTerm, ...]
    tolerations: tuple[Toleration, ...]
    patchable: Mapping[str, Any]   # the pod cut down to what a decision may change (see above)
    uid: str = ""
    being_deleted: bool = False                # metadata.deletionTimestamp is set
    image_volumes: tuple[ImageVolume, ...] = ()   # spec.volumes[] with an image source
    os: str = "linux"   # the OS it runs on (`kubernetes.io/os`), see `pinned_os`
    # ... and a scheduler keeps it there: its nodeSelector or required affinity says that OS
    # (spec.os alone does not: the kubelet of another OS refuses the pod once it is bound).
    os_pinned: bool = False

    @classmethod
    def of(cls, obj: Any, *, namespace: str = "", name: str = "") -> "PodView":
        """Read a Pod object. `namespace` and `name` stand in for what metadata lacks: a pod
        created by a controller has no metadata.namespace yet (the admission request has it)."""
        pod = _mapping(obj, "pod")
        metadata = _mapping(pod.get("metadata"), "metadata")
        spec = _mapping(pod.get("spec"), "spec")
        affinity = _mapping(spec.get("affinity"), "spec.affinity")
        node_affinity = _mapping(affinity.get("nodeAffinity"), "spec.affinity.nodeAffinity")
        node_selector = _string_map(spec.get("nodeSelector"), "spec.nodeSelector")
        required_terms = _required_terms(node_affinity)
        scheduled_os = pinned_os("", node_selector, required_terms)   # what a scheduler keeps
        os = _text(_mapping(spec.get("os"), "spec.os"), "name", "spec.os") or scheduled_os
        return cls(
            namespace=_text(metadata, "namespace", "metadata") or namespace,
            name=_text(metadata, "name", "metadata") or name,
            generate_name=_text(metadata, "generateName", "metadata"),
            annotations=_string_map(metadata.get("annotations"), "metadata.annotations"),
            labels=_string_map(metadata.get("labels"), "metadata.labels"),
            owner_references=tuple([
                _owner(ref, f"metadata.ownerReferences[{i}]") for i, ref in
                enumerate(_list(metadata.get("ownerReferences"), "metadata.ownerReferences"))]),
            containers=_containers(spec, "initContainers") + _containers(spec, "containers"),
            pull_secret_names=_pull_secret_names(spec.get("imagePullSecrets")),
            service_account=(_text(spec, "serviceAccountName", "spec")
                             or _text(spec, "serviceAccount", "spec")),
            node_name=_text(spec, "nodeName", "spec"),
            scheduler_name=_text(spec, "schedulerName", "spec"),
            scheduling_gates=tuple([
                _text(_mapping(gate, f"spec.schedulingGates[{i}]"), "name",
                      f"spec.schedulingGates[{i}]")
                for i, gate in enumerate(_list(spec.get("schedulingGates"),
                                               "spec.schedulingGates"))]),
            node_selector=node_selector,
            required_terms=required_terms,
            preferred_terms=_preferred_terms(node_affinity),
            tolerations=_tolerations(spec.get("tolerations")),
            patchable=MappingProxyType(_patchable(pod, metadata, spec)),
            uid=_text(metadata, "uid", "metadata"),
            being_deleted=bool(metadata.get("deletionTimestamp")),
            image_volumes=_image_volumes(spec.get("volumes")),
            os=os or "linux",
            os_pinned=os is not None and scheduled_os == os,
        )

    @cached_property
    def images(self) -> tuple[str, ...]:
        """The distinct images the kubelet pulls to start the pod, in order: those of
        initContainers and containers, then the references of image volumes (`volume_name`
        tells them apart for messages).

        ephemeralContainers are left out on purpose: the apiserver rejects them at CREATE (they
        are only added later through the pods/ephemeralcontainers subresource, after
        scheduling), and they could not change where an already bound pod runs anyway.
        """
        return tuple(dict.fromkeys([*(c.image for c in self.containers if c.image),
                                    *(v.reference for v in self.image_volumes if v.reference)]))

    @cached_property
    def always_pulled(self) -> frozenset[str]:
        """Images some container (imagePullPolicy) or image volume (pullPolicy) pulls with
        Always: the kubelet will pull what the tag names at start, so a cached answer for it is
        checked at the registry first."""
        return frozenset([*(c.image for c in self.containers
                            if c.image and c.pull_policy == "Always"),
                          *(v.reference for v in self.image_volumes
                            if v.reference and v.pull_policy == "Always")])

    def volume_name(self, image: str) -> str:
        """The name of the (first) image volume `image` is pulled for, when no container runs
        it; "": a container image. For messages ("image volume 'models'") and annotations."""
        if any(c.image == image for c in self.containers):
            return ""
        return next((v.name for v in self.image_volumes if v.reference == image), "")

    @property
    def display_name(self) -> str:
        """namespace/name for logs; `generateName*` for a pod that has no name yet."""
        return f"{self.namespace or '-'}/{self.name or self.generate_name + '*'}"

    def patchable_copy(self) -> dict:
        """A deep copy of `patchable` to change and diff against it."""
        return _copy_json(dict(self.patchable))


# --- the walk ------------------------------------------------------------------------------------

def _mapping(value: Any, where: str) -> dict:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise PodShapeError(f"{where} must be a mapping")
    return value


def _list(value: Any, where: str) -> list:
    if value is None:
        return []
    if not isinstance(value, list):
        raise PodShapeError(f"{where} must be a list")
    return value


def _text(mapping: dict, key: str, where: str) -> str:
    """mapping[key] as a string ("" when absent); `where` names the mapping for the error."""
    value = mapping.get(key)
    if isinstance(value, str):
        return value
    if value is None:
        return ""
    raise PodShapeError(f"{where}.{key} must be a string")


def _string_map(value: Any, where: str) -> Mapping[str, str]:
    mapping = _mapping(value, where)
    if not mapping:
        return _EMPTY
    for key, item in mapping.items():
        if not isinstance(item, str):
            raise PodShapeError(f"{where}[{key!r}] must be a string")
    return MappingProxyType(dict(mapping))


def _containers(spec: dict, field: str) -> tuple[Container, ...]:
    containers = []
    for i, item in enumerate(_list(spec.get(field), f"spec.{field}")):
        where = f"spec.{field}[{i}]"
        if not isinstance(item, dict):
            raise PodShapeError(f"{where} must be a mapping")
        containers.append(Container(
            name=_text(item, "name", where), image=_text(item, "image", where),
            pull_policy=_text(item, "imagePullPolicy", where), init=field == "initContainers"))
    return tuple(containers)


def _image_volumes(value: Any) -> tuple[ImageVolume, ...]:
    volumes = []
    for i, item in enumerate(_list(value, "spec.volumes")):
        where = f"spec.volumes[{i}]"
        item = _mapping(item, where)
        if item.get("image") is None:
            continue
        source = _mapping(item["image"], f"{where}.image")
        volumes.append(ImageVolume(_text(item, "name", where),
                                   _text(source, "reference", f"{where}.image"),
                                   _text(source, "pullPolicy", f"{where}.image")))
    return tuple(volumes)


def pinned_os(spec_os: str, node_selector: Mapping[str, str],
              required_terms: tuple[NodeSelectorTerm, ...] | None) -> str | None:
    """The OS a pod says it runs on: spec.os.name, else its `kubernetes.io/os` nodeSelector,
    else the one OS every required node-affinity term pins (`kubernetes.io/os In [x]`); None
    when it says none (it runs on linux then: what a node without the label runs, and the
    kubelet's default)."""
    if spec_os:
        return spec_os
    if node_selector.get(OS_LABEL):
        return node_selector[OS_LABEL]
    pinned = {_pinned_os(term) for term in required_terms or ()}
    if len(pinned) == 1 and None not in pinned:
        return pinned.pop() or None
    return None


def _pinned_os(term: NodeSelectorTerm) -> str | None:
    """The OS a required term allows alone, or None when it allows any or several."""
    pinned = {r.values[0] for r in term.match_expressions
              if r.key == OS_LABEL and r.operator == "In" and len(r.values) == 1}
    return pinned.pop() if len(pinned) == 1 else None


def _pull_secret_names(refs: Any) -> tuple[str, ...]:
    names = []
    for i, ref in enumerate(_list(refs, "spec.imagePullSecrets")):
        where = f"spec.imagePullSecrets[{i}]"
        name = _text(_mapping(ref, where), "name", where)
        if name and name not in names:
            names.append(name)
    return tuple(names)


def _owner(ref: Any, where: str) -> OwnerReference:
    ref = _mapping(ref, where)
    controller = ref.get("controller")
    if controller is not None and not isinstance(controller, bool):
        raise PodShapeError(f"{where}.controller must be true or false")
    return OwnerReference(
        api_version=_text(ref, "apiVersion", where), kind=_text(ref, "kind", where),
        name=_text(ref, "name", where), uid=_text(ref, "uid", where), controller=bool(controller))


def _requirements(value: Any, where: str) -> tuple[Requirement, ...]:
    requirements = []
    for i, item in enumerate(_list(value, where)):
        here = f"{where}[{i}]"
        item = _mapping(item, here)
        values = _list(item.get("values"), f"{here}.values")
        requirements.append(Requirement(
            key=_text(item, "key", here), operator=_text(item, "operator", here),
            # a non-string value can match no label value; validation rejects it after us
            values=tuple(v for v in values if isinstance(v, str))))
    return tuple(requirements)


def _term(value: Any, where: str) -> NodeSelectorTerm:
    term = _mapping(value, where)
    return NodeSelectorTerm(_requirements(term.get("matchExpressions"), f"{where}.matchExpressions"),
                            _requirements(term.get("matchFields"), f"{where}.matchFields"))


def _required_terms(node_affinity: dict) -> tuple[NodeSelectorTerm, ...] | None:
    if node_affinity.get(REQUIRED_AFFINITY) is None:
        return None
    where = f"spec.affinity.nodeAffinity.{REQUIRED_AFFINITY}"
    required = _mapping(node_affinity[REQUIRED_AFFINITY], where)
    return tuple(_term(t, f"{where}.nodeSelectorTerms[{i}]") for i, t in
                 enumerate(_list(required.get("nodeSelectorTerms"), f"{where}.nodeSelectorTerms")))


def _preferred_terms(node_affinity: dict) -> tuple[PreferredTerm, ...]:
    where = f"spec.affinity.nodeAffinity.{PREFERRED_AFFINITY}"
    terms = []
    for i, item in enumerate(_list(node_affinity.get(PREFERRED_AFFINITY), where)):
        item = _mapping(item, f"{where}[{i}]")
        weight = item.get("weight", 0)
        if isinstance(weight, bool) or not isinstance(weight, int):
            raise PodShapeError(f"{where}[{i}].weight must be an integer")
        terms.append(PreferredTerm(weight, _term(item.get("preference"), f"{where}[{i}].preference")))
    return tuple(terms)


def _tolerations(value: Any) -> tuple[Toleration, ...]:
    tolerations = []
    for i, item in enumerate(_list(value, "spec.tolerations")):
        where = f"spec.tolerations[{i}]"
        item = _mapping(item, where)
        tolerations.append(Toleration(*(_text(item, k, where)
                                         for k in ("key", "operator", "value", "effect"))))
    return tuple(tolerations)


def _patchable(pod: dict, metadata: dict, spec: dict) -> dict:
    """The members a decision may change, at their own paths (values are the pod's objects,
    shared: `patchable_copy` copies before anything changes them)."""
    part: dict = {}
    if pod.get("metadata") is not None:
        part["metadata"] = {"annotations": metadata["annotations"]} if "annotations" in metadata \
            else {}
    if pod.get("spec") is not None:
        part["spec"] = {key: spec[key] for key in PATCHABLE_SPEC if key in spec}
    return part


def _copy_json(value: Any) -> Any:
    """A deep copy of parsed JSON (maps, lists, scalars): copy.deepcopy's memo and dispatch cost
    3 times as much on the warm admission path, for cycles and types JSON cannot hold."""
    if isinstance(value, dict):
        return {key: _copy_json(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_copy_json(item) for item in value]
    return value
