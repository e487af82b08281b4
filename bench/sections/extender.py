"""Figures 7 and 8: the scheduler extender with 5,000 nodes.

7. prioritize in NodeNames mode (nodeCacheCapable, what the chart configures): `archway serve`
   as the chart's sidecar runs it (plain HTTP on loopback, 1 worker), its node cache listing and
   watching 5,000 Nodes from the API server stand-in, its traffic from a real Prometheus that
   scrapes 5,000 nodes' series. Measured while the background readers are busy: a traffic
   refresh every 2 s and pod watch events all along. Side by side, calls alternating, the same
   server with the poller in the worker as before issue 28 (bench/apps/poller_in_worker.py). Server
   side = the extender's own latency histogram.
8. filter with 5,000 full Node objects: in this process, the extender's work on a received body
   (parse_extender_args + Extender.filter, reply bytes included) against plain json.loads of the
   same body, interleaved, median of several runs; the real server's time is given as context.
"""
import copy
import gc
import json
import os
import threading
import time

from archway.config import PrometheusSettings, config_from_dict
from archway.extender.prometheus import (
    SharedSnapshot,
    TrafficSnapshot,
    combined_query,
    prepared_of,
    split_answer,
)
from archway.extender.service import Extender
from archway.extender.traffic import key_scores
from archway.extender.trafficscore import MatchedNodes, ScoreBook
from archway.extender.wire import parse_extender_args
from bench.common.extender_cluster import (
    NODES,
    ManyNodesExporter,
    Prometheus,
    extender_pod,
    link_speed,
    make_nodes,
    node_name,
    running_pods,
    traffic_rate,
)
from bench.common.lab import Lab
from bench.common.report import Figure, failed_figure
from bench.common.rounds import ratios, rounds
from bench.common.section import Started, measured
from bench.common.servers import GunicornServer
from bench.common.stats import (
    bucket_difference,
    histogram_buckets,
    histogram_quantile,
    median,
    percentile,
    share_at_most,
)
from lab.servers.apiserver import FakeApiServer

PRIORITIZE_SECONDS = 30.0   # calls alternating between the two servers for this long
REFRESH_SECONDS = 2.0       # prometheus.refresh_seconds: many refreshes among the calls
POD_EVENTS_PER_SECOND = 20  # pods updated in the API stand-in meanwhile: pod watch events
PRIORITIZE_PODS = 50     # distinct pods among the calls: each one a placement herd control adds
PRIORITIZE_TARGET_MS = 10.0
FILTER_RUNS = 5
FILTER_TARGET = 1.5
HISTOGRAM = "archway_extender_duration_seconds"


def run(lab: Lab) -> list[Figure]:
    specs = (("7", f"extender prioritize, {NODES:,} nodes, NodeNames mode, herd control on",
              f"< {PRIORITIZE_TARGET_MS:g} ms"),
             ("8", f"extender filter, {NODES:,} full Node objects, vs plain json.loads",
              f"<= {FILTER_TARGET}x"))
    figures: dict[str, Figure] = {}
    with Started() as started:
        try:
            _measure(lab, started, specs, figures)
        except Exception as e:   # the figures measured before it still count
            for number, name, target in specs:
                figures.setdefault(number, failed_figure(number, name, target, e))
    return [figures[n] for n, _, _ in specs]


