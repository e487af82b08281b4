"""What the scale section measures at each size beyond memory and the burst (issue 28, item 2):

startup   pod startup latency as ClusterLoader2's density test takes it: pods created at a
          steady RATE (below what the scheduler binds, so no queue is measured), alternately one
          archway admits and one carrying the chart's skip label (the webhook never sees it);
          each timed from the client's create (a pod's creationTimestamp is set after mutating
          admission: it would leave archway's call out) until a watch shows it Running.
apiserver the apiserver's own latency for POST pods from its /metrics: a block of skipped
          creates, then a block of admitted ones, at the same RATE, each block's histogram
          delta (apiserver_request_duration_seconds), and the webhook call as the apiserver
          times it (apiserver_admission_webhook_admission_duration_seconds).
at_rest   archway's requests to the apiserver per minute at rest, from the audit log (each
          request once: its audit ID; a watch counts when it was opened in the window).
"""
import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from bench.common.rounds import blocks
from bench.common.stats import bucket_difference, histogram_buckets, parse_metrics, percentile
from lab.cluster.controlplane import ControlPlane
from lab.cluster.kwok import LABEL
from lab.kube import pod_path

RATE = 10.0             # pods per second, both kinds together
STARTUP_PODS = 150      # of each kind
STARTUP_BLOCKS = 3      # thirds of them, consecutive: how far the p99 moves within one run
BLOCK_PODS = 100        # per block of the apiserver's figure
SKIP = {"archway.dev/skip": "true"}
ACCOUNTS = "system:serviceaccount:archway-system:"
POST_PODS = {"verb": "POST", "resource": "pods", "subresource": ""}


def pod(name: str, image: str, labels: dict | None = None) -> dict:
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "labels": labels or {}},
            "spec": {"nodeSelector": {LABEL: "kwok"}, "terminationGracePeriodSeconds": 0,
                     "containers": [{"name": "c", "image": image}]}}


class RunningWatch:
    """A watch of one namespace's pods (its own connection): when each was first seen Running."""

    def __init__(self, plane: ControlPlane, namespace: str):
        assert plane.kube is not None
        self.kube = plane.kube.as_user(plane.kube.token)
        self.path = pod_path(namespace)
        self.running: dict[str, float] = {}
        self._stop = threading.Event()
        version = self.kube.get(self.path)["metadata"]["resourceVersion"]
        self._response = self.kube.session.get(
            self.kube.server + self.path,
            params={"watch": "1", "resourceVersion": version, "timeoutSeconds": "900"},
            stream=True, timeout=(10, 960))
        self._response.raise_for_status()
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        try:
            # chunk_size None: each event as it arrives (a fixed size would hold the last back)
            for line in self._response.iter_lines(chunk_size=None):
                if self._stop.is_set():
                    return
                if not line:
                    continue
                obj = json.loads(line).get("object") or {}
                name = (obj.get("metadata") or {}).get("name")
                if (obj.get("status") or {}).get("phase") == "Running" and name not in self.running:
                    self.running[name] = time.monotonic()
        except Exception:   # the connection closed at stop()
            return

    def wait(self, names: list[str], timeout: float) -> None:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if all(n in self.running for n in names):
                return
            time.sleep(0.1)
        missing = [n for n in names if n not in self.running]
        raise RuntimeError(f"{len(missing)} pods not seen Running in {timeout:g} s: {missing[:3]}")

    def stop(self) -> None:
        """Left to end by itself (timeoutSeconds): closing a response another thread reads
        from blocks until that read returns, and on a quiet namespace none does."""
        self._stop.set()


def paced_creates(plane: ControlPlane, namespace: str, bodies: list[dict]) -> dict[str, tuple]:
    """Create `bodies` at RATE (each at its time, however slow the previous answer):
    name -> (client's create start, seconds the create took, stored pod)."""
    kube = plane.kube
    assert kube is not None
    started = time.monotonic()
    done: dict[str, tuple] = {}

    def create(body: dict) -> None:
        at = time.monotonic()
        stored = kube.create(pod_path(namespace), body)
        done[body["metadata"]["name"]] = (at, time.monotonic() - at, stored)

    with ThreadPoolExecutor(16) as pool:
        futures = []
        for i, body in enumerate(bodies):
            time.sleep(max(0.0, started + i / RATE - time.monotonic()))
            futures.append(pool.submit(create, body))
        for future in futures:
            future.result()
    return done


