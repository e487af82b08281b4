"""The Flask app: POST /mutate (admission), /healthz, /readyz, /metrics, plus the extender routes.

`create_app` runs once per gunicorn worker, after the fork: the resolver (thread pool, HTTP
connection pools, cache) belongs to the worker that uses it.
"""
import logging
import os
import time

from flask import Flask, Response, jsonify, request
from werkzeug.exceptions import HTTPException

from archway.certs.selfsigned import tls_dir
from archway.certs.x509 import CertificateError, load_cert, remaining
from archway.registry.resolver import Resolver
from archway.registry import sharedlookups

from archway import metrics
from archway.extender.routes import register_extender
from .pullsecrets import PullSecrets
from .service import AdmissionService

log = logging.getLogger("archway.admission")

# Bounds each socket read of a request body (gunicorn's gthread sockets block without limit).
_BODY_READ_TIMEOUT_SECONDS = 5.0
# An oversized body up to this size is read and dropped before the 413: a client still sending
# when the server hangs up sees a reset instead of the answer. Larger ones are cut off at once.
_DRAIN_LIMIT_BYTES = 16 * 1024 * 1024


class ArchwayState:
    """What the routes share inside one worker process."""

    def __init__(self, config, resolver, pull_secrets):
        self.config = config
        self.resolver = resolver
        self.pull_secrets = pull_secrets
        self.admission = AdmissionService.from_config(config, resolver=resolver,
                                                      pull_secrets=pull_secrets)
        # name -> callable returning None when fine, else what is wrong; the extender may add.
        self.readiness_checks: dict = {}


def create_app(config, *, resolver=None, pull_secrets=None) -> Flask:
    app = Flask("archway")
    # One byte over the limit: a chunked body (no Content-Length) is read up to max + 1 bytes,
    # so parse_review can tell "too large" (413) from "exactly the limit".
    app.config["MAX_CONTENT_LENGTH"] = config.server.max_body_bytes + 1
    if resolver is None:
        shared = os.environ.get(sharedlookups.ENV_VAR)  # set by `archway serve` for its workers
        resolver = Resolver(config.registry, sif=config.sif,
                            shared=sharedlookups.SharedLookups(shared) if shared else None)
    pull_secrets = pull_secrets if pull_secrets is not None else PullSecrets.from_config(config)
    state = ArchwayState(config, resolver, pull_secrets)
    app.extensions["archway"] = state
    state.readiness_checks["registry.ca_file"] = lambda: _unreadable(config.registry.ca_file)
    # An expired certificate fails every apiserver call; a failing probe makes that visible.
    state.readiness_checks["serving_certificate"] = lambda: _certificate_problem(config.server)

    @app.post("/mutate")
    def mutate():
        return _mutate(state)

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
        return jsonify(ready=True, resolver_cache_entries=state.resolver.cache_size,
                       kubernetes_api=state.pull_secrets.source)

    @app.get("/metrics")
    def metrics_route():
        body, content_type = metrics.render()
        return Response(body, content_type=content_type)

    @app.errorhandler(HTTPException)
    def http_error(e: HTTPException):
        # 404, 405, 413...: JSON like every other answer, never Flask's HTML page.
        if e.code and 400 <= e.code < 500:
            metrics.bad_request(e.code)
        if e.code in (404, 405):
            message = (f"{e.name}: {request.method} {request.path}; archway serves POST /mutate, "
                       "GET /healthz, /readyz, /metrics and the scheduler extender routes")
        else:
            message = e.description or e.name
        return jsonify(error=message), e.code

    @app.errorhandler(Exception)
    def internal_error(e: Exception):
        log.exception("unhandled error on %s %s", request.method, request.path)
        return jsonify(error="internal error; see archway's log"), 500

    register_extender(app, config, resolver)
    return app


def _refuse_oversized(max_bytes: int):
    length = request.content_length
    if length is None or length <= max_bytes:
        return None  # a chunked body is cut at MAX_CONTENT_LENGTH, then refused by parse_review
    if length <= _DRAIN_LIMIT_BYTES:
        stream, remaining = request.environ["wsgi.input"], length
        try:
            while remaining > 0:
                chunk = stream.read(min(64 * 1024, remaining))
                if not chunk:
                    break
                remaining -= len(chunk)
        except OSError:
            pass  # the answer below may still get through; nothing else to do
    metrics.bad_request(413)
    return jsonify(error=f"request body of {length} bytes exceeds server.max_body_bytes "
                         f"({max_bytes})"), 413


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


def _mutate(state: ArchwayState):
    start = time.monotonic()
    sock = request.environ.get("gunicorn.socket")
    if sock is not None:
        sock.settimeout(_BODY_READ_TIMEOUT_SECONDS)
    too_large = _refuse_oversized(state.config.server.max_body_bytes)
    if too_large is not None:
        return too_large
    body = request.get_data(cache=False)  # over MAX_CONTENT_LENGTH: 413 through http_error
    answer = state.admission.review(body, started=start, peer=request.remote_addr or "-")
    return jsonify(answer.body), answer.status
