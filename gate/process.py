"""The gate controller's process: `python -m archway.gate.process`, started beside `archway
serve`'s gunicorn master and kept running by `archway serve` (archway.server.supervisor)
whenever a Kubernetes API is configured. The process is put together here, in one place: what
it builds once are the fields of ControllerParts, and `ControllerParts.lead` starts what each
leadership runs.

    build once: the API client, the controller's resolver and pull-secret reader, the Event sink
      -> a candidate for the Lease (archway/lease.py), until SIGTERM or the server is gone
      -> each leadership: the caches listed afresh, the gate controller (controller.py) and
         beside it the closed loop (remediation.py; tagwatch.py when workloads are read) and
         the revisit of pods archway never saw (unseen.py, fed by remediation's pod watch),
         the DaemonSets told which nodes cannot run them (daemonsets.py), the status of the
         PlacementPolicies (policystatus.py) and the care of the cluster's image records
         (recordkeeper.py: revalidated once per cluster, expired)
      -> the Lease lost: that leadership stopped, its caches with it
    beside it, leading or not: the check of archway's trust path (certs/trustpath.py), which
      the leader also repairs
"""
import logging
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from archway import logs
from archway.background import supervised_child
from archway.certs.cli import bootstrap_spec
from archway.certs.trustpath import STATUS_FILE, TrustWatch
from archway.cluster.caches import ClusterCaches
from archway.cluster.events import EventSink
from archway.cluster.pullsecrets import PullSecrets
from archway.cluster.ranges import keep_cluster_ranges
from archway.cluster.reads import ClusterReader
from archway.cluster.workloads import TEMPLATE_PATHS
from archway.kubeapi import KubeApi
from archway.kubeclient import api_client_factory, build_api_client
from archway.lease import LeaderElector, lead_while_elected, lease_namespace, new_identity
from archway.objects.imagerecords import ImageRecords, records_for
from archway.objects.policystatus import PolicyStatus
from archway.placement.policy import Policy
from archway.registry.resolver import Resolver

from .controller import GateController
from .coverage import WebhookCoverage
from .daemonsets import DaemonSetNodes
from .recordkeeper import RecordKeeper
from .remediation import Remediation
from .tagwatch import TagWatch
from .unseen import UnseenPods

log = logging.getLogger("archway.gate")

NEGATIVE_TTL_SECONDS = 0.5    # the controller's own resolver forgets failures this fast


@dataclass(frozen=True)
class ControllerParts:
    """What the process builds once and every leadership uses."""
    config: Any
    api_client_factory: Callable[[], object | None]   # for every watch and cache
    api: KubeApi
    resolver: Resolver
    pull_secrets: PullSecrets
    events: EventSink
    controller: GateController
    records: ImageRecords | None = None    # the cluster's image records, read and kept

    @classmethod
    def build(cls, config, api_client, source: str, identity: str) -> "ControllerParts":
        api = KubeApi(api_client)
        # Its own resolver: failures are forgotten within the retry interval, so a registry that
        # comes back is seen at the next retry, not after registry.cache.negative_ttl_seconds.
        registry = replace(config.registry, cache=replace(
            config.registry.cache, negative_ttl_seconds=NEGATIVE_TTL_SECONDS))
        resolver = Resolver(registry, sif=config.sif)
        keep_cluster_ranges(config, api_client, resolver)
        factory = api_client_factory(config.kubernetes)
        records = records_for(config, factory, resolver, has_api=True)
        pull_secrets = PullSecrets(api_client, source=source,
                                   cache_seconds=config.kubernetes.secret_cache_seconds,
                                   namespaces=config.kubernetes.pull_secret_namespaces)
        events = EventSink(api, instance=identity)
        controller = GateController(
            api=api, resolver=resolver, pull_secrets=pull_secrets,
            policy=Policy.from_config(config), max_seconds=config.admission.gate_max_seconds,
            fallback=config.placement.fallback_architectures, events=events,
            resolve_timeout=config.registry.timeout_seconds)
        return cls(config, factory, api, resolver, pull_secrets, events, controller, records)

    def record_keeper(self) -> RecordKeeper:
        assert self.records is not None
        config = self.config
        return RecordKeeper(api=self.api, records=self.records, resolver=self.resolver,
                            list_objects=lambda: _listed(ClusterReader(self.api.client)),
                            expire_seconds=config.kubernetes.image_records.expire_seconds,
                            tag_ttl_seconds=config.registry.cache.tag_ttl_seconds,
                            exclude_namespaces=config.admission.exclude_namespaces)

    def coverage(self) -> WebhookCoverage | None:
        """The pods archway's webhook is sent, read from its configuration (the chart's); None:
        archway runs without it, every pod is taken as sent."""
        name = self.config.kubernetes.webhook_configuration
        return WebhookCoverage(self.api.client, name) if name else None

    def lead(self, stop: threading.Event) -> None:
        """One leadership: the gate controller's work, and beside it the closed loop
        (remediation.py, tagwatch.py) with the caches they read, listed afresh for each
        leadership and stopped with it."""
        config = self.config
        learn = config.remediation.learn_failed_architectures
        # The chart grants list/watch of the workloads only when something here reads them.
        caches = ClusterCaches.for_config(
            config, self.api_client_factory, nodes=True,
            workloads=learn or config.remediation.watch_tags).start()
        self.controller.workloads = caches.workloads if learn else None
        # A gated pod is released under the policy it was admitted under (placement/policies.py).
        policy = Policy.from_config(config)
        self.controller.policy_of = lambda pod: caches.policy_in_force(
            policy, pod, archway_scheduler=config.placement.archway_scheduler).policy
        # The leader's loops act on a pod as admission would: under the policy in force for it.
        common = dict(api=self.api, settings=config.remediation, policy=policy, events=self.events,
                      workloads=caches.workloads, namespaces=caches.namespaces,
                      exclude_namespaces=config.admission.exclude_namespaces,
                      in_force=lambda namespace, labels: caches.policy_for_labels(
                          policy, namespace, labels,
                          archway_scheduler=config.placement.archway_scheduler).policy)
        # Pods archway never saw, revisited beside the closed loop and fed by its pod watch.
        unseen = UnseenPods(nodes=caches.nodes, resolver=self.resolver,
                            pull_secrets=self.pull_secrets, coverage=self.coverage(),
                            resolve_timeout=config.registry.timeout_seconds, **common)
        loops = [threading.Thread(target=Remediation(nodes=caches.nodes, **common).lead,
                                  args=(stop, self.api_client_factory, unseen),
                                  name="archway-remediation", daemon=True),
                 threading.Thread(target=unseen.lead, args=(stop,), name="archway-unseen-pods",
                                  daemon=True),
                 threading.Thread(target=DaemonSetNodes(nodes=caches.nodes, **common).lead,
                                  args=(stop, self.api_client_factory),
                                  name="archway-daemonset-nodes", daemon=True)]
        if caches.policies is not None:   # the one writer of PlacementPolicies' status
            status = PolicyStatus(api=self.api, policies=caches.policies,
                                  cluster_policies=caches.cluster_policies, events=self.events,
                                  archway_scheduler=config.placement.archway_scheduler)
            loops.append(threading.Thread(target=status.lead, args=(stop,),
                                          name="archway-policy-status", daemon=True))
        if self.records is not None:
            loops.append(threading.Thread(target=self.record_keeper().lead, args=(stop,),
                                          name="archway-image-records", daemon=True))
        if caches.workloads is not None:
            registry = config.registry
            tags = TagWatch(resolver=self.resolver, pull_secrets=self.pull_secrets,
                            round_seconds=registry.cache.tag_ttl_seconds,
                            resolve_timeout=registry.timeout_seconds * 2,
                            per_second=registry.prewarm.requests_per_second,
                            records=self.records, **common)
            loops.append(threading.Thread(target=tags.lead, args=(stop,),
                                          name="archway-tag-watch", daemon=True))
        for loop in loops:
            loop.start()
        try:
            self.controller.lead(stop)
        finally:
            stop.set()
            for loop in loops:
                loop.join(10)
            self.controller.workloads = None
            self.controller.policy_of = None
            caches.stop()


