"""The scheduler extender over HTTP: `POST /scheduler/filter` keeps a pod off nodes whose
architecture its images cannot run on; `POST /scheduler/prioritize` prefers nodes with less
network traffic. This module reads the (large) bodies within bounds, hands them to the service
(service.py) and counts and logs the outcome.

kube-scheduler calls these for every pod of the profile that lists archway as extender (the
second scheduler the webhook's `schedulerName` points at). The extender is configured
`ignorable: true`, so any error here only costs the pod archway's opinion, never its scheduling;
that is why unknown things pass instead of blocking.
"""
import json
import logging
import time
from functools import partial

from flask import Flask, Response, request

from archway import metrics
from archway.deadline import arrival
from archway.nodes import NodeCache
from archway.requestbody import read_body

from .service import Extender
from .wire import MalformedExtenderArgs, TooManyNodes, parse_extender_args

log = logging.getLogger("archway.extender")

# Full-Nodes mode sends every candidate Node, far above the admission body limit, so the
# extender routes set their own: 5,000 Nodes (Kubernetes' largest supported cluster) with
# kubelet's 50 status.images each measure 58.8 MB in JSON (bench/common/extender_cluster.py), 11.8 KB a node.
# Parsing holds about twice the body (wire.py), so a worker's threads stay within a few GB.
MAX_BODY_BYTES = 64 * 1024 * 1024
# The whole body by this deadline (archway.requestbody, which bounds each read too): these
# large bodies are read by a handler thread, not by the worker's main loop
# (archway.server.worker), so a client dripping one is cut off here. 64 MiB over loopback takes
# well under a second; kube-scheduler gives up on the call after its httpTimeout anyway.
BODY_DEADLINE_SECONDS = 10.0


# --- HTTP -----------------------------------------------------------------------------------------

def register_extender(app: Flask, config, resolver, *, extender: Extender | None = None,
                      node_cache: NodeCache | None = None, fast_routes: dict | None = None,
                      inline_routes: dict | None = None) -> None:
    """Add POST /scheduler/filter and /scheduler/prioritize to `app`. `resolver` is a
    archway.registry.resolver.Resolver or None (pod arch then comes from the webhook's
    annotation only). `node_cache`: the process's one NodeCache (archway.app
    builds it when extender.node_cache is on and there is cluster access), None: names the
    scheduler sends pass the filter. `extender` replaces the one built from `config`.
    `fast_routes`: archway.app's routes answered from the WSGI environ ahead of Flask (figure 1:
    Flask's request and response objects cost a third of a warm call); the views are added
    there too, and Flask serves what reaches it (a test client, GET's 405). `inline_routes`:
    the worker's routes answered in its main loop (archway.server.inline) when the answer needs
    no wait: kube-scheduler waits for every call."""
    extender = extender or Extender(config, resolver, node_cache=node_cache)
    app.extensions["archway.extender"] = extender
    for path, verb in (("/scheduler/filter", "filter"), ("/scheduler/prioritize", "prioritize")):
        view = _environ_view(extender, verb)

        def flask_view(view=view):
            status, body = view(request.environ)
            return Response(body, status, mimetype="application/json")
        app.add_url_rule(path, path.replace("/", "_").strip("_"), flask_view, methods=["POST"])
        if fast_routes is not None:
            fast_routes[("POST", path)] = view
        if inline_routes is not None:
            inline_routes[("POST", path)] = partial(_answer, extender, verb, wait=False)


def _environ_view(extender: Extender, verb: str):
    """POST /scheduler/<verb> from its WSGI environ: (status, JSON body)."""

    def view(environ: dict) -> tuple[int, bytes]:
        started = time.perf_counter()
        try:
            body = _read_body(environ)
        except _TooLarge as e:
            return _too_large(verb, e, started)
        # From the request's arrival: time it waited for a thread is spent already.
        answer = _answer(extender, verb, body, arrival(environ), started=started)
        assert answer is not None   # it waits when it must
        return answer

    return view


def _answer(extender: Extender, verb: str, body: bytes, arrived: float | None, *,
            wait: bool = True, started: float | None = None) -> tuple[int, bytes] | None:
    """(status, JSON body) of a call with this body; None when `wait` is False and the answer
    would wait for something (a registry lookup, the first list of Nodes)."""
    started = started or time.perf_counter()
    try:
        try:
            args = parse_extender_args(body)
        except TooManyNodes as e:
            raise _TooLarge(str(e)) from None
        if verb == "filter":
            filtered = extender.filter(args, arrived, wait=wait)
            if filtered is None:
                return None
            answer, summary = filtered
        else:
            answer = extender.prioritize(args)
    except MalformedExtenderArgs as e:
        return _bad_request(verb, e, started)
    except _TooLarge as e:
        return _too_large(verb, e, started)
    _finished(verb, "ok", started)
    if verb == "filter":
        log.info("filter %s (%.1f ms)", summary, (time.perf_counter() - started) * 1000)
    return 200, answer


class _TooLarge(Exception):
    """A body over MAX_BODY_BYTES, or a list of more candidates than the extender takes."""


def _read_body(environ: dict) -> bytes:
    try:
        length = int(environ.get("CONTENT_LENGTH") or "")
    except ValueError:
        length = None
    if length is not None and length > MAX_BODY_BYTES:
        raise _TooLarge(f"request body of {length} bytes exceeds the extender's limit "
                        f"({MAX_BODY_BYTES})")
    body = read_body(environ, MAX_BODY_BYTES + 1, time.monotonic() + BODY_DEADLINE_SECONDS)
    if len(body) > MAX_BODY_BYTES:   # a chunked body without a length
        raise _TooLarge(f"request body exceeds the extender's limit ({MAX_BODY_BYTES})")
    return body


def _too_large(verb: str, error: Exception, started: float) -> tuple[int, bytes]:
    _finished(verb, "bad_request", started)
    metrics.bad_request(413)
    return 413, json.dumps({"error": str(error)}).encode()


def _bad_request(verb: str, error: Exception, started: float) -> tuple[int, bytes]:
    _finished(verb, "bad_request", started)
    metrics.bad_request(400)
    log.info("%s: 400 %s", verb, error)
    return 400, json.dumps({"error": f"malformed ExtenderArgs: {error}"}).encode()


def _finished(verb: str, outcome: str, started: float) -> None:
    metrics.EXTENDER_REQUESTS.labels(verb, outcome).inc()
    metrics.EXTENDER_DURATION.labels(verb).observe(time.perf_counter() - started)

