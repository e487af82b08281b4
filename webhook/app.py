"""The webhook product's HTTP side: POST /mutate, translated to and from the admission service.

The handler bounds how the body is read (size, per-read timeout) and writes the service's
answer as JSON; what admission means lives in service.py. It works on the WSGI environ:
archway.app answers POST /mutate with it ahead of Flask (the warm path), and the Flask route,
next to the shared ones (/healthz, /readyz, /metrics), serves the rest (GET /mutate's 405).
"""
import json
import time

from flask import Flask, Response, request

from archway import metrics
from archway.deadline import arrival, caller_timeout
from archway.requestbody import body_stream, read_body

from .service import AdmissionService
from .wiring import build_webhook, startup_seconds

# An oversized body up to this size is read and dropped before the 413: a client still sending
# when the server hangs up sees a reset instead of the answer. Larger ones are cut off at once.
_DRAIN_LIMIT_BYTES = 16 * 1024 * 1024


def register_webhook(app: Flask, state, pull_secrets=None) -> AdmissionService:
    """Add POST /mutate to `app`; `state` is the worker's archway.app.ServerState (config,
    resolver, node cache, readiness). `pull_secrets` replaces the reader built from the config."""
    config = state.config
    parts = build_webhook(config, state.resolver, state.node_cache, pull_secrets)
    service, gating = parts.service, parts.gating
    app.extensions["archway.webhook"] = service
    if parts.prewarmer is not None:
        # Started by `archway serve` as each worker boots (archway.serve), never by a test app.
        app.extensions["archway.prewarm"] = parts.prewarmer
    state.readiness_facts["kubernetes_api"] = lambda: parts.pull_secrets.api_kind
    if gating is not None:
        # Whether this worker would gate a pod now (admission.unresolved: gate).
        state.readiness_facts["gate_controller"] = lambda: _leader_fact(gating)
        state.readiness_checks["gate_controller"] = gate_readiness(
            gating, state.controller_up, startup_seconds(config))
    max_bytes = config.server.max_body_bytes

    def mutate_environ(environ: dict) -> tuple[int, bytes]:
        """POST /mutate from its WSGI environ: (status, JSON body). archway.app calls it ahead
        of Flask (the warm path without the framework's request and response objects). The
        deadline counts from the request's arrival (archway.server.worker), else from now, and stops
        short of the apiserver's `?timeout=`."""
        start = arrival(environ)
        if start is None:
            start = time.monotonic()
        length = _content_length(environ)
        if length is not None and length > max_bytes:
            _drain(body_stream(environ), length)
            metrics.bad_request(413)
            return 413, _json({"error": f"request body of {length} bytes exceeds "
                                        f"server.max_body_bytes ({max_bytes})"})
        # The worker has usually read the whole body already (archway.server.worker). A chunked
        # body (no Content-Length) is cut one byte over the limit and refused by the service.
        body = read_body(environ, max_bytes + 1)
        answer = service.review(body, started=start,
                                timeout=caller_timeout(environ.get("QUERY_STRING") or ""),
                                peer=environ.get("REMOTE_ADDR") or "-")
        return answer.status, _json(answer.body)

    def mutate():
        # The Flask route answers what reaches Flask (a test client without the fast path) and
        # gives GET /mutate its 405.
        status, body = mutate_environ(request.environ)
        return Response(body, status, mimetype="application/json")

    app.add_url_rule("/mutate", "mutate", mutate, methods=["POST"])
    state.fast_routes[("POST", "/mutate")] = mutate_environ
    return service


def _leader_fact(gating) -> str:
    if gating.leader_fresh():
        return "leader alive"
    why = f" ({gating.last_error})" if gating.last_error else ""
    return f"no leader{why}: pods are admitted unplaced"


def gate_readiness(gating, controller_up, startup: float):
    """/readyz's check while a worker starts: not ready until the Lease was read once (for at
    most `startup` seconds), nor, when this server runs a controller that is up, while the
    observer still looks eagerly for a leader (at most `startup` seconds without one). Then
    never again for this reason, whatever the Lease or the API do: readiness gates the
    admissions themselves, and a webhook without endpoints would hold up the cluster's pods.
    Tied to the observer's eagerness because the pod is ready when ANY worker says so: another
    worker still waiting for a leader must answer its next miss with a fresh read of the Lease
    (issue 30), so it stays eager as long as it stays unready. `controller_up`: whether the
    controller this server runs is up (None: it runs none)."""
    booted = time.monotonic()
    settled = False

    def check() -> str | None:
        nonlocal settled
        if settled:
            return None
        if not gating.has_read:
            if time.monotonic() - booted < startup:
                return "reading the gate controller's Lease"
        elif gating.eager and controller_up is not None and controller_up():
            return f"waiting for a gate controller to take the Lease (at most {startup:g} s)"
        settled = True
        return None

    return check


def _json(value) -> bytes:
    return json.dumps(value, separators=(",", ":")).encode()


def _content_length(environ: dict) -> int | None:
    try:
        return int(environ.get("CONTENT_LENGTH") or "")
    except ValueError:
        return None


def _drain(stream, length: int) -> None:
    """Read and drop an oversized body up to _DRAIN_LIMIT_BYTES: a client still sending when
    the server hangs up sees a reset instead of the 413."""
    if length > _DRAIN_LIMIT_BYTES:
        return
    remaining = length
    try:
        while remaining > 0:
            chunk = stream.read(min(64 * 1024, remaining))
            if not chunk:
                break
            remaining -= len(chunk)
    except OSError:
        pass  # the answer may still get through; nothing else to do
