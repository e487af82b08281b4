"""The words every room shares: the architecture label, the names archway writes on objects, and
the arithmetic of architecture sets. Pure; the webhook, the gate controller, the extender and the
operator tools all say these things the same way because they say them from here.
"""
from collections.abc import Callable, Iterable, Mapping

from archway import __version__
from archway.logsafe import redact_url

# What archway calls itself in every request it makes -- to registries, Prometheus, the
# Kubernetes API (RFC 9110 10.1.5: product/version): their operators can tell its traffic apart.
USER_AGENT = f"archway/{__version__}"

ARCH_LABEL = "kubernetes.io/arch"
OS_LABEL = "kubernetes.io/os"
# kubelet still sets the deprecated beta label; a pod selecting on it does constrain its arch.
ARCH_KEYS = (ARCH_LABEL, "beta.kubernetes.io/arch")
# Other names of an architecture, as containerd normalises them (GOARCH is the name).
ARCH_ALIASES = {
    "i386": "386", "i486": "386", "i586": "386", "i686": "386", "x86": "386",
    "x86_64": "amd64", "x86-64": "amd64", "x64": "amd64",
    "aarch64": "arm64", "armhf": "arm", "armel": "arm", "arm64le": "arm64",
    "ppc64el": "ppc64le",
}
REQUIRED_AFFINITY = "requiredDuringSchedulingIgnoredDuringExecution"
PREFERRED_AFFINITY = "preferredDuringSchedulingIgnoredDuringExecution"

# What admission wrote on a pod: the architectures its images share, and what each image runs on.
ANNOTATION_ARCHITECTURES = "archway.dev/architectures"
ANNOTATION_IMAGES = "archway.dev/images"
# What a workload learned from exec format errors (learning.py), on the workload's own metadata.
ANNOTATION_FAILED = "archway.dev/failed-architectures"
ANNOTATION_EVIDENCE = "archway.dev/failed-images"
# What admission kept a pod off, from what its workload learned.
ANNOTATION_EXCLUDED = "archway.dev/excluded-architectures"
# A workload's status condition, False while its images claim only architectures its pods failed
# on (gate/conditions.py).
CONDITION_ARCHITECTURE_LEFT = "archway.dev/ArchitectureLeft"
# A pod that opts out of archway (the annotation, or the chart's objectSelector label).
SKIP_ANNOTATION = "archway.dev/skip"
# A Namespace's own policy: its mode, and the architectures its pods prefer.
LABEL_MODE = "archway.dev/mode"
ANNOTATION_PREFERRED = "archway.dev/preferred-architectures"
# What shaped the policy a pod was admitted under: a PlacementPolicy, the Namespace, the config.
ANNOTATION_POLICY = "archway.dev/policy"
# A pod archway could not place in time waits behind this scheduling gate; the label lets the
# gate controller list and watch only gated pods.
GATE = "archway.dev/resolving"
GATED_LABEL = "archway.dev/gated"


def normal_architecture(name: str) -> str:
    """The architecture as a node's kubernetes.io/arch label says it: aarch64 -> arm64,
    x86_64 -> amd64, lower case."""
    raw = name.strip().lower()
    return ARCH_ALIASES.get(raw, raw)


def parse_architectures(text: str) -> frozenset[str]:
    """`amd64, aarch64` -> {amd64, arm64}: a comma-separated list as an annotation holds it."""
    return frozenset(normal_architecture(a) for a in text.split(",") if a.strip())


def told_architectures(results: Mapping, os: str = "linux") -> dict[str, frozenset[str]]:
    """image -> its architectures for the pod's OS (`kubernetes.io/os`), for the images whose
    result names a platform: a failure (an ArchwayError), a missing result or an image that
    records no platform at all (an OCI artifact, a SIF image of arch 00) says nothing about
    where the pod can run. An image with platforms but none for `os` tells the empty set: it
    runs nowhere the pod can go."""
    told = {}
    for image, result in results.items():
        if getattr(result, "platforms", None):
            told[image] = result.architectures_for(os)
        elif getattr(result, "architectures", None):
            told[image] = result.architectures
    return told


def common_architectures(told: Mapping[str, frozenset[str]]) -> frozenset[str] | None:
    """S, the architectures every image of `told` runs on; None when no image told any."""
    return frozenset.intersection(*told.values()) if told else None


def join_architectures(archs: Iterable[str]) -> str:
    """`amd64, arm64`: architectures as a message shows them, sorted."""
    return ", ".join(sorted(archs))


def share_no_architecture(told: Mapping[str, frozenset[str]], results: Mapping | None = None,
                          os: str = "linux", name: Callable[[str], str] = redact_url) -> str:
    """Why a pod can run nowhere: its images (as `name` shows one: a password in a SIF URL
    redacted, the image volume it is pulled for) and what each runs on; or, when an image has no
    platform for the pod's OS at all, that (`results` give its platforms)."""
    lacking = [image for image, archs in told.items() if not archs]
    if lacking:
        return "; ".join(no_platform_for(name(image), (results or {}).get(image), os)
                         for image in lacking)
    return "the pod's images share no CPU architecture: " + "; ".join(
        f"{name(image)} ({join_architectures(archs)})" for image, archs in told.items())


def no_platform_for(image: str, result, os: str) -> str:
    """`reg/app:1 has no linux platform: windows/amd64 only` (`image` as its caller shows it:
    redacted already)."""
    platforms = ", ".join(sorted(str(p) for p in getattr(result, "platforms", ()) or ()))
    return f"{image} has no {os} platform: {platforms or 'none'} only"
