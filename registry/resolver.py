"""Resolve image references to ImageInfo: cached, single-flight, concurrent under one deadline.

A lookup runs on a lookup thread with its own time budget, independent of the caller's: when an
admission's deadline passes, the lookup carries on and fills the cache, so the next pod with the
same image is answered from memory instead of timing out again.

Once an image has been seen, admission never waits on its registry again: an answer past its TTL
is served at once while a background revalidation asks the registry (a HEAD for a tag: an
unchanged digest costs no manifest GET, and Docker Hub counts only GETs as pulls), and it keeps
being served while the registry is down, slow or rate-limiting, for up to
`cache.stale_if_error_seconds`. Only a pod whose image was never seen can be left without an
answer. Pods that pull with `imagePullPolicy: Always` revalidate first (within their deadline,
stale on failure), since the kubelet will pull whatever the tag names now.

Between this cache and the registry stand the cluster's records (records.py, when the edge
sets `records`): read on a miss or a stale answer; what a registry tells is offered to them.
"""
import dataclasses
import logging
import threading
import time
import typing
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import wait as wait_for
from dataclasses import dataclass
from urllib.parse import urlsplit

from archway.config import RegistrySettings, SifSettings
from archway.errors import (
    ArchwayError,
    DeadlineExceeded,
    Overloaded,
    RateLimited,
    classify_error,
)
from archway.logsafe import redact_url

from .access import RegistryAccess, image_name
from .backoff import Backoff
from .cache import EXPIRED, STALE, Answer, AnswerCache, Entry, Failure, answer_bytes
from .credentials import Keyring
from .http import HttpClient
from .imageref import ImageReference
from .lookuppool import LookupPool
from .mirrors import Mirrors
from .model import ImageInfo
from .nodecredentials import NodeCredentials
from .oci import RegistryClient
from .records import CLUSTER, ImageRecord, RecordStore
from .reference import KINDS, parse_reference
from .sharedlookups import SharedLookups

log = logging.getLogger(__name__)

# Errors that say something about the caller or about archway's load, not the image: never cached.
_NOT_CACHED = (DeadlineExceeded, Overloaded)
# A lookup that has run twice its own time budget is presumed stuck (a name lookup that hangs is
# bounded by no socket timeout): new callers start a fresh one instead of joining it.
_STUCK_AFTER_BUDGETS = 2


@dataclass(frozen=True)
class _Flight:
    future: Future            # -> Answer
    started: float
    token: object             # tells this flight from a later one for the same key


