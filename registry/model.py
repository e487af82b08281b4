"""What a resolution returns."""
import sys
from dataclasses import dataclass

from .platforms import Platform, architectures

ARTIFACT_SOURCE = "oci-artifact"


@dataclass(frozen=True, slots=True)
class ImageInfo:
    """The platforms one image supports, the digest it resolved to, and where the answer came from.

    `platforms` is empty when the image exists but records no architecture (a SIF image with
    arch "00", a pre-SIF squashfs image); `note` then says why.
    """
    image: str                       # the reference as the user wrote it
    platforms: frozenset[Platform]
    digest: str | None
    source: str                      # e.g. "oci-index", "docker-manifest", "sif-oras", "sif-https"
    note: str = ""

    @property
    def architectures(self) -> frozenset[str]:
        """kubernetes.io/arch values of its Linux platforms (a Linux pod's); empty: no Linux
        platform, or none at all. `architectures_for` a pod of another OS."""
        return architectures(self.platforms)

    def architectures_for(self, os: str) -> frozenset[str]:
        """The architectures the image has for one OS (a pod's `spec.os.name`)."""
        return architectures(self.platforms, os)

    @property
    def is_artifact(self) -> bool:
        """An OCI artifact (a model, a bundle): no platform by nature, pulled alike anywhere."""
        return self.source == ARTIFACT_SOURCE

    @property
    def operating_systems(self) -> frozenset[str]:
        return frozenset(p.os for p in self.platforms if p.os)

    def architectures_by_os(self) -> dict[str, list[str]]:
        """{"linux": ["amd64", "arm64"], "windows": ["amd64"]}: what a pod of each OS can use."""
        return {os: sorted(self.architectures_for(os)) for os in sorted(self.operating_systems)}

    def approx_bytes(self) -> int:
        """Memory this answer holds, for a cache bounded in bytes. Each object is counted once
        (the os and variant strings of most platforms are one shared object); platforms shared
        with other answers (normalize() caches them) are counted anyway: an upper bound."""
        objects: dict[int, object] = {id(o): o for o in (self, self.platforms, self.image,
                                                         self.digest, self.source, self.note)}
        for platform in self.platforms:
            for part in (platform, platform.os, platform.architecture, platform.variant):
                objects[id(part)] = part
        return sum(sys.getsizeof(o) for o in objects.values())

    def to_json(self) -> dict:
        return {
            "image": self.image,
            "architectures": sorted(self.architectures),
            "architectures_by_os": self.architectures_by_os(),
            "platforms": sorted(str(p) for p in self.platforms),
            "digest": self.digest,
            "source": self.source,
            "note": self.note or None,
            "error": None,
        }
