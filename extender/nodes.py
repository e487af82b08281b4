"""What archway knows about the cluster's nodes: name, architecture, addresses.

A nodeCacheCapable scheduler sends only node names, so the extender needs the labels from
somewhere; asking the API server per node or per call would put the whole cluster's scheduling
latency on that round trip. Instead one list + watch keeps a small in-memory map, like an
informer, with only the three facts archway uses (a 5,000-node cluster's full Node objects would
be hundreds of megabytes; these facts are a few hundred kilobytes).
"""
import logging
from dataclasses import dataclass

from archway.extender.listwatch import ListWatch
from archway.registry.platforms import normalize
from archway.webhook.placement import ARCH_KEYS

log = logging.getLogger("archway.nodes")


def _normal_arch(value) -> str | None:
    if not isinstance(value, str) or not value.strip():
        return None
    return normalize("linux", value).architecture  # normalize() is memoised


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


def node_addresses(node: dict) -> tuple[str, ...]:
    """status.addresses[].address (InternalIP, ExternalIP, Hostname...), lower-cased."""
    status = node.get("status")
    entries = status.get("addresses") if isinstance(status, dict) else None
    if not isinstance(entries, list):
        return ()
    return tuple(e["address"].lower() for e in entries
                 if isinstance(e, dict) and isinstance(e.get("address"), str) and e["address"])


@dataclass(frozen=True)
class NodeFacts:
    name: str
    arch: str | None
    addresses: tuple[str, ...]


def node_facts(node: dict) -> NodeFacts | None:
    meta = node.get("metadata") if isinstance(node, dict) else None
    name = meta.get("name") if isinstance(meta, dict) else None
    if not isinstance(name, str) or not name:
        return None
    return NodeFacts(name, node_arch(node), node_addresses(node))


class NodeCache(ListWatch):
    """List + watch of Nodes in a background thread, started lazily in the process that serves.

    `nodes` is replaced, never mutated, so request threads read it without a lock; `version`
    changes whenever a fact the extender uses changes (a heartbeat status update does not).
    """
    what = "node cache"

    def __init__(self, api_client_factory, **kwargs):
        super().__init__(api_client_factory, thread_name="archway-node-cache", **kwargs)
        self.nodes: dict[str, NodeFacts] = {}
        self.version = 0

    def _list_call(self, api, **kwargs):
        return api.list_node(**kwargs)

    def _on_no_cluster(self) -> None:
        log.info("no Kubernetes cluster configured: the node cache stays empty and "
                 "NodeNames filter calls let every node pass")

    def _on_list(self, items: list) -> None:
        facts = {}
        for item in items:
            fact = node_facts(item)
            if fact is not None:
                facts[fact.name] = fact
        self._replace(facts)
        if not self.synced:
            log.info("node cache synced: %d nodes", len(facts))

    def _on_event(self, kind: str, obj: dict) -> None:
        if kind == "DELETED":
            self._delete((obj.get("metadata") or {}).get("name"))
        else:
            self._upsert(node_facts(obj))

    # --- copy-on-write updates ------------------------------------------------------------------
    def _replace(self, facts: dict) -> None:
        if facts != self.nodes:
            self.nodes = facts
            self.version += 1

    def _upsert(self, fact: NodeFacts | None) -> None:
        if fact is None or self.nodes.get(fact.name) == fact:
            return
        nodes = dict(self.nodes)
        nodes[fact.name] = fact
        self.nodes = nodes
        self.version += 1

    def _delete(self, name) -> None:
        if name in self.nodes:
            nodes = dict(self.nodes)
            del nodes[name]
            self.nodes = nodes
            self.version += 1