@dataclass(frozen=True)
class _Pending:
    """A lookup to wait for; `fallback` is served if it fails or is late (stale-if-error)."""
    future: Future
    fallback: ImageInfo | None = None


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
        cache = self.settings.cache
        # `clock` ages cache entries and back-offs (tests move it); deadlines are time.monotonic().
        self._clock = clock
        self._cache = AnswerCache(cache.max_entries, cache.max_bytes, clock)
        self._backoff = Backoff(clock)
        self._pool = LookupPool(max_workers, self.settings.max_lookups_per_host,
                                self.settings.max_queued_lookups)
        self._inflight: dict[tuple, _Flight] = {}
        self._lock = threading.Lock()
        # A lookup may outlive its caller's deadline; this bounds how long it keeps going.
        self.fetch_timeout = self.settings.timeout_seconds * 2
        self._shared = shared  # lookups shared with the server's other worker processes
        self._library_host = urlsplit(self.sif.library_url).netloc or "library.sylabs.io"
        self.http.policy.name_host(self._library_host)   # the operator's sif.library_url
        # Told (reference, old answer, new answer) when a revalidation finds a tag naming another
        # digest: archway.gate.remediation raises ArchitecturesDropped from it.
        self.tag_moved: Callable[[ImageReference, ImageInfo, ImageInfo], None] | None = None
        # The cluster's records (objects/imagerecords.py), read after this cache; None: none.
        self.records: RecordStore | None = None

    @property
    def cache_size(self) -> int:
        return len(self._cache)

    @property
    def cache_bytes(self) -> int:
        return self._cache.bytes

    @property
    def lookups_in_flight(self) -> int:
        return len(self._inflight)

    def hosts_backed_off(self) -> int:
        return self._backoff.backed_off()

    def resolve(self, image: str, *, keyring: Keyring | None = None,
                deadline: float | None = None, scope: str | None = None) -> ImageInfo:
        """Resolve one image; raise ArchwayError (DeadlineExceeded when `deadline` passes)."""
        timeout = None if deadline is None else deadline - time.monotonic()
        answer = self.resolve_many([image], keyring=keyring, timeout=timeout, scope=scope)[image]
        if isinstance(answer, ArchwayError):
            raise answer
        return answer

    def resolve_many(self, images, *, keyring: Keyring | None = None, timeout: float | None,
                     revalidate=frozenset(), limit: int | None = None, scope: str | None = None,
                     wait: bool = True, record: bool = True) -> dict[str, ImageInfo | ArchwayError]:
        """Resolve images concurrently under one overall timeout (None: wait). Never raises for
        one image: each failure is the ArchwayError in that image's slot. `revalidate`: images
        whose tag must be checked at the registry before their cached answer is used (pods that
        pull Always). `limit`: at most this many distinct images are looked up; the rest fail
        (Overloaded), so one pod cannot queue a thousand lookups. `scope`: the tenant (the
        namespace) `keyring`'s pull secrets belong to, for the records read with them; None:
        records read with a pod's credentials are neither read nor written. `wait` False: no
        waiting at all; an image whose answer is not in yet (a lookup or a revalidation under way,
        started now or before) is left out of the result. `record` False (a dry-run admission,
        which declares no side effects): the records are read, and the lookups it starts write
        none."""
        distinct = list(dict.fromkeys(images))
        answers: dict[str, object] = {}
        for n, image in enumerate(distinct):
            if limit is not None and n >= limit:
                answers[image] = Overloaded(
                    f"{redact_url(image)}: not looked up: the pod names {len(distinct)} distinct images and "
                    f"archway reads at most {limit}")
                continue
            try:
                answers[image] = self._start(image, keyring, image in revalidate, scope, record)
            except ArchwayError as e:
                answers[image] = e
        pending = [a.future for a in answers.values() if isinstance(a, _Pending)]
        if not wait:
            return {image: _settled(answer, image, 0.0) for image, answer in answers.items()
                    if not isinstance(answer, _Pending) or answer.future.done()}
        if pending:
            wait_for(pending, timeout=None if timeout is None else max(0.0, timeout))
        return {image: _settled(answer, image, timeout) for image, answer in answers.items()}

    # --- internals -------------------------------------------------------------------------
    def _start(self, image: str, keyring: Keyring | None, revalidate: bool, scope: str | None,
               record: bool = True):
        """The answer to hand out now (ImageInfo or ArchwayError), or a _Pending to wait for."""
        ref = parse_reference(image, self._library_host)
        keys = keyring or Keyring.empty()   # the pod's; the node's are added per host looked up
        key = self._key(ref, keys)
        entry = self._cache.get(key)
        scope = self._record_scope(ref, keys, scope)
        if scope is not None and (entry is None or entry.state(self._clock()) == STALE):
            entry = self._recorded(key, ref, scope, entry)
        written = scope if record else None     # the scope the lookups started here offer to
        if entry is not None:
            if isinstance(entry.answer, Failure):
                _count_lookup("fresh")
                return entry.answer.raised()
            info = _named(entry.answer, image)
            state = entry.state(self._clock())
            if state == STALE or revalidate:
                flight = self._revalidation(key, ref, keys, entry, written)
                if revalidate and flight is not None:
                    _count_lookup("revalidate")
                    return _Pending(flight, fallback=info)
            _count_lookup("stale" if state == STALE else "fresh")
            return info
        _count_lookup("miss")
        self._backoff.check(ref.host)
        return _Pending(self._fly(key, ref.host, lambda: self._miss(ref, keys, key, written, revalidate),
                                  miss=True))

    def _key(self, ref: ImageReference, keyring: Keyring) -> tuple:
        # A URL's own user:password is part of the key (str(ref) hides it): an answer read with
        # one password is not handed to a pod that names another, or none.
        return (ref.url or str(ref), _credential_fingerprint(keyring.then(self.node.file_keyring()), ref))

    def _fly(self, key: tuple, host: str, lookup, miss: bool = False) -> Future:
        """Single-flight: join the lookup already running for `key`, else start one."""
        with self._lock:
            flight = self._inflight.get(key)
            if flight is not None and time.monotonic() - flight.started < (
                    self.fetch_timeout * _STUCK_AFTER_BUDGETS):
                _count_lookup("shared")
                return flight.future
            if miss:
                # Another caller's lookup may have filled the cache since ours missed it.
                entry = self._cache.get(key)
                if entry is not None:
                    done: Future = Future()
                    done.set_result(entry.answer)
                    return done
            # Submitted under the lock: the lookup cannot end (and leave the table) before it
            # is in the table.
            token = object()
            future = self._pool.submit(host, lambda: self._finish(key, token, lookup))
            self._inflight[key] = _Flight(future, time.monotonic(), token)
            return future

    def _finish(self, key: tuple, token: object, lookup) -> Answer:
        try:
            return lookup()
        except ArchwayError as e:   # a lookup reports failures as values; this is a slip
            return Failure.of(e)
        except Exception as e:      # a bug must cost one image's answer, never the admission
            log.exception("unexpected error resolving %s", redact_url(key[0]))
            return Failure(ArchwayError(f"{redact_url(key[0])}: internal error ({type(e).__name__}); "
                                        f"see archway's log"))
        finally:
            with self._lock:
                flight = self._inflight.get(key)
                if flight is not None and flight.token is token:
                    del self._inflight[key]

    def _miss(self, ref: ImageReference, keyring: Keyring, key: tuple, scope: str | None,
              fresh: bool = False) -> Answer:
        """Look an image up that has no usable answer in the cache (`fresh`: at the registry,
        not from another worker's answer: a pod pulling Always)."""
        answer, keep = self._ask(key, ref, keyring, fresh=fresh)
        if keep > 0:
            self._remember(key, ref, answer, keep, scope, keyring)
        return answer

    # --- the cluster's records -----------------------------------------------------------------
    def _record_scope(self, ref: ImageReference, keyring: Keyring, scope: str | None) -> str | None:
        """Where this lookup's record lives: CLUSTER when the pod's own credentials play no
        part, the tenant's `scope` when they do; None: no record (no store, an image that is
        not a registry's, a URL that may carry a password, or credentials of no known tenant)."""
        kind = KINDS[ref.scheme]
        if self.records is None or kind.head_digest is None or ref.url:
            return None
        return (scope or None) if kind.pull_secrets and keyring.fingerprint_for(image_name(ref)) else CLUSTER

    def confirmed_at(self, image: str, keyring: Keyring | None = None,
                     scope: str | None = None) -> float | None:
        """When a registry last confirmed the cluster's record of `image` (wall clock); None:
        no record (the leader's tag watch checks only tags no process checked lately)."""
        ref = parse_reference(image, self._library_host)
        scope = self._record_scope(ref, keyring or Keyring.empty(), scope)
        record = self.records.find(scope, ref.url or str(ref)) if self.records and scope is not None else None
        return record.revalidated_at if record else None

    def _recorded(self, key: tuple, ref: ImageReference, scope: str, entry: Entry | None
                  ) -> Entry | None:
        """The record's answer when a registry confirmed it later than `entry`'s (then it is
        this cache's entry too); else `entry`."""
        record = self.records.find(scope, key[0]) if self.records else None
        if record is None:
            return entry
        keep = self._keep(ref, record.info)
        fresh_until = self._clock() + keep - max(0.0, time.time() - record.revalidated_at)
        if entry is not None and entry.fresh_until >= fresh_until:
            return entry
        recorded = Entry(record.info, fresh_until, fresh_until + self.settings.cache.stale_if_error_seconds,
                         answer_bytes(record.info), scope=scope)
        if recorded.state(self._clock()) == EXPIRED:
            return entry
        self._cache.put(key, recorded)
        return recorded

    def _offer(self, ref: ImageReference, scope: str | None, info: ImageInfo, error: str = "") -> None:
        if scope is None or self.records is None:
            return
        try:
            self.records.offer(ImageRecord(scope, str(ref), _named(info, str(ref)), time.time(),
                                           time.time(), error))
        except Exception:   # the store's bug must not cost the answer
            log.exception("offering the record of %s failed", ref)

    def record_changed(self, reference: str, digest: str | None) -> int:
        """A record says `reference` names `digest` now (None: it is gone): answers of another
        digest are dropped, the next lookup reads the record. How many were dropped."""
        def unwanted(key, answer) -> bool:
            return key[0] == reference and not (isinstance(answer, ImageInfo)
                                                and digest is not None and answer.digest == digest)
        return self._cache.drop_where(unwanted)

    def pushed(self, host: str, repository: str, tag: str) -> list[Future]:
        """A registry says it took a push of `repository:tag` (an event: a hint, never
        trusted): every cached answer of that tag is checked at its registry now (a HEAD; a GET
        only when the digest moved), with the credentials that read it. `host` "": the sender
        did not say; an answer of another host is checked only when none of `host` is cached
        (a pusher may name the registry otherwise than the pods do). A tag no pod asked for
        costs nothing. The checks started or joined, to wait for."""
        def wanted(key) -> bool:
            return isinstance(key[0], str) and key[0].endswith(f"/{repository}:{tag}")
        found = []
        for hashed, entry in self._cache.matching(wanted):
            key = typing.cast(tuple, hashed)
            try:
                ref = parse_reference(key[0], self._library_host)
            except ArchwayError:
                continue
            if (isinstance(entry.answer, ImageInfo) and not ref.digest and ref.tag == tag
                    and ref.repository == repository and KINDS[ref.scheme].head_digest):
                found.append((key, ref, entry))
        named = [f for f in found if host and host.lower() in (f[1].host, f[1].api_host)]
        flights = []
        for key, ref, entry in named or found:
            keyring = entry.keyring if isinstance(entry.keyring, Keyring) else Keyring.empty()
            flight = self._revalidation(key, ref, keyring, entry, entry.scope)
            if flight is not None:
                flights.append(flight)
        return flights

    def _revalidation(self, key: tuple, ref: ImageReference, keyring: Keyring,
                      entry: Entry, scope: str | None = None) -> Future | None:
        """Start (or join) a check of a cached answer at its registry; None while the last
        check failed recently or the host is backed off: the cached answer stands."""
        if self._clock() < entry.checks_paused_until:
            return None
        try:
            self._backoff.check(ref.host)
            return self._fly(key, ref.host,
                             lambda: self._revalidate(key, ref, keyring, entry, scope))
        except (RateLimited, Overloaded):   # the cached answer stands; a later pod checks again
            return None

    def _revalidate(self, key: tuple, ref: ImageReference, keyring: Keyring, entry: Entry,
                    scope: str | None = None) -> Answer:
        old = entry.answer
        assert isinstance(old, ImageInfo)
        answer, keep = self._ask(key, ref, keyring, known=old)
        if isinstance(answer, Failure):
            # Stale-if-error: the last good answer stands; the next check waits a little.
            _count_revalidation(classify_error(answer.error).label)
            retry = self.settings.cache.negative_ttl_seconds
            if isinstance(answer.error, RateLimited):
                retry = max(retry, answer.error.retry_after or 0)
            self._cache.put(key, dataclasses.replace(entry, checks_paused_until=self._clock() + retry))
            log.info("revalidating %s failed (%s); serving the answer cached before",
                     ref, classify_error(answer.error).words)
            self._offer(ref, scope, old, classify_error(answer.error).words)
            return answer
        _count_revalidation("unchanged" if answer.digest == old.digest else "changed")
        self._remember(key, ref, answer, keep, scope, keyring)
        if answer.digest != old.digest and self.tag_moved is not None:
            try:
                self.tag_moved(ref, old, answer)
            except Exception:   # an observer's bug must not cost the answer
                log.exception("tag_moved observer failed for %s", ref)
        return answer

    def _ask(self, key: tuple, ref: ImageReference, keyring: Keyring,
             known: ImageInfo | None = None, fresh: bool = False) -> tuple[Answer, float]:
        """The registry's answer and how long to keep it, asked once for all workers when they
        share lookups; waiting for another worker's lookup and asking share one fetch budget."""
        deadline = time.monotonic() + self.fetch_timeout

        def fetch() -> tuple[Answer, float]:
            answer = self._fetch(ref, keyring, deadline, known)
            return answer, self._keep(ref, answer)

        if self._shared is None:
            return fetch()
        # A revalidation must reach the registry: the answer another worker wrote is the one
        # being checked (a pod pulling Always on another worker would get the old digest).
        return self._shared.run(key, fetch, deadline,
                                newer_than=time.time() if known is not None or fresh else None)

    def _fetch(self, ref: ImageReference, keyring: Keyring, deadline: float,
               known: ImageInfo | None = None) -> Answer:
        """Ask the registry by `deadline`, honouring and recording its rate limits. With
        `known`, a tag's digest is checked first (HEAD) and the known answer reused when it has
        not moved."""
        try:
            self._backoff.check(ref.host)
            info = None
            if known is not None and known.digest and not ref.digest and KINDS[ref.scheme].head_digest:
                info = self._unmoved(ref, keyring, known, deadline)
            if info is None:
                info = self._lookup(ref, keyring, deadline)
            self._backoff.succeeded(ref.host)
            return info
        except RateLimited as e:
            pause = self._backoff.rate_limited(ref.host, e.retry_after)
            _recorder().backoff_until(ref.host, time.time() + pause)
            log.warning("%s answered HTTP 429 (rate limit): no request to it for %.0f s; cached "
                        "answers are served meanwhile", ref.host, pause)
            return Failure.of(e)
        except ArchwayError as e:
            return Failure.of(e)

    def _unmoved(self, ref: ImageReference, keyring: Keyring, known: ImageInfo,
                 deadline: float) -> ImageInfo | None:
        """The answer for the digest a tag names now, when archway already has it; None when
        the manifest must be fetched (the tag moved to unknown content, or no digest on HEAD)."""
        head_digest = KINDS[ref.scheme].head_digest
        digest = head_digest(self, ref, keyring, deadline) if head_digest else None
        if digest == known.digest:
            return known
        if digest is not None:
            by_digest = self._cache.get(self._key(dataclasses.replace(ref, tag=None, digest=digest),
                                                  keyring))
            if by_digest is not None and isinstance(by_digest.answer, ImageInfo):
                return by_digest.answer
        return None

    def _lookup(self, ref: ImageReference, keyring: Keyring, deadline: float) -> ImageInfo:
        return KINDS[ref.scheme].resolve(self, ref, keyring, deadline)

    def _keep(self, ref: ImageReference, answer: Answer) -> float:
        """Seconds an answer counts as fresh (0: not cached)."""
        cache = self.settings.cache
        if isinstance(answer, Failure):
            return 0.0 if isinstance(answer.error, _NOT_CACHED) else cache.negative_ttl_seconds
        return cache.digest_ttl_seconds if ref.digest else cache.tag_ttl_seconds

    def _remember(self, key: tuple, ref: ImageReference, answer: Answer, keep: float,
                  scope: str | None = None, keyring: Keyring | None = None) -> None:
        entry = self._entry(answer, keep)
        if not ref.digest and KINDS[ref.scheme].head_digest:   # a tag: who read it (pushed)
            entry = dataclasses.replace(entry, keyring=keyring, scope=scope)
        self._cache.put(key, entry)
        if isinstance(answer, ImageInfo):
            self._offer(ref, scope, answer)
        if isinstance(answer, ImageInfo) and answer.digest and not ref.digest and KINDS[ref.scheme].head_digest:
            # The same content asked for by digest later is a hit, for the long TTL.
            self._cache.put((str(dataclasses.replace(ref, tag=None, digest=answer.digest)), key[1]),
                            self._entry(answer, self.settings.cache.digest_ttl_seconds))
        _recorder().CACHE_BYTES.set(self._cache.bytes)

    def _entry(self, answer: Answer, keep: float) -> Entry:
        now = self._clock()
        fresh_until = now + keep
        # Failures are not served past their TTL; good answers for up to stale_if_error longer.
        stale = 0.0 if isinstance(answer, Failure) else self.settings.cache.stale_if_error_seconds
        return Entry(answer, fresh_until, fresh_until + stale, answer_bytes(answer))


