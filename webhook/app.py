"""The Flask app: POST /mutate (admission), /healthz, /readyz, /metrics, plus the extender routes.

`create_app` runs once per gunicorn worker, after the fork: the resolver (thread pool, HTTP
connection pools, cache) belongs to the worker that uses it.
"""
import logging
import os
import time
from dataclasses import replace

from flask import Flask, Response, jsonify, request
from werkzeug.exceptions import HTTPException

from archway.certs.selfsigned import tls_dir
from archway.certs.x509 import CertificateError, load_cert, remaining
from archway.errors import ArchwayError
from archway.registry.reference import parse_reference
from archway.registry.resolver import Resolver
from archway.registry import sharedlookups

from archway import metrics
from .admission import (AdmissionError, AdmissionRequest, allow_unchanged, parse_review,
                        review_response, skip_reason)
from archway.extender.routes import register_extender
from .placement import Decision, Policy, cap_warnings, decide, pod_images
from .pullsecrets import PullSecrets

log = logging.getLogger("archway.admission")

# Share of the admission deadline the Kubernetes API reads may use: registries need the rest.
_PULL_SECRETS_SHARE = 0.4
# Kept back from the deadline to build and send the answer.
_ANSWER_MARGIN_SECONDS = 0.05
# Bounds each socket read of a request body (gunicorn's gthread sockets block without limit).
_BODY_READ_TIMEOUT_SECONDS = 5.0
# An oversized body up to this size is read and dropped before the 413: a client still sending
# when the server hangs up sees a reset instead of the answer. Larger ones are cut off at once.
_DRAIN_LIMIT_BYTES = 16 * 1024 * 1024


# Outcomes logged even when server.log_every_admission is off.
_WORTH_A_LINE = frozenset({"denied", "fail_open", "error"})


class ArchwayState:
    """What the routes share inside one worker process."""

    def __init__(self, config, resolver, pull_secrets):
        self.config = config
        self.policy = Policy.from_config(config)
        self.resolver = resolver
        self.pull_secrets = pull_secrets
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
    try:
        review = parse_review(body, state.config.server.max_body_bytes)
    except AdmissionError as e:
        metrics.bad_request(e.status)
        log.info("rejected a malformed admission request from %s: %s", request.remote_addr, e)
        return jsonify(error=str(e)), e.status

    skipped = skip_reason(review, state.config.admission.exclude_namespaces)
    if skipped is not None:
        log.info("admission %s uid=%s unchanged: %s", review.display_name, review.uid, skipped)
        metrics.admission_finished("unchanged", time.monotonic() - start, 0)
        return jsonify(allow_unchanged(review))

    try:
        decision, images, results = _decide(state, review, start)
    except Exception:  # a bug must not turn into a 500: the apiserver would apply failurePolicy
        log.exception("admission %s uid=%s failed", review.display_name, review.uid)
        decision = _internal_error_decision(state.policy)
        images, results = (), {}
    elapsed = time.monotonic() - start
    outcome = decision.outcome if decision.reason != "internal error" else "error"
    metrics.admission_finished(outcome, elapsed, len(decision.warnings))
    _count_images(images, results)
    # A log line costs as much as the decision itself: by default only what needs a look.
    level = logging.INFO if state.config.server.log_every_admission or outcome in _WORTH_A_LINE \
        else logging.DEBUG
    log.log(level, "admission %s uid=%s images=%d archs=%s outcome=%s (%s) warnings=%d %.1f ms%s",
            review.display_name, review.uid, len(images),
            ",".join(sorted(decision.architectures)) if decision.architectures else "-",
            outcome, decision.reason, len(decision.warnings), elapsed * 1000,
            " dry-run" if review.dry_run else "")
    return jsonify(review_response(review, decision, _audit(decision, outcome)))


def _decide(state: ArchwayState, review: AdmissionRequest, start: float):
    pod = review.object
    images = pod_images(pod)
    deadline = start + state.config.admission.deadline_seconds - _ANSWER_MARGIN_SECONDS
    results, secret_warnings = {}, ()
    if images:
        secrets_deadline = start + state.config.admission.deadline_seconds * _PULL_SECRETS_SHARE
        credentials = state.pull_secrets.credentials_for(pod, review.pod_namespace, secrets_deadline)
        secret_warnings = credentials.warnings
        results = state.resolver.resolve_many(images, keyring=credentials.keyring,
                                              timeout=deadline - time.monotonic())
    decision = decide(pod, results, state.policy)
    if secret_warnings:
        decision = _with_warnings(decision, secret_warnings)
    return decision, images, results


def _with_warnings(decision: Decision, extra) -> Decision:
    return replace(decision, warnings=cap_warnings(list(decision.warnings) + list(extra)))


def _internal_error_decision(policy: Policy) -> Decision:
    if policy.fail_closed:
        return Decision(allowed=False, outcome="denied", reason="internal error",
                        message="archway failed to decide (internal error; see its log) "
                                "and admission.fail_closed is true")
    return Decision(allowed=True, outcome="fail_open", reason="internal error",
                    warnings=("archway failed to decide (internal error); pod admitted unchanged",))


def _audit(decision: Decision, outcome: str) -> dict:
    audit = {"outcome": outcome}
    if decision.architectures:
        audit["architectures"] = ",".join(sorted(decision.architectures))
    return audit


def _count_images(images, results) -> None:
    for image in images:
        result = results.get(image)
        if isinstance(result, ArchwayError) or result is None:
            metrics.IMAGE_RESOLUTIONS.labels(_scheme(image), _error_kind(result)).inc()
        else:
            metrics.IMAGE_RESOLUTIONS.labels(result.source, 
                                              "resolved" if result.architectures else "no_arch").inc()


def _scheme(image: str) -> str:
    try:
        return parse_reference(image).scheme
    except ArchwayError:
        return "invalid"


def _error_kind(error) -> str:
    """snake_case of the error class: a bounded label set (DeadlineExceeded -> deadline_exceeded)."""
    name = type(error).__name__ if error is not None else "DeadlineExceeded"
    return "".join("_" + c.lower() if c.isupper() else c for c in name).lstrip("_")
