"""Debug containers (`kubectl debug`): an UPDATE of pods/ephemeralcontainers answered for the
admission service (service.py hands such a request to its DebugChecks and sends back what they
return; they read the pod's policy and images through the service, as for a pod).

    skip? -> the node from the node cache -> the new images (cache, then registries, under the
    same deadline as a pod) -> decide (debugcontainers.py) -> reply, metric, log line, Event

Nothing here waits beyond the deadline or on a cache that has not listed yet: a miss is a
warning that the image was not checked. The reply never carries a patch.
"""
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from archway import metrics
from archway.placement.debugcontainers import DebugDecision, NodePlatform, decide_debug
from archway.placement.decision import Decision
from archway.placement.policy import Policy, opt_out_reason
from archway.podview import PodView

from .admission import AdmissionRequest, cap_warnings, review_response
from .interfaces import EventRecorder, NodeSource

log = logging.getLogger("archway.admission")

REASON_DEBUG_IMAGE = "ArchwayDebugImageCannotRun"
_WORTH_A_LINE = frozenset({"denied", "warned", "fail_open", "audited", "error"})


class Resolved(Protocol):
    @property
    def results(self) -> dict: ...

    @property
    def warnings(self) -> tuple[str, ...]: ...


class PodReading(Protocol):
    """What a debug check asks of the admission service (service.py): the pod's policy, and
    images read with its pull secrets under its deadline, as for a pod."""

    def policy_for(self, pod: PodView, api_by: float) -> tuple[Policy, tuple[str, ...]]: ...

    def resolve(self, pod: PodView, due: float, api_by: float, *, images: tuple[str, ...],
                always_pulled: frozenset[str], dry_run: bool = False) -> Resolved: ...


@dataclass(frozen=True)
class DebugChecks:
    """How debug containers are checked: admission.debug_containers (`mode`), who is left alone,
    the node cache, where Warning Events go, the service's clock."""
    mode: str
    exclude_namespaces: tuple[str, ...]
    log_every: bool
    nodes: NodeSource | None
    events: EventRecorder | None
    clock: Callable[[], float]

    def review(self, reading: PodReading, request: AdmissionRequest, *, start: float,
               due: float, api_by: float) -> dict:
        """The AdmissionReview answering `request` (its `debug` set). `due`: when the answer
        must be ready; `api_by`: the Kubernetes API's share."""
        debug = request.debug
        assert debug is not None
        skipped = self._skip_reason(request)
        policy = reading.policy_for(debug.pod, api_by)[0] if skipped is None else None
        if policy is not None and policy.mode == "off":
            skipped = f"mode off ({policy.source or 'config'})"
        if skipped is not None:
            decision = DebugDecision(True, "unchanged", skipped)
            credential_warnings: tuple[str, ...] = ()
        else:
            try:
                node = self._node(debug.pod.node_name)
                credential_warnings = ()
                results: dict = {}
                if node is not None and node.arch:
                    resolved = reading.resolve(debug.pod, due, api_by, images=debug.images,
                                               always_pulled=debug.always_pulled,
                                               dry_run=request.dry_run)
                    results, credential_warnings = resolved.results, resolved.warnings
                decision = decide_debug(debug.images, results, node, self.mode,
                                        audit=policy is not None and policy.mode == "audit")
            except Exception:   # a bug must not turn into a 500 nor refuse a debugging session
                log.exception("admission %s uid=%s failed", request.display_name, request.uid)
                credential_warnings = ()
                decision = DebugDecision(True, "error", "internal error", (
                    "archway failed to check the debug image (internal error); not checked",))
        warnings = cap_warnings(credential_warnings + decision.warnings)
        elapsed = self.clock() - start
        metrics.admission_finished(decision.outcome, elapsed, len(warnings))
        self._record_event(request, decision)
        self._log(request, decision, len(warnings), elapsed)
        return review_response(request, Decision(allowed=decision.allowed,
                                                 message=decision.message),
                               warnings=warnings, audit_annotations={"outcome": decision.outcome})

    def _skip_reason(self, request: AdmissionRequest) -> str | None:
        """Why the debug images are not checked at all (the namespace's mode aside); None:
        check them."""
        debug = request.debug
        assert debug is not None
        if self.mode == "off":
            return "admission.debug_containers is off"
        opted_out = opt_out_reason(debug.pod, self.exclude_namespaces)
        if opted_out is not None:
            return opted_out
        if not debug.images:
            return "no debug container image added"
        if not debug.pod.node_name:
            return "pod is not bound to a node yet"   # placed later, with its own containers' images
        if self.nodes is None:
            return "no node cache (extender.node_cache is off)"
        return None

    def _node(self, name: str) -> NodePlatform | None:
        """The node from the node cache, without waiting; None: not listed (yet)."""
        if self.nodes is None or not self.nodes.wait_synced(0):
            return None
        facts = self.nodes.items.get(name)
        if facts is None:
            return None
        return NodePlatform(facts.name, facts.arch, facts.os)

    def _record_event(self, request: AdmissionRequest, decision: DebugDecision) -> None:
        """A Warning Event on the pod (`kubectl describe pod` shows it) when an image cannot
        run."""
        if not decision.cannot_run or self.events is None or request.dry_run:
            return
        pod = request.debug.pod if request.debug is not None else None
        if pod is None:
            return
        regarding = {"apiVersion": "v1", "kind": "Pod", "namespace": pod.namespace,
                     "name": pod.name, "uid": pod.uid}
        what = "refused" if not decision.allowed else "admitted with a warning"
        self.events.record(regarding, "Warning", REASON_DEBUG_IMAGE,
                           "Deny" if not decision.allowed else "Admit",
                           f"debug container {what}: " + "; ".join(decision.warnings))

    def _log(self, request: AdmissionRequest, decision: DebugDecision, warnings: int,
             elapsed: float) -> None:
        level = logging.INFO if self.log_every or decision.outcome in _WORTH_A_LINE \
            else logging.DEBUG
        if not log.isEnabledFor(level):
            return
        debug = request.debug
        images = len(debug.images) if debug is not None else 0
        node = debug.pod.node_name if debug is not None else ""
        reason = decision.message or decision.reason
        log.log(level, "admission %s uid=%s debug images=%d node=%s outcome=%s (%s) "
                       "warnings=%d %.1f ms%s",
                request.display_name, request.uid, images, node or "-", decision.outcome,
                reason, warnings, elapsed * 1000, " dry-run" if request.dry_run else "",
                extra={"pod": request.display_name, "uid": request.uid,
                       "outcome": decision.outcome, "reason": reason, "node": node,
                       "duration_ms": round(elapsed * 1000, 1), "dry_run": request.dry_run,
                       "subresource": "ephemeralcontainers"})
