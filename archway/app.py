"""The Flask app one `archway serve` worker runs: the products it serves, plus /healthz, /readyz
and /metrics, with JSON errors.

Products (server.product): `webhook` is POST /mutate (archway.webhook.app), `extender` the
scheduler extender routes (archway.extender.routes), `all` both (the embedded localhost setup).
`create_app` runs once per gunicorn worker, after the fork: the resolver (thread pool, HTTP
connection pools, cache) belongs to the worker that uses it.
"""
import logging
import os
from typing import Callable

from flask import Flask, Response, jsonify, request
from werkzeug.exceptions import HTTPException

from archway import __version__, metrics
from archway.certs.selfsigned import tls_dir
from archway.certs.x509 import CertificateError, load_cert, remaining
from archway.extender.nodes import NodeCache
from archway.extender.routes import register_extender
from archway.registry.resolver import Resolver
from archway.registry.sharedlookups import SharedLookups
from archway.webhook.app import register_webhook
from archway.webhook.pullsecrets import build_api_client

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
        # name -> callable returning None when fine, else what is wrong; products may add.
        self.readiness_checks: dict[str, Callable[[], str | None]] = {}
        # name -> callable returning a fact /readyz shows when ready; products may add.
        self.readiness_facts: dict[str, Callable[[], object]] = {
            "resolver_cache_entries": lambda: self.resolver.cache_size}


def create_app(config, *, product: str | None = None, resolver=None, pull_secrets=None,
               lookups_dir: str | None = None) -> Flask:
    """The app serving `product` (default: server.product). `lookups_dir`: where this server's
    workers share image lookups (archway.registry.sharedlookups); None: not shared."""
    products = products_of(product or config.server.product)
    app = Flask("archway", static_folder=None)
    # One byte over the limit: a chunked body (no Content-Length) is read up to max + 1 bytes,
    # so the webhook can tell "too large" (413) from "exactly the limit". The extender raises
    # the limit for its own routes.
    app.config["MAX_CONTENT_LENGTH"] = config.server.max_body_bytes + 1
    if resolver is None:
        resolver = Resolver(config.registry, sif=config.sif,
                            shared=SharedLookups(lookups_dir) if lookups_dir else None)
    node_cache = None
    if config.extender.node_cache and config.kubernetes.enabled != "off":
        node_cache = NodeCache(lambda: build_api_client(config.kubernetes)[0])
    state = ServerState(config, resolver, node_cache)
    metrics.started(__version__)
    app.extensions["archway"] = state
    state.readiness_checks["registry.ca_file"] = lambda: _unreadable(config.registry.ca_file)
    # An expired certificate fails every client's calls; a failing probe makes that visible.
    state.readiness_checks["serving_certificate"] = lambda: _certificate_problem(config.server)
    if "webhook" in products:
        register_webhook(app, state, pull_secrets)
    if "extender" in products:
        register_extender(app, config, resolver, node_cache=node_cache)
    _register_common(app, state)
    return app


def _register_common(app: Flask, state: ServerState) -> None:
    @app.get("/healthz")
    def healthz():
        return jsonify(status="ok")

    @app.get("/readyz")
    def readyz():
        problems = {}
        for name, check in state.readiness_checks.items():
            try:
                problem = check()
            except Exception as e:  # a broken check means not ready, never a 500
                problem = f"check failed: {type(e).__name__}"
            if problem:
                problems[name] = problem
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

    @app.errorhandler(Exception)
    def internal_error(e: Exception):
        log.exception("unhandled error on %s %s", request.method, request.path)
        return jsonify(error="internal error; see archway's log"), 500


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
        return f"serving certificate {path} cannot be read"


def _certificate_problem(server) -> str | None:
    found = _serving_certificate(server)
    if not isinstance(found, tuple):
        return found
    path, cert = found
    if remaining(cert).total_seconds() <= 0:
        return f"serving certificate {path} expired at {cert.not_valid_after_utc:%Y-%m-%d %H:%M}Z"
    return None


def _unreadable(path: str | None) -> str | None:
    if path and not os.access(os.path.expanduser(path), os.R_OK):
        return f"{path} is not readable"
    return None
