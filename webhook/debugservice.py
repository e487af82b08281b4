"""Debug containers (`kubectl debug`): an UPDATE of pods/ephemeralcontainers answered by the
admission service (service.py hands such a request here and sends back what this returns).

    skip? -> the node from the node cache -> the new images (cache, then registries, under the
    same deadline as a pod) -> decide (debugcontainers.py) -> reply, metric, log line, Event

Nothing here waits beyond the deadline or on a cache that has not listed yet: a miss is a
warning that the image was not checked. The reply never carries a patch.
"""
import logging
from typing import Any

from archway import metrics

from .admission import AdmissionRequest, cap_warnings, opt_out_reason, review_response
from .debugcontainers import DebugDecision, NodePlatform, decide_debug
from .placement import Decision

log = logging.getLogger("archway.admission")

REASON_DEBUG_IMAGE = "ArchwayDebugImageCannotRun"
_WORTH_A_LINE = frozenset({"denied", "warned", "fail_open", "audited", "error"})


def review_debug(service: Any, request: AdmissionRequest, *, start: float, due: float,
                 api_by: float) -> dict:
    """The AdmissionReview answering `request` (its `debug` set) for `service` (an
    AdmissionService: its settings, resolver, pull-secret reader, caches, Event recorder and
    clock). `due`: when the answer must be ready; `api_by`: the Kubernetes API's share."""
    debug = request.debug
    assert debug is not None
    settings = service.settings
    skipped = _skip_reason(service, request)
    policy = service.policy_for(debug.pod, api_by)[0] if skipped is None else None
    if policy is not None and policy.mode == "off":
        skipped = f"mode off ({policy.source or 'config'})"
    if skipped is not None:
        decision = DebugDecision(True, "unchanged", skipped)
        credential_warnings: tuple[str, ...] = ()
    else:
        try:
            node = _node(service, debug.pod.node_name)
            results, credential_warnings = _resolve(service, debug, due, api_by) \
                if node is not None and node.arch else ({}, ())
            decision = decide_debug(debug.images, results, node, settings.debug_containers,
                                    audit=policy is not None and policy.mode == "audit")
        except Exception:   # a bug must not turn into a 500 nor refuse a debugging session
            log.exception("admission %s uid=%s failed", request.display_name, request.uid)
            credential_warnings = ()
            decision = DebugDecision(True, "error", "internal error", (
                "archway failed to check the debug image (internal error); not checked",))
    warnings = cap_warnings(credential_warnings + decision.warnings)
    elapsed = service.clock() - start
    metrics.admission_finished(decision.outcome, elapsed, len(warnings))
    _record_event(service, request, decision)
    _log(service, request, decision, len(warnings), elapsed)
    return review_response(request, Decision(allowed=decision.allowed, message=decision.message),
                           warnings=warnings, audit_annotations={"outcome": decision.outcome})


def _skip_reason(service: Any, request: AdmissionRequest) -> str | None:
    """Why the debug images are not checked at all (the namespace's mode aside); None: check
    them."""
    debug = request.debug
    assert debug is not None
    if service.settings.debug_containers == "off":
        return "admission.debug_containers is off"
    opted_out = opt_out_reason(debug.pod, service.settings.exclude_namespaces)
    if opted_out is not None:
        return opted_out
    if not debug.images:
        return "no debug container image added"
    if not debug.pod.node_name:
        return "pod is not bound to a node yet"   # placed later, with its own containers' images
    if service.caches.nodes is None:
        return "no node cache (extender.node_cache is off)"
    return None


def _node(service: Any, name: str) -> NodePlatform | None:
    """The node from the node cache, without waiting; None: not listed (yet)."""
    cache = service.caches.nodes
    if not cache.wait_synced(0):
        return None
    facts = cache.items.get(name)
    if facts is None:
        return None
    return NodePlatform(facts.name, facts.arch, facts.os)


def _resolve(service: Any, debug, due: float, api_by: float) -> tuple[dict, tuple[str, ...]]:
    """The debug images' results, read with the pod's pull secrets, by `due`."""
    resolution = service.resolve(debug.pod, due, api_by, images=debug.images,
                                 always_pulled=debug.always_pulled)
    return resolution.results, resolution.warnings


def _record_event(service: Any, request: AdmissionRequest, decision: DebugDecision) -> None:
    """A Warning Event on the pod (`kubectl describe pod` shows it) when an image cannot run."""
    if not decision.cannot_run or service.events is None or request.dry_run:
        return
    pod = request.debug.pod if request.debug is not None else None
    if pod is None:
        return
    regarding = {"apiVersion": "v1", "kind": "Pod", "namespace": pod.namespace,
                 "name": pod.name, "uid": pod.uid}
    what = "refused" if not decision.allowed else "admitted with a warning"
    service.events.record(regarding, "Warning", REASON_DEBUG_IMAGE,
                          "Deny" if not decision.allowed else "Admit",
                          f"debug container {what}: " + "; ".join(decision.warnings))


def _log(service: Any, request: AdmissionRequest, decision: DebugDecision, warnings: int,
         elapsed: float) -> None:
    level = logging.INFO if service.settings.log_every or decision.outcome in _WORTH_A_LINE \
        else logging.DEBUG
    if not log.isEnabledFor(level):
        return
    debug = request.debug
    images = len(debug.images) if debug is not None else 0
    node = debug.pod.node_name if debug is not None else ""
    reason = decision.message or decision.reason
    log.log(level, "admission %s uid=%s debug images=%d node=%s outcome=%s (%s) warnings=%d "
                   "%.1f ms%s",
            request.display_name, request.uid, images, node or "-", decision.outcome, reason,
            warnings, elapsed * 1000, " dry-run" if request.dry_run else "",
            extra={"pod": request.display_name, "uid": request.uid, "outcome": decision.outcome,
                   "reason": reason, "node": node, "duration_ms": round(elapsed * 1000, 1),
                   "dry_run": request.dry_run, "subresource": "ephemeralcontainers"})
