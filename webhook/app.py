"""The webhook product's HTTP side: POST /mutate, translated to and from the admission service.

The view bounds how the body is read (size, per-read timeout) and writes the service's answer
as JSON; what admission means lives in service.py. archway.app puts this route next to the
shared ones (/healthz, /readyz, /metrics).
"""
import json
import time

from flask import Flask, Response, jsonify, request

from archway import metrics

from .pullsecrets import PullSecrets
from .service import AdmissionService

# Bounds each socket read of a request body (gunicorn's gthread sockets block without limit).
_BODY_READ_TIMEOUT_SECONDS = 5.0
# An oversized body up to this size is read and dropped before the 413: a client still sending
# when the server hangs up sees a reset instead of the answer. Larger ones are cut off at once.
_DRAIN_LIMIT_BYTES = 16 * 1024 * 1024


def register_webhook(app: Flask, state, pull_secrets=None) -> AdmissionService:
    """Add POST /mutate to `app`; `state` is the worker's archway.app.ServerState (config,
    resolver, readiness). `pull_secrets` replaces the reader built from the config."""
    config = state.config
    if pull_secrets is None:
        pull_secrets = PullSecrets.from_config(config)
    service = AdmissionService.from_config(config, resolver=state.resolver,
                                           pull_secrets=pull_secrets)
    app.extensions["archway.webhook"] = service
    state.readiness_facts["kubernetes_api"] = lambda: pull_secrets.source
    max_bytes = config.server.max_body_bytes

    def mutate():
        start = time.monotonic()
        sock = request.environ.get("gunicorn.socket")
        if sock is not None:
            sock.settimeout(_BODY_READ_TIMEOUT_SECONDS)
        too_large = _refuse_oversized(max_bytes)
        if too_large is not None:
            return too_large
        # Straight from the WSGI stream: the worker has usually read the whole body already
        # (archway.worker), and werkzeug's wrappers cost more than the read. A chunked body
        # (no Content-Length) is cut one byte over the limit and refused by the service.
        body = request.environ["wsgi.input"].read(max_bytes + 1)
        answer = service.review(body, started=start, peer=request.remote_addr or "-")
        return Response(json.dumps(answer.body, separators=(",", ":")), answer.status,
                        mimetype="application/json")

    app.add_url_rule("/mutate", "mutate", mutate, methods=["POST"])
    return service


def _refuse_oversized(max_bytes: int):
    length = request.content_length
    if length is None or length <= max_bytes:
        return None  # a chunked body is cut at MAX_CONTENT_LENGTH, then refused by the service
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
