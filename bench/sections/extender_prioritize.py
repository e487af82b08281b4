"""Figure 7's calls: prioritize with 5,000 NodeNames to three extender servers in turn, in blocks.

A block is BLOCK_SECONDS of calls to one server; the servers take turns (each going first in
turn). On a machine with 2 CPUs or more the server of the block runs alone on one CPU and
everything else the bench started (its own process: client, API stand-in, exporter, pod churn;
Prometheus; the other servers) on the other (bench/common/pinning.py), so the figure is the
extender's own work rather than the bench's load. Each block also gives the server's CPU time
per call (its gunicorn workers' threads, the traffic poller process left out).
"""
import copy
import json
import os
import threading
import time

from bench.common.extender_cluster import NODES, Prometheus, node_name, running_pods
from bench.common.pinning import CpuSplit, affinities, process_tree, tree_cpu_ns, unpinned_note
from bench.common.report import Figure
from bench.common.rounds import Steady, steady
from bench.common.servers import GunicornServer
from bench.common.stats import (
    bucket_difference,
    histogram_buckets,
    histogram_quantile,
    percentile,
    share_at_most,
)
from lab.servers.apiserver import FakeApiServer

PRIORITIZE_SECONDS = 30.0   # blocks of calls, the three servers taking turns, for this long
BLOCK_SECONDS = 1.0         # one server's block
POD_EVENTS_PER_SECOND = 20  # pods updated in the API stand-in meanwhile: pod watch events
PRIORITIZE_PODS = 50     # distinct pods among the calls: each one a placement herd control adds
PRIORITIZE_TARGET_MS = 5.0
HISTOGRAM = "archway_extender_duration_seconds"


def answering_pids(server: GunicornServer) -> list[int]:
    """The processes that answer calls: gunicorn's workers (the traffic poller runs beside
    gunicorn's master, under `archway serve`)."""
    return server.worker_pids()


def bodies_of(pod: dict) -> list[bytes]:
    """Distinct pods (uids), every other one with an expected-bandwidth annotation: each call
    records a placement and later calls add the placed pods' traffic to their nodes."""
    body = json.dumps({"Pod": pod, "Nodes": None, "NodeNames": [node_name(i) for i in range(NODES)]},
                      separators=(",", ":")).encode()
    uid = pod["metadata"]["uid"].encode()
    bodies = []
    for k in range(PRIORITIZE_PODS):
        one = body.replace(uid, f"bench-pod-{k:04d}".encode())
        if k % 2:
            one = one.replace(b'"annotations":{', b'"annotations":{"archway.dev/expected-bandwidth":"5M",', 1)
        bodies.append(one)
    return bodies


class Calls:
    """The blocks: client latency per call and CPU per call per block, for each server."""

    def __init__(self, servers: dict[str, GunicornServer], split: CpuSplit | None):
        self.servers, self.split = servers, split
        self.client: dict[str, list[float]] = {k: [] for k in servers}
        self.cpu_ms: dict[str, list[float]] = {k: [] for k in servers}
        self.calls = 0
        self.checked = ""   # the affinities read back during a block of "now"

    def block(self, key: str, bodies: list[bytes]) -> None:
        server = self.servers[key]
        if self.split:
            self.split.measure(server.serve_pid, others=[s.serve_pid for k, s in
                                                          self.servers.items() if k != key])
        pids = answering_pids(server)
        if self.split and key == "now" and not self.checked:
            self.checked = affinities(process_tree(os.getpid()))
        cpu, calls = tree_cpu_ns(pids), 0
        end = time.monotonic() + BLOCK_SECONDS
        while time.monotonic() < end:
            started = time.perf_counter()
            answer = server.post("/scheduler/prioritize", bodies[(self.calls + calls) % len(bodies)])
            self.client[key].append((time.perf_counter() - started) * 1000)
            answer.raise_for_status()
            calls += 1
        self.cpu_ms[key].append((tree_cpu_ns(pids) - cpu) / calls / 1e6)
        self.calls += calls

    def run(self, bodies: list[bytes]) -> int:
        """Blocks until PRIORITIZE_SECONDS have passed; returns the number of turns."""
        keys, turn = list(self.servers), 0
        end = time.monotonic() + PRIORITIZE_SECONDS
        while time.monotonic() < end:
            for key in keys[turn % len(keys):] + keys[:turn % len(keys)]:
                self.block(key, bodies)
            turn += 1
        return turn


