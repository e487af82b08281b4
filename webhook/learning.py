"""What archway learns from what actually runs. Pure functions, no I/O.

A container whose binaries are for another CPU fails to start with `exec format error`. Some
runtimes say so in the pod's status (a StartError message, CRI-O; or the last log lines with
`terminationMessagePolicy: FallbackToLogsOnError`); containerd + runc do not: the container ends
`terminated: {exitCode: 1, reason: Error}` with no message (then CrashLoopBackOff) and the words
are only in its log. The leading gate controller (remediation.py) reads the statuses
(`exec_format_failures`), and for a failed container whose status says nothing, the tail of its
log once per failed instance (`log_reads` says which, `log_wording` what it matched); what it
learns goes onto the workload's own metadata:

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

EXEC_FORMAT_ERROR = "exec format error"
# What a log says when the kernel refused a binary: runc (`exec /app: exec format error`), bash
# (`bash: /app: cannot execute binary file: Exec format error`). Only which one matched is kept,
# never the log's text (a log may hold secrets).
LOG_WORDINGS = ("exec format error", "Exec format error", "cannot execute binary file")

MAX_EVIDENCE = 16            # entries kept in archway.dev/failed-images (the newest)
_MESSAGE_CHARS = 300
_IMAGE_CHARS = 512


@dataclass(frozen=True)
class Failure:
    """One container that failed to start with exec format error."""
    container: str
    image: str               # as the pod spec names it
    digest: str | None       # what the kubelet ran (status imageID), when it says
    message: str             # the status' message, or the wording its log matched
    source: str = "status"   # where it was read: "status" or "log"

    @property
    def where(self) -> str:
        """Where it was read, for an Event: never the log's text, only the wording it matched."""
        if self.source == "log":
            return f"read in its log: it says \"{self.message}\""
        return f"read in its status: {self.message}"


@dataclass(frozen=True)
class LogRead:
    """A failed container whose status says nothing of why: the tail of its log to read, once
    for this failed instance (`episode`)."""
    container: str
    image: str
    digest: str | None
    previous: bool           # the failed instance is the one before the current (restarted)
    episode: str             # names the failed instance


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


# --- the pod's status ------------------------------------------------------------------------

def _messages(status: dict) -> list[str]:
    found = []
    for where in ("state", "lastState"):
        state = status.get(where)
        if not isinstance(state, dict):
            continue
        for phase in (("waiting", "terminated") if where == "state" else ("terminated",)):
            detail = state.get(phase)
            if isinstance(detail, dict) and isinstance(detail.get("message"), str):
                found.append(detail["message"])
    return found


def image_digest(image_id: object) -> str | None:
    """The manifest digest of a container status' imageID (`reg/app@sha256:...`,
    `docker-pullable://reg/app@sha256:...`); None for a bare image ID (`sha256:...`, the
    config's digest on some runtimes, which names no manifest)."""
    if not isinstance(image_id, str) or "@" not in image_id:
        return None
    digest = image_id.rsplit("@", 1)[1]
    return digest if digest.startswith("sha256:") and len(digest) == 71 else None


def _container_statuses(pod: dict):
    """(status, image as the spec names it) of every container status, init containers first."""
    status = pod.get("status") if isinstance(pod, dict) else None
    if not isinstance(status, dict):
        return
    spec = _mapping(pod.get("spec"))
    for statuses_key, spec_key in (("initContainerStatuses", "initContainers"),
                                   ("containerStatuses", "containers")):
        statuses = status.get(statuses_key)
        for container in statuses if isinstance(statuses, list) else ():
            if isinstance(container, dict):
                name = str(container.get("name") or "")
                image = _spec_image(spec.get(spec_key), name) or str(container.get("image") or "")
                yield container, image[:_IMAGE_CHARS]


def exec_format_failures(pod: dict) -> tuple[Failure, ...]:
    """The containers (init containers included) whose status says exec format error."""
    failures = []
    for container, image in _container_statuses(pod):
        message = next((m for m in _messages(container) if EXEC_FORMAT_ERROR in m.lower()),
                       None)
        if message is not None:
            failures.append(Failure(str(container.get("name") or ""), image,
                                    image_digest(container.get("imageID")),
                                    " ".join(message.split())[:_MESSAGE_CHARS]))
    return tuple(failures)


def _failed_instance(container: dict, restarts: bool) -> tuple[dict, bool] | None:
    """(its terminated record, previous) when a container's last instance failed and its status
    says nothing of why: terminated for good (restartPolicy Never: its log is the current one),
    or waiting in CrashLoopBackOff after a failed instance (the previous one's). A container that
    restarts is read only in its back-off: seen just terminated, the kubelet may already have
    started the next instance, whose log ("current") is empty, and `previous` would name the
    one before. None for anything else: a running or starting container, a success, a status
    with a message."""
    state, last = _mapping(container.get("state")), _mapping(container.get("lastState"))
    if isinstance(state.get("terminated"), dict):
        if restarts:
            return None
        record, previous = state["terminated"], False
    elif _mapping(state.get("waiting")).get("reason") == "CrashLoopBackOff" \
            and isinstance(last.get("terminated"), dict):
        record, previous = last["terminated"], True
    else:
        return None
    exit_code = record.get("exitCode")
    if not isinstance(exit_code, int) or exit_code == 0 or record.get("message"):
        return None
    return record, previous


def log_reads(pod: dict) -> tuple[LogRead, ...]:
    """The containers (init containers included) whose log tail may say why they failed: a
    non-zero exit with no message in the status. Nothing for a pod that is not failing."""
    reads = []
    # The pod's restartPolicy (Always when absent) rules its containers, init containers too.
    restarts = _mapping(pod.get("spec")).get("restartPolicy", "Always") != "Never"
    for container, image in _container_statuses(pod):
        failed = _failed_instance(container, restarts)
        if failed is None:
            continue
        record, previous = failed
        episode = str(record.get("containerID") or "") or \
            f"{record.get('startedAt')}/{record.get('finishedAt')}/{record.get('exitCode')}"
        reads.append(LogRead(str(container.get("name") or ""), image,
                             image_digest(container.get("imageID")), previous, episode[:200]))
    return tuple(reads)


def log_wording(tail: str) -> str | None:
    """Which of LOG_WORDINGS the tail of a log holds (the first in that order); None when none."""
    return next((wording for wording in LOG_WORDINGS if wording in tail), None)


def _mapping(value: object) -> dict:
    return value if isinstance(value, dict) else {}


def _spec_image(containers: object, name: str) -> str:
    for container in containers if isinstance(containers, list) else ():
        if isinstance(container, dict) and container.get("name") == name:
            image = container.get("image")
            return image if isinstance(image, str) else ""
    return ""


def admitted_digests(annotations: Mapping) -> dict[str, str]:
    """image -> digest from the pod's archway.dev/images annotation (what admission resolved)."""
    try:
        entries = json.loads(annotations.get("archway.dev/images") or "[]")
    except ValueError:
        return {}
    return {e["image"]: e["digest"] for e in entries if isinstance(e, dict)
            and isinstance(e.get("image"), str) and isinstance(e.get("digest"), str)}


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
