"""The image records' writes: off the admission's path, coalesced and bounded.

An offer (registry/records.py) only decides whether the record tells something new and queues
it: a new image, another digest, an error appearing or clearing, or a revalidation when the
record's is `refresh_seconds` old (the others trust a record a registry confirmed within the tag
TTL). One background thread writes what is queued, the newest offer per record: a create for a
record the watch does not know (409: another process made it first, which is fine: the record is
read and updated only if this offer tells more), else an update on the resourceVersion the watch
holds (409: another process updated it first; the next offer tries again). The queue holds at
most `max_pending` records; past that an offer is dropped and counted.
"""
import logging
import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import replace

from archway import metrics
from archway.background import ProcessThread
from archway.kubeapi import ApiError, KubeApi
from archway.logsafe import redact_url
from archway.registry.records import ImageRecord

from .records import StoredRecord, collection_path, object_path, record_object, stored_record

log = logging.getLogger("archway.imagerecords")

_REMEMBERED = 4096     # records this writer wrote, until the watch shows them


def merged(known: ImageRecord | None, offered: ImageRecord) -> ImageRecord:
    """What the record becomes: a failed revalidation (last_error set) keeps the times of the
    known record; the same digest keeps the time its content was first read."""
    if known is None:
        return offered
    if offered.last_error:
        return replace(known, last_error=offered.last_error)
    if offered.digest == known.digest:
        return replace(offered, read_at=min(known.read_at, offered.read_at),
                       revalidated_at=max(known.revalidated_at, offered.revalidated_at))
    return offered


def tells_more(known: ImageRecord | None, offered: ImageRecord, refresh_seconds: float) -> bool:
    """Whether writing `offered` over `known` tells the other processes something."""
    if known is None:
        return not offered.last_error     # a failure without a known answer is no record
    if offered.last_error:
        return offered.last_error != known.last_error
    return (offered.digest != known.digest or bool(known.last_error)
            or offered.info.platforms != known.info.platforms
            or offered.revalidated_at - known.revalidated_at >= refresh_seconds)


class RecordWriter:
    def __init__(self, api_factory: Callable[[], KubeApi], *, refresh_seconds: float,
                 max_pending: int):
        self._api_factory = api_factory
        self._api: KubeApi | None = None
        self.refresh_seconds = refresh_seconds
        self.max_pending = max_pending
        self.known: Callable[[str], StoredRecord | None] = lambda name: None   # the watch's
        self._pending: OrderedDict[str, ImageRecord] = OrderedDict()
        self._written: OrderedDict[str, ImageRecord] = OrderedDict()
        self._wake = threading.Condition()
        self._stop = threading.Event()
        self._runner = ProcessThread(self._run, "archway-record-writer")

    def offer(self, record: ImageRecord) -> None:
        with self._wake:
            known = self._latest(record.name)
            queued = self._pending.get(record.name)
            if queued is not None:
                record = merged(queued, record)
            elif not tells_more(known, record, self.refresh_seconds):
                return
            elif len(self._pending) >= self.max_pending:
                metrics.IMAGE_RECORD_WRITES.labels("dropped").inc()
                return
            self._pending[record.name] = record
            self._wake.notify()

    def _latest(self, name: str) -> ImageRecord | None:
        stored = self.known(name)
        written = self._written.get(name)
        if stored is None:
            return written
        if written is not None and written.revalidated_at > stored.record.revalidated_at:
            return written
        return stored.record

    @property
    def pending(self) -> int:
        return len(self._pending)

    def start(self) -> None:
        self._runner.start_once()

    def stop(self) -> None:
        self._stop.set()
        with self._wake:
            self._wake.notify_all()
        self._runner.join(5)

    def _run(self) -> None:
        while not self._stop.is_set():
            with self._wake:
                while not self._pending and not self._stop.is_set():
                    self._wake.wait(5.0)
                if self._stop.is_set():
                    return
                _, record = self._pending.popitem(last=False)
            try:
                self.write(record)
            except Exception as e:   # the next offer of this image tries again
                metrics.IMAGE_RECORD_WRITES.labels("failed").inc()
                log.warning("writing the image record of %s failed: %s",
                            redact_url(record.reference), e)

    def write(self, record: ImageRecord) -> str:
        """Create or update `record`'s object now; returns what happened (the metric's label)."""
        api = self._api = self._api or self._api_factory()
        stored = self.known(record.name)
        if stored is None:
            try:
                api.request("POST", collection_path(record.scope), body=record_object(record))
                return self._done(record, "created")
            except ApiError as e:
                if e.status != 409:
                    raise
            stored = stored_record(api.request("GET", object_path(record)))
            if stored is None or not tells_more(stored.record, record, self.refresh_seconds):
                return self._done(None, "exists")
        elif not tells_more(stored.record, record, self.refresh_seconds):
            return "unchanged"    # another process wrote as much since the offer: no request
        update = merged(stored.record, record)
        try:
            api.request("PUT", object_path(update), body=record_object(update, stored.resource_version))
        except ApiError as e:
            if e.status != 409:
                raise
            return self._done(None, "conflict")
        return self._done(update, "updated")

    def _done(self, record: ImageRecord | None, result: str) -> str:
        metrics.IMAGE_RECORD_WRITES.labels(result).inc()
        if record is not None:
            with self._wake:
                self._written[record.name] = record
                while len(self._written) > _REMEMBERED:
                    self._written.popitem(last=False)
        return result
