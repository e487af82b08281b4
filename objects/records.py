"""The image records' API objects: their paths, and a record to an object and back (pure).

The record is all `spec` (no status subresource): it is no desired state a controller works
towards but an observation archway writes whole, so one write (a create) makes it, where a
status would cost a create and an update.
"""
import calendar
import time
from dataclasses import dataclass

from archway.registry.model import ImageInfo
from archway.registry.platforms import normalize
from archway.registry.records import CLUSTER, ImageRecord, record_name

GROUP, VERSION = "archway.dev", "v1alpha1"
API_PATH = f"/apis/{GROUP}/{VERSION}"
CLUSTER_KIND, NAMESPACED_KIND = "ClusterImageRecord", "ImageRecord"
MANAGED_BY = {"app.kubernetes.io/managed-by": "archway"}
MAX_PLATFORMS = 64          # as the CRD's schema allows
# How far ahead of this clock a record's time may lie and still be believed: replicas' clocks
# differ by this much at most where NTP runs. Beyond it the time is nobody's (a fast clock, a
# hand-written record) and counts as never: the record is stale, revalidated and may expire.
CLOCK_SKEW_SECONDS = 5.0


@dataclass(frozen=True, slots=True)
class StoredRecord:
    """A record as the API holds it: its key in the watch (ImageRecord.name), the record, and
    the resourceVersion an update replaces."""
    name: str
    record: ImageRecord
    resource_version: str


def collection_path(scope: str) -> str:
    if scope == CLUSTER:
        return f"{API_PATH}/clusterimagerecords"
    return f"{API_PATH}/namespaces/{scope}/imagerecords"


def object_path(record: ImageRecord) -> str:
    return f"{collection_path(record.scope)}/{record_name(record.reference)}"


def _timestamp(seconds: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(seconds))


def _seconds(text) -> float:
    return float(calendar.timegm(time.strptime(str(text), "%Y-%m-%dT%H:%M:%SZ")))


def record_object(record: ImageRecord, resource_version: str | None = None) -> dict:
    """The API object of `record` (a PUT carries the `resource_version` it replaces)."""
    info = record.info
    metadata: dict = {"name": record_name(record.reference), "labels": dict(MANAGED_BY)}
    if record.scope != CLUSTER:
        metadata["namespace"] = record.scope
    if resource_version:
        metadata["resourceVersion"] = resource_version
    platforms = [{"os": p.os, "architecture": p.architecture, **({"variant": p.variant} if p.variant else {})}
                 for p in sorted(info.platforms)][:MAX_PLATFORMS]
    return {"apiVersion": f"{GROUP}/{VERSION}",
            "kind": CLUSTER_KIND if record.scope == CLUSTER else NAMESPACED_KIND,
            "metadata": metadata,
            "spec": {"reference": record.reference, "digest": info.digest or "",
                     "platforms": platforms,
                     "architectures": ",".join(sorted(info.architectures)) or "unknown",
                     "source": info.source, "note": info.note,
                     "readAt": _timestamp(record.read_at),
                     "lastRevalidated": _timestamp(record.revalidated_at),
                     "lastError": record.last_error}}


def _believed(seconds: float, now: float) -> float:
    """A record's time as this process trusts it: no later than now; 0 (never) when it lies
    further ahead than CLOCK_SKEW_SECONDS."""
    return 0.0 if seconds > now + CLOCK_SKEW_SECONDS else min(seconds, now)


def stored_record(obj: dict, now: float | None = None) -> StoredRecord | None:
    """What a process keeps of a record object; None for one it cannot use (hand-made, or of a
    later schema): the registry is asked instead. Its times are clamped to `now` (wall clock):
    a record dated in the future is not fresh on its own word."""
    now = time.time() if now is None else now
    try:
        metadata, spec = obj["metadata"], obj["spec"]
        reference = str(spec["reference"])
        if record_name(reference) != metadata["name"]:
            return None    # not archway's name for this reference: never trusted
        platforms = frozenset(normalize(p["os"], p["architecture"], p.get("variant"))
                              for p in spec.get("platforms") or ())
        info = ImageInfo(reference, platforms, str(spec.get("digest") or "") or None,
                         str(spec.get("source") or "record"), str(spec.get("note") or ""))
        record = ImageRecord(str(metadata.get("namespace") or CLUSTER), reference, info,
                             _believed(_seconds(spec["readAt"]), now),
                             _believed(_seconds(spec["lastRevalidated"]), now),
                             str(spec.get("lastError") or ""))
        return StoredRecord(record.name, record, str(metadata.get("resourceVersion") or ""))
    except (KeyError, TypeError, ValueError, AttributeError):
        return None
