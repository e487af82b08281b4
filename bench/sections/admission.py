"""Figures 1 and 2: warm-cache admission throughput against a bare Flask app, and latency; 1d:
the server CPU per warm admission against a Go webhook (bench/sections/admission_cpu.py).

Both servers of figure 1 run with archway serve's gunicorn options
(archway.server.master.gunicorn_options: 2 workers x 8 threads, keep-alive, reuse_port) and the
same TLS context on the same certificate, archway under its own worker, the Flask app under
gunicorn's gthread (bench/apps/echo_app.py); wrk POSTs the multi-arch fixture AdmissionReview
over the same number of keep-alive connections for the same time, archway and baseline
alternating, so a change in the machine's load hits both.
"""
from contextlib import contextmanager

from bench.common.lab import PLATFORMS, Lab, fixture_text, mutated_archs
from bench.common.loadgen import run_wrk
from bench.common.pinning import CpuSplit
from bench.common.plots import cumulative, plot
from bench.common.report import Figure
from bench.common.rounds import interleaved, ratios, rounds
from bench.common.section import Started, measured
from bench.common.servers import GunicornServer, cpu_seconds
from bench.common.stats import (
    bucket_difference,
    histogram_buckets,
    histogram_quantile,
    parse_metrics,
    share_at_most,
)
from bench.sections import admission_cpu
from lab.servers.apiserver import FakeApiServer
from lab.servers.registry import RegistryServer

SECONDS = 3
# Each worker listens on a socket of its own (archway/server/worker.py, SO_REUSEPORT) and the kernel
# spreads wrk's connections by hash, so a run can still be uneven (figure 1c). Closing one
# connection every CLOSE_EVERY requests lets reconnections even it out; a TLS handshake per
# 200 requests is the same small cost for both servers.
CLOSE_EVERY = 200
BALANCE = 0.3             # each worker's minimum share of a run's work for the run to count
MAX_ATTEMPTS = 8
WARM_RUNS = 10
SPREAD_RUNS = 6
LIGHT_SECONDS = 5
CONNECTIONS = 16          # = workers x threads: every handler thread busy
LIGHT_CONNECTIONS = 2     # at most 2 requests in flight: latency without queueing
RATIO_TARGET = 0.85
P99_TARGET_MS = 5.0


def run(lab: Lab) -> list[Figure]:
    specs = (("1", "warm-cache admission throughput vs bare Flask+gunicorn echo", f">= {RATIO_TARGET}"),
             ("2", "warm-cache admission latency p50 / p99, server side", f"p99 < {P99_TARGET_MS:g} ms"))

    def measure(started: Started) -> list[Figure]:
        archway, echo, body = started.enter_context(admission_servers(lab))
        return _measure(archway, echo, body, specs)

    def measure_cpu(started: Started) -> list[Figure]:
        # Before anything starts: the servers and the registry inherit the bench's CPUs.
        split = CpuSplit.of_machine()
        if split:
            split.pin_bench()
            started.callback(split.restore)
        config, body = admission_cluster(lab, started, "admission-cpu")
        return [admission_cpu.cpu_per_admission(lab, started, config, body, split)]
    # 1d with servers of its own, after 1 and 2: a failure of one is not the other's.
    return measured(specs, measure) + measured([admission_cpu.SPEC], measure_cpu)


def admission_cluster(lab: Lab, started: Started, name: str = "admission") -> tuple[dict, bytes]:
    """(archway's config, the AdmissionReview to POST): a registry holding the fixture pod's
    multi-arch image and an API stand-in with the pod's ServiceAccount, which the config reads."""
    registry = started(RegistryServer(lab.path(f"registry-{name}"), ca=lab.ca))
    registry.push_index("archway/multi", "1.0", list(PLATFORMS), attestations=True)
    api = started(FakeApiServer())
    # The pod's ServiceAccount, as in a cluster: archway reads it for pull secrets (cached).
    api.put("/api/v1/namespaces/shop/serviceaccounts/default",
            {"kind": "ServiceAccount", "apiVersion": "v1",
             "metadata": {"name": "default", "namespace": "shop"}})
    kubeconfig = api.kubeconfig(lab.path("kube", name))
    config = lab.archway_config(name, kubernetes={"enabled": "auto", "kubeconfig": kubeconfig})
    body = fixture_text("v1-pod-multiarch.json").replace("REGISTRY", registry.host).encode()
    return config, body


@contextmanager
def admission_servers(lab: Lab):
    """(archway, echo, body): both servers up and warm, and the AdmissionReview to POST."""
    with Started() as started:
        config, body = admission_cluster(lab, started)
        archway = started(GunicornServer.archway(lab.path("admission"), config,
                                                 tls_ca=lab.ca.cert_path))
        echo = started(GunicornServer.module(lab.path("admission"), "bench.apps.echo_app", config,
                                             tls_ca=lab.ca.cert_path, name="echo"))
        _warm(archway, echo, body)
        yield archway, echo, body


