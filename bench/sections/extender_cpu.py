"""Figure 8b: the server CPU one filter call costs, archway's extender beside a Go one.

One filter call with 100 NodeNames (nodeCacheCapable, what the chart configures; the node cache
listing 100 Nodes from the API stand-in), as kube-scheduler sends it for a small cluster, to
`archway serve` as the chart's extender sidecar (plain HTTP on loopback, 1 worker) and to the
bench's pass-all Go extender (lab/cluster/go/passall-extender), each over one keep-alive
connection. Blocks of calls, the two servers taking turns (bench/common/rounds.py), each block
with the server it measures alone on one CPU (bench/common/pinning.py); a block's figure is the
server's CPU time over the block divided by its calls.
"""
import http.client
import json
import time

from bench.common.extender_cluster import extender_pod, make_nodes
from bench.common.lab import Lab
from bench.common.pinning import CpuSplit, cpu_ns, unpinned_note
from bench.common.report import Figure
from bench.common.rounds import interleaved, rounds, steady
from bench.common.section import Started
from bench.common.servers import GunicornServer, cpu_seconds
from bench.common.stats import percentile
from lab.cluster.nodeimages import go_binary
from lab.procs import Server, free_port
from lab.servers.apiserver import FakeApiServer

FILTER_NAMES = 100
BLOCK_CALLS = 200       # per block: ~40-80 ms of server CPU, read to the nanosecond
FILTER_BLOCKS = 10
WARM_CALLS = 200
FILTER_CPU_TARGET_MS = 0.5
SPEC = ("8b", f"extender filter, {FILTER_NAMES} NodeNames: server CPU per call, vs a Go "
        f"pass-all extender", f"<= {FILTER_CPU_TARGET_MS} ms")


class Caller:
    """One server under measurement: a keep-alive connection, the processes whose CPU counts,
    and every call's client-side latency."""

    def __init__(self, name: str, port: int, root: int, pids: list[int]):
        self.name, self.root, self.pids = name, root, pids
        self.connection = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        self.latencies_ms: list[float] = []
        self.calls = 0
        self.cpu_ticks = 0.0   # the coarse cross-check, from the first block on

    def call(self, body: bytes) -> bytes:
        self.connection.request("POST", "/scheduler/filter", body,
                                {"Content-Type": "application/json"})
        answer = self.connection.getresponse()
        data = answer.read()
        if answer.status != 200:
            raise RuntimeError(f"{self.name}: filter answered {answer.status}: {data[:200]!r}")
        return data

    def block(self, body: bytes, calls: int) -> float:
        """Server CPU per call over `calls` calls, in ms."""
        if not self.calls:
            self.cpu_ticks = sum(cpu_seconds(pid) for pid in self.pids)
        before = sum(cpu_ns(pid) for pid in self.pids)
        for _ in range(calls):
            started = time.perf_counter()
            self.call(body)
            self.latencies_ms.append((time.perf_counter() - started) * 1000)
        self.calls += calls
        return (sum(cpu_ns(pid) for pid in self.pids) - before) / calls / 1e6

    def ticks_per_call_ms(self) -> float:
        spent = sum(cpu_seconds(pid) for pid in self.pids) - self.cpu_ticks
        return spent / self.calls * 1000

    def stop(self) -> None:
        self.connection.close()


