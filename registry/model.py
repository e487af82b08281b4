"""What a resolution returns."""
import sys
from dataclasses import dataclass

from .platforms import Platform, architectures


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
        """kubernetes.io/arch values; empty means unknown."""
        return architectures(self.platforms)

    def architectures_for(self, os: str) -> frozenset[str]:
        """The architectures the image has for one OS (a pod's `spec.os.name`)."""
        return architectures(self.platforms, os)

    @property
    def operating_systems(self) -> frozenset[str]:
        return frozenset(p.os for p in self.platforms if p.os)

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
            "platforms": sorted(str(p) for p in self.platforms),
            "digest": self.digest,
            "source": self.source,
            "note": self.note or None,
            "error": None,
        }
