"""Figures 25 and 25a (issue 28, the start of the `scale` section): archway on the real control plane
with KWOK-simulated Nodes (lab/cluster/kwok.py) at three sizes, each its own fresh cluster.

25a: archway's memory against the cluster's size: RSS of the webhook's workers and of the
    extender's worker once their caches are synced, at each size, and the growth per Node from
    the smallest to the largest size (what the Sizing page will extrapolate from).
25: archway's requests to the apiserver per pod created during a burst (a Deployment of BURST
    pods, created through the apiserver, until every pod is Running on KWOK Nodes), from the
    audit log: every request of archway's ServiceAccounts in that window but the watches it
    keeps open; target <= 0.01 (watches, never a read per pod). Lease renewals of the gate
    controller's leader election are counted apart (they are per second, not per pod).
25b-25d at every size (load.py), 25e-25g at the largest (events.py), formatted by figures.py;
25h (the image records at each size) and 25i (records on vs off) in records.py;
sizes from ARCHWAY_SCALE_SIZES (default 100,1000,5000); ARCHWAY_SCALE_RECORDS_OFF names sizes
measured a second time with the records off (default none); ARCHWAY_SCALE_EVENTS names the
largest size's measurements to take (default relist,failover,schedule; the others read "left
out").
"""
import json
import os
import sys
import time

from bench.common.lab import Lab
from bench.common.plots import plot
from bench.common.report import Figure, load_average
from bench.common.section import Started, measured
from bench.common.servers import children, cpu_seconds, is_gate_controller, rss_bytes
from lab.cluster.chart import ChartInstall
from lab.cluster.controlplane import ControlPlane
from lab.cluster.kwok import LABEL, Kwok
from lab.procs import REPO
from lab.servers.proxy import DelayProxy
from lab.servers.registry import RegistryServer

from . import events, figures, load, records
from .load import ACCOUNTS

# The largest size also gets the relist, the failover and the schedulers' race (events.py).
SIZES = tuple(int(n) for n in os.environ.get("ARCHWAY_SCALE_SIZES", "100,1000,5000").split(","))
EVENTS = tuple(os.environ.get("ARCHWAY_SCALE_EVENTS", "relist,failover,schedule").split(","))
RECORDS_OFF = tuple(int(n) for n in os.environ.get("ARCHWAY_SCALE_RECORDS_OFF", "").split(",") if n)
BURST = 100
REST_SECONDS = 30     # at rest: CPU and requests per minute (the watches, the Lease renewals)
DEADLINE = 1.0        # admission.deadline_seconds: a pod through the slow registry is gated
REQUESTS_PER_POD_TARGET = 0.01
RESULTS = os.path.join(REPO, "bench", "results")
SPECS = (("25a", f"archway RSS against cluster size ({', '.join(map(str, SIZES))} KWOK Nodes)", "info"),
         ("25", f"archway's apiserver requests per pod, burst of {BURST} pods", f"<= {REQUESTS_PER_POD_TARGET}"),
         *figures.SPECS, *records.SPECS)


def run(lab: Lab) -> list[Figure]:
    return measured(SPECS, lambda started: _measure(lab, started))


def _measure(lab: Lab, started: Started) -> list[Figure]:
    registry = started(RegistryServer(lab.path("scale-registry")))
    registry.push_index("bench/multi", "1", ["linux/amd64", "linux/arm64"])
    registry.push_index("bench/gated", "1", ["linux/amd64", "linux/arm64"])
    slow = started(DelayProxy(registry.port))
    sizes: list[dict] = []
    off: list[dict] = []
    stopped = ""
    for nodes, records_on in [(n, on) for n in SIZES for on in (True, False)
                              if on or n in RECORDS_OFF]:
        try:
            (sizes if records_on else off).append(_one_size(lab, registry, slow, nodes, records_on))
            _keep(sizes, off, "")
        except Exception as e:   # the sizes measured so far still count; say where it stopped
            stopped = f"{nodes:,} Nodes, records {'on' if records_on else 'off'}: " \
                      f"{type(e).__name__}: {str(e)[:300]}"
            step(f"stopped at {stopped}")
            break
    if not sizes:
        raise RuntimeError(stopped)
    _keep(sizes, off, stopped)
    # Each kind of figure made on its own: one that cannot be made leaves the others.
    made = [*measured([SPECS[0]], lambda _: [memory_figure(sizes)]),
            *measured([SPECS[1]], lambda _: [requests_figure(sizes)]),
            *measured([SPECS[2]], lambda _: figures.figures(sizes)),
            *measured([records.SPECS[0]], lambda _: [records.records_figure(sizes, BURST)]),
            *measured([records.SPECS[1]], lambda _: [records.on_off_figure(sizes, off, BURST)])]
    if stopped:
        made[0].notes.append(f"stopped at {stopped}")
    return made


