"""What archway learns from what actually runs, as the workload carries it. Pure functions, no
I/O.

A workload whose pods fail with `exec format error` on an architecture (the leading gate
controller reads their statuses and logs: gate/podstatus.py, gate/remediation.py) gets it on
its own metadata:

    archway.dev/failed-architectures: "arm64"          the architectures to keep its pods off
    archway.dev/failed-images: [{"image": "reg/app:1", "digest": "sha256:...",
                                 "architecture": "arm64"}]          the evidence (JSON)

Admission reads both (`Learned`) and keeps the workload's new pods off those architectures while
the evidence still holds: an evidence image that left the pod, or that now resolves to another
digest (a re-pushed tag, a new tag), ends it (`reset_reason`). Removing the annotation ends it
too; an annotation without evidence (written by hand) holds until it is removed.
"""
import json
from collections.abc import Mapping
from dataclasses import dataclass

from archway.registry.model import ImageInfo
from archway.vocabulary import ANNOTATION_EVIDENCE, ANNOTATION_FAILED, join_architectures, parse_architectures

MAX_EVIDENCE = 16            # entries kept in archway.dev/failed-images (the newest)


@dataclass(frozen=True)
class Evidence:
    image: str
    digest: str | None
    architecture: str

    def to_json(self) -> dict:
        return {"image": self.image, "digest": self.digest, "architecture": self.architecture}


@dataclass(frozen=True)
class Learned:
    """A workload's learned exclusion, as admission applies it."""
    architectures: frozenset[str]
    evidence: tuple[Evidence, ...]
    workload: str            # "Deployment web": who failed, for warnings and Events
    problem: str = ""        # what of the annotations could not be read


# --- the workload's annotations ----------------------------------------------------------------

def parse_evidence(text: str | None) -> tuple[tuple[Evidence, ...], str]:
    """(evidence, problem) of archway.dev/failed-images; problem is "" when it reads."""
    if not text:
        return (), ""
    try:
        entries = json.loads(text)
        if not isinstance(entries, list):
            raise ValueError("not a list")
        return tuple(Evidence(str(e["image"]), e.get("digest") if isinstance(e.get("digest"), str)
                              else None, str(e["architecture"]))
                     for e in entries), ""
    except (ValueError, KeyError, TypeError) as e:
        return (), f"{ANNOTATION_EVIDENCE} is not archway's JSON ({e}); ignored"


def learned_from(annotations: Mapping, workload: str) -> Learned | None:
    """The exclusion a workload's annotations hold; None when it holds none."""
    archs = parse_architectures(str(annotations.get(ANNOTATION_FAILED) or ""))
    if not archs:
        return None
    evidence, problem = parse_evidence(annotations.get(ANNOTATION_EVIDENCE))
    return Learned(archs, evidence, workload, problem)


def merged_annotations(annotations: Mapping, architecture: str,
                       evidence: list[Evidence]) -> dict[str, str] | None:
    """The two annotations with `architecture` and `evidence` merged in; None when they hold
    both already (nothing to write)."""
    archs = parse_architectures(str(annotations.get(ANNOTATION_FAILED) or ""))
    known, _ = parse_evidence(annotations.get(ANNOTATION_EVIDENCE))
    new = [e for e in dict.fromkeys(evidence) if e not in known]
    if architecture in archs and not new:
        return None
    kept = (list(known) + new)[-MAX_EVIDENCE:]
    return {ANNOTATION_FAILED: ",".join(sorted(archs | {architecture})),
            ANNOTATION_EVIDENCE: json.dumps([e.to_json() for e in kept], separators=(",", ":"))}


# --- does it still hold? ---------------------------------------------------------------------------

def reset_reason(learned: Learned, images, results: Mapping) -> str:
    """Why the learned exclusion no longer holds for a pod with `images` resolved to `results`
    ("" while it holds): an evidence image is no longer among the images, or now resolves to a
    digest other than the one that failed. An image archway could not read proves nothing."""
    present = set(images)
    for evidence in learned.evidence:
        if evidence.image not in present:
            return f"{evidence.image} (which failed on {evidence.architecture}) is no longer " \
                   f"among its images"
        result = results.get(evidence.image)
        if evidence.digest and isinstance(result, ImageInfo) and result.digest \
                and result.digest != evidence.digest:
            return (f"{evidence.image} now names {short_digest(result.digest)}, not "
                    f"{short_digest(evidence.digest)} which failed on {evidence.architecture}")
    return ""


@dataclass(frozen=True)
class Exclusion:
    """What a learned exclusion does to one pod: the architectures of S it is kept off, and
    what to tell (what was done, or why not)."""
    excluded: frozenset[str] = frozenset()
    note: str = ""

    @property
    def warnings(self) -> tuple[str, ...]:
        return (self.note,) if self.note else ()


def exclusion(archs: frozenset[str], learned: Learned | None, images, results: Mapping
              ) -> Exclusion:
    """The exclusion for a pod whose images share `archs` (S), given what its workload learned:
    none while the evidence does not hold, nor when it would leave no architecture at all."""
    if learned is None or not learned.architectures & archs:
        return Exclusion()
    failed = join_architectures(learned.architectures & archs)
    reset = reset_reason(learned, images, results)
    if reset:
        return Exclusion(note=f"{learned.workload} failed on {failed} before, but {reset}")
    if archs <= learned.architectures:
        return Exclusion(note=f"{learned.workload} failed on every architecture its images "
                              f"claim ({join_architectures(archs)}); placed as the images claim")
    return Exclusion(learned.architectures & archs,
                     f"kept off {failed}: pods of {learned.workload} failed there with exec "
                     f"format error")


def short_digest(digest: str) -> str:
    return digest[:19] if digest.startswith("sha256:") else digest
