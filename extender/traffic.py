"""Network traffic per node from Prometheus, and the scores the extender's prioritize gives.

ONE instant query for all nodes runs in a background thread every refresh_seconds; requests only
read the last answer. The decisions (which series belongs to which node, which score a rate is
worth) are pure functions below, tested without I/O.
"""
import logging
import math
import threading
import time
from collections import Counter, defaultdict
from dataclasses import dataclass
from urllib.parse import urlencode

from archway.errors import ArchwayError
from archway.registry.http import HttpClient
from archway.config import RegistrySettings
from archway import metrics
from archway.background import ProcessThread

log = logging.getLogger("archway.traffic")

MAX_SCORE = 10          # extenderv1.MaxExtenderPriority
NEUTRAL_SCORE = 5       # no data: neither favour nor avoid the node
MAX_RESPONSE_BYTES = 16 * 1024 * 1024



def _record_query(ok: bool, series: int = 0) -> None:
    metrics.PROMETHEUS_UP.set(1 if ok else 0)
    if ok:
        metrics.PROMETHEUS_SERIES.set(series)
        metrics.PROMETHEUS_LAST_SUCCESS.set(time.time())
    else:
        metrics.PROMETHEUS_QUERY_ERRORS.inc()


class PrometheusError(ArchwayError):
    """Prometheus could not be reached or answered something other than an instant vector."""


# --- pure functions -----------------------------------------------------------------------------