def _credential_fingerprint(keyring: Keyring, ref: ImageReference) -> str:
    """Results are cached per credential: a pod without access must not be answered from a
    lookup made with someone else's secret, and a failure without credentials must not be
    served to a pod that has them."""
    return keyring.fingerprint_for(image_name(ref)) if KINDS[ref.scheme].pull_secrets else ""


def _named(info: ImageInfo, image: str) -> ImageInfo:
    """An answer under the name the caller asked for (answers are shared between spellings)."""
    return info if info.image == image else dataclasses.replace(info, image=image)


def _settled(answer, image: str, timeout: float | None) -> ImageInfo | ArchwayError:
    if not isinstance(answer, _Pending):
        return answer
    if not answer.future.done():
        if answer.fallback is not None:
            return answer.fallback
        return DeadlineExceeded(
            f"{redact_url(image)}: no answer within {timeout:g} s (the registry is slow or unreachable)")
    result = answer.future.result()
    if isinstance(result, Failure):
        return answer.fallback if answer.fallback is not None else result.raised()
    return _named(result, image)


def _recorder():
    # Imported on first use: only the serving processes record metrics (see archway.metrics).
    from archway import metrics
    return metrics


def _count_lookup(result: str) -> None:
    _recorder().CACHE_LOOKUPS.labels(result).inc()


def _count_revalidation(outcome: str) -> None:
    _recorder().CACHE_REVALIDATIONS.labels(outcome).inc()