def _warm(archway: GunicornServer, echo: GunicornServer, body: bytes) -> None:
    """Every worker of both servers has answered the pod (archway: resolved the image and read
    the ServiceAccount, so later answers are cache hits). Which worker takes a keep-alive
    connection is up to the kernel, so short wrk runs repeat until each worker has worked."""
    answer = archway.post("/mutate", body)
    if mutated_archs(answer) != {"amd64", "arm64", "arm"}:
        raise RuntimeError(f"the fixture pod was not mutated: {answer.text[:300]}")
    for server in (archway, echo):
        busy = dict.fromkeys(server.worker_pids(), 0.0)
        for _ in range(WARM_RUNS):
            before = _worker_cpu(server)
            run_wrk(server.url("/mutate"), body, seconds=1, connections=CONNECTIONS,
                    close_every=CLOSE_EVERY)
            for pid, used in _worker_cpu(server).items():
                busy[pid] = busy.get(pid, 0.0) + used - before.get(pid, 0.0)
            if min(busy.values()) > 0.2:
                break
        else:
            raise RuntimeError(f"{server.name}: a worker never got a connection: {busy}")


def _worker_cpu(server: GunicornServer) -> dict[int, float]:
    return {pid: cpu_seconds(pid) for pid in server.worker_pids()}


def _server_cpu(server: GunicornServer) -> float:
    return cpu_seconds(server.master_pid) + sum(_worker_cpu(server).values())


def _balanced_run(server: GunicornServer, body: bytes):
    """(wrk result, CPU seconds, runs discarded) of a run in which every worker did at least
    BALANCE of the work; a run in which one worker still did (nearly) everything, which halves
    throughput whatever the app does, is repeated (and counted)."""
    discarded = []
    for _ in range(MAX_ATTEMPTS):
        master, workers = cpu_seconds(server.master_pid), _worker_cpu(server)
        result = run_wrk(server.url("/mutate"), body, seconds=SECONDS, connections=CONNECTIONS,
                         close_every=CLOSE_EVERY)
        used = {pid: cpu_seconds(pid) - workers.get(pid, 0.0) for pid in server.worker_pids()}
        total = sum(used.values()) + cpu_seconds(server.master_pid) - master
        if min(used.values()) >= BALANCE * sum(used.values()):
            return result, total, discarded
        discarded.append((result, total))
    raise RuntimeError(f"{server.name}: no run in {MAX_ATTEMPTS} kept both workers busy")


def _keepalive_spread(archway: GunicornServer, body: bytes) -> Figure:
    """How wrk's keep-alive connections (never closed) end up spread over the 2 workers."""
    shares, rates = [], []
    for _ in range(SPREAD_RUNS):
        before = _worker_cpu(archway)
        result = run_wrk(archway.url("/mutate"), body, seconds=1, connections=CONNECTIONS)
        used = [cpu - before.get(pid, 0.0) for pid, cpu in _worker_cpu(archway).items()]
        shares.append(max(used) / sum(used))
        rates.append(result.rate)
    lopsided = [r for share, r in zip(shares, rates) if share > 0.9]
    return Figure(
        "1c", "keep-alive only: runs where one worker did > 90% of the work",
        f"{len(lopsided)} of {SPREAD_RUNS}", "context for 1", None, [
            f"{SPREAD_RUNS} wrk runs of 1 s, {CONNECTIONS} connections opened at once and kept: the "
            f"busiest worker's share of the CPU per run {', '.join(f'{s:.0%}' for s in shares)}; "
            f"req/s per run {', '.join(f'{r:.0f}' for r in rates)}. Each worker listens on a "
            f"socket of its own (SO_REUSEPORT) and the kernel spreads new connections by hash; "
            f"before, both polled one socket and the first awake often accepted all 16",
        ])


def _mutated_total(archway: GunicornServer) -> float:
    return sum(value for name, labels, value in parse_metrics(archway.metrics())
               if name == "archway_admissions_total" and labels.get("outcome") == "mutated")