def _keep(sizes: list[dict], off: list[dict], stopped: str) -> None:
    """What was measured so far, kept whatever becomes of the rest (a size takes minutes)."""
    os.makedirs(RESULTS, exist_ok=True)
    with open(os.path.join(RESULTS, "scale-raw.json"), "w") as f:
        json.dump({"sizes": sizes, "records_off": off, "stopped": stopped}, f, indent=1,
                  default=str)


def step(what: str) -> None:
    """Where the section is, on stderr: a size takes minutes."""
    print(f"scale {time.strftime('%H:%M:%S')} load {load_average()}: {what}", file=sys.stderr,
          flush=True)


def _events(plane: ControlPlane, install: ChartInstall, registry: RegistryServer,
            slow: DelayProxy) -> dict:
    """The largest size's figures, each caught on its own (one failing leaves the others)."""
    image = f"{registry.host}/bench/multi:1"
    runs = {"relist": lambda: events.relist(plane, install, image),
            "failover": lambda: events.failover(plane, install, slow, f"{slow.host}/bench/gated:1"),
            "schedule": lambda: events.schedule(plane, install, image)}
    found: dict = {}
    for name, measure in runs.items():
        if name not in EVENTS:
            found[name] = {"left_out": True}
            continue
        step(name)
        try:
            found[name] = {**measure(), "load": load_average()}
        except Exception as e:
            found[name] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"}
    return found


def _one_size(lab: Lab, registry: RegistryServer, slow: DelayProxy, nodes: int,
              records_on: bool = True) -> dict:
    with Started() as cluster:   # each size its own fresh cluster
        plane = cluster(ControlPlane(lab.path(f"scale-{nodes}" + ("" if records_on else "-off"))))
        step(f"{nodes} Nodes (records {'on' if records_on else 'off'}): control plane and KWOK")
        started = time.monotonic()
        plane.start()
        kwok = Kwok(plane).start()
        kwok.wait_ready(kwok.add_nodes(nodes), timeout=900)
        ready = time.monotonic() - started
        step(f"{nodes} Nodes Ready; installing archway")
        install = ChartInstall(plane, archway_config={
            "registry": {"insecure_hosts": [registry.host, slow.host], "timeout_seconds": 2.0},
            "admission": {"deadline_seconds": DEADLINE}},
            values=None if records_on else records.OFF_VALUES)
        cluster.callback(install.stop_processes)
        installed = plane.audit_mark()
        install.install()
        assert install.webhook and install.extender
        time.sleep(5)   # the caches listed at boot; let the lists' garbage go
        webhook = children(install.webhook.process.pid)
        procs = {"webhook": [p for p in webhook if not is_gate_controller(p)],
                 "controller": [p for p in webhook if is_gate_controller(p)],
                 "extender": children(install.extender.process.pid),
                 "masters": [install.webhook.process.pid, install.extender.process.pid]}
        rss = {k: [rss_bytes(p) for p in pids] for k, pids in procs.items()}
        before = _cpu(procs)
        step(f"{nodes} Nodes: at rest")
        at_rest = load.at_rest(plane, REST_SECONDS)
        rest = {k: (v - before[k]) / REST_SECONDS for k, v in _cpu(procs).items()}
        rest_load = load_average()
        namespace = plane.new_namespace("burst")
        kube = plane.kube
        assert kube is not None
        mark = plane.audit_mark()
        before = _cpu(procs)
        step(f"{nodes} Nodes: burst")
        burst_started = time.monotonic()
        kube.create(f"/apis/apps/v1/namespaces/{namespace}/deployments", {
            "metadata": {"name": "burst"},
            "spec": {"replicas": BURST, "selector": {"matchLabels": {"app": "burst"}},
                     "template": {"metadata": {"labels": {"app": "burst"}},
                                  "spec": {"nodeSelector": {LABEL: "kwok"}, "containers": [
                                      {"name": "c", "image": f"{registry.host}/bench/multi:1"}]}}}})
        kube.wait_for(lambda: sum(p.get("status", {}).get("phase") == "Running" for p in
                                  kube.items(f"/api/v1/namespaces/{namespace}/pods")) >= BURST,
                      timeout=300, what=f"{BURST} pods Running")
        burst = time.monotonic() - burst_started
        in_burst = {k: v - before[k] for k, v in _cpu(procs).items()}
        found = {"nodes": nodes, "ready_s": ready, "rss": rss, "burst_s": burst,
                 "cpu_rest": rest, "cpu_burst": in_burst, "rest_load": rest_load,
                 "requests": _archway_requests(plane, mark), "at_rest": at_rest}
        image = f"{registry.host}/bench/multi:1"
        step(f"{nodes} Nodes: startup latency")
        found["startup"] = {**load.startup(plane, image), "load": load_average()}
        step(f"{nodes} Nodes: the apiserver's latency")
        found["apiserver"] = {**load.apiserver(plane, image), "load": load_average()}
        if nodes == max(SIZES) and records_on:
            found["events"] = _events(plane, install, registry, slow)
        found["records"] = {"on": records_on, "objects": records.record_objects(kube),
                            "requests": records.records_requests(plane, installed)}
        return found


