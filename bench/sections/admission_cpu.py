"""Figure 1d: the server CPU one warm admission costs, archway beside a Go webhook writing
archway's patch.

The multi-arch fixture AdmissionReview of figures 1 and 2 (its image in a real docker-registry;
archway warm: the image and the pod's ServiceAccount cached), POSTed over one keep-alive TLS
connection each to `archway serve` (the section's config, 1 worker) and to the bench's Go webhook
(lab/cluster/go/patch-webhook), which decodes the review and the pod and allows it with the very
patch archway wrote for that review, taken from archway's first answer: both read the same bytes
and write the same patch. Blocks of calls, the two servers taking turns, each block with the
server it measures alone on one CPU, as figure 8b's (bench/common/cpucalls.py).

archway's CPU is that of every process of its `archway serve` but the gate controller's. One
worker, because one keep-alive connection is answered by one worker: a second would add its idle
upkeep only, charged to calls it never answered. The gate controller (a process of its own that
releases scheduling gates) takes no part in an admission; its CPU over the blocks is in the notes.
"""
import base64
import json
import os

from bench.common.cpucalls import (
    Caller,
    client_latency,
    cpu_blocks,
    idle_ms_per_s,
    pinning_note,
    ticks_note,
    upkeep_note,
)
from bench.common.lab import Lab, mutated_archs
from bench.common.pinning import CpuSplit, cpu_ns, process_tree
from bench.common.report import Figure
from bench.common.rounds import ratios
from bench.common.section import Started
from bench.common.servers import GunicornServer
from bench.common.stats import parse_metrics
from lab.cluster.nodeimages import go_binary
from lab.procs import Server, free_port

BLOCK_CALLS = 1000      # per block: ~0.7 s of archway's CPU and ~0.2 s of Go's: a GC or a timer averages out
CPU_BLOCKS = 10
WARM_CALLS = 200
RATIO_TARGET = 2.0
SPEC = ("1d", "server CPU per warm admission, archway vs a Go webhook writing archway's patch",
        f"<= {RATIO_TARGET:g}x")
ANSWER_KEYS = {"uid", "allowed", "patchType", "patch"}   # what the Go webhook's answer holds


