"""The cluster's own addresses, which a pod's image reference must not make archway contact
(registry.hostpolicy refuses them unless registry.allow_hosts lists the host): the Service ranges
(networking.k8s.io/v1 ServiceCIDR objects, or registry.service_cidrs when set), the `kubernetes`
Service's address (KUBERNETES_SERVICE_HOST, the client's own API server), the API server's
real addresses (the `kubernetes` EndpointSlice in `default`), and every Node's addresses and
pod ranges (a node's other addresses reach the API server and the node's agents too: its
bridge's gateway, its IPv6 address; a pod IP is a pod's, not a registry's unless named). Read
once as a worker or a leadership starts, before it answers, then every REFRESH_SECONDS in a
daemon thread: a cluster gains Service ranges rarely, and one failed read keeps the last answer.
A webhook worker takes the Nodes from its node cache (a watch it keeps anyway) once that has
synced, and follows its changes within NODE_LOOK_SECONDS: every worker listing every Node every
REFRESH_SECONDS would cost a 5,000-node cluster's apiserver thousands of Nodes a second.
"""
import ipaddress
import itertools
import logging
import os
import threading
import time
from urllib.parse import urlsplit

from archway.kubeapi import LIST_PAGE_SIZE, ApiError, KubeApi
from archway.registry.hostpolicy import ClusterAddresses, Network, canonical_address, parse_networks

from .nodes import node_addresses, node_pod_cidrs

log = logging.getLogger(__name__)
REFRESH_SECONDS = 300.0
NODE_LOOK_SECONDS = 5.0
SERVICE_CIDRS = "/apis/networking.k8s.io/v1/servicecidrs"
API_ENDPOINTS = "/apis/discovery.k8s.io/v1/namespaces/default/endpointslices/kubernetes"
NODES = "/api/v1/nodes"


def _host_network(host: str | None) -> list[Network]:
    address = canonical_address(host) if host else None
    return [ipaddress.ip_network(address)] if address is not None else []


def read_cluster_networks(api: KubeApi, configured: tuple[str, ...], environ=None, *,
                          list_nodes: bool = True) -> tuple[list[Network], list[str]]:
    """(the cluster's networks, what could not be read). `configured`: registry.service_cidrs,
    which replaces the ServiceCIDRs when not empty. `list_nodes` False: without the Nodes'."""
    env = os.environ if environ is None else environ
    networks = list(parse_networks(configured, "registry.service_cidrs"))
    problems = []
    if not configured:
        try:
            for item in api.request("GET", SERVICE_CIDRS).get("items") or []:
                networks += parse_networks((item.get("spec") or {}).get("cidrs") or [],
                                           "ServiceCIDR")
        except (ApiError, ValueError, AttributeError) as e:
            problems.append(f"Service ranges (set registry.service_cidrs): {e}")
    networks += _host_network(env.get("KUBERNETES_SERVICE_HOST"))
    networks += _host_network(urlsplit(getattr(api.client.configuration, "host", "") or "").hostname)
    try:
        for endpoint in api.request("GET", API_ENDPOINTS).get("endpoints") or []:
            for address in endpoint.get("addresses") or []:
                networks += _host_network(address)
    except (ApiError, AttributeError) as e:
        problems.append(f"the API server's addresses: {e}")
    try:
        for page in api.pages(NODES, LIST_PAGE_SIZE) if list_nodes else ():
            for node in page.get("items") or []:
                networks += node_networks(node_addresses(node), node_pod_cidrs(node))
    except (ApiError, AttributeError) as e:
        problems.append(f"the Nodes' addresses: {e}")
    return list(dict.fromkeys(networks)), problems


def node_networks(addresses, pod_cidrs) -> list[Network]:
    """A Node's addresses (status.addresses: a name is no address) and pod ranges."""
    networks = [network for address in addresses for network in _host_network(address)]
    try:
        networks += parse_networks(list(pod_cidrs), "a Node's spec.podCIDRs")
    except ValueError:
        pass     # the apiserver validates them; one that does not parse is no range
    return networks


class ClusterRanges:
    """Keeps `cluster` (the resolver's policy's ClusterAddresses) up to date from the API."""

    def __init__(self, api: KubeApi, cluster: ClusterAddresses, configured: tuple[str, ...],
                 refresh_seconds: float = REFRESH_SECONDS, nodes=None):
        self.api = api
        self.cluster = cluster
        self.configured = configured
        self.refresh_seconds = refresh_seconds
        self.nodes = nodes                 # a NodeCache (name -> NodeFacts), or None: listed
        self._read: list[Network] = []     # the last refresh's, from the API
        self._nodes_version: int | None = None
        self._per_node: dict[tuple, tuple[Network, ...]] = {}   # (addresses, pod ranges) ->
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def refresh(self) -> None:
        from_cache = self.nodes is not None and self.nodes.synced
        networks, problems = read_cluster_networks(self.api, self.configured,
                                                   list_nodes=not from_cache)
        for problem in problems:
            log.warning("cluster addresses archway refuses to contact: cannot read %s", problem)
        if problems and self.cluster.networks:
            networks = list(dict.fromkeys([*self.cluster.networks, *networks]))  # keep the last
        self._read = networks
        self._publish(from_cache)

    def _publish(self, from_cache: bool) -> None:
        networks = self._read
        if from_cache and self.nodes is not None:
            self._nodes_version = self.nodes.version
            # Each Node's networks parsed once: a change of one Node is not 5,000 parsed again.
            known, self._per_node = self._per_node, {}
            for facts in self.nodes.items.values():
                key = (facts.addresses, facts.pod_cidrs)
                self._per_node[key] = known.get(key) or tuple(node_networks(*key))
            networks = list(dict.fromkeys([*networks, *itertools.chain.from_iterable(
                self._per_node.values())]))
        if tuple(networks) != self.cluster.networks:
            log.info("cluster addresses archway refuses to contact unless listed: %s",
                     ", ".join(map(str, networks)) or "none")
        self.cluster.update(networks)

    def start(self) -> "ClusterRanges":
        """Read now (the first pods need it), then keep reading in a daemon thread."""
        self.refresh()
        self._thread = threading.Thread(target=self._run, name="archway-cluster-ranges",
                                        daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        nodes = self.nodes
        next_read = time.monotonic() + self.refresh_seconds
        while not self._stop.wait(self.refresh_seconds if nodes is None else NODE_LOOK_SECONDS):
            if nodes is None or time.monotonic() >= next_read:
                next_read = time.monotonic() + self.refresh_seconds
                self.refresh()
            elif nodes.synced and nodes.version != self._nodes_version:
                self._publish(True)        # a Node changed (or listed at start: the cache's now)


    @classmethod
    def for_resolver(cls, config, api_client, resolver, nodes=None) -> "ClusterRanges | None":
        """The keeper of `resolver`'s refused cluster addresses, with an API client; None
        without one (then only registry.service_cidrs, loopback and kubelet ports apply).
        `nodes`: the process's NodeCache, the Nodes' source once it has synced."""
        cluster = getattr(getattr(getattr(resolver, "http", None), "policy", None), "cluster", None)
        if api_client is None or cluster is None:
            return None
        return cls(KubeApi(api_client, timeout_seconds=5), cluster, config.registry.service_cidrs,
                   nodes=nodes)


def keep_cluster_ranges(config, api_client, resolver, nodes=None) -> ClusterRanges | None:
    """Start keeping `resolver`'s refused cluster addresses up to date (ClusterRanges.start)."""
    ranges = ClusterRanges.for_resolver(config, api_client, resolver, nodes)
    return ranges.start() if ranges is not None else None
