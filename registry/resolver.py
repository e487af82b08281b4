"""Resolve image references to ImageInfo: cached, single-flight, concurrent under one deadline.

A lookup runs in a worker thread with its own time budget, independent of the caller's: when an
admission's deadline passes, the lookup carries on and fills the cache, so the next pod with the
same image is answered from memory instead of timing out again.
"""
import dataclasses
import logging
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from urllib.parse import urlsplit

from . import sifsources
from .access import RegistryAccess, image_name
from .credentials import Keyring
from archway.errors import ArchwayError, DeadlineExceeded, InvalidReference
from .http import HttpClient
from .mirrors import Mirrors
from .model import ImageInfo
from .nodecredentials import NodeCredentials
from .oci import RegistryClient
from .reference import ImageReference, parse_reference
from archway.config import RegistrySettings, SifSettings
from .sharedlookups import SharedLookups

log = logging.getLogger(__name__)

# Errors that say something about the caller's budget, not the image: never cached.
_NOT_CACHED = (DeadlineExceeded,)


@dataclass
class ResolverStats:
    cache_hits: int = 0
    cache_misses: int = 0
    fetches: int = 0        # lookups that went to the network
    shared: int = 0         # callers that joined a lookup already in flight
    failures: int = 0


class TTLCache:
    """A bounded LRU map whose entries also expire."""

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


