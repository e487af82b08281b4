"""Figures 24 and 25 (issue 28, the start of the `scale` section): archway on the real control plane
with KWOK-simulated Nodes (tests/infra/kwok.py) at three sizes, each its own fresh cluster.

24: archway's memory against the cluster's size: RSS of the webhook's workers and of the
    extender's worker once their caches are synced, at each size, and the growth per Node from
    the smallest to the largest size (what the Sizing page will extrapolate from).
25: archway's requests to the apiserver per pod created during a burst (a Deployment of BURST
    pods, created through the apiserver, until every pod is Running on KWOK Nodes), from the
    audit log: every request of archway's ServiceAccounts in that window but the watches it
    keeps open; target <= 0.01 (watches, never a read per pod). Lease renewals of the gate
    controller's leader election are counted apart (they are per second, not per pod).
"""
import json
import time

from tests.infra.cluster import ChartInstall
from tests.infra.controlplane import ControlPlane
from tests.infra.kwok import LABEL, Kwok
from tests.infra.registry import RegistryServer

from .lab import Lab
from .report import Figure, failed_figure
from .servers import _is_gate_controller, children, cpu_seconds, rss_bytes

SIZES = (100, 300, 1000)
BURST = 100
REST_SECONDS = 10     # CPU at rest: the caches' watches and the Lease renewals only
REQUESTS_PER_POD_TARGET = 0.01
ACCOUNTS = "system:serviceaccount:archway-system:"
SPECS = (("24", f"archway RSS against cluster size ({', '.join(map(str, SIZES))} KWOK Nodes)", "info"),
         ("25", f"archway's apiserver requests per pod, burst of {BURST} pods", f"<= {REQUESTS_PER_POD_TARGET}"))


def run(lab: Lab) -> list[Figure]:
    registry = None
    try:
        registry = RegistryServer(lab.path("scale-registry"))
        registry.push_index("bench/multi", "1", ["linux/amd64", "linux/arm64"])
        sizes = [_one_size(lab, registry, nodes) for nodes in SIZES]
        return [_memory_figure(sizes), _requests_figure(sizes)]
    except Exception as e:
        return [failed_figure(number, name, target, e) for number, name, target in SPECS]
    finally:
        if registry is not None:
            registry.stop()


def _one_size(lab: Lab, registry: RegistryServer, nodes: int) -> dict:
    plane = ControlPlane(lab.path(f"scale-{nodes}"))
    install = None
    try:
        started = time.monotonic()
        plane.start()
        kwok = Kwok(plane).start()
        kwok.wait_ready(kwok.add_nodes(nodes), timeout=900)
        ready = time.monotonic() - started
        install = ChartInstall(plane, archway_config={
            "registry": {"insecure_hosts": [registry.host]}}).install()
        assert install.webhook and install.extender
        time.sleep(5)   # the caches listed at boot; let the lists' garbage go
        webhook = children(install.webhook.process.pid)
        procs = {"webhook": [p for p in webhook if not _is_gate_controller(p)],
                 "controller": [p for p in webhook if _is_gate_controller(p)],
                 "extender": children(install.extender.process.pid),
                 "masters": [install.webhook.process.pid, install.extender.process.pid]}
        rss = {k: [rss_bytes(p) for p in pids] for k, pids in procs.items()}
        before = _cpu(procs)
        time.sleep(REST_SECONDS)
        rest = {k: (v - before[k]) / REST_SECONDS for k, v in _cpu(procs).items()}
        namespace = plane.new_namespace("burst")
        kube = plane.kube
        assert kube is not None
        mark = plane.audit_mark()
        before = _cpu(procs)
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
        return {"nodes": nodes, "ready_s": ready, "rss": rss, "burst_s": burst,
                "cpu_rest": rest, "cpu_burst": in_burst,
                "requests": _archway_requests(plane, mark)}
    finally:
        if install is not None:
            install.stop_processes()
        plane.stop()


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


def _memory_figure(sizes: list[dict]) -> Figure:
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
    grow = {k: (max(last["rss"][k]) - max(first["rss"][k])) / (last["nodes"] - first["nodes"])
            for k in ("webhook", "extender")}
    return Figure("24", SPECS[0][1],
                  f"webhook worker {mb([max(s['rss']['webhook']) for s in sizes])} MB, extender "
                  f"{mb([max(s['rss']['extender']) for s in sizes])} MB; +{grow['webhook'] / 1e3:.1f}"
                  f" / +{grow['extender'] / 1e3:.1f} KB per Node", "info", None,
                  ["RSS (/proc VmRSS) of each `archway serve` worker the chart's config runs, "
                   "5 s after install (node, namespace, workload caches and the pod watch "
                   "synced), one fresh control plane + KWOK per size", *rows])


def _requests_figure(sizes: list[dict]) -> Figure:
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
