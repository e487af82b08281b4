"""Network traffic and link capacity per node, read from Prometheus: the query, its answer, and
the poller that keeps the last answer for prioritize and the utilisation ceiling.

ONE instant query per refresh asks for both (traffic and capacity series tagged apart with
label_replace), made by ONE process per server: under `archway serve` a process of its own
(pollerprocess.py), else the one of the processes sharing the directory that holds a lock file;
the others read the snapshot it writes (`SharedSnapshot`), with each series' score worked out
(traffic.key_scores). Requests only read the last snapshot. Reading an answer is pure (`parse_vector`, `split_answer`), tested without I/O; what a
sample is worth to a node is traffic.py's.
"""
import logging
import marshal
import math
import os
import tempfile
import threading
import time
from dataclasses import dataclass, field
from urllib.parse import urlencode

from archway import metrics
from archway.background import ProcessThread
from archway.config import RegistrySettings
from archway.errors import ArchwayError
from archway.registry.http import HttpClient

from .traffic import LARGEST, TrafficScale, key_scores
from .wire import MAX_SCORE

log = logging.getLogger("archway.traffic")

MAX_RESPONSE_BYTES = 16 * 1024 * 1024
# The label that tells the two halves of the one query apart.
SERIES_LABEL = "archway_series"
# How often a process that does not poll looks for a newer snapshot and a vacant poller's lock.
FOLLOW_SECONDS = 1.0
_VALID_SCORES = set(range(MAX_SCORE + 1))


def _record_query(ok: bool, series: int = 0) -> None:
    metrics.PROMETHEUS_UP.set(1 if ok else 0)
    if ok:
        metrics.PROMETHEUS_SERIES.set(series)
        metrics.PROMETHEUS_LAST_SUCCESS.set(time.time())
    else:
        metrics.PROMETHEUS_QUERY_ERRORS.inc()


class PrometheusError(ArchwayError):
    """Prometheus could not be reached or answered something other than an instant vector."""


# --- the query and its answer (pure) ------------------------------------------------------------

def combined_query(settings) -> str:
    """The one PromQL query of a refresh: the traffic query, and the capacity query when there
    is one, each series tagged with SERIES_LABEL; `$window` replaced by prometheus.window."""
    query = settings.query.replace("$window", settings.window)
    capacity = settings.capacity_query.replace("$window", settings.window).strip()
    if not capacity:
        return query
    return (f'label_replace(({query}), "{SERIES_LABEL}", "traffic", "", "") or '
            f'label_replace(({capacity}), "{SERIES_LABEL}", "capacity", "", "")')


def split_answer(payload, node_label: str) -> tuple[dict[str, float], dict[str, float]]:
    """(traffic, capacity) of an answer to combined_query: series tagged `capacity` are link
    capacities, every other series (an untagged query too) traffic."""
    both = parse_vector(payload, node_label,
                        kind=lambda labels: labels.get(SERIES_LABEL) == "capacity")
    # A link of speed 0 (down, or a driver that reports none) says nothing about capacity.
    return both[False], {k: v for k, v in both[True].items() if v > 0}


def parse_vector(payload, node_label: str, kind=None):
    """Map `node_label`'s value -> bytes/s from a /api/v1/query answer. With `kind` (a function
    of a series' labels) one such map per kind: {kind: {value: bytes/s}}, in one pass.

    Series without the label, and NaN/Inf/negative values, carry no usable information and are
    skipped; series sharing a label value are added up (a query left per-device still works).
    """
    if not isinstance(payload, dict):
        raise PrometheusError("Prometheus answered something other than a JSON object")
    if payload.get("status") != "success":
        raise PrometheusError(f"Prometheus query failed: {payload.get('errorType', 'error')}: "
                              f"{str(payload.get('error', 'no reason given'))[:300]}")
    data = payload.get("data")
    if not isinstance(data, dict) or data.get("resultType") != "vector":
        kind = data.get("resultType") if isinstance(data, dict) else None
        raise PrometheusError(f"prometheus.query must return an instant vector, got {kind!r}")
    maps: dict = {False: {}, True: {}}
    traffic: dict[str, float] = maps[False]
    for series in data.get("result") or ():
        try:
            if kind is not None:
                traffic = maps.setdefault(kind(series["metric"]), {})
            key = series["metric"][node_label]
            value = float(series["value"][1])
        except (KeyError, IndexError, TypeError, ValueError):
            continue
        if not isinstance(key, str) or not key or not math.isfinite(value) or value < 0:
            continue
        key = key.lower()
        # Finite values can add up to inf (two of 1e308): the largest float stands for it.
        traffic[key] = min(traffic.get(key, 0.0) + value, LARGEST)
    return maps if kind is not None else traffic

# --- the poller ---------------------------------------------------------------------------------

