"""The webhook's parts in a worker, built once: the client factory every cache of the worker
reads through, the pull-secret reader, the caches (cluster/caches.py), the gate controller's
Lease observer, the Event sink and the cluster addresses the resolver refuses
(cluster/ranges.py) when a Kubernetes API is configured, the cluster's image records the
resolver reads before a registry (objects/imagerecords.py), the admission service over them,
pre-warming, and what /readyz says of them. The worker's composition root (archway.main.worker)
puts the service behind POST /mutate (routes.py) and starts the pre-warming as the worker boots.
"""
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

from archway.cluster.caches import ClusterCaches
from archway.cluster.events import EventSink
from archway.cluster.pullsecrets import PullSecrets
from archway.cluster.ranges import keep_cluster_ranges
from archway.cluster.reads import ClusterReader
from archway.kubeapi import KubeApi
from archway.kubeclient import api_client_factory
from archway.lease import LeaseObserver, lease_namespace, new_identity
from archway.objects.imagerecords import ImageRecords, records_for

from .prewarm import Prewarmer
from .service import AdmissionService, AdmissionSettings


@dataclass(frozen=True)
class WebhookParts:
    service: AdmissionService
    pull_secrets: PullSecrets             # or the reader a test handed in
    gating: LeaseObserver | None          # admission.unresolved: gate with an API; else None
    prewarmer: Prewarmer | None           # registry.prewarm.enabled with an API; else None
    records: ImageRecords | None = None   # kubernetes.image_records.enabled with an API
    startup: float = 10.0                 # startup_seconds(config)

    def readiness_facts(self) -> dict[str, Callable[[], object]]:
        """What /readyz shows of the webhook: where the API was found, whether it would gate."""
        facts: dict[str, Callable[[], object]] = {
            "kubernetes_api": lambda: self.pull_secrets.api_kind}
        if self.gating is not None:
            facts["gate_controller"] = lambda: _leader_fact(self.gating)
        return facts

    def readiness_checks(self, controller_up: Callable[[], bool] | None
                         ) -> dict[str, Callable[[], str | None]]:
        """/readyz's checks of the webhook (`controller_up`: whether the gate controller this
        server runs is up; None: it runs none)."""
        if self.gating is None:
            return {}
        return {"gate_controller": gate_readiness(self.gating, controller_up, self.startup)}


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


def build_webhook(config, resolver, node_cache, pull_secrets=None) -> WebhookParts:
    """The parts of one worker. `resolver` and `node_cache` are the worker's, shared with the
    extender (archway.main.app); `pull_secrets` replaces the reader built from the config."""
    factory = api_client_factory(config.kubernetes)
    if pull_secrets is None:
        pull_secrets = PullSecrets.from_config(config, factory)
    gating, events = _gate_support(config, pull_secrets)
    # Before pre-warming and the first pod: what the cluster already knows, so a new replica
    # asks no registry for it.
    records = records_for(config, factory, resolver,
                          has_api=getattr(pull_secrets, "api", None) is not None)
    # Before the first pod: the Service ranges and the API server a pod's image may not name.
    keep_cluster_ranges(config, getattr(getattr(pull_secrets, "api", None), "client", None),
                        resolver, nodes=node_cache)
    accounts = getattr(pull_secrets, "accounts", None)
    if accounts is not None:
        accounts.ensure_started()     # in this worker, listed before the first pods come
    caches = ClusterCaches.for_config(
        config, factory, nodes=False, workloads=config.remediation.learn_failed_architectures,
        node_pools=config.kubernetes.karpenter_node_pools).start()   # the first pods need them
    # The node cache is the extender's too: the worker's composition root (archway.main.worker)
    # builds it and starts it as the worker boots.
    caches = replace(caches, nodes=node_cache)
    service = AdmissionService(AdmissionSettings.from_config(config), resolver=resolver,
                               pull_secrets=pull_secrets, caches=caches, gating=gating,
                               events=events)
    return WebhookParts(service, pull_secrets, gating,
                        _prewarmer(config, resolver, pull_secrets), records, startup_seconds(config))


def startup_seconds(config) -> float:
    """How long a starting worker may wait, not ready, for a gate controller to take the Lease:
    a Lease duration, and time for the controller's process to start on a busy machine. Its
    observer reads eagerly as long (_gate_support)."""
    return max(config.admission.gate_lease_seconds, 10.0)


def _gate_support(config, pull_secrets):
    """(Lease observer, Event sink) when a Kubernetes API is configured, else (None, None)."""
    api_client = getattr(getattr(pull_secrets, "api", None), "client", None)
    if api_client is None:
        return None, None
    api = KubeApi(api_client, timeout_seconds=5)
    gating = None
    if config.admission.unresolved == "gate":
        gating = LeaseObserver(api, lease_namespace(config.kubernetes.namespace),
                               duration_seconds=config.admission.gate_lease_seconds,
                               eager_seconds=startup_seconds(config))
        gating.start()
    return gating, EventSink(api, instance=new_identity())


def _prewarmer(config, resolver, pull_secrets) -> Prewarmer | None:
    prewarm = config.registry.prewarm
    if not prewarm.enabled or getattr(pull_secrets, "api", None) is None:
        return None
    return Prewarmer(lambda: ClusterReader(pull_secrets.api.client), resolver, pull_secrets,
                     per_second=prewarm.requests_per_second,
                     exclude_namespaces=config.admission.exclude_namespaces)
