"""The admission service: an AdmissionReview body in, the answer out. Plain Python, no HTTP.

    parse -> skip -> resolve (pull secrets, then the images, under the deadline) -> decide -> reply

The deadline counts from the request's arrival and stops short of the apiserver's own timeout
(archway/deadline.py): a request that waited for a thread gets only what is left, and one with
nothing left is answered at once from what the cache knows (an image not in it: the gate, or
admission.unresolved), never left for the apiserver to admit unplaced. Lookups it started go on
in the background and fill the cache.

The server's loop asks first `at_once`: an answer that waits for nothing (every image, pull
secret, policy and controller in memory) is given there, without a thread; anything else is
None before anything is counted, logged or recorded, and a thread asks again with time to
wait. The two answers are the same where both are given (tests/test_service.py).

The route (routes.py) only hands over the body and writes the answer; everything admission means
happens here, so it is tested without a server. The resolver and the pull-secret reader are
small interfaces (interfaces.py) handed in, with what it reads of the cluster
(cluster/caches.py), all built once per worker by wiring.py; `decide` is the pure placement
decision. The reply's warnings are put together and capped once, here: the pull-secret warnings
(the ones a user can act on) first, then the decision's.
"""
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from itertools import chain

from archway import metrics
from archway.cluster.caches import ClusterCaches
from archway.cluster.events import REASON_UNSCHEDULABLE, owner_reference, pod_or_owner
from archway.deadline import answer_by, share_of
from archway.errors import classify_error
from archway.placement.decision import Decision, decide, display_image, gated_warnings
from archway.placement.patches import gate_patch
from archway.placement.policy import Policy
from archway.podview import PodView
from archway.registry.model import ImageInfo
from archway.registry.reference import scheme_of

from .admission import (
    AdmissionError,
    AdmissionRequest,
    allow_unchanged,
    cap_warnings,
    parse_review,
    review_response,
    skip_reason,
)
from .debugservice import DebugChecks
from .interfaces import EventRecorder, Gating, ImageResolver, PullCredentialSource

log = logging.getLogger("archway.admission")

# Share of the time left the Kubernetes API reads may use: registries need the rest.
PULL_SECRETS_SHARE = 0.4
# Kept back from the deadline to build and send the answer.
ANSWER_MARGIN_SECONDS = 0.05
# A log line names at most this many failed images, each error's message cut at this length.
_LOGGED_FAILURES = 10
_DETAIL_CHARS = 300
# Outcomes logged even when server.log_every_admission is off.
_WORTH_A_LINE = frozenset({"denied", "fail_open", "gated", "error"})


@dataclass(frozen=True)
class Answer:
    """What to send back: an HTTP status and a JSON body (an AdmissionReview when 200)."""
    status: int
    body: dict


class _WouldWait(Exception):
    """`review(at_once=True)` met something that is not in memory yet."""


@dataclass(frozen=True)
class Resolution:
    """What was learnt about the pod's images before deciding."""
    results: dict                        # image -> ImageInfo | ArchwayError; missing: no answer
    warnings: tuple[str, ...] = ()       # about credentials that could not be used
    complete: bool = True                # every image answered, every pull secret read


@dataclass(frozen=True)
class AdmissionSettings:
    """How the service decides: the configured policy and admission's bounds and choices."""
    policy: Policy
    deadline_seconds: float
    max_body_bytes: int
    exclude_namespaces: tuple[str, ...] = ()
    log_every: bool = False             # server.log_every_admission
    max_images: int | None = None       # admission.max_images_per_pod
    unresolved: str = "admit"           # admission.unresolved: admit | gate | deny
    gate_max_seconds: float = 120.0     # how long a gated pod waits at most (its warning says)
    debug_containers: str = "warn"      # admission.debug_containers: warn | deny | off
    archway_scheduler: str | None = None   # placement.archway_scheduler, for policies

    def __post_init__(self):
        # One truth for the configured answer to an unread image: the policy's (a
        # PlacementPolicy may say another).
        if self.policy.unresolved != self.unresolved:
            object.__setattr__(self, "policy", replace(self.policy, unresolved=self.unresolved))

    @classmethod
    def from_config(cls, config) -> "AdmissionSettings":
        return cls(policy=Policy.from_config(config),
                   deadline_seconds=config.admission.deadline_seconds,
                   max_body_bytes=config.server.max_body_bytes,
                   exclude_namespaces=tuple(config.admission.exclude_namespaces),
                   log_every=config.server.log_every_admission,
                   max_images=config.admission.max_images_per_pod,
                   unresolved=config.admission.unresolved,
                   gate_max_seconds=config.admission.gate_max_seconds,
                   debug_containers=config.admission.debug_containers,
                   archway_scheduler=config.placement.archway_scheduler)


