"""Evicting a pod that fails with exec format error (remediation.evict), so its workload makes
it again on an architecture left to it. The Eviction API: PodDisruptionBudgets hold.

Each pod ends: evicted, or given up with one Event and the metric: refused (403: archway may not
evict there; asking again would be refused again) or a budget that still does not allow it after
MAX_TRIES asks (2 s, doubling to 30 s: about 3 minutes). Never a loop for ever.
"""
import logging
from collections.abc import Callable

from archway import metrics
from archway.kubeapi import ApiError, KubeApi
from archway.vocabulary import join_architectures

log = logging.getLogger("archway.remediation")

RETRY_MIN_SECONDS = 2.0          # a PodDisruptionBudget that refused is asked again after this,
RETRY_MAX_SECONDS = 30.0         # doubling up to this,
MAX_TRIES = 10                   # this many times in all
REASON_EVICTED = "EvictedExecFormatError"
REASON_BLOCKED = "EvictionBlocked"
REASON_NOT_EVICTED = "NotEvicted"


def recreated_on(pod, failed: frozenset[str]) -> frozenset[str]:
    """Where the pod's replacement may run: what its images claim but `failed`, within the pod's
    own arch constraint (a pod pinned to the failing architecture would come back to it: an
    eviction loop, not a repair)."""
    if pod.architectures is None:
        return frozenset()
    left = pod.architectures - failed
    return pod.arch_constraint.within(left) if pod.arch_constraint is not None else left


class Evictions:
    def __init__(self, api: KubeApi, event: Callable[..., None], clock: Callable[[], float]):
        self.api = api
        self._event = event            # (regarding, type, reason, action, note)
        self._clock = clock

    def maybe_evict(self, tracked, arch: str, top, *, reason: str = REASON_EVICTED,
                    because: str = "") -> bool:
        """Evict the tracked pod (remediation._Tracked, unseen._Revisit) when an architecture
        is left to it; True when it was evicted now. `because`: why, for its log line and Event
        (default: it fails on `arch` with exec format error)."""
        because = because or f"it fails on {arch} with exec format error"
        pod = tracked.pod
        learned = top.learned
        failed = (learned.architectures if learned is not None else frozenset()) | {arch}
        left = recreated_on(pod, failed)
        if not left:
            return False   # no architecture left to recreate it on: evicting would only repeat
        if tracked.next_look is not None and tracked.next_look > self._clock():
            return False
        path = f"/api/v1/namespaces/{pod.namespace}/pods/{pod.name}/eviction"
        body = {"apiVersion": "policy/v1", "kind": "Eviction",
                "metadata": {"name": pod.name, "namespace": pod.namespace},
                # This pod, not one recreated under its name since (StatefulSets reuse names).
                "deleteOptions": {"preconditions": {"uid": pod.uid}}}
        try:
            self.api.request("POST", path, body=body)
        except ApiError as e:
            self._refused(tracked, e)
            return False
        tracked.next_look, tracked.evict_done = None, True
        metrics.REMEDIATION_EVICTIONS.labels("evicted").inc()
        log.warning("pod %s/%s evicted: %s; %s recreates it elsewhere", pod.namespace,
                    pod.name, because, top.display_name)
        self._event(pod.reference, "Normal", reason, "Evict",
                    f"evicted (remediation.evict): {because}; "
                    f"{top.display_name} recreates it on "
                    f"{join_architectures(left)}")
        return True

    def _refused(self, tracked, error: ApiError) -> None:
        pod = tracked.pod
        if error.status in (404, 409):     # gone, or replaced meanwhile
            tracked.next_look, tracked.evict_done = None, True
            return
        tracked.evict_tries += 1
        if error.status == 403 or tracked.evict_tries >= MAX_TRIES:
            tracked.next_look, tracked.evict_done = None, True
            outcome = "refused" if error.status == 403 else "abandoned"
            metrics.REMEDIATION_EVICTIONS.labels(outcome).inc()
            log.warning("pod %s/%s not evicted, not asked again: %s", pod.namespace, pod.name,
                        error)
            why = ("archway may not evict here (403: pods/eviction create is granted with "
                   "remediation.evict)" if error.status == 403 else
                   f"still refused after {tracked.evict_tries} asks")
            self._event(pod.reference, "Warning", REASON_NOT_EVICTED, "Evict",
                        f"not evicted, and not asked again: {why} "
                        f"({error.message[:300] or error.reason})")
            return
        outcome = "blocked" if error.status == 429 else "failed"
        metrics.REMEDIATION_EVICTIONS.labels(outcome).inc()
        tracked.next_look = self._clock() + min(
            RETRY_MAX_SECONDS, RETRY_MIN_SECONDS * 2 ** (tracked.evict_tries - 1))
        if tracked.evict_tries > 1:
            return      # the first refusal is told; the next ones only counted
        if error.status == 429:
            self._event(pod.reference, "Warning", REASON_BLOCKED, "Evict",
                        f"not evicted yet ({error.message[:300] or 'disruption budget'}): archway "
                        f"asks again, at most every {RETRY_MAX_SECONDS:g} s, {MAX_TRIES} times "
                        f"in all")
        else:
            log.warning("evicting pod %s/%s failed: %s", pod.namespace, pod.name, error)
