"""Image lookups shared by the worker processes of one server.

Each gunicorn worker has its own cache and in-flight table, so without this a burst of pods with
one new image costs the registry one manifest fetch per worker. The first worker to look an
image up holds a lock on that image's key and writes the answer down; a worker asking meanwhile
waits on the same key's lock (never past its own deadline) and reads the answer instead of
fetching. Failures are shared the same way, as values.

The lock is a POSIX record lock on one byte of a sparse lock file, at an offset taken from 60
bits of the key's hash: one lock per image key, so an unrelated image never waits on another's
fetch. Record locks belong to the process, so each process keeps one descriptor open for good
(closing any descriptor of the file would drop the process's locks); threads of one process never
contend for one key, since the resolver's in-flight table already joins them. Answers are written
whole with a rename into a fixed number of record files: a key sharing a record file with another
only costs a refetch. Records hold what ImageInfo shows and a hash of the key: no credentials.
"""
import fcntl
import hashlib
import json
import os
import threading
import time
from collections.abc import Callable

from archway.errors import ArchwayError

from .cache import Answer, Failure
from .model import ImageInfo
from .platforms import normalize

RECORD_FILES = 1024
_POLL_SECONDS = 0.005
_MAX_RECORD_BYTES = 256 * 1024
_LOCK_OFFSET_BITS = 60


class SharedLookups:
    def __init__(self, directory: str, clock=time.time):
        self.directory = directory
        self._clock = clock  # wall clock: the one clock every process agrees on
        self._lock_fd: int | None = None
        self._lock_pid = 0
        self._open_lock = threading.Lock()

    def run(self, key: tuple, fetch: Callable[[], tuple[Answer, float]],
            deadline: float, newer_than: float | None = None) -> tuple[Answer, float]:
        """fetch() -> (answer, seconds to keep it); or the answer another worker wrote for `key`
        and the seconds it has left. An answer kept for 0 s is not shared. `newer_than` (wall
        clock): a revalidation takes only an answer written since it began (another worker's
        check it waited for), never the one it is checking."""
        key_hash = hashlib.sha256(repr(key).encode()).hexdigest()
        offset = int(key_hash[:_LOCK_OFFSET_BITS // 4], 16)
        fd = self._lock_file()
        if not _lock(fd, offset, deadline):
            return fetch()  # the other worker is slow: don't wait past our own deadline
        try:
            path = os.path.join(self.directory, f"record-{offset % RECORD_FILES:04d}")
            shared = _read(path, key_hash, self._clock(), newer_than)
            if shared is not None:
                return shared
            answer, keep = fetch()
            if keep > 0:
                _write(path, key_hash, answer, self._clock() + keep, self._clock())
            return answer, keep
        finally:
            fcntl.lockf(fd, fcntl.LOCK_UN, 1, offset)

    def _lock_file(self) -> int:
        with self._open_lock:
            if self._lock_fd is None or self._lock_pid != os.getpid():   # a forked worker
                self._lock_fd = os.open(os.path.join(self.directory, "locks"),
                                        os.O_RDWR | os.O_CREAT, 0o600)
                self._lock_pid = os.getpid()
            return self._lock_fd


def _lock(fd: int, offset: int, deadline: float) -> bool:
    while True:
        try:
            fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB, 1, offset)
            return True
        except OSError:   # EAGAIN / EACCES: another process holds this key
            if time.monotonic() >= deadline:
                return False
            time.sleep(_POLL_SECONDS)


def _read(path: str, key_hash: str, now: float,
          newer_than: float | None = None) -> tuple[Answer, float] | None:
    try:
        with open(path, "rb") as f:
            record = json.loads(f.read(_MAX_RECORD_BYTES))
        if record["key"] != key_hash or record["expires"] <= now:
            return None
        if newer_than is not None and record.get("written", 0.0) < newer_than:
            return None
        if "error" in record:
            return Failure(_error_from(record["error"])), record["expires"] - now
        image = record["image"]
        info = ImageInfo(image["image"], frozenset(normalize(*p) for p in image["platforms"]),
                         image["digest"], image["source"], image["note"])
        return info, record["expires"] - now
    except FileNotFoundError:
        return None
    except (ValueError, KeyError, TypeError):
        return None  # written by another version, or damaged: fetch again


def _write(path: str, key_hash: str, answer: Answer, expires: float, written: float) -> None:
    record: dict = {"key": key_hash, "expires": expires, "written": written}
    if isinstance(answer, Failure):
        record["error"] = _error_record(answer.error)
    else:
        record["image"] = {"image": answer.image, "digest": answer.digest, "source": answer.source,
                           "note": answer.note,
                           "platforms": [[p.os, p.architecture, p.variant] for p in answer.platforms]}
    data = json.dumps(record).encode()
    if len(data) > _MAX_RECORD_BYTES:
        return
    temporary = f"{path}.{os.getpid()}.{threading.get_ident()}"
    with open(temporary, "wb") as f:
        f.write(data)
    os.replace(temporary, path)   # readers see the old record or the new one, never half


# --- failures as values across processes ---------------------------------------------------

def _error_record(error: ArchwayError) -> dict:
    fields = {name: value for name, value in vars(error).items()
              if isinstance(value, (str, int, float)) or value is None}
    return {"type": type(error).__name__, "message": str(error), "fields": fields}


def _error_from(record: dict) -> ArchwayError:
    cls = _error_classes().get(record["type"], ArchwayError)
    error = cls.__new__(cls)
    Exception.__init__(error, str(record["message"]))
    for name, value in dict(record["fields"]).items():
        setattr(error, name, value)
    return error


def _error_classes() -> dict[str, type[ArchwayError]]:
    found: dict[str, type[ArchwayError]] = {}
    pending: list[type[ArchwayError]] = [ArchwayError]
    while pending:
        cls = pending.pop()
        found[cls.__name__] = cls
        pending.extend(cls.__subclasses__())
    return found
