"""Lookups paced per registry host: a cluster's thousand images on one registry are not a
thousand requests at once (pre-warming, the leader's tag checks)."""
import heapq
from collections import deque
from collections.abc import Callable
from typing import TypeVar

from archway.errors import ArchwayError

from .reference import parse_reference

T = TypeVar("T")


def image_host(image: str) -> str:
    """The registry host of an image reference; "" for one that does not parse."""
    try:
        return parse_reference(image).host
    except ArchwayError:
        return ""


def paced(items: list[T], per_second: float, host_of: Callable[[T], str]
          ) -> list[tuple[float, T]]:
    """(start offset in seconds, item) so that no host gets more than `per_second` lookups a
    second; hosts interleave, so a host with many images does not hold back the others."""
    lines: dict[str, deque] = {}
    for item in items:
        lines.setdefault(host_of(item), deque()).append(item)
    step = 1.0 / per_second
    heap = [(0.0, host) for host in lines]
    heapq.heapify(heap)
    schedule = []
    while heap:
        at, host = heapq.heappop(heap)
        schedule.append((at, lines[host].popleft()))
        if lines[host]:
            heapq.heappush(heap, (at + step, host))
    return schedule