class Resolver:
    def __init__(self, settings: RegistrySettings | None = None, *, keyring: Keyring | None = None,
                 http: HttpClient | None = None, max_workers: int = 32, clock=time.monotonic,
                 shared: SharedLookups | None = None, sif: SifSettings | None = None):
        self.settings = settings or RegistrySettings()
        self.sif = sif or SifSettings()
        self.http = http or HttpClient(self.settings)
        self.oci = RegistryClient(self.http, self.settings)
        # Node-level credentials: `keyring` stands in for registry.credentials_file.
        self.node = NodeCredentials(self.settings, keyring=keyring)
        self.access = RegistryAccess(self.oci, self.node, Mirrors(self.settings.hosts_dir)
                                     if self.settings.hosts_dir else None)
        self.stats = ResolverStats()
        # `clock` ages cache entries (tests move it); deadlines are always time.monotonic().
        self._cache = TTLCache(self.settings.cache.max_entries, clock)
        self._inflight: dict[tuple, Future] = {}
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="resolve")
        # A lookup may outlive its caller's deadline; this bounds how long it keeps going.
        self.fetch_timeout = self.settings.timeout_seconds * 2
        self._shared = shared  # lookups shared with the server's other worker processes
        self._library_host = urlsplit(self.sif.library_url).netloc or "library.sylabs.io"

    @property
    def cache_size(self) -> int:
        return len(self._cache)

    def resolve(self, image: str, *, keyring: Keyring | None = None,
                deadline: float | None = None) -> ImageInfo:
        """Resolve one image; raise ArchwayError (DeadlineExceeded when `deadline` passes)."""
        answer = self._start(image, keyring)
        if isinstance(answer, Future):
            timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not wait([answer], timeout=timeout).done:
                raise DeadlineExceeded(f"{image}: no answer before the deadline")
            answer = answer.exception() or answer.result()
        if isinstance(answer, ArchwayError):
            raise answer
        return answer

    def resolve_many(self, images, *, keyring: Keyring | None = None,
                     timeout: float) -> dict[str, ImageInfo | ArchwayError]:
        """Resolve images concurrently under one overall timeout. Never raises for one image:
        each failure is the ArchwayError in that image's slot."""
        answers = {}
        for image in dict.fromkeys(images):
            try:
                answers[image] = self._start(image, keyring)
            except ArchwayError as e:
                answers[image] = e
        pending = [a for a in answers.values() if isinstance(a, Future)]
        if pending:
            wait(pending, timeout=max(0.0, timeout))
        return {image: _settled(answer, image, timeout) for image, answer in answers.items()}

    # --- internals -------------------------------------------------------------------------
    def _start(self, image: str, keyring: Keyring | None):
        """The cached answer (ImageInfo or ArchwayError), else a Future of the lookup."""
        ref = parse_reference(image, self._library_host)
        keys = keyring or Keyring.empty()   # the pod's; the node's are added per host looked up
        key = (str(ref), _credential_fingerprint(keys.then(self.node.file_keyring()), ref))
        cached = self._cache.get(key)
        if cached is not None:
            self._count("cache_hits")
            if isinstance(cached, ImageInfo) and cached.image != image:
                return dataclasses.replace(cached, image=image)
            return cached
        with self._lock:
            future = self._inflight.get(key)
            if future is not None:
                self.stats.shared += 1
                return _relabel(future, image)
            self.stats.cache_misses += 1
            future = self._pool.submit(self._fetch, image, ref, keys, key)
            self._inflight[key] = future
        return future

    def _fetch(self, image: str, ref: ImageReference, keyring: Keyring, key: tuple) -> ImageInfo:
        self._count("fetches")
        deadline = time.monotonic() + self.fetch_timeout
        try:
            if self._shared is not None:
                info = self._shared.run(key, lambda: self._lookup(ref, keyring, deadline),
                                        self._ttl(ref), deadline)
            else:
                info = self._lookup(ref, keyring, deadline)
            info = dataclasses.replace(info, image=image)
            self._remember(key, ref, info)
            return info
        except ArchwayError as e:
            self._count("failures")
            if not isinstance(e, _NOT_CACHED):
                self._cache.put(key, e, self.settings.cache.negative_ttl_seconds)
            raise
        except Exception as e:  # a bug must cost one image's answer, never the admission
            self._count("failures")
            log.exception("unexpected error resolving %s", image)
            raise ArchwayError(f"{image}: internal error ({type(e).__name__}); see archway's log") from e
        finally:
            with self._lock:
                self._inflight.pop(key, None)

    def _count(self, name: str) -> None:
        with self._lock:
            setattr(self.stats, name, getattr(self.stats, name) + 1)

    def _lookup(self, ref: ImageReference, keyring: Keyring, deadline: float) -> ImageInfo:
        if ref.scheme in ("docker", "oras"):
            return self.access.resolve(ref, keyring, deadline)
        if ref.scheme in ("https", "http"):
            return sifsources.resolve_https(ref, self.http, deadline)
        if ref.scheme == "library":
            return sifsources.resolve_library(ref, self.http, self.sif, deadline)
        raise InvalidReference(f"{ref}: unsupported scheme {ref.scheme}")

    def _ttl(self, ref: ImageReference) -> float:
        return self.settings.cache.digest_ttl_seconds if ref.digest else self.settings.cache.tag_ttl_seconds

    def _remember(self, key: tuple, ref: ImageReference, info: ImageInfo) -> None:
        self._cache.put(key, info, self._ttl(ref))
        if info.digest and not ref.digest and ref.scheme in ("docker", "oras"):
            # The same content asked for by digest later is a hit, for the long TTL.
            by_digest = dataclasses.replace(ref, tag=None, digest=info.digest)
            self._cache.put((str(by_digest), key[1]), info, self.settings.cache.digest_ttl_seconds)


def _credential_fingerprint(keyring: Keyring, ref: ImageReference) -> str:
    """Results are cached per credential: a pod without access must not be answered from a
    lookup made with someone else's secret, and a failure without credentials must not be
    served to a pod that has them."""
    return keyring.fingerprint_for(image_name(ref)) if ref.scheme in ("docker", "oras") else ""


def _settled(answer, image: str, timeout: float) -> ImageInfo | ArchwayError:
    if not isinstance(answer, Future):
        return answer
    if not answer.done():
        return DeadlineExceeded(
            f"{image}: no answer within {timeout:g} s (the registry is slow or unreachable)")
    return answer.exception() or answer.result()


def _relabel(shared: Future, image: str) -> Future:
    """A caller that joins another's lookup gets the answer under the name it asked for."""
    mine = Future()

    def copy(source: Future):
        error = source.exception()
        if error is not None:
            mine.set_exception(error)
        else:
            info = source.result()
            mine.set_result(info if info.image == image else dataclasses.replace(info, image=image))

    shared.add_done_callback(copy)
    return mine