def prioritize(servers: dict[str, GunicornServer], floor, api: FakeApiServer,
               prometheus: Prometheus, pod: dict, split: CpuSplit | None, spec, before: str,
               refresh_seconds: float) -> Figure:
    number, name, target = spec
    bodies = bodies_of(pod)
    prometheus.wait_for("node_uname_info", NODES)
    scores = wait_for_scores(servers["now"], bodies[0])
    servers["floor"] = floor()   # started once the others score: its one query sees every rate
    for other in servers.values():
        wait_for_scores(other, bodies[0], timeout=180)
    start = {k: histogram_buckets(s.metrics(), HISTOGRAM, verb="prioritize")
             for k, s in servers.items()}
    calls = Calls(servers, split)
    stop = threading.Event()
    churn = threading.Thread(target=_churn_pods, args=(api, stop), daemon=True)
    churn.start()
    try:
        turns = calls.run(bodies)
    finally:
        stop.set()
        churn.join(10)
        if split:
            split.pin_bench()   # every server back among the bench's processes
    buckets = {k: bucket_difference(histogram_buckets(s.metrics(), HISTOGRAM, verb="prioritize"),
                                    start[k]) for k, s in servers.items()}
    cpu = {k: steady(v) for k, v in calls.cpu_ms.items()}
    client = {k: (percentile(c, 50), percentile(c, 99)) for k, c in calls.client.items()}
    share = {k: (share_at_most(b, 0.005), share_at_most(b, 0.010)) for k, b in buckets.items()}
    wall = "pinned" if split else "unpinned"
    ok = share["now"][0] >= 0.99 if split else cpu["now"].median <= PRIORITIZE_TARGET_MS

    def line(key: str) -> str:
        return (f"{_server_side(buckets[key])}, CPU per call {cpu[key].median:.2f} ms, client "
                f"p50 / p99 {client[key][0]:.1f} / {client[key][1]:.1f} ms")
    judged = ("judged on the pinned server-side p99" if split else
              "judged on CPU per call (nothing pinned)")
    spread = sorted(set(scores))
    return Figure(number, name, f"{wall}, {judged}: {line('now')}; before: {line('before')}; no "
                  f"refresh among the calls: {line('floor')}", target, ok, [
        f"{turns} turns of {BLOCK_SECONDS:g} s blocks of calls to each of three archway serve "
        f"(1 worker x 8 threads, plain HTTP, as the chart's extender sidecar; each server going "
        f"first in turn) for {PRIORITIZE_SECONDS:g} s, {len(calls.client['now']):,} calls to now, "
        f"{NODES:,} NodeNames ({len(bodies[0]) // 1000} KB) each; "
        f"prometheus.refresh_seconds {refresh_seconds:g} and {POD_EVENTS_PER_SECOND} pod updates "
        f"a second in the API stand-in (pod watch events); now: the traffic poller in a process "
        f"of its own (extender/pollerprocess.py); before: {before}; floor: as now, with no "
        f"refresh among the calls",
        (f"{split.describe()}; read back in a block of now, the bench's process (pid "
         f"{os.getpid()}) and its descendants, by the CPUs their threads may use (now's master "
         f"{servers['now'].master_pid}): {calls.checked}") if split else unpinned_note(),
        f"server side from {HISTOGRAM}{{verb=\"prioritize\"}} (its first buckets 5 ms and 10 ms "
        f"bound the quantiles; interpolated like histogram_quantile): calls <= 5 ms / <= 10 ms: "
        + ", ".join(f"{k} {a:.1%} / {b:.1%}" for k, (a, b) in share.items()),
        "CPU per call = a block's CPU time in the server's gunicorn worker (its process CPU "
        "clock: every thread's sum_exec_runtime; the traffic poller's process not counted) / its calls; per block: "
        + "; ".join(f"{k} {c.describe('{:.2f}', ' ms')}" for k, c in cpu.items()),
        f"node cache listed from the API server stand-in ({NODES:,} full Nodes) and watching; "
        f"traffic and link speeds (100 Mb/s..25 Gb/s, every fifth node none) from a real "
        f"Prometheus scraping {NODES:,} nodes' node_exporter series, default archway queries, "
        f"nodename short names matched to FQDN node names; scores seen {spread[0]}..{spread[-1]}",
        f"herd control on: the pod watch lists {NODES:,} running pods (one per node) and watches; "
        f"the calls cycle through {PRIORITIZE_PODS} distinct pods (half annotated "
        f"archway.dev/expected-bandwidth: 5M), so every call after the first round adds the "
        f"estimated traffic of up to {PRIORITIZE_PODS - 1} placed pods to their nodes",
    ], rounds=_judged_rounds(cpu["now"], split))


def _judged_rounds(cpu: Steady, split: CpuSplit | None) -> Steady | None:
    """CPU per call is the figure (its blocks its rounds) only when nothing could be pinned."""
    return None if split else cpu


def _server_side(buckets) -> str:
    """p50 / p99 from the histogram; inside its first bucket it only bounds them: said so."""
    fast = share_at_most(buckets, 0.005)
    if fast >= 0.99:
        return f"p99 <= 5 ms server side ({fast:.1%} of calls <= 5 ms)"
    return (f"p50 {histogram_quantile(buckets, 0.5) * 1000:.1f} / p99 "
            f"{histogram_quantile(buckets, 0.99) * 1000:.1f} ms server side")


def _churn_pods(api: FakeApiServer, stop: threading.Event) -> None:
    """Status updates of running pods (a watch event each) while figure 7 measures."""
    pods = running_pods()
    k = 0
    while not stop.wait(1.0 / POD_EVENTS_PER_SECOND):
        one = copy.deepcopy(pods[k % len(pods)])
        one["status"]["conditions"] = [{"type": "Ready", "status": "True", "reason": f"r{k}"}]
        api.put(f"/api/v1/namespaces/bench/pods/{one['metadata']['name']}", one)
        k += 1


def wait_for_scores(server: GunicornServer, body: bytes, timeout: float = 90.0) -> list[int]:
    """Until the node cache is synced and Prometheus' answer is in: scores stop being all
    neutral (5), and the server logged its node cache sync."""
    end = time.monotonic() + timeout
    scores = []
    while time.monotonic() < end:
        answer = server.post("/scheduler/prioritize", body)
        answer.raise_for_status()
        scores = [entry["Score"] for entry in answer.json()]
        synced = "node cache synced" in server.log_since(0)
        if len(scores) == NODES and len(set(scores)) > 1 and synced:
            return scores
        time.sleep(0.5)
    raise TimeoutError(f"{server.name}: prioritize stayed neutral (scores {sorted(set(scores))}) "
                       f"or the node cache never synced; log:\n{server.log_since(0)[-3000:]}")
