"""Reading the tail of a failed container's log, for the closed loop (remediation.py): on
containerd + runc an exec format error is only in the container's log, never in its status.

A log may hold secrets, so what is read is as little as tells: the last LOG_TAIL_LINES lines,
at most LOG_LIMIT_BYTES, of a container that just failed with a status saying nothing of why
(podstatus.log_reads), once per failed instance. Nothing of it is kept but which known wording
matched (podstatus.log_wording): no log text goes into a log line, an Event, an annotation or a
metric label. Bounded by `LogReadBudget`: so many reads per workload and per minute
cluster-wide. Needs `get` on `pods/log` (the chart grants it while learning is on).
"""
import time
from collections import deque
from collections.abc import Callable
from typing import Protocol
from urllib.parse import quote

from archway import metrics
from archway.kubeapi import ApiError, KubeApi

from .podstatus import LogRead, log_wording

LOG_TAIL_LINES = 10
LOG_LIMIT_BYTES = 2048
READS_PER_WORKLOAD_PER_MINUTE = 3
READS_PER_MINUTE = 30          # the whole cluster's
_WINDOW_SECONDS = 60.0


class LogReader(Protocol):
    def wording(self, namespace: str, pod: str, read: LogRead) -> str | None:
        """Which known wording the tail of the container's log holds (None: none; ApiError when
        it could not be read)."""


class ApiLogReader:
    """The log tail through the API (`pods/log`: the apiserver asks the node's kubelet)."""

    def __init__(self, api: KubeApi, *, timeout: float = 5.0):
        self.api = api
        self.timeout = timeout

    def wording(self, namespace: str, pod: str, read: LogRead) -> str | None:
        query = {"container": read.container, "tailLines": str(LOG_TAIL_LINES),
                 "limitBytes": str(LOG_LIMIT_BYTES)}
        if read.previous:
            query["previous"] = "true"
        path = f"/api/v1/namespaces/{quote(namespace, safe='')}/pods/{quote(pod, safe='')}/log"
        try:
            tail = self.api.read_text("GET", path, query=query, timeout=self.timeout,
                                      max_bytes=LOG_LIMIT_BYTES)
        except ApiError:
            metrics.REMEDIATION_LOG_READS.labels("failed").inc()
            raise
        found = log_wording(tail)
        metrics.REMEDIATION_LOG_READS.labels("matched" if found else "unmatched").inc()
        return found


class LogReadBudget:
    """At most `per_workload` reads per workload and `per_minute` in all, in any 60 s."""

    def __init__(self, *, per_workload: int = READS_PER_WORKLOAD_PER_MINUTE,
                 per_minute: int = READS_PER_MINUTE,
                 clock: Callable[[], float] = time.monotonic):
        self.per_workload = per_workload
        self.per_minute = per_minute
        self._clock = clock
        self._all: deque[float] = deque()
        self._by_workload: dict[str, deque[float]] = {}

    def take(self, workload: str) -> float:
        """0 when a read of `workload` may go now (and counts it); else the seconds until one
        may."""
        now = self._clock()
        self._forget(now)
        mine = self._by_workload.get(workload, deque())
        waits = [q[0] + _WINDOW_SECONDS - now for q, cap in
                 ((self._all, self.per_minute), (mine, self.per_workload)) if len(q) >= cap]
        if waits:
            return max(0.01, max(waits))
        self._all.append(now)
        mine.append(now)
        self._by_workload[workload] = mine
        return 0.0

    def _forget(self, now: float) -> None:
        while self._all and self._all[0] <= now - _WINDOW_SECONDS:
            self._all.popleft()
        for key in [k for k, q in self._by_workload.items()
                    if not q or q[-1] <= now - _WINDOW_SECONDS]:
            del self._by_workload[key]
        for q in self._by_workload.values():
            while q and q[0] <= now - _WINDOW_SECONDS:
                q.popleft()