def _measure(archway, echo, body, specs) -> list[Figure]:
    hist = "archway_admission_duration_seconds"
    archway_runs, echo_runs, archway_cpu, echo_cpu = [], [], [], []
    mutated_before = _mutated_total(archway)
    buckets_before = histogram_buckets(archway.metrics(), hist)
    discarded = {archway.name: [], echo.name: []}

    def side(server, runs, cpu):
        def one_run() -> float:
            result, used, unbalanced = _balanced_run(server, body)
            runs.append(result)
            cpu.append(used)
            discarded[server.name] += unbalanced
            return result.rate
        return one_run
    count = rounds()
    rates = interleaved({"archway": side(archway, archway_runs, archway_cpu),
                         "echo": side(echo, echo_runs, echo_cpu)}, count)
    saturated_buckets = bucket_difference(histogram_buckets(archway.metrics(), hist), buckets_before)
    mutated = _mutated_total(archway) - mutated_before

    errors = sum(r.errors for r in archway_runs + echo_runs)
    served = sum(r.requests for r in archway_runs)
    served_all = served + sum(r.requests for r, _ in discarded[archway.name])
    archway_rate = served / sum(r.seconds for r in archway_runs)
    echo_rate = sum(r.requests for r in echo_runs) / sum(r.seconds for r in echo_runs)
    steady = ratios(rates["archway"], rates["echo"])
    ratio = steady.median
    archway_us = sum(archway_cpu) / served * 1e6
    echo_us = sum(echo_cpu) / sum(r.requests for r in echo_runs) * 1e6
    throughput = Figure(
        specs[0][0], specs[0][1],
        f"{steady.describe()} ({archway_rate:.0f} vs {echo_rate:.0f} req/s)", specs[0][2],
        ratio >= RATIO_TARGET and errors == 0 and mutated >= served_all, [
            f"wrk, {CONNECTIONS} keep-alive TLS connections, {count} rounds of {SECONDS} s per "
            f"server, interleaved (each first in turn); figure = median of the per-round ratios; "
            f"{errors} errors; every archway answer a "
            f"real mutation (archway_admissions_total{{outcome=\"mutated\"}} grew by "
            f"{mutated:.0f} for {served_all} requests wrk counted)",
            "baseline: bench/apps/echo_app.py, Flask parses the AdmissionReview and answers "
            "allowed with the uid, under gunicorn's stock gthread worker with archway serve's "
            "other gunicorn options (archway.server.master.gunicorn_options) and its TLS context "
            "(archway.certs.tls.server_context, through gunicorn's ssl_context hook)",
            f"wrk closes one connection every {CLOSE_EVERY} requests so that reconnections even "
            f"out the kernel's spread of the {CONNECTIONS} connections over the workers (see "
            f"1c); only runs in which each worker did >= "
            f"{BALANCE:.0%} of the work count: repeated runs archway "
            f"{len(discarded[archway.name])}, echo {len(discarded[echo.name])}",
        ], rounds=steady)
    spread = _keepalive_spread(archway, body)
    cpu = Figure(
        "1b", "server CPU per warm admission (gunicorn master + workers)",
        f"{archway_us:.0f} us vs {echo_us:.0f} us (ratio {echo_us / archway_us:.2f})",
        "context for 1", None, [
            "user+system CPU of the server's processes (/proc/PID/stat) over the same wrk "
            "rounds, divided by the requests served: unlike requests/s it does not move when "
            "other processes compete for the 2 cores",
        ])

    # Latency with at most 2 requests in flight (the API server's usual pace).
    buckets_before = histogram_buckets(archway.metrics(), hist)
    light = run_wrk(archway.url("/mutate"), body, seconds=LIGHT_SECONDS,
                    connections=LIGHT_CONNECTIONS)
    light_buckets = bucket_difference(histogram_buckets(archway.metrics(), hist), buckets_before)
    if not light_buckets.get(float("inf")) or not saturated_buckets.get(float("inf")):
        raise RuntimeError("archway's latency histogram counted no admissions")
    p50, p99 = (histogram_quantile(light_buckets, q) * 1000 for q in (0.5, 0.99))
    s50, s99 = (histogram_quantile(saturated_buckets, q) * 1000 for q in (0.5, 0.99))
    within = share_at_most(light_buckets, P99_TARGET_MS / 1000)
    latency = Figure(
        specs[1][0], specs[1][1], f"{p50:.2f} / {p99:.2f} ms", specs[1][2],
        within >= 0.99 and light.errors == 0, [
            f"server side = archway's latency histogram {hist} (from the handler's start, body "
            f"read included, to the answer built), quantiles interpolated inside its buckets as "
            f"Prometheus' histogram_quantile does; {light_buckets[float('inf')]:.0f} admissions, "
            f"wrk with {LIGHT_CONNECTIONS} keep-alive connections; {within:.1%} <= "
            f"{P99_TARGET_MS:g} ms (exact: a bucket bound); wrk client side (TLS, gunicorn, "
            f"queueing) p50 {light.p50_ms:.1f} / p99 {light.p99_ms:.1f} ms",
            f"at saturation ({CONNECTIONS} connections, the throughput runs, "
            f"{saturated_buckets[float('inf')]:.0f} admissions): server side p50 {s50:.2f} / "
            f"p99 {s99:.2f} ms, {share_at_most(saturated_buckets, 0.005):.1%} <= 5 ms; wrk "
            f"client side p99 {max(r.p99_ms for r in archway_runs):.1f} ms (worst round)",
        ], data={"plots": latency_plot(light_buckets, saturated_buckets)})
    return [throughput, cpu, spread, latency]


def latency_plot(light: dict, saturated: dict) -> dict:
    """Figure 2's distribution: the share of admissions answered within each bucket bound."""
    series = {}
    for label, buckets in ((f"light load: {LIGHT_CONNECTIONS} connections", light),
                           (f"saturated: {CONNECTIONS} connections", saturated)):
        bounds, shares = cumulative(buckets)
        series[label] = {"x": [b * 1000 for b in bounds], "y": shares}
    return plot("admission-latency", "How fast archway decides: share of warm admissions "
                "answered within a time, server side (figure 2)",
                "answered within (ms; the bounds of the latency histogram's buckets)",
                "share of admissions", series, kind="step", log_x=True)