def _cpu(procs: dict[str, list[int]]) -> dict[str, float]:
    """CPU seconds used so far, per kind of process: the busiest of its processes."""
    return {k: max((cpu_seconds(p) for p in pids), default=0.0) for k, pids in procs.items()}


def _archway_requests(plane: ControlPlane, mark: int) -> dict[str, int]:
    """verb + resource -> count of archway's requests since `mark`, watches left out."""
    counts: dict[str, int] = {}
    with open(plane.path("audit.log"), "rb") as f:
        f.seek(mark)
        for line in f:
            event = json.loads(line)
            if not event.get("user", {}).get("username", "").startswith(ACCOUNTS):
                continue
            if event["verb"] == "watch":
                continue
            resource = (event.get("objectRef") or {}).get("resource", "?")
            key = f"{event['verb']} {resource}"
            counts[key] = counts.get(key, 0) + 1
    return counts


def memory_figure(sizes: list[dict]) -> Figure:
    def mb(values):
        return "/".join(f"{v / 1e6:.0f}" for v in values)
    def cpu(s, k):
        return (f"{s['cpu_rest'][k] * 1000:.0f} m at rest, {s['cpu_burst'][k]:.2f} s in the "
                f"{s['burst_s']:.0f} s burst")
    rows = [f"{s['nodes']:,} Nodes: webhook workers {mb(s['rss']['webhook'])} MB ({cpu(s, 'webhook')}), "
            f"gate controller (leader) {mb(s['rss']['controller'])} MB ({cpu(s, 'controller')}), "
            f"extender worker {mb(s['rss']['extender'])} MB ({cpu(s, 'extender')}), gunicorn "
            f"masters {mb(s['rss']['masters'])} MB (Nodes Ready {s['ready_s']:.0f} s after start)"
            for s in sizes]
    first, last = sizes[0], sizes[-1]
    grow = {k: (max(last["rss"][k]) - max(first["rss"][k])) / max(1, last["nodes"] - first["nodes"])
            for k in ("webhook", "extender")}
    return Figure("25a", SPECS[0][1],
                  f"webhook worker {mb([max(s['rss']['webhook']) for s in sizes])} MB, extender "
                  f"{mb([max(s['rss']['extender']) for s in sizes])} MB; +{grow['webhook'] / 1e3:.1f}"
                  f" / +{grow['extender'] / 1e3:.1f} KB per Node", "info", None,
                  ["RSS (/proc VmRSS) of each `archway serve` worker the chart's config runs, "
                   "5 s after install (node, namespace, workload caches and the pod watch "
                   "synced), one fresh control plane + KWOK per size", *rows],
                  data={"plots": memory_plot(sizes)})


def memory_plot(sizes: list[dict]) -> dict:
    """25a's curves: the largest of each kind's processes, the smallest beside it."""
    nodes = [s["nodes"] for s in sizes]
    return plot("scale-memory", "archway's memory per process against cluster size (figure "
                "25a; the largest of a kind's processes)",
                "cluster size (KWOK Nodes)", "RSS per process, caches synced (MB)", {
                    label: {"x": nodes, "y": [max(s["rss"][kind]) / 1e6 for s in sizes],
                            "low": [min(s["rss"][kind]) / 1e6 for s in sizes],
                            "high": [max(s["rss"][kind]) / 1e6 for s in sizes]}
                    for label, kind in (("webhook worker", "webhook"),
                                        ("gate controller (leader)", "controller"),
                                        ("extender worker", "extender"))}, log_x=True,
                whiskers="down to the smallest of them")


def requests_figure(sizes: list[dict]) -> Figure:
    per_pod, notes = [], []
    for s in sizes:
        leases = sum(n for k, n in s["requests"].items() if k.endswith(" leases"))
        others = {k: n for k, n in s["requests"].items() if not k.endswith(" leases")}
        per_pod.append(sum(others.values()) / BURST)
        notes.append(f"{s['nodes']:,} Nodes: {sum(others.values())} requests in the "
                     f"{s['burst_s']:.1f} s burst ({', '.join(f'{k} {n}' for k, n in sorted(others.items())) or 'none'})"
                     f" + {leases} Lease renewals")
    worst = max(per_pod)
    return Figure("25", SPECS[1][1], " / ".join(f"{p:.2f}" for p in per_pod) + " per pod",
                  SPECS[1][2], worst <= REQUESTS_PER_POD_TARGET,
                  [f"a Deployment of {BURST} pods (multi-arch image, cache warm after the first) "
                   f"on KWOK Nodes, created through the apiserver; archway's ServiceAccounts' "
                   f"requests from the audit log, watches left out", *notes])