class AdmissionService:
    """`settings`: how it decides; `resolver` and `pull_secrets`: how it reads images; `caches`:
    what it reads of the cluster, from memory (each None: not consulted); `gating`: whether a
    gate controller is alive (None: no Kubernetes API, nobody could release a gated pod);
    `events`: where its Warning Events go (unschedulable pods, fail-open owners). Built by
    wiring.py."""

    def __init__(self, settings: AdmissionSettings, *, resolver: ImageResolver,
                 pull_secrets: PullCredentialSource, caches: ClusterCaches | None = None,
                 gating: Gating | None = None, events: EventRecorder | None = None,
                 clock: Callable[[], float] = time.monotonic):
        self.settings = settings
        self.resolver = resolver
        self.pull_secrets = pull_secrets
        self.caches = caches or ClusterCaches()
        self.gating = gating
        self.events = events
        self.clock = clock
        self.debug = DebugChecks(settings.debug_containers, settings.exclude_namespaces,
                                 settings.log_every, self.caches.nodes, events, clock)
        # ((node cache version, NodePool cache version), their OSes): node_oses' memo
        self._node_oses: tuple[tuple[int, int], frozenset[str]] | None = None

    def review(self, body: bytes, *, started: float | None = None, timeout: float | None = None,
               peer: str = "-", at_once: bool = False) -> Answer | None:
        """Answer one AdmissionReview body. `started`: clock() when the request arrived (the
        deadline counts from there); `timeout`: the seconds the caller gives the call (the
        apiserver's `?timeout=`), None: not said. `at_once`: answer only what waits for nothing
        (the images, pull secrets and policies in memory, no gate to decide), else None, before
        anything is counted or logged: the caller asks again with time to wait."""
        now = self.clock()
        start = now if started is None or started > now else started
        due = now if at_once else answer_by(now, start, self.settings.deadline_seconds, timeout)
        api_by = share_of(now, due, PULL_SECRETS_SHARE)   # the Kubernetes API reads, all told
        try:
            return self._review(body, start, due, api_by, peer, at_once)
        except _WouldWait:
            return None

    def _review(self, body: bytes, start: float, due: float, api_by: float, peer: str,
                at_once: bool) -> Answer:
        try:
            request = parse_review(body, self.settings.max_body_bytes)
        except AdmissionError as e:
            metrics.bad_request(e.status)
            log.info("rejected a malformed admission request from %s: %s", peer, e)
            return Answer(e.status, {"error": str(e)})
        if request.debug is not None:   # kubectl debug: debugservice.py
            if at_once:
                raise _WouldWait
            return Answer(200, self.debug.review(self, request, start=start, due=due,
                                                 api_by=api_by))

        skipped = skip_reason(request, self.settings.exclude_namespaces)
        if skipped is not None:
            log.info("admission %s uid=%s unchanged: %s", request.display_name, request.uid, skipped)
            metrics.admission_finished("unchanged", self.clock() - start, 0)
            return Answer(200, allow_unchanged(request))

        pod = request.pod
        assert pod is not None  # every pod CREATE carries one; the rest was skipped
        if at_once and not self.caches.settled():
            raise _WouldWait
        policy, policy_warnings = self.policy_for(pod, api_by)
        if policy.mode == "off":
            log.info("admission %s uid=%s unchanged: mode off (%s)",
                     request.display_name, request.uid, policy.source or "config")
            metrics.admission_finished("unchanged", self.clock() - start, 0)
            return Answer(200, allow_unchanged(request))
        resolution = Resolution({})
        try:
            resolution = self.resolve(pod, due, api_by, wait=not at_once, dry_run=request.dry_run)
            if at_once and not resolution.complete:
                raise _WouldWait
            decision = decide(pod, resolution.results, policy, nodes=self.known_nodes(),
                              node_oses=self.node_oses() if policy.scheduler_only_when_needed
                              else None,
                              learned=self.learned_for(pod, api_by, at_once=at_once))
            outcome = decision.outcome
            if outcome == "fail_open":
                if at_once:
                    raise _WouldWait
                decision = self._unresolved(request, decision, due, policy)
                outcome = decision.outcome
        except _WouldWait:
            raise
        except Exception:  # a bug must not turn into a 500: the apiserver would apply failurePolicy
            log.exception("admission %s uid=%s failed", request.display_name, request.uid)
            decision, outcome = self._internal_error(), "error"
        warnings = cap_warnings(policy_warnings + resolution.warnings + decision.warnings)
        elapsed = self.clock() - start
        metrics.admission_finished(outcome, elapsed, len(warnings))
        _count_images(pod.images, resolution.results)
        self._report(request, pod, decision)
        self._log(request, decision, outcome, warnings, elapsed, resolution.results)
        return Answer(200, review_response(request, decision, warnings=warnings,
                                                    audit_annotations=_audit(decision, outcome)))

    def policy_for(self, pod: PodView, api_by: float) -> tuple[Policy, tuple[str, ...]]:
        """The policy in force for `pod` (placement/policies.py: its PlacementPolicies, the
        ClusterPlacementPolicies, its Namespace's label and annotation, the config), and the
        warnings of what was passed over. Right after start-up the first lists may still be on
        their way: they may wait until `api_by` (the Kubernetes API's share of the time), never
        more; a kind not listed by then (or whose CRD is not installed) counts as none."""
        in_force = self.caches.policy_in_force(
            self.settings.policy, pod, archway_scheduler=self.settings.archway_scheduler,
            seconds=lambda: api_by - self.clock())
        return in_force.policy, in_force.warnings

    def learned_for(self, pod: PodView, api_by: float, *, at_once: bool = False):
        """What the pod's workload learned (learning.Learned), from the workload caches: no
        request per admission. Right after start-up their first lists, and a controller made a
        moment before the pod, may wait until `api_by`, never more (the latter only for a few
        pods at once: WorkloadCache.top_of); a pod with no controller costs nothing."""
        cache = self.caches.workloads
        if cache is None or not pod.owner_references:
            return None
        if not cache.wait_synced(api_by - self.clock()):
            return None
        top = cache.top_of(pod, timeout=max(0.0, api_by - self.clock()))
        if top is None and at_once and cache.would_wait_for(pod):
            raise _WouldWait   # its controller is not in the cache yet: a thread may wait
        return top.learned if top is not None else None

    def known_nodes(self):
        """The node cache's nodes once it has listed them, with the nodes Karpenter's NodePools
        may launch when those are read; None: the cluster is not consulted (no waiting here: a
        pod admitted before the first lists is simply not checked)."""
        cache = self.caches.nodes
        if cache is None or not cache.wait_synced(0):
            return None
        pools = self.caches.node_pools
        if pools is None:
            return cache.items.values()
        if not pools.wait_synced(0):
            return None   # whether a node may join is not known yet: judge nothing
        # One pass, stopped at the first node that can run the pod: no copy of 5,000 facts.
        return chain(cache.items.values(), pools.nodes_that_may_join())

    def node_oses(self) -> frozenset[str] | None:
        """The OSes of the nodes known_nodes gives, worked out again only when a node or
        NodePool changed; None when those are not known."""
        cache, pools = self.caches.nodes, self.caches.node_pools
        if cache is None or not cache.wait_synced(0) or (pools and not pools.wait_synced(0)):
            return None
        versions = (cache.version, pools.version if pools else 0)
        known = self._node_oses
        if known is None or known[0] != versions:
            may_join = pools.nodes_that_may_join() if pools else ()
            known = self._node_oses = (versions, frozenset(
                node.os for node in chain(cache.items.values(), may_join)))
        return known[1]

    def _report(self, request: AdmissionRequest, pod: PodView, decision: Decision) -> None:
        if decision.outcome == "audited":
            metrics.AUDIT_DECISIONS.labels(decision.would).inc()
        if decision.unschedulable:
            metrics.UNSCHEDULABLE_PODS.labels("warned" if decision.allowed else "denied").inc()
            if decision.allowed and self.events is not None and not request.dry_run:
                regarding = pod_or_owner(pod)
                self.events.record(regarding, "Warning", REASON_UNSCHEDULABLE, "Admit",
                                   decision.unschedulable
                                   + ": the pod stays Pending until such a node joins",
                                   being_created=bool(pod.name) and regarding["kind"] == "Pod")

    def resolve(self, pod: PodView, due: float, api_by: float, *,
                images: tuple[str, ...] | None = None,
                always_pulled: frozenset[str] | None = None, wait: bool = True,
                dry_run: bool = False) -> Resolution:
        """The images' results and the credential warnings, by `due`; the API reads may go on
        until `api_by`, the registries get the rest. With no time left, the cache answers alone
        (the lookups it starts go on in the background). `images` (and of them
        `always_pulled`): others than the pod's own, read with its pull secrets (a debug
        container's). `wait` False: nothing waited for; what is not in memory is incomplete.
        `dry_run`: the lookups started write no image record."""
        images = pod.images if images is None else images
        if not images:
            return Resolution({})
        credentials = self.pull_secrets.credentials_for(pod, api_by)
        if not wait and not credentials.complete:
            # A lookup started now would ask the registry without the secrets still unread
            # (a needless refusal from a private one): the thread that waits reads them first.
            return Resolution({}, tuple(credentials.warnings), complete=False)
        timeout = max(0.0, due - ANSWER_MARGIN_SECONDS - self.clock())
        results = self.resolver.resolve_many(images, keyring=credentials.keyring,
                                             timeout=timeout,
                                             revalidate=(pod.always_pulled if always_pulled is None
                                                         else always_pulled),
                                             limit=self.settings.max_images,
                                             scope=pod.namespace, wait=wait,
                                             record=not dry_run)
        complete = credentials.complete and all(image in results for image in images)
        return Resolution(results, tuple(credentials.warnings), complete)

    def _unresolved(self, request: AdmissionRequest, decision: Decision, deadline: float,
                    policy: Policy) -> Decision:
        """An image was not resolved in time: gate the pod when its policy says so and a gate
        controller is alive to release it, else admit it unplaced and tell its owner with a
        Warning Event."""
        pod = request.pod
        assert pod is not None
        if policy.unresolved == "gate":
            # The Lease's deadline is time.monotonic()'s, the service's clock may be a test's.
            wait_until = time.monotonic() + max(0.0, deadline - self.clock())
            if self.gating is not None and self.gating.leader_fresh(wait_until):
                return replace(decision, patch=gate_patch(pod, decision.patch, policy.source),
                               outcome="gated",
                               reason="gated until its images are read", warnings=(
                                   ("the pod waits (SchedulingGated) for archway to read its "
                                    f"images, at most {self.settings.gate_max_seconds:g} s"),
                               ) + gated_warnings(decision.warnings))
            decision = replace(decision, warnings=(
                "no archway gate controller is running: admitted without waiting",
            ) + decision.warnings)
        owner = owner_reference(pod)
        if self.events is not None and owner is not None and not request.dry_run:
            self.events.record(
                owner, "Warning", "AdmittedUnplaced", "Admit",
                f"pod {pod.display_name} admitted without architecture placement: "
                + "; ".join(w for w in decision.warnings if w.startswith("could not inspect")))
        return decision

    def _internal_error(self) -> Decision:
        if self.settings.policy.fail_closed:
            return Decision(allowed=False, outcome="denied", reason="internal error",
                            message="archway failed to decide (internal error; see its log) "
                                    "and admission.unresolved is deny")
        return Decision(allowed=True, outcome="fail_open", reason="internal error",
                        warnings=("archway failed to decide (internal error); "
                                  "pod admitted unchanged",))

    def _log(self, request: AdmissionRequest, decision: Decision, outcome: str, warnings,
             elapsed: float, results: dict) -> None:
        # A log line costs as much as the decision itself: by default only what needs a look.
        level = logging.INFO if self.settings.log_every or outcome in _WORTH_A_LINE \
            else logging.DEBUG
        if not log.isEnabledFor(level):
            return
        images = request.pod.images if request.pod is not None else ()
        archs = ",".join(sorted(decision.architectures)) if decision.architectures else "-"
        # A denial's reason is its message: the words the pod's creator saw.
        reason = decision.message if not decision.allowed and decision.message else decision.reason
        failed = failed_images(images, results)
        listed = "; failed: " + ", ".join(f"{f['image']} ({f['error']}: {f['detail']})"
                                          for f in failed[:_LOGGED_FAILURES]) if failed else ""
        if len(failed) > _LOGGED_FAILURES:
            listed += f", and {len(failed) - _LOGGED_FAILURES} more"
        log.log(level, "admission %s uid=%s images=%d archs=%s outcome=%s (%s) warnings=%d "
                       "%.1f ms%s%s",
                request.display_name, request.uid, len(images), archs, outcome, reason,
                len(warnings), elapsed * 1000, " dry-run" if request.dry_run else "", listed,
                extra={"pod": request.display_name, "uid": request.uid, "outcome": outcome,
                       "reason": reason, "architectures": archs,
                       "duration_ms": round(elapsed * 1000, 1), "dry_run": request.dry_run,
                       **({"failed_images": failed[:_LOGGED_FAILURES]} if failed else {})})


def failed_images(images, results: dict) -> list[dict]:
    """For the log: each image without an answer, the kind of failure (the words its warning
    uses) and the error's own message (an operator's detail: URLs in it carry no password)."""
    failed = []
    for image in dict.fromkeys(images):
        result = results.get(image)
        if isinstance(result, ImageInfo):
            continue
        detail = " ".join(str(result).split())[:_DETAIL_CHARS] if result is not None \
            else "no answer before the admission deadline"
        failed.append({"image": display_image(image), "error": classify_error(result).words,
                       "detail": detail})
    return failed


def _audit(decision: Decision, outcome: str) -> dict:
    audit = {"outcome": outcome}
    if decision.would:
        audit["would"] = decision.would
    if decision.architectures:
        audit["architectures"] = ",".join(sorted(decision.architectures))
    return audit


def _count_images(images, results: dict) -> None:
    for image in images:
        result = results.get(image)
        if isinstance(result, ImageInfo):
            metrics.IMAGE_RESOLUTIONS.labels(
                result.source, "resolved" if result.platforms else "no_arch").inc()
        else:
            metrics.IMAGE_RESOLUTIONS.labels(scheme_of(image), classify_error(result).label).inc()
