"""The Flask app one `archway serve` worker runs: the products it serves, plus /healthz, /readyz
and /metrics, with JSON errors.

Products (server.product): `webhook` is POST /mutate (archway.webhook.app), `extender` the
scheduler extender routes (archway.extender.routes), `all` both (the embedded localhost setup).
`create_app` runs once per gunicorn worker, after the fork: the resolver (thread pool, HTTP
connection pools, cache) belongs to the worker that uses it.
"""
import json
import logging
import os
import time
from collections.abc import Callable
from http import HTTPStatus

from flask import Flask, Response, jsonify, request
from gunicorn.http.errors import NoMoreData, ParseException
from werkzeug.exceptions import HTTPException

from archway import __version__, metrics
from archway.certs.selfsigned import tls_dir
from archway.certs.trustpath import STATUS_FILE as TRUST_STATUS_FILE
from archway.certs.trustpath import trust_fact
from archway.certs.x509 import CertificateError, load_cert, remaining
from archway.extender import pollerprocess
from archway.extender.routes import register_extender
from archway.hostport import split_bind
from archway.kubeclient import build_api_client
from archway.nodes import NodeCache
from archway.registry.resolver import Resolver
from archway.registry.sharedlookups import SharedLookups
from archway.server import supervisor
from archway.webhook.app import register_webhook
from archway.webhook.clusterranges import ClusterRanges

log = logging.getLogger("archway.server")

PRODUCTS = ("webhook", "extender")


def products_of(choice: str) -> tuple[str, ...]:
    """server.product (or `archway serve --product`) -> the products to serve."""
    return PRODUCTS if choice == "all" else (choice,)


class ServerState:
    """What the routes of one worker share."""

    def __init__(self, config, resolver, node_cache=None):
        self.config = config
        self.resolver = resolver
        self.node_cache = node_cache   # one list + watch of Nodes for both products
        # Whether the gate controller this server runs is up; None: it runs none here.
        self.controller_up: Callable[[], bool] | None = None
        # name -> callable returning None when fine, else why the process needs a restart
        # (/healthz fails: the kubelet restarts the pod); products may add.
        self.health_checks: dict[str, Callable[[], str | None]] = {}
        # name -> callable returning None when fine, else what is wrong; products may add.
        self.readiness_checks: dict[str, Callable[[], str | None]] = {}
        # (method, path) -> handler(environ) -> (status, JSON bytes): answered ahead of Flask.
        self.fast_routes: dict[tuple[str, str], Callable[[dict], tuple[int, bytes]]] = {}
        # (method, path) -> handler(body, arrived) -> (status, JSON bytes) or None: answered in
        # the worker's main loop when it needs no wait (archway.server.inline).
        self.inline_routes: dict[tuple[str, str], Callable] = {}
        # name -> callable returning a fact /readyz shows when ready; products may add.
        self.readiness_facts: dict[str, Callable[[], object]] = {
            "resolver_cache_entries": lambda: self.resolver.cache_size}


def create_app(config, *, product: str | None = None, resolver=None, pull_secrets=None,
               lookups_dir: str | None = None, controller_status: str | None = None,
               poller_status: str | None = None) -> Flask:
    """The app serving `product` (default: server.product). `lookups_dir`: where this server's
    workers share image lookups (archway.registry.sharedlookups); None: not shared.
    `controller_status`: the status file of the gate controller this server runs, if any;
    `poller_status`: that of its traffic poller process (extender/pollerprocess.py), if any."""
    products = products_of(product or config.server.product)
    app = Flask("archway", static_folder=None)
    # One byte over the limit: a chunked body (no Content-Length) is read up to max + 1 bytes,
    # so the webhook can tell "too large" (413) from "exactly the limit". The extender raises
    # the limit for its own routes.
    app.config["MAX_CONTENT_LENGTH"] = config.server.max_body_bytes + 1
    if resolver is None:
        resolver = Resolver(config.registry, sif=config.sif,
                            shared=SharedLookups(lookups_dir) if lookups_dir else None)
    node_cache = NodeCache.for_config(config)
    if "webhook" not in products:   # the webhook's wiring keeps them, per worker
        _refuse_cluster_addresses(config, resolver)
    state = ServerState(config, resolver, node_cache)
    metrics.started(__version__)
    app.extensions["archway"] = state
    state.readiness_checks["registry.ca_file"] = lambda: _unreadable(config.registry.ca_file)
    # An expired certificate fails every client's calls; a failing probe makes that visible.
    state.readiness_checks["serving_certificate"] = lambda: _certificate_problem(config.server)
    if controller_status is not None:
        _controller_health(state, controller_status)
    if poller_status is not None:
        _poller_health(state, poller_status, config.prometheus)
    if "webhook" in products:
        register_webhook(app, state, pull_secrets)
    if "extender" in products:
        register_extender(app, config, resolver, node_cache=node_cache,
                          fast_routes=state.fast_routes, inline_routes=state.inline_routes)
    _register_common(app, state)
    app.inline_routes_for = _inline_routes_for(config, state.inline_routes)  # type: ignore[attr-defined]
    if state.fast_routes:
        app.wsgi_app = _FastRoutes(app.wsgi_app, state.fast_routes)  # type: ignore[method-assign]
    if config.server.metrics_bind:
        app.wsgi_app = _MetricsListener(  # type: ignore[method-assign]
            app.wsgi_app, split_bind(config.server.metrics_bind)[1])
    return app


