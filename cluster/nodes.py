"""What archway knows about the cluster's nodes: name, architecture, OS, addresses, taints.

A nodeCacheCapable scheduler sends only node names, so the extender needs the labels from
somewhere; asking the API server per node or per call would put the whole cluster's scheduling
latency on that round trip. Instead one list + watch keeps a small in-memory map, like an
informer, with only the few facts archway uses (a 5,000-node cluster's full Node objects would
be hundreds of megabytes; these facts are a few hundred kilobytes).
"""
from dataclasses import dataclass

from archway.vocabulary import ARCH_KEYS, OS_LABEL, normal_architecture
from archway.watchcache import WatchCache

# What `kubectl cordon` (spec.unschedulable) means to the scheduler, as the node controller
# writes it; counted even before the controller has added the taint.
CORDON_TAINT = ("node.kubernetes.io/unschedulable", "", "NoSchedule")


def _normal_arch(value) -> str | None:
    if not isinstance(value, str) or not value.strip():
        return None
    return normal_architecture(value)


def node_arch(node: dict) -> str | None:
    """The node's GOARCH: label kubernetes.io/arch, then the beta label, then what the kubelet
    reported in status.nodeInfo.architecture; None when none is usable."""
    meta = node.get("metadata")
    labels = meta.get("labels") if isinstance(meta, dict) else None
    if isinstance(labels, dict):
        for key in ARCH_KEYS:  # kubernetes.io/arch, then the deprecated beta label
            arch = _normal_arch(labels.get(key))
            if arch:
                return arch
    status = node.get("status")
    info = status.get("nodeInfo") if isinstance(status, dict) else None
    return _normal_arch(info.get("architecture")) if isinstance(info, dict) else None


def node_os(node: dict) -> str:
    """The node's `kubernetes.io/os` label, else what the kubelet reported in
    status.nodeInfo.operatingSystem, else linux (a node without the label is a Linux node to
    archway, as to a pod without spec.os)."""
    meta = node.get("metadata")
    labels = meta.get("labels") if isinstance(meta, dict) else None
    value = labels.get(OS_LABEL) if isinstance(labels, dict) else None
    if not isinstance(value, str) or not value.strip():
        status = node.get("status")
        info = status.get("nodeInfo") if isinstance(status, dict) else None
        value = info.get("operatingSystem") if isinstance(info, dict) else None
    return value.strip().lower() if isinstance(value, str) and value.strip() else "linux"


def node_addresses(node: dict) -> tuple[str, ...]:
    """status.addresses[].address (InternalIP, ExternalIP, Hostname...), lower-cased."""
    status = node.get("status")
    entries = status.get("addresses") if isinstance(status, dict) else None
    if not isinstance(entries, list):
        return ()
    return tuple(e["address"].lower() for e in entries
                 if isinstance(e, dict) and isinstance(e.get("address"), str) and e["address"])


def node_taints(node: dict) -> tuple[tuple[str, str, str], ...]:
    """spec.taints as (key, value, effect), plus the cordon taint when spec.unschedulable."""
    spec = node.get("spec")
    if not isinstance(spec, dict):
        return ()
    taints = []
    for taint in spec.get("taints") or ():
        if isinstance(taint, dict) and isinstance(taint.get("key"), str):
            taints.append((taint["key"], str(taint.get("value") or ""),
                           str(taint.get("effect") or "")))
    if spec.get("unschedulable") is True and CORDON_TAINT not in taints:
        taints.append(CORDON_TAINT)
    return tuple(taints)


@dataclass(frozen=True)
class NodeFacts:
    name: str
    arch: str | None
    addresses: tuple[str, ...]
    taints: tuple[tuple[str, str, str], ...] = ()   # (key, value, effect)
    os: str = "linux"                                # kubernetes.io/os
    pod_cidrs: tuple[str, ...] = ()                  # spec.podCIDRs (cluster/ranges.py)


def node_facts(node: dict) -> NodeFacts | None:
    meta = node.get("metadata") if isinstance(node, dict) else None
    name = meta.get("name") if isinstance(meta, dict) else None
    if not isinstance(name, str) or not name:
        return None
    return NodeFacts(name, node_arch(node), node_addresses(node), node_taints(node), node_os(node),
                     node_pod_cidrs(node))


def node_pod_cidrs(node: dict) -> tuple[str, ...]:
    spec = node.get("spec")
    if not isinstance(spec, dict):
        return ()
    cidrs = spec.get("podCIDRs") or ([spec["podCIDR"]] if spec.get("podCIDR") else [])
    return tuple(str(c) for c in cidrs) if isinstance(cidrs, list) else ()


class NodeCache(WatchCache[NodeFacts]):
    """List + watch of Nodes (archway.watchcache), started lazily in the process that serves.

    `nodes` is replaced, never mutated, so request threads read it without a lock; `version`
    changes whenever a fact archway uses changes (a heartbeat status update does not).
    """

    def __init__(self, api_client_factory, *, watch_timeout_seconds: int = 240,
                 request_timeout_seconds: float = 30.0, max_backoff_seconds: float = 30.0):
        super().__init__(api_client_factory, what="node", path="/api/v1/nodes",
                         facts=node_facts, watch_timeout_seconds=watch_timeout_seconds,
                         request_timeout_seconds=request_timeout_seconds,
                         max_backoff_seconds=max_backoff_seconds)

    @classmethod
    def for_config(cls, config) -> "NodeCache | None":
        """The process's one node cache, shared by the webhook and the extender; None when
        extender.node_cache is off or no Kubernetes API is to be used (kubernetes.enabled)."""
        if not (config.extender.node_cache and config.kubernetes.enabled != "off"):
            return None
        from archway.kubeclient import api_client_factory
        return cls(api_client_factory(config.kubernetes))

    @property
    def nodes(self) -> dict[str, NodeFacts]:
        return self.items
