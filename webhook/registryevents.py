"""POST /registry-events on registry.events.listen: a registry's push notifications, so a
re-pushed tag is answered by its new digest within a second, not after registry.cache.tag_ttl_seconds.

    bearer token (registry.events.token_file) -> a rate limit per sending address -> the
    envelope read (registry/pushevents.py) -> each pushed tag queued, coalesced -> one thread
    asks the resolver to check the tag at its registry (Resolver.pushed: a HEAD, a GET only
    when the digest moved) -> the new answer in this worker's cache and in the image records,
    which every replica and the gate controller watch

An event is a hint, never an answer: what it says of digests and platforms is not believed, and
a tag no pod asked this worker about costs no registry request. Delivery is best effort
everywhere (registries keep undelivered events in memory), so the tag TTL's revalidation stays
the fallback. The token is compared in constant time and never logged.
"""
import hmac
import json
import logging
import threading
import time
from collections import OrderedDict
from concurrent.futures import wait as wait_for

from archway import metrics
from archway.registry.filewatch import WatchedFile
from archway.registry.pushevents import MalformedEvents, Push, parse, read_token
from archway.server.routes import Reply, Request, Route, error_reply

log = logging.getLogger("archway.registryevents")

PATH = "/registry-events"
LIMIT_NAME = "registry.events.max_body_bytes"
EVENTS_ONLY = f"this address (registry.events.listen) serves only POST {PATH}"
# A burst's events are one check: it starts once no event came for SETTLE_SECONDS, or
# MAX_SETTLE_SECONDS after the first (a steady stream waits no longer).
SETTLE_SECONDS = 0.05
MAX_SETTLE_SECONDS = 0.25
MAX_PENDING = 10_000      # distinct tags waiting; past it new ones wait for the next TTL
MAX_SOURCES = 4096        # addresses the rate limit remembers


class SourceLimit:
    """At most `per_second` requests a second from one address, in bursts of twice that (a
    token bucket each; the oldest address forgotten past MAX_SOURCES)."""

    def __init__(self, per_second: float, clock=time.monotonic):
        self.per_second, self.burst = per_second, max(1.0, 2 * per_second)
        self._clock = clock
        self._buckets: OrderedDict[str, tuple[float, float]] = OrderedDict()
        self._lock = threading.Lock()

    def admit(self, source: str) -> float:
        """0 when `source` may send now, else seconds until it may."""
        now = self._clock()
        with self._lock:
            tokens, then = self._buckets.pop(source, (self.burst, now))
            tokens = min(self.burst, tokens + (now - then) * self.per_second)
            wait = 0.0 if tokens >= 1 else (1 - tokens) / self.per_second
            self._buckets[source] = (tokens - 1 if wait == 0 else tokens, now)
            while len(self._buckets) > MAX_SOURCES:
                self._buckets.popitem(last=False)
            return wait


class PushQueue:
    """Pushed tags waiting to be checked, once per burst however many events name them; a tag
    named again while its check runs is checked once more after it (its push may have come
    after the HEAD)."""

    def __init__(self, resolver):
        self.resolver = resolver
        self._pending: dict[Push, None] = {}
        self._last = 0.0                      # when the last event came (monotonic)
        self._wake = threading.Condition()
        self._thread: threading.Thread | None = None

    def add(self, pushes) -> int:
        """Queue `pushes`; how many were not waiting already."""
        with self._wake:
            before = len(self._pending)
            for push in pushes:
                if len(self._pending) >= MAX_PENDING:
                    break
                self._pending.setdefault(push)
            added = len(self._pending) - before
            self._last = time.monotonic()
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="registry-events",
                                                daemon=True)
                self._thread.start()
            self._wake.notify()
        return added

    def _run(self) -> None:
        while True:
            with self._wake:
                while not self._pending:
                    self._wake.wait()
                first = time.monotonic()
                while (quiet := self._last + SETTLE_SECONDS - time.monotonic()) > 0 and \
                        time.monotonic() < first + MAX_SETTLE_SECONDS:
                    self._wake.wait(min(quiet, first + MAX_SETTLE_SECONDS - time.monotonic()))
                batch, self._pending = list(self._pending), {}
            flights = []
            for push in batch:
                try:
                    flights += self.resolver.pushed(push.host, push.repository, push.tag)
                except Exception:   # one tag's bug must not end the queue
                    log.exception("checking pushed tag %r:%r failed", push.repository, push.tag)
            if flights:   # what arrives meanwhile is the next batch
                wait_for(flights, timeout=self.resolver.fetch_timeout)


class RegistryEvents:
    """The route's handler over one worker's resolver."""

    def __init__(self, settings, resolver, clock=time.monotonic):
        self.token = WatchedFile(settings.token_file, read_token, what="registry.events.token_file")
        self.token.get()    # a missing or empty token fails at start, not at the first event
        self.limit = SourceLimit(settings.per_source_per_second, clock)
        self.queue = PushQueue(resolver)

    def route(self, max_body: int) -> Route:
        return Route("POST", PATH, self.handle, max_body=max_body, limit_name=LIMIT_NAME)

    def handle(self, request: Request) -> Reply:
        given = request.headers.get("authorization", "")
        scheme, _, token = given.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(
                token.strip().encode(), self.token.get().encode()):
            return self._refused("unauthorized", error_reply(
                401, "a registry event needs the bearer token of registry.events.token_file",
                (("WWW-Authenticate", 'Bearer realm="archway registry events"'),)))
        wait = self.limit.admit(request.peer)
        if wait:
            return self._refused("rate_limited", error_reply(
                429, f"more than {self.limit.per_second:g} requests a second from {request.peer} "
                     f"(registry.events.per_source_per_second)",
                (("Retry-After", str(max(1, round(wait)))),)))
        try:
            parsed = parse(request.body, request.headers)
        except MalformedEvents as e:
            return self._refused("malformed", error_reply(400, f"malformed registry event: {e}"))
        queued = self.queue.add(parsed.pushes)
        if parsed.pushes:
            metrics.REGISTRY_EVENTS.labels(parsed.source, "queued").inc(queued)
            metrics.REGISTRY_EVENTS.labels(parsed.source, "coalesced").inc(len(parsed.pushes) - queued)
        if parsed.ignored:
            metrics.REGISTRY_EVENTS.labels(parsed.source, "ignored").inc(parsed.ignored)
        return Reply(202, json.dumps({"pushes": len(parsed.pushes),
                                      "ignored": parsed.ignored}).encode())

    @staticmethod
    def _refused(outcome: str, reply: Reply) -> Reply:
        metrics.REGISTRY_EVENTS.labels("unknown", outcome).inc()
        return reply
