"""A webhook worker's parts, built in one place, once: the client factory every cache of the
worker reads through, the pull-secret reader, the caches (caches.py), the gate controller's
Lease observer, the Event sink and the cluster addresses the resolver refuses (clusterranges.py)
when a Kubernetes API is configured, the cluster's image records the resolver reads before a
registry (imagerecords.py), the admission service over them, and pre-warming. register_webhook (app.py) puts them behind POST /mutate and
/readyz; `archway serve` starts the pre-warming as each worker boots.
"""
from dataclasses import dataclass, replace

from archway.cluster import ClusterReader
from archway.kubeapi import KubeApi
from archway.kubeclient import api_client_factory
from archway.lease import LeaseObserver, lease_namespace, new_identity

from .caches import ClusterCaches
from .clusterranges import keep_cluster_ranges
from .events import EventSink
from .imagerecords import ImageRecords, records_for
from .prewarm import Prewarmer
from .pullsecrets import PullSecrets
from .service import AdmissionService, AdmissionSettings


@dataclass(frozen=True)
class WebhookParts:
    service: AdmissionService
    pull_secrets: PullSecrets             # or the reader a test handed in
    gating: LeaseObserver | None          # admission.unresolved: gate with an API; else None
    prewarmer: Prewarmer | None           # registry.prewarm.enabled with an API; else None
    records: ImageRecords | None = None   # kubernetes.image_records.enabled with an API


def build_webhook(config, resolver, node_cache, pull_secrets=None) -> WebhookParts:
    """The parts of one worker. `resolver` and `node_cache` are the worker's, shared with the
    extender (archway.app); `pull_secrets` replaces the reader built from the config."""
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
                        resolver)
    accounts = getattr(pull_secrets, "accounts", None)
    if accounts is not None:
        accounts.ensure_started()     # in this worker, listed before the first pods come
    caches = ClusterCaches.for_config(
        config, factory, nodes=False, workloads=config.remediation.learn_failed_architectures,
        node_pools=config.kubernetes.karpenter_node_pools).start()   # the first pods need them
    # The node cache is the extender's too: archway.app builds it, `archway serve` starts it.
    caches = replace(caches, nodes=node_cache)
    service = AdmissionService(AdmissionSettings.from_config(config), resolver=resolver,
                               pull_secrets=pull_secrets, caches=caches, gating=gating,
                               events=events)
    return WebhookParts(service, pull_secrets, gating,
                        _prewarmer(config, resolver, pull_secrets), records)


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
