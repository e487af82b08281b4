"""When an answer is due: counted from the request's arrival, bounded by the caller's timeout.

A request can wait before a handler thread takes it (the worker's queue, behind requests held by
slow lookups), and the apiserver's clock runs from the moment it sent the request: it gives up at
the webhook's `timeoutSeconds` and, with failurePolicy Ignore, admits the pod as if archway had
never been asked (it "fails open"). So the deadline counts from when the request began arriving
(the server's loop hands that time.monotonic() over as Request.arrived), and it never goes past
the timeout the apiserver sends with each call (`?timeout=5s`, a Go duration) minus a margin. A
request that waited gets the time it has left; one with none left is answered at once.

Pure: the callers read the clock and the request.
"""
import functools
import re
from urllib.parse import unquote

# Kept back from the caller's timeout: its clock started before ours (connecting, the TLS
# handshake, the kernel's accept queue), the answer still has to travel back, and the apiserver
# rounds a timeout that is not a whole number of seconds up to the next second. At most a
# quarter of a short timeout, so that one of 1 or 2 s still leaves time to look.
CALLER_MARGIN_SECONDS = 1.0
_MARGIN_SHARE = 0.25

_MAX_DURATION_CHARS = 64
_GO_UNITS = {"ns": 1e-9, "us": 1e-6, "\u00b5s": 1e-6, "\u03bcs": 1e-6, "ms": 1e-3, "s": 1.0,
             "m": 60.0, "h": 3600.0}
_GO_TERM = re.compile(r"([0-9]+\.?[0-9]*|\.[0-9]+)(ns|us|\u00b5s|\u03bcs|ms|s|m|h)")


def parse_go_duration(text: str) -> float | None:
    """Seconds in a Go duration ("5s", "1m30s", "1.5s", "250ms"), as time.Duration.String()
    writes it; None for anything else (a sign, no unit, an unknown unit, too long)."""
    if not text or len(text) > _MAX_DURATION_CHARS:
        return None
    seconds, at = 0.0, 0
    for term in _GO_TERM.finditer(text):
        if term.start() != at:
            return None
        seconds += float(term.group(1)) * _GO_UNITS[term.group(2)]
        at = term.end()
    return seconds if at == len(text) else None


@functools.lru_cache(maxsize=64)   # the apiserver sends the same `?timeout=10s` every call
def caller_timeout(query_string: str) -> float | None:
    """The `timeout` the caller sent in the query string, in seconds; None when it sent none, or
    none that is a positive Go duration (ignored: archway's own deadline still holds). Several:
    the shortest."""
    found = []
    for pair in (query_string or "").split("&"):
        name, _, value = pair.partition("=")
        if name == "timeout":
            seconds = parse_go_duration(unquote(value))
            if seconds is not None and seconds > 0:
                found.append(seconds)
    return min(found) if found else None


def answer_by(now: float, arrived: float | None, deadline_seconds: float,
              timeout: float | None) -> float:
    """The time (on the clock `now` is read from) by which the answer must be sent: at most
    `deadline_seconds` after the request arrived, and before the caller's `timeout` (less the
    margin) runs out. `arrived` None, or later than `now` (not this clock's): counted from now.
    A result at or before `now` means: no time to look, answer at once."""
    start = now if arrived is None or arrived > now else arrived
    budget = deadline_seconds
    if timeout is not None:
        budget = min(budget, timeout - min(CALLER_MARGIN_SECONDS, timeout * _MARGIN_SHARE))
    return start + max(0.0, budget)


def share_of(now: float, due: float, share: float) -> float:
    """A deadline giving a part of the time left until `due` (none when it has passed)."""
    return now + max(0.0, due - now) * share
