"""Platforms (os/architecture/variant), normalised as containerd normalises them.

The architecture part is what a node's `kubernetes.io/arch` label carries (GOARCH).
"""
import functools
from dataclasses import dataclass

from archway.vocabulary import ARCH_ALIASES

# Variants implied by Debian-style names, and the defaults containerd fills in or drops.
_IMPLIED_VARIANT = {"armhf": "v7", "armel": "v6"}


@dataclass(frozen=True, order=True, slots=True)
class Platform:
    os: str
    architecture: str
    variant: str = ""

    def __str__(self):
        parts = [self.os, self.architecture] + ([self.variant] if self.variant else [])
        return "/".join(parts)


@functools.lru_cache(maxsize=1024)  # one shared object per platform, not one per cached image
def normalize(os: str | None, architecture: str | None, variant: str | None = None) -> Platform:
    """Return the containerd-normalised platform (e.g. x86_64 -> amd64, armhf -> arm/v7)."""
    raw_arch = (architecture or "").strip().lower()
    arch = ARCH_ALIASES.get(raw_arch, raw_arch)
    var = (variant or "").strip().lower() or _IMPLIED_VARIANT.get(raw_arch, "")
    if arch == "arm64" and var in ("v8", "8"):
        var = ""  # arm64/v8 is plain arm64
    elif arch == "arm" and var in ("", "7"):
        var = "v7"  # containerd's default ARM variant
    elif arch == "arm" and var in ("5", "6", "8"):
        var = "v" + var
    elif arch == "amd64" and var == "v1":
        var = ""
    return Platform((os or "").strip().lower(), arch, var)


def parse_platform(text: str) -> Platform:
    """Parse `os/arch[/variant]` or a bare `arch[/variant]` (os defaults to linux)."""
    parts = text.strip().split("/")
    if len(parts) >= 2 and parts[0] in ("linux", "windows", "darwin", "freebsd", "unknown"):
        return normalize(parts[0], parts[1], parts[2] if len(parts) > 2 else None)
    return normalize("linux", parts[0], parts[1] if len(parts) > 1 else None)


def architectures(platforms, os: str = "linux") -> frozenset[str]:
    """The `kubernetes.io/arch` values (GOARCH, no variant) of the platforms given for one OS
    (`kubernetes.io/os`: linux, windows)."""
    return frozenset(p.architecture for p in platforms if p.os == os and p.architecture)


def is_attestation(entry: dict) -> bool:
    """An image-index entry that describes an attestation (BuildKit provenance, SBOM), not an
    image: annotated as such, or with the platform unknown/unknown."""
    annotations = entry.get("annotations")
    if isinstance(annotations, dict) and \
            annotations.get("vnd.docker.reference.type") == "attestation-manifest":
        return True
    platform = entry.get("platform")
    return isinstance(platform, dict) and platform.get("os") == "unknown" \
        and platform.get("architecture") == "unknown"
