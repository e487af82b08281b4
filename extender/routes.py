"""The scheduler extender over HTTP: `POST /scheduler/filter` keeps a pod off nodes whose
architecture its images cannot run on; `POST /scheduler/prioritize` prefers nodes with less
network traffic. This module declares the two routes (archway.server.routes), hands their
bodies to the service (service.py) and counts and logs the outcome.

kube-scheduler calls these for every pod of the profile that lists archway as extender (the
second scheduler the webhook's `schedulerName` points at). The extender is configured
`ignorable: true`, so any error here only costs the pod archway's opinion, never its scheduling;
that is why unknown things pass instead of blocking.
"""
import json
import logging
import time

from archway import metrics
from archway.server.routes import Reply, Request, Route

from .service import Extender
from .wire import MalformedExtenderArgs, TooManyNodes, parse_extender_args

log = logging.getLogger("archway.extender")

# Full-Nodes mode sends every candidate Node, far above the admission body limit, so the
# extender routes set their own: 5,000 Nodes (Kubernetes' largest supported cluster) with
# kubelet's 50 status.images each measure 58.8 MB in JSON (bench/common/extender_cluster.py), 11.8 KB a node.
# Parsing holds about twice the body (wire.py), so a worker's threads stay within a few GB.
# The server reads the whole body within its deadline before the route sees it
# (archway.server.loop: 10 s from the head), and over the limit answers 413 unread.
MAX_BODY_BYTES = 64 * 1024 * 1024


# --- HTTP -----------------------------------------------------------------------------------------

def extender_routes(extender: Extender) -> list[Route]:
    """POST /scheduler/filter and /scheduler/prioritize. kube-scheduler waits for every call,
    so both are answered on the server's loop when the answer waits for nothing (the pod's
    architectures are in its annotation, the node cache has listed), else on a thread."""
    return [Route("POST", f"/scheduler/{verb}", _handler(extender, verb), max_body=MAX_BODY_BYTES,
                  limit_name="the extender's limit", on_loop=True)
            for verb in ("filter", "prioritize")]


def _handler(extender: Extender, verb: str):
    def handle(request: Request) -> Reply | None:
        answer = _answer(extender, verb, request.body, request.arrived, wait=request.may_wait)
        return None if answer is None else Reply(*answer)
    return handle


def _answer(extender: Extender, verb: str, body: bytes, arrived: float | None, *,
            wait: bool = True) -> tuple[int, bytes] | None:
    """(status, JSON body) of a call with this body; None when `wait` is False and the answer
    would wait for something (a registry lookup, the first list of Nodes)."""
    started = time.perf_counter()
    try:
        try:
            args = parse_extender_args(body)
        except TooManyNodes as e:
            return _too_large(verb, e, started)
        if verb == "filter":
            filtered = extender.filter(args, arrived, wait=wait)
            if filtered is None:
                return None
            answer, summary = filtered
        else:
            answer = extender.prioritize(args)
    except MalformedExtenderArgs as e:
        return _bad_request(verb, e, started)
    _finished(verb, "ok", started)
    if verb == "filter":
        log.info("filter %s (%.1f ms)", summary, (time.perf_counter() - started) * 1000)
    return 200, answer


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
