"""Debug containers (`kubectl debug`): the pure part. Which images an UPDATE of
`pods/ephemeralcontainers` adds, and whether each can run on the node the pod is bound to.

Ephemeral containers join a pod already placed: archway cannot move it, only say before the user
waits for an `exec format error` or a pull error. So the answer is a warning by default
(admission.debug_containers: warn; kubectl prints it), a refusal with `deny`, nothing with `off`;
never a patch (an ephemeral container cannot be changed), never a gate (a running pod cannot be
gated). An image or a node archway does not know in time is a warning that it was not checked,
never a refusal: holding up a debugging session for a slow registry would cost more than the
check saves.

No I/O, no clock: debugservice.py reads the images and the node and records what happened.
"""
from dataclasses import dataclass
from typing import Any

from archway.errors import classify_error
from archway.logsafe import clip
from archway.podview import PodShapeError, PodView
from archway.registry.model import ImageInfo

from .decision import display_image

SETTINGS = ("warn", "deny", "off")   # admission.debug_containers
WARNING_CHARS = 120   # what the API conventions recommend for a warning
_IMAGE_CHARS = 40
_NODE_CHARS = 24


@dataclass(frozen=True)
class DebugRequest:
    """What an UPDATE of pods/ephemeralcontainers asks: the pod (after) and the images of the
    ephemeral containers it adds."""
    pod: PodView
    images: tuple[str, ...]            # distinct, in order; "" and unchanged containers left out
    always_pulled: frozenset[str]      # of them, those with imagePullPolicy Always


def read_debug_request(obj: Any, old: Any, *, namespace: str = "", name: str = "") -> DebugRequest:
    """The pod after the update and the images of the ephemeral containers it adds: those whose
    name `old` (the pod before) does not hold. PodShapeError names a field of the wrong type
    ("object: ..." or "oldObject: ...")."""
    try:
        pod = PodView.of(obj, namespace=namespace, name=name)
    except PodShapeError as e:
        raise PodShapeError(f"object: {e}") from None
    before = {c["name"] for c in _ephemeral(old, "oldObject") if isinstance(c.get("name"), str)}
    added = [c for c in _ephemeral(obj, "object") if c.get("name") not in before]
    images, always = [], set()
    for i, container in enumerate(added):
        image = container.get("image")
        policy = container.get("imagePullPolicy")
        if image is None:
            continue
        if not isinstance(image, str) or not isinstance(policy, (str, type(None))):
            raise PodShapeError(f"object: spec.ephemeralContainers: added container {i} has an "
                                "image or imagePullPolicy that is not a string")
        if image:
            images.append(image)
            if policy == "Always":
                always.add(image)
    return DebugRequest(pod, tuple(dict.fromkeys(images)), frozenset(always))


def _ephemeral(obj: Any, where: str) -> list[dict]:
    if not isinstance(obj, dict):
        raise PodShapeError(f"{where} must be a pod (a mapping)")
    spec = obj.get("spec")
    if spec is None:
        return []
    if not isinstance(spec, dict):
        raise PodShapeError(f"{where}.spec must be a mapping")
    containers = spec.get("ephemeralContainers")
    if containers is None:
        return []
    if not isinstance(containers, list) or not all(isinstance(c, dict) for c in containers):
        raise PodShapeError(f"{where}.spec.ephemeralContainers must be a list of mappings")
    return containers


@dataclass(frozen=True)
class NodePlatform:
    """The node a pod is bound to, as the check needs it (archway.cluster.nodes.NodeFacts has it)."""
    name: str
    arch: str | None
    os: str = "linux"


@dataclass(frozen=True)
class DebugDecision:
    allowed: bool
    outcome: str                         # unchanged | warned | denied | fail_open | audited
                                         # (audited: audit mode, where deny would refuse)
    reason: str                          # one phrase for the log line
    warnings: tuple[str, ...] = ()
    message: str = ""                    # the refusal (empty when allowed)
    cannot_run: tuple[str, ...] = ()     # the images with no platform for the node


def decide_debug(images: tuple[str, ...], results: dict, node: NodePlatform | None,
                 setting: str, *, audit: bool = False) -> DebugDecision:
    """Whether the debug images `images` (results: image -> ImageInfo | ArchwayError; missing:
    no answer in time) can run on `node` (None: not known), under admission.debug_containers
    `setting`. `audit`: the namespace's or the config's audit mode, which refuses nothing."""
    if setting == "off" or not images:
        return DebugDecision(True, "unchanged",
                             "admission.debug_containers is off" if images else "no new image")
    if node is None or node.arch is None:
        why = "its node is not known to archway" if node is None else \
            f"node {clip(node.name, _NODE_CHARS)} has no kubernetes.io/arch"
        return DebugDecision(True, "fail_open", why, (f"archway did not check the debug image: "
                                                      f"{why}",))
    unread = [image for image in images if not isinstance(results.get(image), ImageInfo)]
    cannot_run = tuple(image for image in images
                       if isinstance(results.get(image), ImageInfo)
                       and not _runs_on(results[image], node))
    warnings = [_cannot_run(image, results[image], node) for image in cannot_run]
    warnings += [f"could not inspect debug image {_short(image)} "
                 f"({classify_error(results.get(image)).words}); not checked" for image in unread]
    if not cannot_run:
        if unread:
            return DebugDecision(True, "fail_open", "a debug image was not read in time",
                                 tuple(warnings))
        return DebugDecision(True, "unchanged", f"runs on {node.os}/{node.arch}")
    where = f"node {clip(node.name, _NODE_CHARS)} ({node.os}/{node.arch})"
    if setting == "deny" and not audit:
        listed = ", ".join(_short(image) for image in cannot_run)
        return DebugDecision(False, "denied", "cannot run on its node", tuple(warnings),
                             message=f"archway: debug image {listed} has no platform for {where}: "
                                     "it cannot run there (admission.debug_containers is deny)",
                             cannot_run=cannot_run)
    outcome = "warned"
    if setting == "deny":   # and audit: say what enforce would have done, refuse nothing
        warnings.insert(0, "audit mode: archway would have refused this debug container")
        outcome = "audited"
    return DebugDecision(True, outcome, "cannot run on its node", tuple(warnings),
                         cannot_run=cannot_run)


def _runs_on(info: ImageInfo, node: NodePlatform) -> bool:
    """True when the image has a platform for the node's OS and architecture, or none at all
    (an image whose platforms are unknown restricts nothing, as at pod creation)."""
    return not info.platforms or node.arch in info.architectures_for(node.os)


def _cannot_run(image: str, info: ImageInfo, node: NodePlatform) -> str:
    """One warning line of at most 120 characters: the image, the node and its platform first,
    then what the image has (cut first when names are long)."""
    has = sorted({f"{p.os}/{p.architecture}" for p in info.platforms if p.os and p.architecture})
    shown = ", ".join(has[:2]) + (", ..." if len(has) > 2 else "")
    return clip(f"debug image {_short(image)} cannot run on node {clip(node.name, _NODE_CHARS)} "
                f"({node.os}/{node.arch}): it has {shown or 'other platforms'}", WARNING_CHARS)


def _short(image: str) -> str:
    return clip(display_image(image), _IMAGE_CHARS)
