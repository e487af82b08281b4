"""Figure 8b: the server CPU one filter call costs, archway's extender beside a Go one.

One filter call with 100 NodeNames (nodeCacheCapable, what the chart configures; the node cache
listing 100 Nodes from the API stand-in), as kube-scheduler sends it for a small cluster, to
`archway serve` as the chart's extender sidecar (plain HTTP on loopback, 1 worker) and to the
bench's pass-all Go extender (lab/cluster/go/passall-extender), each over one keep-alive
connection. Blocks of calls, the two servers taking turns, each block with the server it
measures alone on one CPU; a block's figure is the server's CPU time over the block divided by
its calls (bench/common/cpucalls.py, as figure 1d).
"""
import json
import time

from bench.common.cpucalls import Caller, client_latency, cpu_blocks, pinning_note, ticks_note
from bench.common.extender_cluster import extender_pod, make_nodes
from bench.common.lab import Lab
from bench.common.pinning import CpuSplit
from bench.common.report import Figure
from bench.common.section import Started
from bench.common.servers import GunicornServer
from lab.cluster.nodeimages import go_binary
from lab.procs import Server, free_port
from lab.servers.apiserver import FakeApiServer

FILTER_NAMES = 100
BLOCK_CALLS = 200       # per block: ~40-80 ms of server CPU, read to the nanosecond
FILTER_BLOCKS = 10
WARM_CALLS = 200
FILTER_CPU_TARGET_MS = 0.5
FILTER_PATH = "/scheduler/filter"
SPEC = ("8b", f"extender filter, {FILTER_NAMES} NodeNames: server CPU per call, vs a Go "
        f"pass-all extender", f"<= {FILTER_CPU_TARGET_MS} ms")


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
                                         [archway.master_pid, *archway.worker_pids()],
                                         path=FILTER_PATH)),
               "go": started(Caller("Go", port, go.proc.pid, [go.proc.pid], path=FILTER_PATH))}
    kept = _wait_for_node_cache(archway, callers["archway"], body)
    for caller in callers.values():
        for _ in range(WARM_CALLS):
            caller.call(body)

    per_call = cpu_blocks(callers, body, calls=BLOCK_CALLS, blocks=FILTER_BLOCKS, split=split)
    ours, theirs = per_call["archway"], per_call["go"]
    return Figure(*SPEC[:2], f"archway {ours.describe('{:.3f}', ' ms')} vs Go "
                  f"{theirs.median:.3f} ms ({ours.median / theirs.median:.1f}x); "
                  f"{client_latency(callers)}", SPEC[2],
                  ours.median <= FILTER_CPU_TARGET_MS, [
        f"one filter call with {FILTER_NAMES} NodeNames ({len(body) / 1e3:.1f} KB; nodeCacheCapable, "
        f"the node cache listing {FILTER_NAMES} Nodes from the API stand-in, pod annotated amd64: "
        f"{kept} kept), to archway serve (1 worker, plain HTTP, the chart's extender sidecar) "
        f"and to the Go pass-all extender (lab/cluster/go/passall-extender), one keep-alive "
        f"connection each; {WARM_CALLS} calls each to warm up, then blocks of {BLOCK_CALLS} "
        f"calls, the two taking turns; a block's figure = the server's CPU over the block "
        f"(its processes' CPU clocks: every thread's sum_exec_runtime) / its calls",
        pinning_note(split, "the Go extender", "one Python worker answers archway's calls"),
        f"Go per block: {theirs.describe('{:.3f}', ' ms')}; {ticks_note(callers)}",
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
