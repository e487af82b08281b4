"""What `archway explain` says of one workload: the webhook's own decision (`placement.decide`)
on its pod template, with the images' answers and what shaped the policy, and how that reads as
text or JSON."""
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import yaml

from archway.cluster.workloads import Workload
from archway.errors import ArchwayError
from archway.placement.decision import Decision, decide, display_image
from archway.placement.learning import Learned
from archway.placement.policy import Policy
from archway.podview import PodShapeError, PodView
from archway.vocabulary import (
    ANNOTATION_FAILED,
    join_architectures,
    share_no_architecture,
    told_architectures,
)

if TYPE_CHECKING:   # the policy modules read the cluster: imported when a command runs
    from archway.placement.policies import InForce

    from .explainpolicy import KnownPolicies


@dataclass(frozen=True)
class Explanation:
    workload: Workload
    results: dict                 # image -> ImageInfo | ArchwayError
    decision: Decision
    annotations: dict | None = None   # a live pod's archway.dev/* annotations
    events: tuple = ()                # a live pod's (and its controller's) archway Events
    learned: Learned | None = None    # what the live pod's workload learned (learning.py)
    in_force: "InForce | None" = None   # the policy it was judged under, and what shaped it
    pod: PodView | None = None        # the pod template read: its OS and image volumes

    @property
    def os(self) -> str:
        """The pod's OS (`kubernetes.io/os`): which platforms of its images count."""
        return self.pod.os if self.pod is not None else "linux"

    @property
    def unreadable(self) -> list[str]:
        from archway.registry.model import ImageInfo
        return [image for image, result in self.results.items()
                if not isinstance(result, ImageInfo)]

    @property
    def can_run(self) -> bool:
        """Some architecture runs every image and the pod's own arch pin allows it, and every
        image could be read."""
        return not self.cannot_run and not self.unreadable

    @property
    def cannot_run(self) -> str:
        """Why no node of any architecture can run the workload ("" when one can, or unknown)."""
        d = self.decision
        if not d.allowed:
            return d.message
        if d.architectures == frozenset():
            return share_no_architecture(told_architectures(self.results, self.os), self.results, self.os)
        return d.conflict


def explain_workload(workload: Workload, results: dict, policy: Policy, *, nodes=None,
                     annotations=None, events=(), learned: Learned | None = None,
                     known: "KnownPolicies | None" = None, namespace_object: dict | None = None,
                     archway_scheduler: str | None = None) -> Explanation:
    """`known`: the policy objects and Namespaces to judge it under (the webhook's precedence);
    None: `policy` as it is."""
    pod = pod_view(workload)
    mine = {image: results.get(image) for image in pod.images}
    in_force = None
    if known is not None:
        in_force = known.in_force(policy, dict(pod.labels), workload.namespace or "default",
                                  namespace_object=namespace_object,
                                  archway_scheduler=archway_scheduler)
        policy = in_force.policy
    decision = decide(pod, mine, policy, nodes=nodes, learned=learned,
                      node_oses=frozenset(n.os for n in nodes) if nodes is not None else None)
    return Explanation(workload, mine, decision, annotations, tuple(events), learned, in_force, pod)


def image_json(image: str, result, os: str = "linux", volume: str = "") -> dict:
    """One image of a workload: its architectures for the pod's OS `os`, every platform, the
    image volume it is pulled for (`volume`), or its error."""
    from archway.registry.inspect import normalized, pinned
    from archway.registry.model import ImageInfo
    reference = normalized(image)
    row = {"image": display_image(image),
           "reference": display_image(reference) if reference else None, "volume": volume or None}
    if isinstance(result, ImageInfo):
        return {**row, "architectures": sorted(result.architectures_for(os)),
                "platforms": sorted(str(p) for p in result.platforms), "digest": result.digest,
                "pinned": pinned(image, result.digest), "source": result.source,
                "note": result.note or None, "error": None}
    return {**row, "architectures": [], "platforms": [], "digest": None, "pinned": None,
            "source": None, "note": None, "error": str(result) if result is not None else "no answer"}


def _image_rows(explanation: "Explanation") -> list[dict]:
    pod = explanation.pod
    return [image_json(image, result, explanation.os, pod.volume_name(image) if pod else "")
            for image, result in explanation.results.items()]


