"""The resolver's memory: answers with their age, bounded in entries and in bytes.

An answer is *fresh* until its TTL passes; after that a good answer is *stale*: still served at
once while a background revalidation asks the registry (stale-while-revalidate), and still
served when that revalidation fails (stale-if-error), until `stale_if_error_seconds` past its
TTL. A failure is never served stale: once its short TTL passes the image is looked up again.
Pure data and arithmetic on an injected clock; no I/O.
"""
import copy
import threading
import time
from collections import OrderedDict
from collections.abc import Hashable
from dataclasses import dataclass

from archway.errors import ArchwayError

from .model import ImageInfo

FRESH, STALE, EXPIRED = "fresh", "stale", "expired"


@dataclass(frozen=True, slots=True)
class Failure:
    """A failed lookup kept as a value. The stored error is never raised itself: every caller
    gets its own copy, so no traceback grows on it across re-raises and no two threads share one
    exception object."""
    error: ArchwayError

    @classmethod
    def of(cls, error: ArchwayError) -> "Failure":
        kept = copy.copy(error)   # copy.copy drops __traceback__, __cause__ and __context__
        return cls(kept)

    def raised(self) -> ArchwayError:
        return copy.copy(self.error)


Answer = ImageInfo | Failure


@dataclass(frozen=True, slots=True)
class Entry:
    answer: Answer
    fresh_until: float           # clock time the TTL ends
    usable_until: float          # clock time past which the answer is not served at all
    size: int                    # approximate bytes held
    checks_paused_until: float = 0.0  # after a failed revalidation: no new one before this
    # Who read it: the credentials and record scope a check the registry asks for (a push
    # event, Resolver.pushed) is made with, as the pod's own lookup would be.
    keyring: object = None
    scope: str | None = None

    def state(self, now: float) -> str:
        if now < self.fresh_until:
            return FRESH
        return STALE if now < self.usable_until else EXPIRED


def answer_bytes(answer: Answer) -> int:
    """What an answer keeps alive, for a cache bounded in bytes."""
    if isinstance(answer, Failure):
        return 256 + len(str(answer.error))
    return answer.approx_bytes()


class AnswerCache:
    """A least-recently-used map of Entry, bounded by count and by approximate bytes."""

    def __init__(self, max_entries: int, max_bytes: int, clock):
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self._clock = clock
        self._data: OrderedDict[Hashable, Entry] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def get(self, key: Hashable) -> Entry | None:
        """The entry while it may be served, else None (an expired one is dropped)."""
        with self._lock:
            entry = self._data.get(key)
            if entry is None:
                return None
            if entry.state(self._clock()) == EXPIRED:
                self._drop(key)
                return None
            self._data.move_to_end(key)
            return entry

    def put(self, key: Hashable, entry: Entry) -> None:
        with self._lock:
            if key in self._data:
                self._drop(key)
            self._data[key] = entry
            self._bytes += entry.size
            while self._data and (len(self._data) > self.max_entries or self._bytes > self.max_bytes):
                self._drop(next(iter(self._data)))

    def drop_where(self, unwanted) -> int:
        """Drop every entry whose (key, answer) `unwanted` says so (a record told of a tag's new
        digest: the answers of the old one go); how many were dropped. One pass over the map:
        rare, and bounded by max_entries."""
        with self._lock:
            gone = [key for key, entry in self._data.items() if unwanted(key, entry.answer)]
            for key in gone:
                self._drop(key)
            return len(gone)

    def matching(self, wanted) -> list[tuple[Hashable, Entry]]:
        """The (key, entry) pairs `wanted(key)` picks, in one pass (see drop_where)."""
        with self._lock:
            return [(key, entry) for key, entry in self._data.items() if wanted(key)]

    def _drop(self, key: Hashable) -> None:
        self._bytes -= self._data.pop(key).size

    @property
    def bytes(self) -> int:
        return self._bytes

    def __len__(self) -> int:
        return len(self._data)


class TTLCache:
    """A bounded LRU map whose entries also expire: for values with no stale life (pull secrets
    read from the API, Events recently sent)."""

    def __init__(self, max_entries: int, clock=time.monotonic):
        self.max_entries = max_entries
        self._clock = clock
        self._data: OrderedDict = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key):
        with self._lock:
            entry = self._data.get(key)
            if entry is None:
                return None
            expires, value = entry
            if expires <= self._clock():
                del self._data[key]
                return None
            self._data.move_to_end(key)
            return value

    def put(self, key, value, ttl: float) -> None:
        with self._lock:
            self._data[key] = (self._clock() + ttl, value)
            self._data.move_to_end(key)
            while len(self._data) > self.max_entries:
                self._data.popitem(last=False)

    def __len__(self):
        return len(self._data)