def _inline_routes_for(config, routes: dict) -> Callable[[object], dict]:
    """For the worker (archway.server.inline): the routes it may answer in its main loop on the
    listener at a (host, port) address; none on server.metrics_bind's, which serves only
    metrics and probes (_MetricsListener)."""
    metrics_port = split_bind(config.server.metrics_bind)[1] if config.server.metrics_bind else None

    def routes_for(address) -> dict:
        on_metrics_port = isinstance(address, tuple) and address[1] == metrics_port
        return {} if on_metrics_port else routes

    return routes_for


def _refuse_cluster_addresses(config, resolver) -> None:
    """The extender resolves pods' images too: the cluster's Service ranges and API server are
    read once, before the workers fork (their copies keep what was read)."""
    if config.kubernetes.enabled == "off":
        return
    api_client, _ = build_api_client(config.kubernetes)
    ranges = ClusterRanges.for_resolver(config, api_client, resolver)
    if ranges is not None:
        ranges.refresh()


def _controller_health(state: ServerState, status_path: str) -> None:
    """The gate controller process this server runs: whether it is up (the webhook's readiness
    asks), a fact on /readyz, a problem on /healthz when nothing brings it back
    (archway.server.supervisor)."""
    state.controller_up = lambda: supervisor.is_up(supervisor.read_status(status_path))
    state.readiness_facts["gate_controller_process"] = lambda: supervisor.process_fact(
        supervisor.read_status(status_path), time.time())
    state.health_checks["gate_controller"] = lambda: supervisor.process_problem(
        supervisor.read_status(status_path), time.time(), what="gate controller")
    # Shown, never failing: an unready webhook pod restores no trust (the apiserver's call
    # fails either way), and every pod unready would stall drains (PDB), rollouts and the
    # `helm upgrade --wait` whose certificate Job repairs the caBundle (docs/serving.md).
    if state.config.kubernetes.webhook_configuration:
        trust_status = os.path.join(os.path.dirname(status_path), TRUST_STATUS_FILE)
        state.readiness_facts["trust_path"] = lambda: trust_fact(trust_status, time.time())


def _poller_health(state: ServerState, status_path: str, settings) -> None:
    """The traffic poller process this server runs: a fact on /readyz, a problem on /healthz
    when it is down and nothing brings it back, or alive and stuck (no turn of its loop)."""
    heartbeat = os.path.join(os.path.dirname(status_path), pollerprocess.HEARTBEAT_FILE)

    def problem() -> str | None:
        status, now = supervisor.read_status(status_path), time.time()
        return (supervisor.process_problem(status, now, what="traffic poller")
                or pollerprocess.stall_problem(status, _mtime(heartbeat), now, settings))

    state.readiness_facts["traffic_poller_process"] = lambda: supervisor.process_fact(
        supervisor.read_status(status_path), time.time())
    state.health_checks["traffic_poller"] = problem


def _mtime(path: str) -> float | None:
    try:
        return os.stat(path).st_mtime
    except OSError:
        return None


class _MetricsListener:
    """WSGI middleware: on server.metrics_bind's port, only what scrapers and probes read; and
    /metrics only there, so that whoever may call the product's port (the apiserver, from an
    address nobody can predict) needs no way to the metrics."""
    PATHS = frozenset({"/metrics", "/healthz", "/readyz"})
    NOT_HERE = json.dumps({"error": "this address serves only /metrics, /healthz and /readyz"}
                          ).encode()
    ELSEWHERE = json.dumps({"error": "/metrics is served on server.metrics_bind"}).encode()

    def __init__(self, app, port: int):
        self.app = app
        self.port = str(port)

    def __call__(self, environ, start_response):
        on_metrics_port = environ.get("SERVER_PORT") == self.port
        path = environ.get("PATH_INFO")
        if on_metrics_port and path not in self.PATHS:
            return self._not_found(start_response, self.NOT_HERE)
        if not on_metrics_port and path == "/metrics":
            return self._not_found(start_response, self.ELSEWHERE)
        return self.app(environ, start_response)

    @staticmethod
    def _not_found(start_response, body: bytes) -> list[bytes]:
        start_response("404 Not Found", [("Content-Type", "application/json"),
                                         ("Content-Length", str(len(body)))])
        return [body]