def _measure(lab: Lab, started: Started, specs, figures: dict[str, Figure]) -> None:
    exporter = started(ManyNodesExporter())
    # its first scrapes take ~8 s
    prometheus = started(Prometheus(lab.path("prometheus"), exporter))
    nodes = make_nodes()
    pod = extender_pod("amd64")
    body = json.dumps({"Pod": pod, "Nodes": {"metadata": {"resourceVersion": "48377"},
                                             "items": nodes}, "NodeNames": None},
                      separators=(",", ":")).encode()
    figures["8"], = measured([specs[1]], lambda _: [_filter_in_process(body, *specs[1])])
    api = started(FakeApiServer())
    for node in nodes:
        api.put(f"/api/v1/nodes/{node['metadata']['name']}", node)
    for pod in running_pods():
        api.put(f"/api/v1/namespaces/bench/pods/{pod['metadata']['name']}", pod)
    del nodes
    config = lab.archway_config(
        "extender",
        server={"tls": False, "cert_file": None, "key_file": None, "workers": 1},
        kubernetes={"enabled": "auto", "kubeconfig": api.kubeconfig(lab.path("kube-extender"))},
        prometheus={"url": prometheus.url, "refresh_seconds": REFRESH_SECONDS})
    server = started(GunicornServer.archway(lab.path("extender"), config, tls_ca=None,
                                            name="extender"))
    # The floor: no refresh among the calls (one as it starts, once Prometheus has every
    # rate, fresh all along).
    quiet = dict(config, prometheus={**config["prometheus"], "refresh_seconds": 3600,
                                     "stale_after_seconds": 7200, "timeout_seconds": 30})
    with Started() as others:   # stopped before the in-process costs are measured
        baseline = others(_baseline(lab, config))

        def floor() -> GunicornServer:
            return others(GunicornServer.archway(lab.path("extender-floor"), quiet,
                                                 tls_ca=None, name="extender-floor"))
        figures["7"] = _prioritize({"now": server, "before": baseline}, floor, api,
                                   prometheus, pod, *specs[0])
    figures["7"].notes.append(_refresh_cost_in_process(prometheus, lab.path("refresh-cost")))
    figures["7"].notes.append(_herd_cost_in_process(pod))
    _filter_on_server(server, body, figures["8"])


def _baseline(lab: Lab, config: dict) -> GunicornServer:
    """Figure 7's baseline: the poller in the worker (bench/apps/poller_in_worker.py), or, with
    BENCH_EXTENDER_BASELINE_REPO, `archway serve` from that directory, to measure a change
    against the code before it. The directory must hold the package as Python imports it: an
    earlier commit's `archway/` with its room folders (extender, registry, webhook, gate, tools,
    certs) copied or linked inside it (pyproject's package-dir does that mapping only when
    installed)."""
    repo = os.environ.get("BENCH_EXTENDER_BASELINE_REPO")
    if repo:
        return GunicornServer(lab.path("extender-before"), "extender-before", ["archway.cli"],
                              config, tls_ca=None, repo=repo)
    return GunicornServer.module(lab.path("extender-before"), "bench.apps.poller_in_worker", config,
                                 tls_ca=None, name="extender-before")


# --- figure 8 ---------------------------------------------------------------------------------