def to_json(explanation: Explanation) -> dict:
    w, d = explanation.workload, explanation.decision
    data: dict[str, Any] = {
        "kind": w.kind, "namespace": w.namespace, "name": w.name, "origin": w.origin,
        "os": explanation.os, "images": _image_rows(explanation),
        "architectures": sorted(d.architectures) if d.architectures is not None else None,
        "can_run": explanation.can_run, "cannot_run": explanation.cannot_run or None,
        "allowed": d.allowed, "outcome": d.outcome,
        "would": d.would or None, "reason": d.reason, "message": d.message or None,
        "warnings": list(d.warnings), "patch": list(d.patch),
        "policy": _policy_json(explanation.in_force),
    }
    if explanation.annotations is not None:
        data["annotations"] = explanation.annotations
        data["events"] = list(explanation.events)
        learned = explanation.learned
        data["learned"] = None if learned is None else {
            "workload": learned.workload, "architectures": sorted(learned.architectures),
            "evidence": [e.to_json() for e in learned.evidence],
            "excluded": sorted(d.excluded), "note": d.learned or None,
            "problem": learned.problem or None}
    return data


def to_text(explanation: Explanation) -> str:
    w, d = explanation.workload, explanation.decision
    lines = [f"{w.display_name}" + (f"  ({w.origin})" if w.origin else "")]
    lines += _image_lines(_image_rows(explanation), explanation.os)
    on_os = "" if explanation.os == "linux" else f" ({explanation.os})"
    if explanation.cannot_run:
        lines.append(f"  CANNOT RUN: {explanation.cannot_run}")
    elif d.architectures is None:
        lines.append(f"  runs on: unknown (no image told its architectures){on_os}")
    else:
        lines.append(f"  runs on: {join_architectures(d.architectures)}{on_os}")
    lines += _policy_lines(explanation.in_force)
    if explanation.learned is not None:
        lines += _learned_lines(explanation.learned, d)
    lines += _decision_lines(d)
    if explanation.annotations is not None:
        lines += _live_lines(explanation.annotations, explanation.events)
    return "\n".join(lines) + "\n"


def _image_lines(rows: list[dict], os: str) -> list[str]:
    lines = []
    for row in rows:
        shown = row["image"] + (f"  ->  {row['reference']}"
                                if row["reference"] and row["reference"] != row["image"] else "")
        lines.append(f"  image {shown}" + (f"  (image volume '{row['volume']}')"
                                           if row["volume"] else ""))
        if row["error"]:
            lines.append(f"    error: {row['error']}")
            continue
        archs = " ".join(row["architectures"]) or ("unknown" if not row["platforms"]
                                                   else f"none for {os}")
        lines.append(f"    architectures: {archs}"
                     f"  ({row['source']}, {row['pinned'] or row['digest'] or 'no digest'})")
        if row["platforms"] and any(not p.startswith(os + "/") for p in row["platforms"]):
            lines.append(f"    platforms: {' '.join(row['platforms'])}")
        if row["note"] and not row["platforms"]:
            lines.append(f"    note: {row['note']}")
    return lines or ["  no images"]


def _decision_lines(d: Decision) -> list[str]:
    lines = [f"  audit mode: enforce would have {d.would}"] if d.would else []
    if d.patch:
        lines.append("  archway would apply this JSON patch:")
        lines += ["    " + line for line in yaml.safe_dump(
            list(d.patch), sort_keys=False, width=100).rstrip().splitlines()]
    elif d.allowed:
        lines.append(f"  archway would change nothing ({d.reason})")
    return lines + [f"  warning: {warning}" for warning in d.warnings]


def _policy_lines(in_force) -> list[str]:
    from .explainpolicy import policy_lines
    return policy_lines(in_force)


def _policy_json(in_force) -> dict | None:
    from .explainpolicy import policy_json
    return policy_json(in_force)


def _live_lines(annotations: dict, events) -> list[str]:
    """What archway wrote on a live pod: its annotations and Events."""
    lines = ["  archway annotations on the pod:" if annotations
             else "  archway annotations on the pod: none"]
    lines += [f"    {key}: {value}" for key, value in sorted(annotations.items())]
    return lines + [f"  event {event['type']} {event['reason']} on "
                    f"{event['object']}: {event['message']}" for event in events]


def _learned_lines(learned: Learned, d: Decision) -> list[str]:
    lines = [f"  learned: {learned.workload} failed with exec format error on "
             f"{join_architectures(learned.architectures)} (annotation {ANNOTATION_FAILED})"]
    for e in learned.evidence:
        lines.append(f"    {e.architecture}: {display_image(e.image)}"
                     f"{'@' + e.digest if e.digest and '@' not in e.image else ''}")
    if learned.problem:
        lines.append(f"    {learned.problem}")
    if d.excluded:
        lines.append(f"  kept off: {join_architectures(d.excluded)} (new pods of "
                     f"{learned.workload} are not placed there)")
    elif d.learned:
        lines.append(f"  not kept off: {d.learned}")
    return lines


def pod_view(workload: Workload) -> PodView:
    try:
        return PodView.of(workload.pod)
    except PodShapeError as e:
        raise ArchwayError(f"{workload.display_name} ({workload.origin}): {e}") from None
