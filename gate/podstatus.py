"""What a pod's status and a failed container's log say of why it failed: the closed loop's
reading (failingpods.py keeps what it finds, logreads.py reads the log tails). Pure, no I/O;
this runs on every pod status update of the cluster.

A container whose binaries are for another CPU fails to start with `exec format error`. Some
runtimes say so in the pod's status (a StartError message, CRI-O; or the last log lines with
`terminationMessagePolicy: FallbackToLogsOnError`); containerd + runc do not: the container ends
`terminated: {exitCode: 1, reason: Error}` with no message (then CrashLoopBackOff) and the words
are only in its log. So the statuses are read (`exec_format_failures`), and for a failed
container whose status says nothing, the tail of its log once per failed instance (`log_reads`
says which, `log_wording` what it matched). What is learned goes onto the workload
(placement/learning.py, which admission reads).
"""
import json
from collections.abc import Mapping
from dataclasses import dataclass

EXEC_FORMAT_ERROR = "exec format error"
# What a log says when the kernel refused a binary: runc (`exec /app: exec format error`), bash
# (`bash: /app: cannot execute binary file: Exec format error`). Only which one matched is kept,
# never the log's text (a log may hold secrets).
LOG_WORDINGS = ("exec format error", "Exec format error", "cannot execute binary file")

_MESSAGE_CHARS = 300
_IMAGE_CHARS = 512


@dataclass(frozen=True)
class Failure:
    """One container that failed to start with exec format error."""
    container: str
    image: str               # as the pod spec names it
    digest: str | None       # what the kubelet ran (status imageID), when it says
    message: str             # the status' message, or the wording its log matched
    # where it was read: "status", "log", or "evidence" (not read: its workload's evidence names
    # this image at this digest failing on this architecture already)
    source: str = "status"

    @property
    def where(self) -> str:
        """Where it was read, for an Event: never the log's text, only the wording it matched."""
        if self.source == "log":
            return f"read in its log: it says \"{self.message}\""
        if self.source == "evidence":
            return ("its workload's pods failed so with this image at this digest on this "
                    "architecture before (archway.dev/failed-images): its log is not read again")
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