@dataclass(frozen=True)
class TrafficSnapshot:
    traffic: dict[str, float]
    fetched_at: float        # time.monotonic() of the answer
    version: int
    capacity: dict[str, float] = field(default_factory=dict)  # series key -> bytes/s
    sampled_at: float = 0.0  # wall-clock time the query was sent: what it measured ends there
    # traffic.key_scores of it, worked out where it was parsed (the poller's process).
    prepared: tuple[TrafficScale, dict[str, int]] | None = None

    def scores(self) -> tuple[TrafficScale, dict[str, int]]:
        return self.prepared or key_scores(self.traffic, self.capacity)


class SharedSnapshot:
    """The server's one poller, elected among its worker processes, and the snapshot file it
    writes for the others.

    The poller holds an exclusive flock on `poller.lock`; the kernel drops it when that process
    dies, however it dies, and another worker takes it over at its next look (every
    FOLLOW_SECONDS). The snapshot is replaced atomically (write, then rename), so a reader sees
    the previous file or the next, never half of one. It is in `marshal`'s format, written and
    read by the same interpreter: a worker reads it 4-5x faster than the same content as JSON,
    and that read is one C call holding the worker's GIL (figure 7).
    """

    def __init__(self, directory: str):
        os.makedirs(directory, mode=0o700, exist_ok=True)
        self.directory = directory
        self.path = os.path.join(directory, "snapshot.marshal")
        self._lock_path = os.path.join(directory, "poller.lock")
        self._lock_fd: int | None = None
        self._seen: tuple | None = None

    def lead(self) -> bool:
        """True when this process is (now) the poller."""
        if self._lock_fd is not None:
            return True
        import fcntl
        fd = os.open(self._lock_path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            return False
        self._lock_fd = fd
        return True

    def release(self) -> None:
        if self._lock_fd is not None:
            os.close(self._lock_fd)   # closing the descriptor drops the flock
            self._lock_fd = None

    def write(self, traffic: dict, capacity: dict, sampled_at: float, prepared=None) -> None:
        fd, tmp = tempfile.mkstemp(dir=self.directory, prefix=".snapshot-")
        content = {"traffic": traffic, "capacity": capacity, "sampled_at": sampled_at}
        if prepared is not None:   # the followers adopt these instead of working them out
            scale, scores = prepared
            content.update(scale=[scale.low, scale.high], scores=scores)
        try:
            with os.fdopen(fd, "wb") as f:
                marshal.dump(content, f)
            os.replace(tmp, self.path)
        except BaseException:
            os.unlink(tmp)
            raise
        st = os.stat(self.path)
        self._seen = (st.st_ino, st.st_mtime_ns, st.st_size)   # not read back by its writer

    def read_if_new(self) -> dict | None:
        """The snapshot file's content when it changed since the last read, else None."""
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            return None
        seen = (st.st_ino, st.st_mtime_ns, st.st_size)
        if seen == self._seen:
            return None
        try:
            with open(self.path, "rb") as f:
                # One read, then one parse: marshal.load(f) reads piece by piece, 10x slower.
                data = marshal.loads(f.read())
        except (OSError, ValueError, EOFError, TypeError):
            return None   # a file this server did not write: ignore it, poll soon ourselves
        self._seen = seen
        if not (isinstance(data, dict) and isinstance(data.get("traffic"), dict)
                and isinstance(data.get("capacity"), dict)
                and isinstance(data.get("sampled_at"), (int, float))):
            return None
        return data


def prepared_of(data: dict) -> tuple[TrafficScale, dict[str, int]] | None:
    """The key scores a snapshot file carries, or None (its reader works them out)."""
    scale, scores = data.get("scale"), data.get("scores")
    # Checked at C speed: a score for every traffic key, each one of 0..10.
    if not (isinstance(scale, list) and len(scale) == 2 and isinstance(scores, dict)
            and all(isinstance(x, (int, float)) for x in scale)
            and scores.keys() == data["traffic"].keys()
            and set(scores.values()) <= _VALID_SCORES):
        return None
    return TrafficScale(float(scale[0]), float(scale[1])), scores


class TrafficPoller:
    """Runs the query every refresh_seconds in a daemon thread, in one process per server when
    `shared_dir` is given (see SharedSnapshot), else in every process that uses it. With
    `follow_only` this process never queries: another one (pollerprocess.py) writes the
    snapshot it follows."""

    def __init__(self, settings, *, http: HttpClient | None = None, clock=time.monotonic,
                 wall=time.time, shared_dir: str | None = None, follow_only: bool = False):
        self.settings = settings
        self.clock = clock
        self.wall = wall
        # Prometheus is the operator's URL, often a Service address: not refused as a cluster one.
        self.http = http or HttpClient(RegistrySettings(timeout_seconds=settings.timeout_seconds),
                                       refuse_cluster=False)
        self.shared_dir = shared_dir
        self.follow_only = follow_only and shared_dir is not None
        self.queries = 0
        self.last_error: str | None = None
        self._shared: SharedSnapshot | None = None
        self._snapshot: TrafficSnapshot | None = None
        self._last_attempt: float | None = None
        self._version = 0
        self._up: bool | None = None
        self._stop = threading.Event()
        self._runner = ProcessThread(self._run, "archway-traffic")
        # Called with each new snapshot, in the poller's thread: work derived from a snapshot
        # is done there, not in the first request that needs it.
        self.listeners: list = []

    @property
    def configured(self) -> bool:
        return bool(self.settings.url)

    def fresh_snapshot(self) -> TrafficSnapshot | None:
        """The last answer, or None when there is none younger than stale_after_seconds."""
        snapshot = self._snapshot
        if snapshot is None or self.clock() - snapshot.fetched_at > self.settings.stale_after_seconds:
            return None
        return snapshot

    def ensure_started(self) -> None:
        if self.configured:
            self._runner.start_once(self._stop.clear)

    def stop(self) -> None:
        self._stop.set()
        self._runner.join(self.settings.timeout_seconds + 1)
        if self._shared is not None:
            self._shared.release()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.tick()
            except Exception:  # a bug must not silently end the thread and freeze the scores
                log.exception("unexpected error in the traffic poller")
            self._stop.wait(min(self.settings.refresh_seconds, FOLLOW_SECONDS)
                            if self.shared_dir else self.settings.refresh_seconds)

    def tick(self) -> None:
        """One turn of the loop: adopt a newer shared snapshot; query when this process is
        the poller and the last query is refresh_seconds old."""
        if self.shared_dir is None:
            self.refresh_once()
            return
        if self._shared is None:
            self._shared = SharedSnapshot(self.shared_dir)
        shared = self._shared
        data = shared.read_if_new()
        if data is not None:
            self._adopt(data["traffic"], data["capacity"], data["sampled_at"], prepared_of(data))
        if self.follow_only or not shared.lead():
            metrics.PROMETHEUS_POLLER.set(0)
            return
        metrics.PROMETHEUS_POLLER.set(1)
        # A new poller goes by the age of what the last one wrote, so a worker's death does
        # not add a query; a failing Prometheus is retried every refresh, not every look.
        last = max(-math.inf if self._last_attempt is None else self._last_attempt,
                   self._snapshot.fetched_at if self._snapshot else -math.inf)
        if self.clock() - last >= self.settings.refresh_seconds:
            self.refresh_once()

    def refresh_once(self) -> None:
        """One query; on failure the previous answer stays until it goes stale."""
        self.queries += 1
        self._last_attempt = self.clock()
        sampled_at = self.wall()
        try:
            traffic, capacity = self._query()
        except (ArchwayError, RecursionError) as e:
            self._failed(str(e) or type(e).__name__)
            return
        except Exception as e:  # a bug must not silently end the thread and freeze the scores
            log.exception("unexpected error in the Prometheus traffic query")
            self._failed(f"unexpected error: {type(e).__name__}")
            return
        _record_query(True, len(traffic) + len(capacity))
        if self._up is not True:
            log.info("Prometheus traffic query answered: %d traffic and %d capacity series",
                     len(traffic), len(capacity))
        self._up = True
        self.last_error = None
        prepared = key_scores(traffic, capacity)
        self._adopt(traffic, capacity, sampled_at, prepared)
        if self._shared is not None:
            try:
                self._shared.write(traffic, capacity, sampled_at, prepared)
            except OSError as e:
                log.warning("cannot share the traffic snapshot with the other workers: %s", e)

    def _adopt(self, traffic: dict, capacity: dict, sampled_at: float, prepared=None) -> None:
        self._version += 1
        # The snapshot's age in this process's monotonic clock, from its wall-clock time.
        fetched_at = self.clock() - max(0.0, self.wall() - sampled_at)
        snapshot = TrafficSnapshot(traffic, fetched_at, self._version, capacity, sampled_at,
                                   prepared)
        self._snapshot = snapshot
        metrics.PROMETHEUS_SNAPSHOT.set(sampled_at)
        for listener in self.listeners:
            try:
                listener(snapshot)
            except Exception:  # the request path does the work instead
                log.exception("preparing scores for a new traffic snapshot failed")

    def _failed(self, error: str) -> None:
        _record_query(False)
        self.last_error = error
        if self._up is not False:  # one line per outage, not one per refresh
            log.warning("Prometheus traffic query failed, prioritize goes neutral once the "
                        "last answer is %gs old: %s", self.settings.stale_after_seconds, error)
        self._up = False

    def _query(self) -> tuple[dict[str, float], dict[str, float]]:
        url = (self.settings.url.rstrip("/") + "/api/v1/query?"
               + urlencode({"query": combined_query(self.settings),
                            "timeout": f"{self.settings.timeout_seconds:g}s"}))
        deadline = time.monotonic() + self.settings.timeout_seconds
        response = self.http.get(url, headers={"Accept": "application/json"}, deadline=deadline,
                                 max_bytes=MAX_RESPONSE_BYTES)
        try:
            payload = response.json()
        except ValueError:
            raise PrometheusError(f"Prometheus answered HTTP {response.status} with a body that "
                                  f"is not JSON") from None
        # Prometheus reports query errors as JSON with 400/422/503: parse_vector words them.
        if response.status != 200 and not isinstance(payload, dict):
            raise PrometheusError(f"Prometheus answered HTTP {response.status}")
        return split_answer(payload, self.settings.node_label)
