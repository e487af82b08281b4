"""The list + watch caches a process reads the cluster from, in memory: Nodes, Namespaces, the
workloads, Karpenter's NodePools. A webhook worker (wiring.py) and a leadership of the gate
controller (gate/process.py) each build theirs here, from the config and the one client
factory of their process; None where that process does not read the kind (the chart grants the
list/watch of workloads and NodePools only when something reads them).

Every cache takes the same client (archway.kubeclient builds one per process, so one connection
pool: each watch holds one of its connections for as long as it is open).
"""
from collections.abc import Callable
from dataclasses import dataclass, field

from archway.objects.policies import CLUSTER_KIND, NAMESPACED_KIND, PolicyCache
from archway.placement.namespaces import NamespaceFacts, namespace_facts
from archway.placement.policies import InForce, namespace_labels, policy_in_force
from archway.watchcache import WatchCache

from .nodepools import NodePoolCache
from .nodes import NodeCache
from .workloadcache import WorkloadCache


class NamespaceCache(WatchCache[NamespaceFacts]):
    """The Namespaces' labels and annotations archway applies over the configured policy."""

    def __init__(self, api_client_factory, **kwargs):
        super().__init__(api_client_factory, what="namespace",
                         path="/api/v1/namespaces", facts=namespace_facts,
                         **kwargs)


@dataclass(frozen=True)
class ClusterCaches:
    nodes: NodeCache | None = None
    namespaces: NamespaceCache | None = None     # label/annotation overrides of the policy
    workloads: WorkloadCache | None = None       # owner chains, learned exclusions, templates
    node_pools: NodePoolCache | None = None      # Karpenter's: nodes that may join
    policies: PolicyCache | None = None          # PlacementPolicies (namespaced)
    cluster_policies: PolicyCache | None = None  # ClusterPlacementPolicies
    _settled: bool = field(default=False, init=False, repr=False, compare=False)

    @classmethod
    def for_config(cls, config, api_client_factory: Callable[[], object | None], *, nodes: bool,
                   workloads: bool, node_pools: bool = False) -> "ClusterCaches":
        """The caches asked for, on `api_client_factory`'s client, and the Namespace cache when
        kubernetes.namespace_cache is on, and the PlacementPolicy caches when
        kubernetes.placement_policies is on; none without a Kubernetes API (kubernetes.enabled)."""
        if config.kubernetes.enabled == "off":
            return cls()
        policies = config.kubernetes.placement_policies
        return cls(nodes=NodeCache(api_client_factory) if nodes else None,
                   namespaces=(NamespaceCache(api_client_factory)
                               if config.kubernetes.namespace_cache else None),
                   workloads=WorkloadCache(api_client_factory) if workloads else None,
                   node_pools=NodePoolCache(api_client_factory) if node_pools else None,
                   policies=PolicyCache(api_client_factory, NAMESPACED_KIND) if policies else None,
                   cluster_policies=(PolicyCache(api_client_factory, CLUSTER_KIND)
                                     if policies else None))

    def policy_in_force(self, base, pod, *, archway_scheduler: str | None = None,
                        seconds: Callable[[], float] = lambda: 0.0) -> InForce:
        """The policy in force for `pod` (a PodView) over `base` (placement/policies.py), from
        what the caches hold. A cache not listed yet may be waited for `seconds()` (the time
        left to wait, asked afresh for each); one not listed by then counts as empty."""
        return self.policy_for_labels(base, pod.namespace, dict(pod.labels),
                                      archway_scheduler=archway_scheduler, seconds=seconds)

    def policy_for_labels(self, base, namespace: str, labels: dict, *,
                          archway_scheduler: str | None = None,
                          seconds: Callable[[], float] = lambda: 0.0) -> InForce:
        """policy_in_force for a pod of `namespace` with `labels` (a workload's template's)."""
        def listed(cache) -> bool:
            return cache is not None and cache.wait_synced(seconds())
        facts = self.namespaces.items.get(namespace) \
            if self.namespaces is not None and listed(self.namespaces) else None
        namespaced = self.policies.in_namespace(namespace) \
            if self.policies is not None and listed(self.policies) else ()
        cluster = self.cluster_policies.selecting_namespace(namespace_labels(namespace, facts)) \
            if self.cluster_policies is not None and listed(self.cluster_policies) else ()
        return policy_in_force(base, labels, namespace, facts, namespaced, cluster,
                               archway_scheduler=archway_scheduler)

    def settled(self) -> bool:
        """Whether no cache an admission may wait for would make it wait now: each has listed,
        or its first list failed (it counts as empty while it retries). Nodes and NodePools are
        never waited for: until they list, a pod is simply not checked against them."""
        if self._settled:
            return True   # a cache that settled stays so for the life of the process
        caches = [c for c in (self.namespaces, self.workloads, self.policies,
                              self.cluster_policies) if c is not None]
        for cache in caches:
            cache.ensure_started()
        settled = all(cache.settled for cache in caches)
        if settled:
            object.__setattr__(self, "_settled", True)
        return settled

    def _present(self) -> list:
        return [c for c in (self.nodes, self.namespaces, self.workloads, self.node_pools,
                            self.policies, self.cluster_policies) if c is not None]

    def start(self) -> "ClusterCaches":
        """Each listing from now, in this process (threads do not survive a fork)."""
        for cache in self._present():
            cache.ensure_started()
        return self

    def stop(self) -> None:
        for cache in self._present():
            cache.stop()