def _filter_in_process(body: bytes, number: str, name: str, target: str) -> Figure:
    config = config_from_dict({"kubernetes": {"enabled": "off"}, "extender": {"node_cache": False}})
    extender = Extender(config, None)
    loads_times, filter_times, no_gc_times = [], [], []
    reply = b""
    for _ in range(rounds(FILTER_RUNS)):
        started = time.perf_counter()
        json.loads(body)
        loads_times.append(time.perf_counter() - started)
        gc.disable()
        try:
            started = time.perf_counter()
            json.loads(body)
            no_gc_times.append(time.perf_counter() - started)
        finally:
            gc.enable()
        started = time.perf_counter()
        reply, _summary = extender.filter(parse_extender_args(body))
        filter_times.append(time.perf_counter() - started)
    answer = json.loads(reply)
    kept, failed = len(answer["Nodes"]["items"]), len(answer["FailedAndUnresolvableNodes"])
    if (kept, failed) != (NODES // 2, NODES - NODES // 2):
        raise RuntimeError(f"filter kept {kept} and failed {failed} of {NODES} nodes")
    steady = ratios(filter_times, loads_times)    # run by run: each pair saw the same load
    ratio = steady.median
    return Figure(number, name, f"{steady.describe(unit='x')} ({median(filter_times) * 1000:.0f} ms vs "
                  f"{median(loads_times) * 1000:.0f} ms)", target, ratio <= FILTER_TARGET, [
        f"a {len(body) / 1e6:.0f} MB ExtenderArgs body (compact JSON, as kube-scheduler sends it) "
        f"of {NODES:,} Nodes of ~{len(body) // NODES // 1000} KB (50 status.images each), half "
        f"amd64, half arm64; pod annotated amd64; timed in one process: parse_extender_args + "
        f"Extender.filter (reply of {kept:,} Nodes and {failed:,} failures, {len(reply) / 1e6:.0f} MB, "
        f"built) vs json.loads(body), interleaved; figure = median of the per-run ratios",
        f"the extender keeps only each node's facts (name, arch, addresses) and leaves the "
        f"garbage collector alone (extender/wire.py); json.loads with the collector paused "
        f"takes {median(no_gc_times) * 1000:.0f} ms; against that the extender takes "
        f"{median(filter_times) / median(no_gc_times):.2f}x",
    ], rounds=steady)


def _filter_on_server(server: GunicornServer, body: bytes, figure: Figure) -> None:
    """Context for figure 8: the same call against the running extender, end to end."""
    mark = server.log_mark()
    client = []
    for _ in range(3):
        started = time.perf_counter()
        answer = server.post("/scheduler/filter", body, timeout=60)
        client.append(time.perf_counter() - started)
        answer.raise_for_status()
    time.sleep(0.2)
    logged = server.filter_times_ms(mark)
    if logged:
        figure.notes.append(
            f"the same call to archway serve (1 worker, plain HTTP): median {median(logged):.0f} ms "
            f"server side (the extender's log line: body read from the socket, parse, filter, reply "
            f"built), {median(client) * 1000:.0f} ms client side (sending and receiving included)")


# --- figure 7 ---------------------------------------------------------------------------------

def _prioritize(servers: dict[str, GunicornServer], floor, api: FakeApiServer,
                prometheus: Prometheus, pod: dict, number: str, name: str,
                target: str) -> Figure:
    names = [node_name(i) for i in range(NODES)]
    body = json.dumps({"Pod": pod, "Nodes": None, "NodeNames": names},
                      separators=(",", ":")).encode()
    # Distinct pods (uids), every other one with an expected-bandwidth annotation: each call
    # records a placement and later calls add the placed pods' traffic to their nodes.
    uid = pod["metadata"]["uid"].encode()
    bodies = []
    for k in range(PRIORITIZE_PODS):
        one = body.replace(uid, f"bench-pod-{k:04d}".encode())
        if k % 2:
            one = one.replace(b'"annotations":{', b'"annotations":{"archway.dev/expected-bandwidth":"5M",', 1)
        bodies.append(one)
    prometheus.wait_for("node_uname_info", NODES)
    scores = _wait_for_scores(servers["now"], body)
    servers["floor"] = floor()   # started once the others score: its one query sees every rate
    for other in servers.values():
        _wait_for_scores(other, body, timeout=180)
    start = {k: histogram_buckets(s.metrics(), HISTOGRAM, verb="prioritize")
             for k, s in servers.items()}
    client: dict[str, list[float]] = {k: [] for k in servers}
    stop = threading.Event()
    churn = threading.Thread(target=_churn_pods, args=(api, stop), daemon=True)
    churn.start()
    call, end = 0, time.monotonic() + PRIORITIZE_SECONDS
    try:
        while time.monotonic() < end:
            order = list(servers)[call % len(servers):] + list(servers)[:call % len(servers)]
            for key in order:
                started = time.perf_counter()
                answer = servers[key].post("/scheduler/prioritize", bodies[call % PRIORITIZE_PODS])
                client[key].append((time.perf_counter() - started) * 1000)
                answer.raise_for_status()
            call += 1
    finally:
        stop.set()
        churn.join(10)
    buckets = {k: bucket_difference(histogram_buckets(s.metrics(), HISTOGRAM, verb="prioritize"),
                                    start[k]) for k, s in servers.items()}
    side = {k: _server_side(b) for k, b in buckets.items()}
    within = share_at_most(buckets["now"], PRIORITIZE_TARGET_MS / 1000)
    p99 = histogram_quantile(buckets["now"], 0.99) * 1000
    ok = p99 < PRIORITIZE_TARGET_MS and within >= 0.99
    spread = sorted(set(scores))
    cp99 = {k: percentile(c, 99) for k, c in client.items()}
    return Figure(number, name, side["now"] + f"; client p50 {percentile(client['now'], 50):.1f} "
                  f"/ p99 {cp99['now']:.1f} ms; before: {side['before']}, client p99 "
                  f"{cp99['before']:.1f} ms; no refresh among the calls: {side['floor']}, client "
                  f"p99 {cp99['floor']:.1f} ms", target, ok, [
        f"{call:,} calls to each of three archway serve (1 worker x 8 threads, plain HTTP, as the "
        f"chart's extender sidecar), in turn, for {PRIORITIZE_SECONDS:g} s, {NODES:,} "
        f"NodeNames ({len(body) // 1000} KB) each; prometheus.refresh_seconds "
        f"{REFRESH_SECONDS:g} (about {PRIORITIZE_SECONDS / REFRESH_SECONDS:.0f} refreshes among "
        f"the calls) and {POD_EVENTS_PER_SECOND} pod updates a second in the API stand-in (pod "
        f"watch events); now: the traffic poller in a process of its own "
        f"(extender/pollerprocess.py); before: "
        + (f"archway serve from {os.environ['BENCH_EXTENDER_BASELINE_REPO']}"
           if os.environ.get("BENCH_EXTENDER_BASELINE_REPO") else
           "the poller elected among the workers (bench/apps/poller_in_worker.py)")
        + "; floor: as now, with no refresh among the calls",
        f"server side from {HISTOGRAM}{{verb=\"prioritize\"}} (p50/p99 interpolated inside its "
        f"5 ms / 10 ms buckets like histogram_quantile): now {within:.1%} <= 10 ms, "
        f"{share_at_most(buckets['now'], 0.005):.1%} <= 5 ms; before "
        f"{share_at_most(buckets['before'], 0.010):.1%} <= 10 ms, "
        f"{share_at_most(buckets['before'], 0.005):.1%} <= 5 ms; floor "
        f"{share_at_most(buckets['floor'], 0.010):.1%} <= 10 ms, "
        f"{share_at_most(buckets['floor'], 0.005):.1%} <= 5 ms; client side (request and "
        f"{NODES:,}-entry reply over keep-alive HTTP) p50 / p99: now "
        f"{percentile(client['now'], 50):.1f} / {cp99['now']:.1f} ms, before "
        f"{percentile(client['before'], 50):.1f} / {cp99['before']:.1f} ms, floor "
        f"{percentile(client['floor'], 50):.1f} / {cp99['floor']:.1f} ms",
        f"node cache listed from the API server stand-in ({NODES:,} full Nodes) and watching; "
        f"traffic and link speeds (100 Mb/s..25 Gb/s, every fifth node none) from a real "
        f"Prometheus scraping {NODES:,} nodes' node_exporter series, default archway queries, "
        f"nodename short names matched to FQDN node names; scores seen {spread[0]}..{spread[-1]}",
        f"herd control on: the pod watch lists {NODES:,} running pods (one per node) and watches; "
        f"the calls cycle through {PRIORITIZE_PODS} distinct pods (half annotated "
        f"archway.dev/expected-bandwidth: 5M), so every call after the first round adds the "
        f"estimated traffic of up to {PRIORITIZE_PODS - 1} placed pods to their nodes",
    ])


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


def _refresh_cost_in_process(prometheus: Prometheus, directory: str, runs: int = 15) -> str:
    """What a new sample costs the process that answers prioritize, on the bench's real
    Prometheus answer, interleaved in this process: before, the worker that polled parsed the
    answer and built the book; now a worker reads the poller process's snapshot file and swaps
    its book (the match to the series kept)."""
    settings = PrometheusSettings(url=prometheus.url)
    answer = prometheus.http.get(f"{prometheus.url}/api/v1/query",
                                 params={"query": combined_query(settings)}, timeout=60).content
    names = [node_name(i) for i in range(NODES)]
    traffic, capacity = split_answer(json.loads(answer), settings.node_label)
    shared = SharedSnapshot(directory)
    shared.write(traffic, capacity, time.time(), key_scores(traffic, capacity))
    matched = MatchedNodes(dict.fromkeys(names), traffic.keys())
    times: dict[str, list[float]] = {"before": [], "now": [], "parse": [], "read": []}
    for _ in range(runs):
        started = time.perf_counter()
        payload = json.loads(answer)
        times["parse"].append(time.perf_counter() - started)
        t, c = split_answer(payload, settings.node_label)
        book = ScoreBook(TrafficSnapshot(t, 0.0, 1, c), names, {}, "name")
        book.table.entries   # noqa: B018 - made per sample, as the poller's listener does
        times["before"].append(time.perf_counter() - started)
        started = time.perf_counter()
        data = SharedSnapshot(directory).read_if_new()
        times["read"].append(time.perf_counter() - started)
        assert data is not None
        ScoreBook.matched(TrafficSnapshot(data["traffic"], 0.0, 1, data["capacity"],
                                          prepared=prepared_of(data)), matched)
        times["now"].append(time.perf_counter() - started)
    ms = {k: median(v) * 1000 for k, v in times.items()}
    return (f"per new sample, the work in a process that answers prioritize, on this run's real "
            f"Prometheus answer ({len(answer) / 1e6:.1f} MB, {len(traffic) + len(capacity):,} "
            f"series), {runs} interleaved runs in this process, medians: before (parse, split, "
            f"book of {NODES:,} nodes) {ms['before']:.1f} ms, of which one json.loads holding "
            f"the GIL {ms['parse']:.1f} ms; now (read the poller process's snapshot file, "
            f"{os.path.getsize(shared.path) / 1e3:.0f} KB, and swap the book) {ms['now']:.1f} ms, "
            f"of which reading the file {ms['read']:.1f} ms ({ms['now'] / ms['before']:.2f}x)")


class _Nodes:
    """The node cache as prioritize reads it, already synced (bench only)."""

    def __init__(self, names):
        from archway.nodes import NodeFacts
        self.nodes = {n: NodeFacts(n, "amd64", ()) for n in names}

    def ensure_started(self):
        pass


def _herd_cost_in_process(pod: dict, runs: int = 300) -> str:
    """What herd control adds to prioritize itself: Extender.prioritize on the same 5,000-node
    snapshot with herd control on (50 placed pods) and off, interleaved, in this process."""
    names = [node_name(i) for i in range(NODES)]
    traffic = {node_name(i).split(".")[0]: traffic_rate(i) for i in range(NODES)}
    capacity = {node_name(i).split(".")[0]: 2 * link_speed(i) for i in range(NODES) if link_speed(i)}
    snapshot = TrafficSnapshot(traffic, time.monotonic(), 1, capacity, time.time() - 1)

    class Poller:
        def __init__(self):
            self.listeners: list = []

        def ensure_started(self):
            pass

        def fresh_snapshot(self):
            return snapshot

    extenders = {}
    for herd in (True, False):
        config = config_from_dict({"kubernetes": {"enabled": "off"},
                                   "extender": {"herd_control": herd}})
        extenders[herd] = Extender(config, None, node_cache=_Nodes(names), traffic=Poller())
    bodies = []
    for k in range(PRIORITIZE_PODS):
        one = copy.deepcopy(pod)
        one["metadata"]["uid"] = f"in-process-{k}"
        bodies.append(parse_extender_args(json.dumps({"Pod": one, "NodeNames": names}).encode()))
    times: dict = {True: [], False: []}
    for call in range(runs):
        for herd in (True, False):
            args = bodies[call % PRIORITIZE_PODS]
            started = time.perf_counter()
            extenders[herd].prioritize(args)
            times[herd].append(time.perf_counter() - started)
    on, off = median(times[True]) * 1000, median(times[False]) * 1000
    return (f"in this process, Extender.prioritize alone (body already parsed) on the same "
            f"{NODES:,}-node snapshot, {runs} interleaved calls each: herd control on "
            f"({PRIORITIZE_PODS} pods placed since the sample) median {on:.2f} ms, p99 "
            f"{percentile([t * 1000 for t in times[True]], 99):.2f} ms; off median {off:.2f} ms, "
            f"p99 {percentile([t * 1000 for t in times[False]], 99):.2f} ms (medians "
            f"{on / off:.2f}x)")


def _wait_for_scores(server: GunicornServer, body: bytes, timeout: float = 90.0) -> list[int]:
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
