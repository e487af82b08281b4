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
from gunicorn.http.errors import NoMoreData, ParseException
from werkzeug.exceptions import HTTPException

from archway import metrics
from archway.certs.selfsigned import tls_dir
from archway.certs.x509 import CertificateError, load_cert, remaining
from archway.extender.routes import register_extender
from archway.registry.resolver import Resolver
from archway.registry.sharedlookups import SharedLookups
from archway.webhook.app import register_webhook

log = logging.getLogger("archway.server")

PRODUCTS = ("webhook", "extender")


def products_of(choice: str) -> tuple[str, ...]:
    """server.product (or `archway serve --product`) -> the products to serve."""
    return PRODUCTS if choice == "all" else (choice,)


class ServerState:
    """What the routes of one worker share."""

    def __init__(self, config, resolver):
        self.config = config
        self.resolver = resolver
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
    state = ServerState(config, resolver)
    app.extensions["archway"] = state
    state.readiness_checks["registry.ca_file"] = lambda: _unreadable(config.registry.ca_file)
    # An expired certificate fails every client's calls; a failing probe makes that visible.
    state.readiness_checks["serving_certificate"] = lambda: _certificate_problem(config.server)
    if "webhook" in products:
        register_webhook(app, state, pull_secrets)
    if "extender" in products:
        register_extender(app, config, resolver)
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

    @app.errorhandler(ParseException)
    def malformed_http(e: ParseException):
        # A body gunicorn cannot decode (an invalid chunk size...) surfaces while the view
        # reads it: the client's fault, not a 500.
        metrics.bad_request(400)
        return jsonify(error=f"malformed HTTP request body: {type(e).__name__}: {e}"), 400

    @app.errorhandler(NoMoreData)
    def body_cut_short(e: NoMoreData):
        metrics.bad_request(400)
        return jsonify(error="the request body ended before its announced length"), 400

    @app.errorhandler(TimeoutError)
    def body_too_slow(e: TimeoutError):
        # The per-read timeout the views set on the socket while they read a body.
        metrics.bad_request(408)
        return jsonify(error="the request body stopped arriving"), 408

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


def _certificate_problem(server) -> str | None:
    if not server.tls:
        return None
    path = os.path.expanduser(server.cert_file or os.path.join(tls_dir(server.state_dir), "tls.crt"))
    if not os.path.exists(path):
        return None  # the app runs without `archway serve` (tests, a debugger): nothing to check
    try:
        with open(path, "rb") as f:
            cert = load_cert(f.read(1024 * 1024))
    except (OSError, CertificateError):
        return f"serving certificate {path} cannot be read"
    if remaining(cert).total_seconds() <= 0:
        return f"serving certificate {path} expired at {cert.not_valid_after_utc:%Y-%m-%d %H:%M}Z"
    return None


def _unreadable(path: str | None) -> str | None:
    if path and not os.access(os.path.expanduser(path), os.R_OK):
        return f"{path} is not readable"
    return None