def startup(plane: ControlPlane, image: str) -> dict:
    """p50/p99 seconds from the client's create to Running seen, admitted vs skipped, and
    the p99 of each block of consecutive pods (the plot's whiskers)."""
    namespace = plane.new_namespace("startup")
    watch = RunningWatch(plane, namespace)
    try:
        bodies = []
        for i in range(STARTUP_PODS):
            bodies += [pod(f"admitted-{i}", image), pod(f"skipped-{i}", image, SKIP)]
        created = paced_creates(plane, namespace, bodies)
        watch.wait(list(created), timeout=300)
    finally:
        watch.stop()
    for name, (_, _, stored) in created.items():
        if name.startswith("admitted-") and "archway.dev/architectures" not in (
                stored["metadata"].get("annotations") or {}):
            raise RuntimeError(f"pod {name} was not placed by archway")
    result = {}
    for kind in ("admitted", "skipped"):
        took = [watch.running[n] - at for n, (at, _, _) in created.items() if n.startswith(kind)]
        creates = [c for n, (_, c, _) in created.items() if n.startswith(kind)]
        result[kind] = {"p50": percentile(took, 50), "p99": percentile(took, 99),
                        "create_p99": percentile(creates, 99),
                        "p99_blocks": [percentile(b, 99) for b in blocks(took, STARTUP_BLOCKS)]}
    return result


# --- the apiserver's own figures -----------------------------------------------------------------

def histogram(text: str, name: str, **match) -> dict:
    """{"buckets": {le: count}, "sum": s, "count": n} of metric `name`, summed over the series
    whose labels include `match`."""
    out = {"buckets": histogram_buckets(text, name, **match), "sum": 0.0, "count": 0.0}
    for sample, labels, value in parse_metrics(text):
        if sample in (name + "_sum", name + "_count") and all(
                labels.get(k) == v for k, v in match.items()):
            out[sample.rsplit("_", 1)[1]] += value
    return out


def delta(after: dict, before: dict) -> dict:
    return {"buckets": bucket_difference(after["buckets"], before["buckets"]),
            "sum": after["sum"] - before["sum"], "count": after["count"] - before["count"]}


def bucket_quantile(h: dict, q: float) -> float:
    """The upper bound of the bucket the q-th quantile falls in (what a histogram can say)."""
    for le in sorted(h["buckets"]):
        if h["buckets"][le] >= q * h["count"]:
            return le
    return float("inf")


def summary(h: dict) -> str:
    if not h["count"]:
        return "no calls"
    return (f"mean {1000 * h['sum'] / h['count']:.1f} ms, p50 <= {1000 * bucket_quantile(h, 0.5):g}"
            f" ms, p99 <= {1000 * bucket_quantile(h, 0.99):g} ms ({h['count']:.0f})")


def apiserver_metrics(plane: ControlPlane) -> dict:
    assert plane.kube is not None
    text = plane.kube.session.get(plane.kube.server + "/metrics", timeout=60).text
    return {"request": histogram(text, "apiserver_request_duration_seconds", **POST_PODS),
            "webhook": histogram(text, "apiserver_admission_webhook_admission_duration_seconds",
                                 type="admit", operation="CREATE")}


def apiserver(plane: ControlPlane, image: str) -> dict:
    """The apiserver's POST pods latency per block (without, then with archway), and the
    webhook calls in the second block as the apiserver times them."""
    namespace = plane.new_namespace("apiserver-latency")
    result = {}
    for kind, labels in (("skipped", SKIP), ("admitted", None)):
        before = apiserver_metrics(plane)
        paced_creates(plane, namespace, [pod(f"{kind}-{i}", image, labels) for i in range(BLOCK_PODS)])
        after = apiserver_metrics(plane)
        result[kind] = delta(after["request"], before["request"])
        if kind == "admitted":
            result["webhook"] = delta(after["webhook"], before["webhook"])
    return result


# --- at rest ---------------------------------------------------------------------------------------

def archway_requests(plane: ControlPlane, mark: int, since: str = "") -> dict[str, int]:
    """verb + resource -> archway's requests in the audit log after `mark`, each once (its
    auditID: a watch has two events) and only those received at `since` (RFC 3339) or later."""
    seen: set[str] = set()
    counts: dict[str, int] = {}
    for event in plane.audit_events(mark):
        if (not event.get("user", {}).get("username", "").startswith(ACCOUNTS)
                or event["auditID"] in seen or event["requestReceivedTimestamp"] < since):
            continue
        seen.add(event["auditID"])
        key = f"{event['verb']} {(event.get('objectRef') or {}).get('resource', '?')}"
        counts[key] = counts.get(key, 0) + 1
    return counts


def utc_now() -> str:
    """Now as the audit log's requestReceivedTimestamp writes it (compares as a string)."""
    now = time.time()
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(now)) + f".{int(now % 1 * 1e6):06d}Z"


def at_rest(plane: ControlPlane, seconds: float) -> dict:
    """archway's requests per minute over `seconds` of no pod being created."""
    mark, since = plane.audit_mark(), utc_now()
    time.sleep(seconds)
    counts = archway_requests(plane, mark, since)
    return {"per_minute": 60 * sum(counts.values()) / seconds,
            "by_kind": {k: round(60 * n / seconds, 1) for k, n in counts.items()}}
