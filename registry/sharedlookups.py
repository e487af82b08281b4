"""Image lookups shared by the worker processes of one server.

Each gunicorn worker has its own cache and in-flight table, so without this a burst of pods with
one new image costs the registry one manifest fetch per worker. The first worker to look an image
up holds an exclusive lock (flock) on a slot file and writes the answer into it; a worker asking
meanwhile waits on the lock (never past its own deadline) and reads the answer instead of
fetching. Keys hash into a fixed number of slots, so the directory never grows; two images that
share a slot only make each other fetch again. Slot files hold what ImageInfo.to_json shows and
a hash of the cache key: no credentials.
"""
import fcntl
import hashlib
import json
import os
import time

from .model import ImageInfo
from .platforms import normalize

SLOTS = 1024
_POLL_SECONDS = 0.005
_MAX_RECORD_BYTES = 256 * 1024


class SharedLookups:
    def __init__(self, directory: str, clock=time.time):
        self.directory = directory
        self._clock = clock  # wall clock: the one clock every process agrees on

    def run(self, key: tuple, fetch, ttl: float, deadline: float) -> ImageInfo:
        """fetch()'s answer, or the one another worker fetched for `key` less than `ttl` ago."""
        key_hash = hashlib.sha256(repr(key).encode()).hexdigest()
        slot = int(key_hash[:8], 16) % SLOTS
        fd = os.open(os.path.join(self.directory, f"slot-{slot:04d}"), os.O_RDWR | os.O_CREAT, 0o600)
        try:
            if not _lock(fd, deadline):
                return fetch()  # the other worker is slow: don't wait past our own deadline
            try:
                shared = _read(fd, key_hash, self._clock())
                if shared is not None:
                    return shared
                info = fetch()
                _write(fd, key_hash, info, self._clock() + ttl)
                return info
            finally:
                fcntl.flock(fd, fcntl.LOCK_UN)
        finally:
            os.close(fd)


def _lock(fd: int, deadline: float) -> bool:
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            if time.monotonic() >= deadline:
                return False
            time.sleep(_POLL_SECONDS)


def _read(fd: int, key_hash: str, now: float) -> ImageInfo | None:
    data = os.pread(fd, _MAX_RECORD_BYTES, 0)
    try:
        record = json.loads(data) if data else None
        if not record or record["key"] != key_hash or record["expires"] <= now:
            return None
        return ImageInfo(record["image"], frozenset(normalize(*p) for p in record["platforms"]),
                         record["digest"], record["source"], record["note"])
    except (ValueError, KeyError, TypeError):
        return None  # half-written by a worker that died: fetch again


def _write(fd: int, key_hash: str, info: ImageInfo, expires: float) -> None:
    data = json.dumps({"key": key_hash, "expires": expires, "image": info.image,
                       "digest": info.digest, "source": info.source, "note": info.note,
                       "platforms": [[p.os, p.architecture, p.variant] for p in info.platforms]})
    os.ftruncate(fd, 0)
    os.pwrite(fd, data.encode(), 0)
