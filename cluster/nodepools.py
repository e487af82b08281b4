"""Nodes that may join: the architectures Karpenter's NodePools allow, shaped as Node facts.

With an autoscaler a cluster may have no node of a pod's architecture yet and still run it: the
NodePool launches one for the pending pod. So when `kubernetes.karpenter_node_pools` is on, the
check "can any node run this pod" (placement.unschedulable_reason) counts each NodePool as one
node per architecture it allows, with the taints its nodes will carry. One list + watch of
nodepools.karpenter.sh (a cluster has a handful), nothing per admission.
"""
from dataclasses import dataclass

from archway.vocabulary import ARCH_LABEL, OS_LABEL, normal_architecture
from archway.watchcache import WatchCache

from .nodes import NodeFacts

PATH = "/apis/karpenter.sh/v1/nodepools"
# A NodePool that says nothing of the architecture launches whatever its cloud offers: any Linux
# GOARCH Kubernetes builds for.
ANY_ARCH = frozenset({"amd64", "arm64", "arm", "386", "ppc64le", "s390x", "riscv64", "loong64",
                      "mips64le"})


# A NodePool that says nothing of the OS launches Linux nodes (Karpenter's default images).
OPERATING_SYSTEMS = frozenset({"linux", "windows"})


@dataclass(frozen=True)
class NodePoolFacts:
    name: str
    nodes: tuple[NodeFacts, ...]   # one per architecture (and OS) the pool may launch


def _strings(values) -> frozenset[str]:
    return frozenset(normal_architecture(v) for v in values or () if isinstance(v, str) and v)


def pool_architectures(requirements) -> frozenset[str]:
    """The architectures a NodePool's spec.template.spec.requirements allow (Karpenter's
    operators: In, NotIn, Exists, DoesNotExist; several requirements on the key all hold)."""
    archs: frozenset[str] | None = None    # None: not restricted yet
    for term in requirements if isinstance(requirements, list) else ():
        if not isinstance(term, dict) or term.get("key") != ARCH_LABEL:
            continue
        operator, values = term.get("operator"), _strings(term.get("values"))
        if operator == "In":
            archs = values if archs is None else archs & values
        elif operator == "NotIn":
            archs = (ANY_ARCH if archs is None else archs) - values
        elif operator == "DoesNotExist":
            archs = frozenset()
    return ANY_ARCH if archs is None else archs


def pool_operating_systems(requirements) -> frozenset[str]:
    """The OSes (`kubernetes.io/os`) a NodePool's requirements allow; linux when they say none."""
    found: frozenset[str] | None = None
    for term in requirements if isinstance(requirements, list) else ():
        if not isinstance(term, dict) or term.get("key") != OS_LABEL:
            continue
        values = frozenset(v.strip().lower() for v in term.get("values") or ()
                           if isinstance(v, str) and v.strip())
        if term.get("operator") == "In":
            found = values if found is None else found & values
        elif term.get("operator") == "NotIn":
            found = (OPERATING_SYSTEMS if found is None else found) - values
    return frozenset({"linux"}) if found is None else found


def _taints(template_spec: dict) -> tuple[tuple[str, str, str], ...]:
    # spec.template.spec.taints stay on the node; startupTaints go once it is initialised.
    return tuple((t["key"], str(t.get("value") or ""), str(t.get("effect") or ""))
                 for t in template_spec.get("taints") or ()
                 if isinstance(t, dict) and isinstance(t.get("key"), str))


def nodepool_facts(pool: dict) -> NodePoolFacts | None:
    meta = pool.get("metadata") if isinstance(pool, dict) else None
    name = meta.get("name") if isinstance(meta, dict) else None
    if not isinstance(name, str) or not name:
        return None
    template = ((pool.get("spec") or {}).get("template") or {}).get("spec") or {}
    if not isinstance(template, dict):
        return NodePoolFacts(name, ())
    taints, requirements = _taints(template), template.get("requirements")
    return NodePoolFacts(name, tuple(NodeFacts(f"nodepool/{name}", arch, (), taints, os)
                                     for os in sorted(pool_operating_systems(requirements))
                                     for arch in sorted(pool_architectures(requirements))))


class NodePoolCache(WatchCache[NodePoolFacts]):
    """List + watch of Karpenter's NodePools (archway.watchcache). Until it has listed (no
    Karpenter installed: 404, retried with backoff) the webhook does not judge schedulability."""

    def __init__(self, api_client_factory):
        super().__init__(api_client_factory, what="nodepool", path=PATH, facts=nodepool_facts)

    def nodes_that_may_join(self) -> list[NodeFacts]:
        return [node for pool in self.items.values() for node in pool.nodes]
