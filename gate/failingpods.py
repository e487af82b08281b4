"""What the closed loop keeps of a failing pod (remediation.py): a few facts, decided from one
status update, pure. This runs on every pod status update of the cluster, so a pod that is not
failing costs a scan of its container statuses and nothing more."""
from dataclasses import dataclass

from archway.placement.archset import ArchSet, pod_arch_constraint
from archway.placement.learning import Evidence, Learned
from archway.podview import OwnerReference, PodShapeError, PodView
from archway.vocabulary import ANNOTATION_ARCHITECTURES

from .podstatus import (
    EXEC_FORMAT_ERROR,
    Failure,
    LogRead,
    admitted_digests,
    exec_format_failures,
    log_reads,
)


@dataclass(frozen=True)
class FailingPod:
    """A bound pod with a container that failed with exec format error (its status says so), or
    failed with a status that says nothing of why (`log_reads`: its log may)."""
    namespace: str
    name: str
    uid: str
    node: str
    owner: OwnerReference | None              # its controller, as the pod claims it
    labels: tuple[tuple[str, str], ...]       # what its controller's selector must select
    architectures: frozenset[str] | None      # archway.dev/architectures: what its images claim
    digests: tuple[tuple[str, str], ...]      # image -> digest archway admitted it with
    failures: tuple[Failure, ...]
    log_reads: tuple[LogRead, ...] = ()
    # Its own kubernetes.io/arch constraint, which its controller's replacement keeps when the
    # pod's template carries it (archway adds none to a pod that has one).
    arch_constraint: ArchSet | None = None

    @property
    def reference(self) -> dict:
        return {"apiVersion": "v1", "kind": "Pod", "namespace": self.namespace,
                "name": self.name, "uid": self.uid}

    def evidence(self, arch: str, failures: tuple[Failure, ...]) -> list[Evidence]:
        return [Evidence(f.image, self.failed_digest(f.image, f.digest), arch) for f in failures]

    def failed_digest(self, image: str, status_digest: str | None) -> str | None:
        """The digest a failure of `image` is evidence against: the one archway admitted the pod
        with, which is what admission compares the next pods' images to (learning.reset_reason);
        the container status' imageID only when archway admitted none. containerd names in
        imageID one of all the references it holds for the same image content: another
        repository's, or an older index of the tag, whose digest no admission would ever see
        again: the exclusion would be reset at the next admission, and the scale-up's pods go
        back to the failing architecture (issue 38)."""
        return dict(self.digests).get(image) or status_digest


def failing_pod(obj: dict) -> FailingPod | None:
    """The facts of a bound pod, not being deleted, with an exec format error in its status or
    a container that failed saying nothing; None for every other pod (almost all of them)."""
    failures = exec_format_failures(obj)
    said = {f.container for f in failures}
    reads = tuple(r for r in log_reads(obj) if r.container not in said)
    if not failures and not reads:
        return None
    try:
        pod = PodView.of(obj)
    except PodShapeError:
        return None
    # A pod being deleted is on its way out (its namespace may be too: no Event would be taken).
    if not pod.node_name or pod.being_deleted:
        return None
    claimed = pod.annotations.get(ANNOTATION_ARCHITECTURES)
    return FailingPod(
        namespace=pod.namespace, name=pod.name, uid=pod.uid, node=pod.node_name,
        owner=next((o for o in pod.owner_references if o.controller), None),
        labels=tuple(sorted(pod.labels.items())),
        architectures=frozenset(a for a in claimed.split(",") if a) if claimed is not None
        else None,
        digests=tuple(sorted(admitted_digests(pod.annotations).items())), failures=failures,
        log_reads=reads, arch_constraint=pod_arch_constraint(pod))


def explained_failures(pod: FailingPod, reads: list[LogRead], learned: Learned | None,
                       arch: str) -> tuple[Failure, ...]:
    """The silent failures among `reads` that what the pod's workload learned explains: the same
    image, at the same digest, failed with exec format error on `arch` before. Its binaries
    cannot run there whatever else went wrong, so its log need not be read (the budget of log
    reads would hold a crash loop of many replicas for minutes)."""
    if learned is None or arch not in learned.architectures:
        return ()
    failed = {(e.image, e.digest) for e in learned.evidence if e.architecture == arch and e.digest}
    explained = []
    for read in reads:
        digest = pod.failed_digest(read.image, read.digest)
        if (read.image, digest) in failed:
            explained.append(Failure(read.container, read.image, digest, EXEC_FORMAT_ERROR,
                                     source="evidence"))
    return tuple(explained)
