"""Per-host back-off after a registry says "too many requests" (HTTP 429).

A host that answered 429 gets no request until its Retry-After has passed (as read, and capped,
by registry.http.parse_retry_after), else for an exponentially growing pause (1 s, 2 s, 4 s ...
`MAX_PAUSE_SECONDS`); the next success clears it. Meanwhile the resolver answers from its cache
and fails new images at once with the rate limit named. Pure arithmetic on an injected clock.
"""
import threading
from dataclasses import dataclass

from archway.errors import RateLimited

FIRST_PAUSE_SECONDS = 1.0
MAX_PAUSE_SECONDS = 300.0


@dataclass(frozen=True)
class _State:
    until: float
    strikes: int


class Backoff:
    def __init__(self, clock):
        self._clock = clock
        self._hosts: dict[str, _State] = {}
        self._lock = threading.Lock()

    def check(self, host: str) -> None:
        """Raise RateLimited while `host` is backed off."""
        with self._lock:
            state = self._hosts.get(host)
        if state is None:
            return
        remaining = state.until - self._clock()
        if remaining > 0:
            raise RateLimited(f"{host} rate-limited archway (HTTP 429); no request to it for "
                              f"another {remaining:.0f} s", host=host, status=429,
                              retry_after=remaining)

    def rate_limited(self, host: str, retry_after: float | None) -> float:
        """Record a 429 from `host`; returns the pause chosen, in seconds."""
        with self._lock:
            strikes = self._hosts[host].strikes + 1 if host in self._hosts else 1
            if retry_after is not None and retry_after >= 0:
                pause = retry_after
            else:
                pause = min(FIRST_PAUSE_SECONDS * 2 ** (strikes - 1), MAX_PAUSE_SECONDS)
            self._hosts[host] = _State(self._clock() + pause, strikes)
            return pause

    def succeeded(self, host: str) -> None:
        if host in self._hosts:
            with self._lock:
                self._hosts.pop(host, None)

    def backed_off(self) -> int:
        """How many hosts are paused now."""
        now = self._clock()
        with self._lock:
            return sum(1 for state in self._hosts.values() if state.until > now)