def _listed(reader: ClusterReader):
    return (obj for kind in TEMPLATE_PATHS for obj in reader.workloads(kind))


def trust_watch(config, api_client) -> TrustWatch | None:
    """The check of the trust path this server's certificate files are served on, when
    kubernetes.webhook_configuration names archway's MutatingWebhookConfiguration; repaired by
    the leader with kubernetes.trust_repair (the certificate Job's arguments). Its status goes
    beside the gate controller's, in the server's run directory, for the workers' /readyz."""
    kube, server = config.kubernetes, config.server
    if not (kube.webhook_configuration and server.tls and server.cert_file and server.key_file):
        return None
    run_directory = os.environ.get("PROMETHEUS_MULTIPROC_DIR")   # archway serve's, per run
    return TrustWatch(api_client, configuration=kube.webhook_configuration,
                      cert_file=os.path.expanduser(server.cert_file),
                      key_file=os.path.expanduser(server.key_file),
                      repair=bootstrap_spec(kube.trust_repair) if kube.trust_repair else None,
                      status_path=os.path.join(run_directory, STATUS_FILE) if run_directory
                      else None)


def run(config, stop: threading.Event | None = None) -> None:
    """Elect, lead while elected, until `stop` (or SIGTERM) -- the process's main."""
    stop = stop or threading.Event()
    api_client, source = build_api_client(config.kubernetes)
    if api_client is None:
        log.info("gate controller not started: no Kubernetes API configured")
        return
    identity = new_identity()
    parts = ControllerParts.build(config, api_client, source, identity)
    namespace = lease_namespace(config.kubernetes.namespace)
    elector = LeaderElector(parts.api, namespace, identity=identity,
                            duration_seconds=config.admission.gate_lease_seconds)
    log.info("gate controller %s: candidate for Lease %s/%s (%s)", identity, namespace,
             "archway-gate-controller", source)
    leading = threading.Event()
    watch = trust_watch(config, api_client)
    if watch is not None:
        threading.Thread(target=watch.run, args=(stop, leading.is_set), name="archway-trust-path",
                         daemon=True).start()

    def lead(leadership: threading.Event) -> None:
        leading.set()
        try:
            parts.lead(leadership)
        finally:
            leading.clear()
    lead_while_elected(elector, lead, stop, what="gate controller",
                       thread_name="archway-gate-lead", logger=log)


def main() -> None:
    config, stop = supervised_child("gate controller")
    logs.configure(logging.INFO, config.server.log_format)   # as `archway serve` logs
    run(config, stop)


if __name__ == "__main__":
    main()