def parse_vector(payload, node_label: str) -> dict[str, float]:
    """Map `node_label`'s value -> bytes/s from a /api/v1/query answer.

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
    traffic: dict[str, float] = {}
    for series in data.get("result") or ():
        try:
            key = series["metric"][node_label]
            value = float(series["value"][1])
        except (KeyError, IndexError, TypeError, ValueError):
            continue
        if not isinstance(key, str) or not key or not math.isfinite(value) or value < 0:
            continue
        key = key.lower()
        traffic[key] = traffic.get(key, 0.0) + value
    return traffic


def short_name(name: str) -> str:
    return name.split(".", 1)[0]


def match_by_name(series_keys, node_names) -> dict[str, str]:
    """node name -> series key. Exact matches first; otherwise a short host name matches an
    FQDN whose first label it is, in either direction, but only when exactly one series and
    one node share that short name: an ambiguous short name is not guessed."""
    keys = set(series_keys)
    series_by_short = defaultdict(list)
    for key in keys:
        series_by_short[short_name(key)].append(key)
    names = list(node_names)
    nodes_by_short = Counter(short_name(n.lower()) for n in names)
    matched = {}
    for name in names:
        lowered = name.lower()
        if lowered in keys:
            matched[name] = lowered
            continue
        short = short_name(lowered)
        # Two different FQDNs with the same first label are different hosts.
        candidates = [k for k in series_by_short.get(short, ()) if "." not in k or "." not in lowered]
        if len(candidates) == 1 and nodes_by_short[short] == 1:
            matched[name] = candidates[0]
    return matched


def instance_host(value: str) -> str:
    """The host part of an `instance` label: `10.0.0.1:9100` -> `10.0.0.1`, `[fd00::1]:9100`
    -> `fd00::1`; a bare address or name is returned as is."""
    value = value.strip().lower()
    if value.startswith("["):
        return value[1:value.find("]")] if "]" in value else value[1:]
    if value.count(":") == 1:
        return value.split(":", 1)[0]
    return value  # a bare IPv6 address or a name without a port


def match_by_address(series_keys, node_addresses) -> dict[str, list[str]]:
    """node name -> series keys whose host part is one of the node's status.addresses.
    An address two nodes claim is ambiguous and matches neither."""
    owners = defaultdict(set)
    for node, addresses in node_addresses.items():
        for address in addresses:
            owners[address.lower()].add(node)
    matched = defaultdict(list)
    for key in series_keys:
        nodes = owners.get(instance_host(key), ())
        if len(nodes) == 1:
            matched[next(iter(nodes))].append(key)
    return dict(matched)


@dataclass(frozen=True)
class TrafficScale:
    """Scores on a log scale between the quietest (10) and the busiest (0) series of the whole
    query, so a node's score does not depend on which other nodes happen to be candidates and
    one very busy node does not flatten every other difference."""
    low: float
    high: float

    @classmethod
    def of(cls, values) -> "TrafficScale":
        logs = [math.log1p(v) for v in values]
        return cls(min(logs), max(logs)) if logs else cls(0.0, 0.0)

    def score(self, value: float) -> int:
        if self.high - self.low < 1e-9:
            return NEUTRAL_SCORE  # every node is as busy as every other: no preference
        position = (math.log1p(value) - self.low) / (self.high - self.low)
        return max(0, min(MAX_SCORE, round(MAX_SCORE * (1.0 - position))))


def node_traffic(traffic: dict[str, float], node_names, *, match: str = "name",
                 node_addresses=None) -> dict[str, float]:
    """node name -> bytes/s for the nodes some series belongs to."""
    if match == "address":
        wanted = set(node_names)
        addresses = {n: a for n, a in (node_addresses or {}).items() if n in wanted}
        # Several exporters for one node measure the same traffic: take the largest, not the sum.
        return {node: max(traffic[k] for k in keys)
                for node, keys in match_by_address(traffic, addresses).items()}
    return {node: traffic[key] for node, key in match_by_name(traffic, node_names).items()}


def node_scores(traffic: dict[str, float], node_names, *, match: str = "name",
                node_addresses=None) -> list[int]:
    """THE decision: a score 0..10 per node, in the order given; lower traffic scores higher,
    a node without data gets NEUTRAL_SCORE."""
    names = list(node_names)
    scale = TrafficScale.of(traffic.values())
    per_node = node_traffic(traffic, names, match=match, node_addresses=node_addresses)
    return [scale.score(per_node[n]) if n in per_node else NEUTRAL_SCORE for n in names]


# --- the poller ---------------------------------------------------------------------------------

@dataclass(frozen=True)
class TrafficSnapshot:
    traffic: dict[str, float]
    fetched_at: float        # time.monotonic() of the answer
    version: int


class TrafficPoller:
    """Runs the query every refresh_seconds in a daemon thread of the serving process."""

    def __init__(self, settings, *, http: HttpClient | None = None, clock=time.monotonic):
        self.settings = settings
        self.clock = clock
        self.http = http or HttpClient(RegistrySettings(timeout_seconds=settings.timeout_seconds))
        self.queries = 0
        self.last_error: str | None = None
        self._snapshot: TrafficSnapshot | None = None
        self._version = 0
        self._up: bool | None = None
        self._stop = threading.Event()
        self._runner = ProcessThread(self._run, "archway-traffic")

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

    def _run(self) -> None:
        while not self._stop.is_set():
            self.refresh_once()
            self._stop.wait(self.settings.refresh_seconds)

    def refresh_once(self) -> None:
        """One query; on failure the previous answer stays until it goes stale."""
        self.queries += 1
        try:
            traffic = self._query()
        except (ArchwayError, RecursionError) as e:
            self._failed(str(e) or type(e).__name__)
            return
        except Exception as e:  # a bug must not silently end the thread and freeze the scores
            log.exception("unexpected error in the Prometheus traffic query")
            self._failed(f"unexpected error: {type(e).__name__}")
            return
        _record_query(True, len(traffic))
        if self._up is not True:
            log.info("Prometheus traffic query answered: %d series", len(traffic))
        self._up = True
        self.last_error = None
        self._version += 1
        self._snapshot = TrafficSnapshot(traffic, self.clock(), self._version)

    def _failed(self, error: str) -> None:
        _record_query(False)
        self.last_error = error
        if self._up is not False:  # one line per outage, not one per refresh
            log.warning("Prometheus traffic query failed, prioritize goes neutral once the "
                        "last answer is %gs old: %s", self.settings.stale_after_seconds, error)
        self._up = False

    def _query(self) -> dict[str, float]:
        url = (self.settings.url.rstrip("/") + "/api/v1/query?"
               + urlencode({"query": self.settings.query,
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
        return parse_vector(payload, self.settings.node_label)
