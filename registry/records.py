"""What the cluster knows of an image, shared by every process that resolves images: a record
store the resolver consults after its own cache and before a registry, and tells what it read.

The store itself lives at the edge (objects/imagerecords.py keeps it as Kubernetes objects,
listed and watched); this module only says what a record is and what a store does, so the
resolver stays free of Kubernetes. A record has a *scope*: "" for an answer read without any of
a pod's credentials (anyone may be told it), else the tenant whose credentials read it (the
namespace): such a record is only ever served within that scope.
"""
import hashlib
import re
from dataclasses import dataclass
from typing import Protocol

from .model import ImageInfo

CLUSTER = ""          # the scope of an answer read without a pod's credentials

_NAME_MAX = 200       # of the readable part; the hash keeps names unique within 253
_NOT_IN_NAME = re.compile(r"[^a-z0-9.-]+")


@dataclass(frozen=True, slots=True)
class ImageRecord:
    """One image's answer as the cluster knows it. Times are wall-clock seconds (time.time()):
    they are compared between processes and machines."""
    scope: str                 # CLUSTER, or the namespace whose credentials read it
    reference: str             # the resolver's canonical reference (str(ImageReference))
    info: ImageInfo
    read_at: float             # when the content (digest) was read
    revalidated_at: float      # when a registry last confirmed the tag names this digest
    last_error: str = ""       # the last failed revalidation's message ("" after a success)

    @property
    def name(self) -> str:
        """The key of the record in its store: the object name, namespaced by its scope."""
        own = record_name(self.reference)
        return own if self.scope == CLUSTER else f"{self.scope}/{own}"

    @property
    def digest(self) -> str | None:
        return self.info.digest


def record_name(reference: str) -> str:
    """A DNS-subdomain name derived from `reference` (a digest or a tag with '_' or ':' is no
    valid name): its readable part cleaned, then a hash of the whole reference, so two
    references never share a name."""
    readable = _NOT_IN_NAME.sub("-", reference.lower())[:_NAME_MAX].strip("-.")
    readable = re.sub(r"[-.]{2,}", "-", readable).strip("-.") or "image"
    return f"{readable}-{hashlib.sha256(reference.encode()).hexdigest()[:12]}"


class RecordStore(Protocol):
    """Where the resolver reads and offers records; both calls return at once (no I/O on the
    caller's thread: a store writes in the background, coalesced)."""

    def find(self, scope: str, reference: str) -> ImageRecord | None:
        """The record of `reference` in `scope`, if the store has one."""

    def offer(self, record: ImageRecord) -> None:
        """What a process read at a registry; the store writes it when it tells something new
        (a new image, another digest, a revalidation the others should trust)."""
