"""The leader's care of the cluster's image records (objects/imagerecords.py), once per cluster
instead of once per process:

    every round (a quarter of the tag TTL, at most a quarter of kubernetes.image_records.expire_seconds)
      -> the images the cluster's pods and workload templates name, per namespace (listed again
         when the last listing is LIST_SECONDS old, or a quarter of expire_seconds: a listing
         of every pod is the round's dearest part)
      -> a cluster-wide record of a tag still in use whose last revalidation is half a tag TTL
         old: revalidated (a HEAD at its registry; the resolver offers the result, so the record
         says when, and a moved tag's new digest reaches every replica through its watch)
      -> a record no pod or workload uses (in its namespace, for an ImageRecord) and not read
         or revalidated for expire_seconds: deleted (on the resourceVersion seen, so a record
         another process just rewrote stays)

Webhook workers trust a record revalidated within the tag TTL, so they send no HEAD of their
own while the leader keeps up. A namespace's records are revalidated by the workers that serve
that namespace's pods, with the pods' credentials (the leader holds no tenant's secret for them).
"""
import logging
import threading
import time
from collections.abc import Callable, Iterable

from archway import metrics
from archway.cluster.workloads import wanted_images
from archway.errors import ArchwayError
from archway.kubeapi import ApiError, KubeApi
from archway.objects.imagerecords import ImageRecords
from archway.objects.records import object_path
from archway.registry.records import CLUSTER, ImageRecord
from archway.registry.reference import parse_reference

log = logging.getLogger("archway.imagerecords")

MIN_ROUND_SECONDS = 1.0
LIST_SECONDS = 600.0


def images_in_use(objects: Iterable[dict], exclude_namespaces=()) -> set[tuple[str, str]]:
    """(namespace, canonical reference) of every image the listed pods and workloads name."""
    used = set()
    for wanted in wanted_images(objects, exclude_namespaces):
        try:
            used.add((wanted.pod.namespace, str(parse_reference(wanted.image))))
        except (ArchwayError, ValueError):
            continue
    return used


def in_use(record: ImageRecord, used: set[tuple[str, str]], anywhere: set[str]) -> bool:
    """A cluster-wide record serves every namespace; a namespace's only its own."""
    if record.scope == CLUSTER:
        return record.reference in anywhere
    return (record.scope, record.reference) in used


class RecordKeeper:
    def __init__(self, *, api: KubeApi, records: ImageRecords, resolver,
                 list_objects: Callable[[], Iterable[dict]], expire_seconds: float,
                 tag_ttl_seconds: float, exclude_namespaces=(), wall=time.time):
        self.api = api
        self.records = records
        self.resolver = resolver
        self.list_objects = list_objects          # pods and workloads (ClusterReader's pages)
        self.expire_seconds = expire_seconds
        self.refresh_seconds = tag_ttl_seconds / 2
        self.round_seconds = max(MIN_ROUND_SECONDS, min(expire_seconds, tag_ttl_seconds) / 4)
        self.list_seconds = max(self.round_seconds, min(expire_seconds / 4, LIST_SECONDS))
        self.exclude_namespaces = tuple(exclude_namespaces)
        self._wall = wall
        self._used: set[tuple[str, str]] | None = None
        self._listed_at = 0.0

    def _in_use(self, now: float) -> set[tuple[str, str]]:
        if self._used is None or now - self._listed_at >= self.list_seconds:
            self._used = images_in_use(self.list_objects(), self.exclude_namespaces)
            self._listed_at = now
        return self._used

    def lead(self, stop: threading.Event) -> None:
        while not stop.is_set():
            try:
                self.round()
            except Exception as e:    # the next round tries again
                log.warning("the image records' round failed: %s", e)
            stop.wait(self.round_seconds)

    def round(self) -> dict[str, int]:
        """One pass over the records; returns how many were revalidated and deleted."""
        now = self._wall()
        used = self._in_use(now)
        anywhere = {reference for _, reference in used}
        done = {"revalidated": 0, "deleted": 0}
        for record in self.records.records():
            if in_use(record, used, anywhere):
                if self._revalidate(record, now):
                    done["revalidated"] += 1
            elif now - max(record.read_at, record.revalidated_at) >= self.expire_seconds:
                done["deleted"] += self._delete(record)
        if any(done.values()):
            log.info("image records: %(revalidated)d revalidated, %(deleted)d expired", done)
        return done

    def _revalidate(self, record: ImageRecord, now: float) -> bool:
        if record.scope != CLUSTER or now - record.revalidated_at < self.refresh_seconds:
            return False
        if parse_reference(record.reference).digest:
            return False     # a digest's content never changes
        # timeout 0: the check goes on in the background and offers what it finds.
        self.resolver.resolve_many([record.reference], timeout=0,
                                   revalidate=frozenset([record.reference]), scope=CLUSTER)
        return True

    def _delete(self, record: ImageRecord) -> int:
        stored = self.records.known(record.name)
        if stored is None:
            return 0
        try:
            self.api.request("DELETE", object_path(record), body={
                "preconditions": {"resourceVersion": stored.resource_version}})
        except ApiError as e:
            if e.status in (404, 409):   # gone already, or rewritten since: kept
                return 0
            raise
        metrics.IMAGE_RECORD_WRITES.labels("deleted").inc()
        return 1
