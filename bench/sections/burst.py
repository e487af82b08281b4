"""Figure 24: a burst of pod creates on a slow registry through the real apiserver (issue 30).

100 pods, each with one image archway has never read, created at once (100 clients, a connection
each) while a proxy delays every answer of their registry by 10 s: archway's 2 workers x 8
threads are each held for the admission deadline (the chart's 3 s) by a lookup, and the rest of
the burst waits in their queues. The apiserver gives up on a call after the webhook's
timeoutSeconds (the chart's 5 s) and, failurePolicy Ignore, admits the pod unplaced: a
fail-open, counted by the apiserver itself (apiserver_admission_webhook_fail_open_count). The
figure: the slowest create as the client timed it, and the fail-opens (target 0); every pod must
come back gated or placed.
"""
import time
from concurrent.futures import ThreadPoolExecutor

from bench.common.lab import Lab
from bench.common.report import Figure
from bench.common.section import Started, measured
from lab.cluster.chart import ChartInstall
from lab.cluster.controlplane import ControlPlane
from lab.kube import Kube, pod_path
from lab.servers.proxy import DelayProxy
from lab.servers.registry import RegistryServer

BURST = 100
REGISTRY_SECONDS = 10.0
SPEC = ("24", f"{BURST} pod creates at once, registry at {REGISTRY_SECONDS:g} s: slowest create, "
              "fail-opens (apiserver's count)", "0 fail-opens")


def run(lab: Lab) -> list[Figure]:
    def measure(started: Started) -> list[Figure]:
        registry = started(RegistryServer(lab.path("burst-registry")))
        registry.push_image("bench/burst", "1", "linux/amd64")
        slow = started(DelayProxy(registry.port))
        plane = started(ControlPlane(lab.path("burst-control-plane"), audit=False))
        plane.start()
        install = ChartInstall(plane, archway_config={
            "registry": {"insecure_hosts": [registry.host, slow.host], "timeout_seconds": 2.0}})
        started.callback(install.stop_processes)
        install.install()
        return [_burst(plane, f"{slow.host}/bench/burst:1", slow)]
    return measured([SPEC], measure)


def fail_opens(kube: Kube) -> float:
    text = kube.session.get(kube.server + "/metrics", timeout=30).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("apiserver_admission_webhook_fail_open_count{"))


def _burst(plane: ControlPlane, image: str, slow: DelayProxy) -> Figure:
    kube = plane.kube
    ns = plane.new_namespace("bench-burst")
    clients = [kube.as_user(kube.token) for _ in range(BURST)]
    slow.delay = REGISTRY_SECONDS
    before = fail_opens(kube)

    def create(i: int) -> tuple[float, dict]:
        body = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": f"b-{i}"},
                "spec": {"containers": [{"name": "c", "image": image}]}}
        start = time.perf_counter()
        stored = clients[i].create(pod_path(ns), body)
        return time.perf_counter() - start, stored

    with ThreadPoolExecutor(BURST) as pool:
        results = list(pool.map(create, range(BURST)))
    failed_open = fail_opens(kube) - before
    slow.delay = 0.0
    took = sorted(seconds for seconds, _ in results)
    gated = sum(1 for _, p in results if any(
        g["name"] == "archway.dev/resolving" for g in p["spec"].get("schedulingGates") or []))
    placed = sum(1 for _, p in results
                 if "archway.dev/architectures" in p["metadata"].get("annotations", {}))
    unplaced = BURST - gated - placed
    return Figure(SPEC[0], SPEC[1],
                  f"slowest {took[-1]:.2f} s (median {took[len(took) // 2]:.2f}); "
                  f"{failed_open:g} fail-opens",
                  SPEC[2], failed_open == 0 and unplaced == 0, [
                      f"{BURST} creates from {BURST} threads at once, a connection each; the "
                      f"chart's defaults (deadline 3 s, timeoutSeconds 5, failurePolicy Ignore, "
                      f"2 workers x 8 threads); {gated} came back gated, {placed} placed, "
                      f"{unplaced} with neither; fail-opens from the apiserver's /metrics"])
