"""The webhook product's HTTP side: POST /mutate, translated to and from the admission service.

The view bounds how the body is read (size, per-read timeout) and writes the service's answer
as JSON; what admission means lives in service.py. archway.app puts this route next to the
shared ones (/healthz, /readyz, /metrics).
"""
import time

from flask import Flask, jsonify, request

from archway import metrics

from .namespaces import NamespaceCache
from .pullsecrets import PullSecrets, build_api_client
from .service import AdmissionService

# Bounds each socket read of a request body (gunicorn's gthread sockets block without limit).
_BODY_READ_TIMEOUT_SECONDS = 5.0
# An oversized body up to this size is read and dropped before the 413: a client still sending
# when the server hangs up sees a reset instead of the answer. Larger ones are cut off at once.
_DRAIN_LIMIT_BYTES = 16 * 1024 * 1024


def register_webhook(app: Flask, state, pull_secrets=None) -> AdmissionService:
    """Add POST /mutate to `app`; `state` is the worker's archway.app.ServerState (config,
    resolver, node cache, readiness). `pull_secrets` replaces the reader built from the config."""
    config = state.config
    if pull_secrets is None:
        pull_secrets = PullSecrets.from_config(config)
    gating, events = _gate_support(config, pull_secrets)
    namespaces = None
    if config.kubernetes.namespace_cache and config.kubernetes.enabled != "off":
        namespaces = NamespaceCache(lambda: build_api_client(config.kubernetes)[0])
        namespaces.ensure_started()   # in this worker: the first pods need it listed
    service = AdmissionService.from_config(
        config, resolver=state.resolver, pull_secrets=pull_secrets, namespaces=namespaces,
        nodes=state.node_cache, gating=gating, events=events)
    app.extensions["archway.webhook"] = service
    prewarm = config.registry.prewarm
    if prewarm.enabled and getattr(pull_secrets, "api", None) is not None:
        from .cluster import ClusterReader
        from .prewarm import Prewarmer
        # Started by `archway serve` as each worker boots (archway.serve), never by a test app.
        app.extensions["archway.prewarm"] = Prewarmer(
            lambda: ClusterReader(pull_secrets.api.api_client), state.resolver, pull_secrets,
            per_second=prewarm.requests_per_second,
            exclude_namespaces=config.admission.exclude_namespaces)
    state.readiness_facts["kubernetes_api"] = lambda: pull_secrets.source
    if gating is not None:
        # Whether this worker would gate a pod now (admission.unresolved: gate).
        state.readiness_facts["gate_controller"] = lambda: (
            "leader alive" if gating.leader_fresh() else "no leader: pods are admitted unplaced")
    max_bytes = config.server.max_body_bytes

    def mutate():
        start = time.monotonic()
        sock = request.environ.get("gunicorn.socket")
        if sock is not None:
            sock.settimeout(_BODY_READ_TIMEOUT_SECONDS)
        too_large = _refuse_oversized(max_bytes)
        if too_large is not None:
            return too_large
        body = request.get_data(cache=False)  # over MAX_CONTENT_LENGTH: the app's 413
        answer = service.review(body, started=start, peer=request.remote_addr or "-")
        return jsonify(answer.body), answer.status

    app.add_url_rule("/mutate", "mutate", mutate, methods=["POST"])
    return service


def _gate_support(config, pull_secrets):
    """(Lease observer, Event sink) when a Kubernetes API is configured, else (None, None)."""
    api_client = getattr(getattr(pull_secrets, "api", None), "api_client", None)
    if api_client is None:
        return None, None
    from .events import EventSink
    from .kubeapi import KubeApi
    from .lease import LeaseObserver, lease_namespace, new_identity
    api = KubeApi(api_client, timeout_seconds=5)
    gating = None
    if config.admission.unresolved == "gate":
        gating = LeaseObserver(api, lease_namespace(config.kubernetes.namespace),
                               duration_seconds=config.admission.gate_lease_seconds)
        gating.start()
    return gating, EventSink(api, instance=new_identity())


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
