"""Which policy `archway explain` applies, and why: the PlacementPolicies and
ClusterPlacementPolicies given in the manifests (-f) and read from the cluster when one is
reachable, and the Namespaces given or read, through the webhook's own precedence
(placement/policies.py)."""
import sys
from dataclasses import dataclass, field

from archway.errors import ArchwayError
from archway.objects.policies import CLUSTER_KIND, GROUP, NAMESPACED_KIND, policy_object
from archway.placement.namespaces import NamespaceFacts, namespace_facts
from archway.placement.policies import InForce, PolicyObject, policy_in_force
from archway.placement.policy import Policy

POLICY_KINDS = (NAMESPACED_KIND, CLUSTER_KIND)


@dataclass
class KnownPolicies:
    """The policy objects and Namespaces explain knows of."""
    namespaced: list[PolicyObject] = field(default_factory=list)
    cluster: list[PolicyObject] = field(default_factory=list)
    namespaces: dict[str, NamespaceFacts] = field(default_factory=dict)
    origins: list[str] = field(default_factory=list)   # where they came from, for the output

    def add(self, docs: list, origin: str) -> None:
        """The policies and Namespaces among manifests' `docs` (a namespaced policy without a
        namespace is the default namespace's, as kubectl would create it)."""
        added = 0
        for doc in docs:
            if not isinstance(doc, dict):
                continue
            kind = doc.get("kind")
            if kind in POLICY_KINDS and str(doc.get("apiVersion", "")).startswith(GROUP + "/"):
                added += self._add_policy(doc, kind)
            elif kind == "Namespace" and doc.get("apiVersion") == "v1":
                facts = namespace_facts(doc)
                if facts is not None:
                    self.namespaces[facts.name] = facts
        if added:
            self.origins.append(origin)

    def _add_policy(self, doc: dict, kind: str) -> int:
        if kind == NAMESPACED_KIND:
            meta = doc.get("metadata")
            meta = meta if isinstance(meta, dict) else {}
            doc = dict(doc, metadata={"namespace": "default", **meta})
        policy = policy_object(doc, kind)
        if policy is None:
            return 0
        (self.namespaced if kind == NAMESPACED_KIND else self.cluster).append(policy)
        return 1

    def in_force(self, base: Policy, pod_labels: dict, namespace: str, *,
                 archway_scheduler: str | None = None,
                 namespace_object: dict | None = None) -> InForce:
        facts = namespace_facts(namespace_object) if namespace_object else None
        return policy_in_force(base, pod_labels, namespace,
                               facts or self.namespaces.get(namespace), self.namespaced,
                               self.cluster, archway_scheduler=archway_scheduler)


def read_from_cluster(known: KnownPolicies, config) -> None:
    """Add the cluster's policies when a Kubernetes API is configured and answers; otherwise say
    on stderr that only the given ones apply."""
    from archway.cluster.reads import ClusterReader
    from archway.kubeclient import build_api_client
    try:
        api_client, _source = build_api_client(config.kubernetes)
        if api_client is None:
            return
        namespaced, cluster = ClusterReader(api_client).placement_policies()
    except (ArchwayError, OSError) as e:
        print(f"archway explain: policies not read from the cluster ({e}); only the given "
              "ones apply", file=sys.stderr)
        return
    for kind, items in ((NAMESPACED_KIND, namespaced), (CLUSTER_KIND, cluster)):
        known.add([dict(item, kind=kind) for item in items], "the cluster")


def policy_lines(in_force: InForce | None) -> list[str]:
    """`  policy: PlacementPolicy ml/batch (priority 10)` and why the others did not apply."""
    if in_force is None:
        return []
    shaped = in_force.shaped_by
    if shaped is None:
        line = f"  policy: {in_force.source or 'config'}" + (
            " (no PlacementPolicy selects it)" if in_force.source else "")
    else:
        line = f"  policy: {shaped.display} (priority {shaped.priority}, selects it)"
    return [line] + [f"    passed over: {w}" for w in in_force.warnings]


def policy_json(in_force: InForce | None) -> dict | None:
    if in_force is None:
        return None
    shaped = in_force.shaped_by
    return {"source": in_force.source or "config",
            "priority": shaped.priority if shaped is not None else None,
            "passed_over": list(in_force.warnings),
            "conflicts": [[p.display for p in group] for group in in_force.conflicts]}