def filter_cpu(lab: Lab, started: Started, split: CpuSplit | None) -> Figure:
    api = started(FakeApiServer())
    nodes = make_nodes(FILTER_NAMES)
    for node in nodes:
        api.put(f"/api/v1/nodes/{node['metadata']['name']}", node)
    names = [node["metadata"]["name"] for node in nodes]
    body = json.dumps({"Pod": extender_pod("amd64"), "Nodes": None, "NodeNames": names},
                      separators=(",", ":")).encode()
    config = lab.archway_config(
        "extender", server={"tls": False, "cert_file": None, "key_file": None, "workers": 1},
        kubernetes={"enabled": "auto", "kubeconfig": api.kubeconfig(lab.path("kube-filter-cpu"))})
    archway = started(GunicornServer.archway(lab.path("extender-filter-cpu"), config,
                                             tls_ca=None, name="extender-filter-cpu"))
    port = free_port()
    go = started(Server([go_binary("passall-extender"), f"127.0.0.1:{port}"], port=port,
                        log_path=f"{lab.path('passall-extender')}/passall-extender.log"))
    callers = {"archway": started(Caller("archway", archway.port, archway.master_pid,
                                         [archway.master_pid, *archway.worker_pids()])),
               "go": started(Caller("go", port, go.proc.pid, [go.proc.pid]))}
    kept = _wait_for_node_cache(archway, callers["archway"], body)
    for caller in callers.values():
        for _ in range(WARM_CALLS):
            caller.call(body)

    def side(name: str):
        def block() -> float:
            if split:
                split.measure(callers[name].root,
                              others=[c.root for c in callers.values() if c.name != name])
            return callers[name].block(body, BLOCK_CALLS)
        return block

    per_call = {k: steady(v) for k, v in interleaved(
        {name: side(name) for name in callers}, rounds(FILTER_BLOCKS)).items()}
    ours, theirs = per_call["archway"], per_call["go"]
    client = {k: (percentile(c.latencies_ms, 50), percentile(c.latencies_ms, 99))
              for k, c in callers.items()}
    return Figure(*SPEC[:2], f"archway {ours.describe('{:.3f}', ' ms')} vs Go "
                  f"{theirs.median:.3f} ms ({ours.median / theirs.median:.1f}x); client p50 / p99 "
                  f"archway {client['archway'][0]:.2f} / {client['archway'][1]:.2f} ms, Go "
                  f"{client['go'][0]:.2f} / {client['go'][1]:.2f} ms", SPEC[2],
                  ours.median <= FILTER_CPU_TARGET_MS, [
        f"one filter call with {FILTER_NAMES} NodeNames ({len(body) / 1e3:.1f} KB; nodeCacheCapable, "
        f"the node cache listing {FILTER_NAMES} Nodes from the API stand-in, pod annotated amd64: "
        f"{kept} kept), to archway serve (1 worker, plain HTTP, the chart's extender sidecar) "
        f"and to the Go pass-all extender (lab/cluster/go/passall-extender), one keep-alive "
        f"connection each; {WARM_CALLS} calls each to warm up, then blocks of {BLOCK_CALLS} "
        f"calls, the two taking turns; a block's figure = the server's CPU over the block "
        f"(its processes' CPU clocks: every thread's sum_exec_runtime) / its calls",
        (f"{split.describe()}; the Go extender started on the bench's CPU(s), so its runtime "
         f"sized GOMAXPROCS to {len(split.others)} (one Python worker answers archway's calls)")
        if split else unpinned_note(),
        f"Go per block: {theirs.describe('{:.3f}', ' ms')}; cross-check over all blocks from "
        f"/proc/PID/stat utime+stime (10 ms ticks): archway "
        f"{callers['archway'].ticks_per_call_ms():.3f} ms, Go {callers['go'].ticks_per_call_ms():.3f} ms "
        f"per call",
    ], rounds=ours, data={"cpu_per_call_ms": {"archway": list(ours.values),
                                               "go": list(theirs.values)}})


def _wait_for_node_cache(server: GunicornServer, caller: Caller, body: bytes,
                         timeout: float = 60.0) -> int:
    """Until the node cache has synced and a filter keeps the amd64 half; returns how many."""
    end = time.monotonic() + timeout
    kept = None
    while time.monotonic() < end:
        answer = json.loads(caller.call(body))
        kept = len(answer.get("NodeNames") or [])
        if kept == FILTER_NAMES // 2 and "node cache synced" in server.log_since(0):
            return kept
        time.sleep(0.2)
    raise TimeoutError(f"archway's filter kept {kept} of {FILTER_NAMES} names or its node cache "
                       f"never synced; log:\n{server.log_since(0)[-3000:]}")