def cpu_per_admission(lab: Lab, started: Started, config: dict, body: bytes,
                      split: CpuSplit | None) -> Figure:
    """Figure 1d on `config` (the section's: its registry and API stand-in) and `body`."""
    one_worker = dict(config, server=dict(config["server"], workers=1))
    archway = started(GunicornServer.archway(lab.path("admission-cpu"), one_worker,
                                             tls_ca=lab.ca.cert_path, name="archway-1d"))
    first = archway.post("/mutate", body)
    if mutated_archs(first) != {"amd64", "arm64", "arm"}:
        raise RuntimeError(f"the fixture pod was not mutated: {first.text[:300]}")
    answer = first.json()["response"]
    patch = base64.b64decode(answer["patch"])
    patch_file = os.path.join(lab.path("patch-webhook"), "patch.json")
    with open(patch_file, "wb") as f:
        f.write(patch)
    port = free_port()
    go = started(Server([go_binary("patch-webhook"), f"127.0.0.1:{port}", lab.serving.chain_path,
                         lab.serving.key_path, patch_file], port=port,
                        log_path=os.path.join(lab.path("patch-webhook"), "patch-webhook.log")))
    root = archway.server.proc.pid
    controller = {pid for c in archway.controller_pids() for pid in process_tree(c)}
    counted = [pid for pid in process_tree(root) if pid not in controller]
    callers = {"archway": started(Caller("archway", archway.port, root, counted, path="/mutate",
                                         ca=lab.ca.cert_path)),
               "go": started(Caller("Go", port, go.proc.pid, [go.proc.pid], path="/mutate",
                                    ca=lab.ca.cert_path))}
    sizes = _warm(callers, body, json.loads(body)["request"]["uid"], patch)
    idle = idle_ms_per_s(callers)

    counts = _counts(archway)
    gate = sum(cpu_ns(pid) for pid in controller)
    per_call = cpu_blocks(callers, body, calls=BLOCK_CALLS, blocks=CPU_BLOCKS, split=split)
    gate_ms = (sum(cpu_ns(pid) for pid in controller) - gate) / callers["archway"].calls / 1e6
    counts = {k: v - counts.get(k, 0.0) for k, v in _counts(archway).items()}
    ours, theirs = per_call["archway"], per_call["go"]
    ratio = ratios(ours.values, theirs.values)
    calls = callers["archway"].calls
    warm = counts.get("mutated") == calls and counts.get("fresh") == calls and not counts.get("other")
    once = all(c.connects == 1 for c in callers.values())
    return Figure(*SPEC[:2], f"archway {ours.median:.3f} ms ±{ours.spread_text} vs Go "
                  f"{theirs.median:.3f} ms ±{theirs.spread_text} ({ratio.median:.1f}x "
                  f"±{ratio.spread_text})",
                  SPEC[2], ratio.median <= RATIO_TARGET and warm and once, [
        f"the multi-arch fixture AdmissionReview ({len(body) / 1e3:.1f} KB, one container, its "
        f"image a 3-platform index in a real docker-registry) POSTed over one keep-alive TLS "
        f"connection each (connections opened: archway {callers['archway'].connects}, Go "
        f"{callers['go'].connects}) to archway serve (the section's config, 1 worker) and to "
        f"the Go webhook (lab/cluster/go/patch-webhook: decodes the review and the pod's "
        f"metadata and images, allows it with PATCHFILE's bytes as its JSON patch); the patch "
        f"is archway's own for this review ({len(patch)} bytes, from its first answer), so "
        f"both write the same patch (answers of {sizes['archway']} and {sizes['go']} bytes"
        f"{_extra(answer)})",
        f"{WARM_CALLS} calls each to warm up, then blocks of {BLOCK_CALLS} calls, the two "
        f"taking turns; a block's figure = the server's CPU over the block (its processes' CPU "
        f"clocks: every thread's sum_exec_runtime) / its calls; the figure = the median of the "
        f"blocks' ratios archway / Go; over the blocks archway_admissions_total"
        f"{{outcome=\"mutated\"}} grew by {counts.get('mutated', 0):.0f} and "
        f"archway_cache_lookups_total{{result=\"fresh\"}} by {counts.get('fresh', 0):.0f} for "
        f"{calls} calls (other lookup results: {counts.get('other', 0):.0f}): every answer a "
        f"mutation from the warm cache",
        f"archway's CPU: every process of its archway serve but the gate controller's "
        f"({len(counted)}: {_roles(archway, counted)}). 1 worker because one "
        f"keep-alive connection is answered by one worker (a second would only add its idle "
        f"upkeep, charged to calls it never answered; as 8b); the gate controller, a process "
        f"of its own that releases scheduling gates, takes no part in an admission: it used "
        f"{gate_ms:.3f} ms per call over the blocks, not counted",
        upkeep_note(callers, idle),
        pinning_note(split, "the Go webhook", "one Python worker answers archway's calls"),
        f"per block: archway {ours.describe('{:.3f}', ' ms')}, Go "
        f"{theirs.describe('{:.3f}', ' ms')}; {ticks_note(callers)}; {client_latency(callers)}",
    ], rounds=ratio, data={"cpu_per_call_ms": {"archway": list(ours.values),
                                               "go": list(theirs.values)}})


def _warm(callers: dict[str, Caller], body: bytes, uid: str, patch: bytes) -> dict[str, int]:
    """WARM_CALLS calls each; both answer this review's uid with exactly `patch`. Returns the
    size of each one's answer (its body, in bytes)."""
    sizes = {}
    for name, caller in callers.items():
        for _ in range(WARM_CALLS):
            data = caller.call(body)
        answer = json.loads(data)["response"]
        if answer.get("uid") != uid or base64.b64decode(answer.get("patch", "")) != patch:
            raise RuntimeError(f"{caller.name} answered another uid or patch: {data[:300]!r}")
        sizes[name] = len(data)
    return sizes


def _counts(archway: GunicornServer) -> dict[str, float]:
    """Mutated admissions, fresh cache lookups and lookups of any other result, so far."""
    counts = {"mutated": 0.0, "fresh": 0.0, "other": 0.0}
    for name, labels, value in parse_metrics(archway.metrics()):
        if name == "archway_admissions_total" and labels.get("outcome") == "mutated":
            counts["mutated"] += value
        elif name == "archway_cache_lookups_total":
            counts["fresh" if labels.get("result") == "fresh" else "other"] += value
    return counts


def _roles(archway: GunicornServer, counted: list[int]) -> str:
    root, master, workers = archway.server.proc.pid, archway.master_pid, set(archway.worker_pids())

    def role(pid: int) -> str:
        if pid in workers:
            return "its worker"
        if pid == master:
            return "gunicorn's master" + (", the serve process itself" if pid == root else "")
        return "the serve process" if pid == root else f"process {pid}"
    return ", ".join(map(role, counted))


def _extra(answer: dict) -> str:
    extra = sorted(set(answer) - ANSWER_KEYS)
    return f"; archway's also holds {', '.join(extra)}, the Go one not" if extra else ""
