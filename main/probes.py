"""What a serving worker says of itself: GET /healthz (liveness), GET /readyz (readiness, with
facts) and GET /metrics, and which address serves them.

Products and the processes `archway serve` keeps running add their checks and facts here by
name (the name is what /readyz shows); a check gives None when fine, else its problem in words
that name no path (whoever reaches the port reads /readyz). The probes are answered on the
server's loop (they read only memory and small status files), so a worker whose handler threads
are all waiting on registries still answers its kubelet; /metrics, which reads every process's
samples, on a thread.

With server.metrics_bind, that address serves the probes and /metrics only, and the serving
address no /metrics: whoever may call the product's port (the apiserver, from an address nobody
can predict) needs no way to the metrics.
"""
import json
import os
import time
from collections.abc import Callable

from archway import metrics
from archway.certs.selfsigned import tls_dir
from archway.certs.trustpath import STATUS_FILE as TRUST_STATUS_FILE
from archway.certs.trustpath import trust_fact
from archway.certs.x509 import CertificateError, load_cert, remaining
from archway.extender import pollerprocess
from archway.hostport import split_bind
from archway.server import supervisor
from archway.server.routes import Reply, Request, Route, Routes, Site, error_reply

Check = Callable[[], "str | None"]
METRICS_ONLY = "this address serves only /metrics, /healthz and /readyz"


class Probes:
    """The checks and facts of one worker, and its routes."""

    def __init__(self, config, resolver):
        self.config = config
        # name -> None when fine, else why the process needs a restart (the kubelet restarts it)
        self.health_checks: dict[str, Check] = {}
        # name -> None when fine, else why the pod must not get requests now
        self.readiness_checks: dict[str, Check] = {
            "registry.ca_file": lambda: _unreadable(config.registry.ca_file),
            # An expired certificate fails every client's calls; a failing probe shows it.
            "serving_certificate": lambda: _certificate_problem(config.server)}
        # name -> a fact /readyz shows when ready
        self.readiness_facts: dict[str, Callable[[], object]] = {
            "resolver_cache_entries": lambda: resolver.cache_size}

    def watch_gate_controller(self, status_path: str) -> Callable[[], bool]:
        """The gate controller process this server runs: a fact on /readyz, a problem on
        /healthz when nothing brings it back (archway.server.supervisor). Returns whether it
        is up (the webhook's readiness asks)."""
        def status():
            return supervisor.read_status(status_path)
        self.readiness_facts["gate_controller_process"] = lambda: supervisor.process_fact(
            status(), time.time())
        self.health_checks["gate_controller"] = lambda: supervisor.process_problem(
            status(), time.time(), what="gate controller")
        # Shown, never failing: an unready webhook pod restores no trust (the apiserver's call
        # fails either way), and every pod unready would stall drains (PDB), rollouts and the
        # `helm upgrade --wait` whose certificate Job repairs the caBundle (docs/serving.md).
        if self.config.kubernetes.webhook_configuration:
            trust_status = os.path.join(os.path.dirname(status_path), TRUST_STATUS_FILE)
            self.readiness_facts["trust_path"] = lambda: trust_fact(trust_status, time.time())
        return lambda: supervisor.is_up(status())

    def watch_traffic_poller(self, status_path: str) -> None:
        """The traffic poller process this server runs: a fact on /readyz, a problem on /healthz
        when it is down and nothing brings it back, or alive and stuck (no turn of its loop)."""
        heartbeat = os.path.join(os.path.dirname(status_path), pollerprocess.HEARTBEAT_FILE)
        settings = self.config.prometheus

        def problem() -> str | None:
            status, now = supervisor.read_status(status_path), time.time()
            return (supervisor.process_problem(status, now, what="traffic poller")
                    or pollerprocess.stall_problem(status, _mtime(heartbeat), now, settings))

        self.readiness_facts["traffic_poller_process"] = lambda: supervisor.process_fact(
            supervisor.read_status(status_path), time.time())
        self.health_checks["traffic_poller"] = problem

    # --- the routes ---------------------------------------------------------------------------
    def site(self, product_routes: list[Route]) -> Site:
        """What the worker serves: the products' routes and the probes on the serving address,
        and with server.metrics_bind, the probes and /metrics alone on that one."""
        probes = [Route("GET", "/healthz", self._healthz, on_loop=True),
                  Route("GET", "/readyz", self._readyz, on_loop=True)]
        scrape = Route("GET", "/metrics", self._metrics)
        metrics_bind = self.config.server.metrics_bind
        if not metrics_bind:
            return Site(Routes([*product_routes, *probes, scrape]))
        elsewhere = Route("GET", "/metrics", lambda _request: error_reply(
            404, "/metrics is served on server.metrics_bind"), on_loop=True)
        return Site(Routes([*product_routes, *probes, elsewhere]),
                    {split_bind(metrics_bind)[1]: Routes([*probes, scrape], not_found=METRICS_ONLY)})

    def _healthz(self, _request: Request) -> Reply:
        problems = _problems(self.health_checks)
        if problems:
            return _json(503, {"status": "failing", "problems": problems})
        return _json(200, {"status": "ok"})

    def _readyz(self, _request: Request) -> Reply:
        problems = _problems(self.readiness_checks)
        if problems:
            return _json(503, {"ready": False, "problems": problems})
        return _json(200, {"ready": True,
                           **{name: fact() for name, fact in self.readiness_facts.items()}})

    def _metrics(self, _request: Request) -> Reply:
        # Read at every scrape: a renewed certificate is picked up without a restart.
        cert = _serving_certificate(self.config.server)
        if isinstance(cert, tuple):
            metrics.certificate_expires(cert[1].not_valid_after_utc.timestamp())
        body, content_type = metrics.render()
        return Reply(200, body, content_type)


def _json(status: int, value: dict) -> Reply:
    return Reply(status, json.dumps(value).encode())


def _problems(checks: dict[str, Check]) -> dict[str, str]:
    problems = {}
    for name, check in checks.items():
        try:
            problem = check()
        except Exception as e:  # a broken check is a problem, never a 500
            problem = f"check failed: {type(e).__name__}"
        if problem:
            problems[name] = problem
    return problems


def _mtime(path: str) -> float | None:
    try:
        return os.stat(path).st_mtime
    except OSError:
        return None


def _serving_certificate(server):
    """(path, certificate) of the serving certificate; None without TLS or without the file
    (the worker runs without `archway serve`: tests, a debugger); a problem's words as a str."""
    if not server.tls:
        return None
    path = os.path.expanduser(server.cert_file or os.path.join(tls_dir(server.state_dir), "tls.crt"))
    if not os.path.exists(path):
        return None
    try:
        with open(path, "rb") as f:
            return path, load_cert(f.read(1024 * 1024))
    except (OSError, CertificateError):
        return "the serving certificate cannot be read"   # /readyz: no paths shown


def _certificate_problem(server) -> str | None:
    found = _serving_certificate(server)
    if not isinstance(found, tuple):
        return found
    _, cert = found
    if remaining(cert).total_seconds() <= 0:
        return f"the serving certificate expired at {cert.not_valid_after_utc:%Y-%m-%d %H:%M}Z"
    return None


def _unreadable(path: str | None) -> str | None:
    if path and not os.access(os.path.expanduser(path), os.R_OK):
        return "the file is not readable"   # the check's name says which; /readyz shows no paths
    return None
