"""Figures 7, 8 and 8b: the scheduler extender with 5,000 nodes, and one small filter call's CPU.

7. prioritize in NodeNames mode (nodeCacheCapable, what the chart configures): `archway serve`
   as the chart's sidecar runs it (plain HTTP on loopback, 1 worker), its node cache listing and
   watching 5,000 Nodes from the API server stand-in, its traffic from a real Prometheus that
   scrapes 5,000 nodes' series. Measured while the background readers are busy: a traffic
   refresh every 2 s and pod watch events all along. Side by side, in blocks of calls taking
   turns, the same server with the poller in the worker as before issue 28
   (bench/apps/poller_in_worker.py) and one with no refresh among the calls. The extender's own
   work (issue 37): the server of a block alone on one CPU, everything else the bench runs on
   the other (bench/sections/extender_prioritize.py, bench/common/pinning.py); server side =
   the extender's own latency histogram, with its CPU time per call beside it.
8. filter with 5,000 full Node objects: in this process, the extender's work on a received body
   (parse_extender_args + Extender.filter, reply bytes included) against plain json.loads of the
   same body, interleaved, median of several runs; the real server's time is given as context.
8b. filter with 100 NodeNames: server CPU per call, archway beside the Go pass-all extender
   (bench/sections/extender_cpu.py).
"""
import copy
import gc
import json
import os
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
from bench.common.pinning import CpuSplit, released
from bench.common.report import Figure, failed_figure
from bench.common.rounds import ratios, rounds
from bench.common.section import Started, measured
from bench.common.servers import GunicornServer
from bench.common.stats import median, percentile
from bench.sections import extender_cpu
from bench.sections.extender_prioritize import PRIORITIZE_PODS, PRIORITIZE_TARGET_MS, prioritize
from lab.servers.apiserver import FakeApiServer

REFRESH_SECONDS = 2.0       # prometheus.refresh_seconds: many refreshes among the calls
FILTER_RUNS = 5
FILTER_TARGET = 1.5


def run(lab: Lab) -> list[Figure]:
    specs = (("7", f"extender prioritize, {NODES:,} nodes, NodeNames mode, herd control on",
              f"p99 <= {PRIORITIZE_TARGET_MS:g} ms"),
             ("8", f"extender filter, {NODES:,} full Node objects, vs plain json.loads",
              f"<= {FILTER_TARGET}x"),
             extender_cpu.SPEC)
    figures: dict[str, Figure] = {}
    with Started() as started:
        # The bench's own threads and every process it starts from here on away from the CPU
        # the measured server gets (none to spare on one CPU).
        split = CpuSplit.of_machine()
        if split:
            split.pin_bench()
            started.callback(split.restore)
        for number, measure in (("8b", _filter_cpu), ("7", _measure)):
            try:
                measure(lab, split, specs, figures)
            except Exception as e:   # the figures measured before it still count
                for spec in specs:
                    if spec[0] == number or (number == "7" and spec[0] == "8"):
                        figures.setdefault(spec[0], failed_figure(*spec, e))
    return [figures[spec[0]] for spec in specs]


def _filter_cpu(lab: Lab, split: CpuSplit | None, specs, figures: dict[str, Figure]) -> None:
    """Figure 8b first, before Prometheus scrapes 5,000 nodes' series beside it."""
    with Started() as started:
        figures["8b"] = extender_cpu.filter_cpu(lab, started, split)


def _measure(lab: Lab, split: CpuSplit | None, specs, figures: dict[str, Figure]) -> None:
    with Started() as started:
        _measure_5000(lab, started, split, specs, figures)


def _measure_5000(lab: Lab, started: Started, split: CpuSplit | None, specs,
                  figures: dict[str, Figure]) -> None:
    exporter = started(ManyNodesExporter())
    # its first scrapes take ~8 s
    prometheus = started(Prometheus(lab.path("prometheus"), exporter))
    nodes = make_nodes()
    pod = extender_pod("amd64")
    body = json.dumps({"Pod": pod, "Nodes": {"metadata": {"resourceVersion": "48377"},
                                             "items": nodes}, "NodeNames": None},
                      separators=(",", ":")).encode()
    with released(split):   # timed in this process: on every CPU, as before pinning
        figures["8"], = measured([specs[1]], lambda _: [_filter_in_process(body, *specs[1])])
    api = started(FakeApiServer())
    for node in nodes:
        api.put(f"/api/v1/nodes/{node['metadata']['name']}", node)
    for running in running_pods():
        api.put(f"/api/v1/namespaces/bench/pods/{running['metadata']['name']}", running)
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
        before = (f"archway serve from {os.environ['BENCH_EXTENDER_BASELINE_REPO']}"
                  if os.environ.get("BENCH_EXTENDER_BASELINE_REPO") else
                  "the poller elected among the workers (bench/apps/poller_in_worker.py)")
        figures["7"] = prioritize({"now": server, "before": baseline}, floor, api, prometheus,
                                  pod, split, specs[0], before, REFRESH_SECONDS)
    with released(split):
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
        return GunicornServer(lab.path("extender-before"), "extender-before", ["archway.main.cli"],
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


# --- figure 7's notes ------------------------------------------------------------------------

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
        from archway.cluster.nodes import NodeFacts
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