class _FastRoutes:
    """WSGI middleware: the routes in `routes` answered without Flask's request context, URL
    matching and response objects, a third of a warm admission's CPU in the profile of
    docs/benchmarks.md (figure 1). Everything else, and every other method on those paths,
    goes to Flask. Errors are answered as Flask's handlers below answer them."""

    def __init__(self, flask_app, routes: dict):
        self.flask_app = flask_app
        self.routes = routes

    def __call__(self, environ, start_response):
        handler = self.routes.get((environ.get("REQUEST_METHOD"), environ.get("PATH_INFO")))
        if handler is None:
            return self.flask_app(environ, start_response)
        try:
            status, body = handler(environ)
        except Exception as e:  # a bug must be a JSON 500 with a log line, as under Flask
            status, message = _client_fault(e) or (500, "")
            if status == 500:
                log.exception("unhandled error on %s %s", environ.get("REQUEST_METHOD"),
                              environ.get("PATH_INFO"))
                message = _INTERNAL_ERROR
            else:
                metrics.bad_request(status)
            body = json.dumps({"error": message}).encode()
        start_response(f"{status} {HTTPStatus(status).phrase}",
                       [("Content-Type", "application/json"), ("Content-Length", str(len(body)))])
        return [body]


_INTERNAL_ERROR = "internal error; see archway's log"


def _client_fault(e: BaseException) -> tuple[int, str] | None:
    """(status, message) for what a client did wrong while its body was read; None: a bug."""
    if isinstance(e, ParseException):   # a body gunicorn cannot decode (an invalid chunk size)
        return 400, f"malformed HTTP request body: {type(e).__name__}: {e}"
    if isinstance(e, NoMoreData):
        return 400, "the request body ended before its announced length"
    if isinstance(e, TimeoutError):     # the per-read timeout the views set on the socket
        return 408, "the request body stopped arriving"
    return None


def _register_common(app: Flask, state: ServerState) -> None:
    @app.get("/healthz")
    def healthz():
        problems = _problems(state.health_checks)
        if problems:
            return jsonify(status="failing", problems=problems), 503
        return jsonify(status="ok")

    @app.get("/readyz")
    def readyz():
        problems = _problems(state.readiness_checks)
        if problems:
            return jsonify(ready=False, problems=problems), 503
        return jsonify(ready=True, **{name: fact() for name, fact in state.readiness_facts.items()})

    @app.get("/metrics")
    def metrics_route():
        # Read at every scrape: a renewed certificate is picked up without a restart.
        cert = _serving_certificate(state.config.server)
        if isinstance(cert, tuple):
            metrics.certificate_expires(cert[1].not_valid_after_utc.timestamp())
        body, content_type = metrics.render()
        return Response(body, content_type=content_type)

    served = _served_routes(app)

    @app.errorhandler(HTTPException)
    def http_error(e: HTTPException):
        # 404, 405, 413...: JSON like every other answer, never Flask's HTML page.
        if e.code and 400 <= e.code < 500:
            metrics.bad_request(e.code)
        if e.code in (404, 405):
            message = f"{e.name}: {request.method} {request.path}; archway serves {served}"
        else:
            message = e.description or e.name
        return jsonify(error=message), e.code

    def client_error(e: Exception):
        # Raised while a view reads the body: the client's fault, not a 500.
        status, message = _client_fault(e) or (500, _INTERNAL_ERROR)
        metrics.bad_request(status)
        return jsonify(error=message), status

    for fault in (ParseException, NoMoreData, TimeoutError):
        app.register_error_handler(fault, client_error)

    @app.errorhandler(Exception)
    def internal_error(e: Exception):
        log.exception("unhandled error on %s %s", request.method, request.path)
        return jsonify(error=_INTERNAL_ERROR), 500


def _problems(checks: dict) -> dict[str, str]:
    problems = {}
    for name, check in checks.items():
        try:
            problem = check()
        except Exception as e:  # a broken check is a problem, never a 500
            problem = f"check failed: {type(e).__name__}"
        if problem:
            problems[name] = problem
    return problems


def _served_routes(app: Flask) -> str:
    """'POST /mutate, GET /healthz, ...': what a 404 or 405 tells the client this server has."""
    routes = []
    for rule in app.url_map.iter_rules():
        methods = sorted((rule.methods or set()) - {"HEAD", "OPTIONS"})
        routes.append(f"{'/'.join(methods)} {rule.rule}")
    return ", ".join(routes)


def _serving_certificate(server):
    """(path, certificate) of the serving certificate; None without TLS or without the file
    (the app runs without `archway serve`: tests, a debugger); a problem's words as a str."""
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
