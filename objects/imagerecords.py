"""The cluster's image records as Kubernetes objects: the record store (registry/records.py) of
every process that resolves images, kept in the API and read through one list + watch.

    ClusterImageRecord   an answer read without a pod's pull secrets: every pod may be told it
    ImageRecord          an answer read with a namespace's pull secrets: in that namespace,
                         served only to that namespace's pods (a tenant's knowledge stays its own)

The objects are objects/records.py's; writes go through recordwriter.py's queue. A watch event that says a tag names another digest
drops this process's answers of the old one at once (Resolver.record_changed): every replica
answers from the new digest within the watch's delay, not after a TTL.
"""
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from archway import metrics
from archway.kubeapi import KubeApi
from archway.registry.records import CLUSTER, ImageRecord, record_name
from archway.watchcache import WatchCache

from .records import API_PATH, CLUSTER_KIND, NAMESPACED_KIND, StoredRecord, stored_record
from .recordwriter import RecordWriter

log = logging.getLogger("archway.imagerecords")

class RecordWatch(WatchCache[StoredRecord]):
    """One kind's records (all namespaces for ImageRecord), keyed as ImageRecord.name is;
    `changed(before, after or None)` hears of a record that names another digest or is gone."""

    def __init__(self, api_client_factory, *, scope_kind: str, changed, **kwargs):
        plural = "clusterimagerecords" if scope_kind == CLUSTER_KIND else "imagerecords"
        super().__init__(api_client_factory, what=scope_kind, path=f"{API_PATH}/{plural}",
                         facts=stored_record, **kwargs)
        self._changed = changed

    def _name_of(self, obj: dict):
        metadata = obj.get("metadata") or {}
        namespace, name = metadata.get("namespace"), metadata.get("name")
        return f"{namespace}/{name}" if namespace else name

    def _replace(self, facts: dict) -> None:
        before = self.items
        super()._replace(facts)
        for name in before.keys() | facts.keys():
            self._tell(before.get(name), facts.get(name))

    def _upsert(self, fact: StoredRecord | None) -> None:
        before = self.items.get(fact.name) if fact is not None else None
        super()._upsert(fact)
        self._tell(before, fact)

    def _delete(self, name) -> None:
        before = self.items.get(name)
        super()._delete(name)
        self._tell(before, None)

    def _tell(self, before: StoredRecord | None, after: StoredRecord | None) -> None:
        if before is None or (after is not None and after.record.digest == before.record.digest):
            return    # a new record, or the same digest: no answer this process holds is wrong
        try:
            self._changed(before.record, after.record if after else None)
        except Exception:   # a listener's bug must not end the watch
            log.exception("telling of the record of %s failed", before.record.reference)


@dataclass
class ImageRecords:
    """The record store of one process: the two watches, and the writer that offers go to."""
    cluster: RecordWatch
    namespaced: RecordWatch
    writer: RecordWriter
    listeners: list[Callable[[str, str | None], None]]
    # Told (before, after) of a record that names another digest: the leader's tag watch
    # alarms on a move another replica saw (a push event), at once.
    moves: list[Callable[[ImageRecord, ImageRecord], None]]
    read_only: bool = False     # the operator's commands read, and write nothing

    @classmethod
    def build(cls, api_client_factory, *, refresh_seconds: float, max_pending: int) -> "ImageRecords":
        listeners: list = []
        moves: list = []

        def changed(before: ImageRecord, after: ImageRecord | None) -> None:
            for listener in listeners:
                listener(before.reference, after.digest if after else None)
            for mover in moves:
                if after is not None:
                    mover(before, after)
        watches = [RecordWatch(api_client_factory, scope_kind=kind, changed=changed)
                   for kind in (CLUSTER_KIND, NAMESPACED_KIND)]
        records = cls(watches[0], watches[1], RecordWriter(
            lambda: KubeApi(api_client_factory(), timeout_seconds=5.0),
            refresh_seconds=refresh_seconds, max_pending=max_pending), listeners, moves)
        records.writer.known = records.known
        return records

    def serve(self, resolver) -> "ImageRecords":
        """`resolver` reads and offers records here, and forgets what a record says moved."""
        resolver.records = self
        self.listeners.append(resolver.record_changed)
        return self

    # --- RecordStore ---------------------------------------------------------------------------
    def find(self, scope: str, reference: str) -> ImageRecord | None:
        name = record_name(reference)
        stored = self.known(name if scope == CLUSTER else f"{scope}/{name}")
        if stored is None or stored.record.reference != reference:
            return None
        metrics.IMAGE_RECORDS_SERVED.inc()
        return stored.record

    def offer(self, record: ImageRecord) -> None:
        if not self.read_only:
            self.writer.offer(record)

    def known(self, name: str) -> StoredRecord | None:
        watch = self.namespaced if "/" in name else self.cluster
        return watch.items.get(name)

    def records(self) -> list[ImageRecord]:
        return [s.record for watch in (self.cluster, self.namespaced) for s in watch.items.values()]

    # --- lifetime ------------------------------------------------------------------------------
    def start(self, wait_seconds: float = 0.0) -> "ImageRecords":
        """Both watches and the writer, in this process; waits up to `wait_seconds` for the
        first lists (a replica that starts answers from them, not from the registries)."""
        for watch in (self.cluster, self.namespaced):
            watch.ensure_started()
        if not self.read_only:
            self.writer.start()
        deadline = time.monotonic() + wait_seconds
        for watch in (self.cluster, self.namespaced):
            watch.wait_synced(deadline - time.monotonic())
        return self

    def stop(self) -> None:
        for watch in (self.cluster, self.namespaced):
            watch.stop()
        self.writer.stop()


def records_for(config, api_client_factory, resolver, *, has_api: bool,
                read_only: bool = False) -> ImageRecords | None:
    """The record store `resolver` reads and offers to, started (its first lists waited for,
    up to kubernetes.image_records.start_wait_seconds); None without a Kubernetes API or with
    kubernetes.image_records.enabled off."""
    settings = config.kubernetes.image_records
    if not (has_api and settings.enabled and config.kubernetes.enabled != "off"):
        return None
    records = ImageRecords.build(api_client_factory,
                                 refresh_seconds=config.registry.cache.tag_ttl_seconds / 2,
                                 max_pending=settings.max_queued_writes)
    records.read_only = read_only
    return records.serve(resolver).start(settings.start_wait_seconds)


def read_records(config, api_client, resolver) -> ImageRecords | None:
    """For `archway explain` and `report`: the records listed once (up to
    kubernetes.image_records.start_wait_seconds) before `resolver` asks a registry; nothing is
    written (the operator may read, not write, them). Stop it when done."""
    if api_client is None:
        return None
    records = records_for(config, lambda: api_client, resolver, has_api=True, read_only=True)
    return records
