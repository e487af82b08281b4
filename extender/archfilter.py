"""Which candidate nodes may run a pod: the filter's decision, pure, tested without I/O.

The pod's architectures S come from the webhook's annotation or from its images' resolved
manifests (the same set the webhook's placement decision computes); a node passes unless its
architecture is known and not in S.
"""
from archway.podview import PodView
from archway.vocabulary import (
    ANNOTATION_ARCHITECTURES,
    common_architectures,
    join_architectures,
    parse_architectures,
    told_architectures,
)


def annotated_architectures(pod: PodView) -> frozenset[str] | None:
    """The set the webhook wrote into the pod at admission, or None when it is absent/blank."""
    value = pod.annotations.get(ANNOTATION_ARCHITECTURES)
    if value is None:
        return None
    archs = parse_architectures(value)
    return archs or None


def shared_architectures(results: dict, os: str = "linux") -> tuple[frozenset[str] | None, str]:
    """(S, explanation): the placement decision's S of these results for the pod's OS `os`
    (unresolvable or platform-less images do not shrink it), and which image told what."""
    told = told_architectures(results, os)
    if not told:
        return None, "no image told its architectures"
    detail = "; ".join(f"{image}: {join_architectures(archs) or 'no ' + os + ' platform'}"
                       for image, archs in told.items())
    return common_architectures(told), detail


class FilterOutcome:
    __slots__ = ("keep", "unresolvable")

    def __init__(self):
        self.keep: list[int] = []                 # positions of the passing candidates
        self.unresolvable: dict[str, str] = {}    # node -> why it cannot run the pod


def filter_by_arch(pod_archs: frozenset[str] | None, node_archs, names, *,
                   why_none: str = "", node_oses=(), pod_os: str = "linux") -> FilterOutcome:
    """Which candidates may run the pod. `node_archs[i]` is node i's GOARCH or None (unknown);
    `node_oses[i]`, when given, its kubernetes.io/os: S holds the architectures of the pod's OS
    `pod_os` only, so a node of another OS cannot run its images either.

    A mismatching node goes to FailedAndUnresolvableNodes: no preemption can change a node's
    architecture, and in FailedNodes the scheduler would consider evicting that node's pods for
    a pod that still could not run there.
    """
    outcome = FilterOutcome()
    if pod_archs is None:  # nothing known about the images: archway has no objection
        outcome.keep = list(range(len(names)))
        return outcome
    if not pod_archs:
        reason = f"the pod's images have no architecture in common ({why_none})"
        for name in names:
            outcome.unresolvable[name] = reason
        return outcome
    wanted = join_architectures(pod_archs)
    reasons: dict[str, str] = {}
    keep, unresolvable = outcome.keep, outcome.unresolvable
    for i, arch in enumerate(node_archs):
        node_os = node_oses[i] if i < len(node_oses) else pod_os
        if node_os != pod_os:
            unresolvable[names[i]] = f"node OS {node_os} is not the pod's OS {pod_os}"
        elif arch is None or arch in pod_archs:
            keep.append(i)
        else:
            why = reasons.get(arch)
            if why is None:
                why = reasons[arch] = (f"node arch {arch} not in the pod's images' "
                                       f"architectures {wanted}")
            unresolvable[names[i]] = why
    return outcome
