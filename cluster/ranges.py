"""The cluster's own addresses, which a pod's image reference must not make archway contact
(registry.hostpolicy refuses them unless registry.allow_hosts lists the host): the Service ranges
(networking.k8s.io/v1 ServiceCIDR objects, or registry.service_cidrs when set), the `kubernetes`
Service's address (KUBERNETES_SERVICE_HOST, the client's own API server), the API server's
real addresses (the `kubernetes` EndpointSlice in `default`), and every Node's addresses and
pod ranges (a node's other addresses reach the API server and the node's agents too: its
bridge's gateway, its IPv6 address; a pod IP is a pod's, not a registry's unless named). Read
once as a worker or a leadership starts, before it answers, then every REFRESH_SECONDS in a
daemon thread: a cluster gains Service ranges rarely, and one failed read keeps the last answer.
"""
import ipaddress
import logging
import os
import threading
from urllib.parse import urlsplit

from archway.kubeapi import LIST_PAGE_SIZE, ApiError, KubeApi
from archway.registry.hostpolicy import ClusterAddresses, Network, canonical_address, parse_networks

log = logging.getLogger(__name__)
REFRESH_SECONDS = 300.0
SERVICE_CIDRS = "/apis/networking.k8s.io/v1/servicecidrs"
API_ENDPOINTS = "/apis/discovery.k8s.io/v1/namespaces/default/endpointslices/kubernetes"
NODES = "/api/v1/nodes"
_NAME_TYPES = ("Hostname", "InternalDNS", "ExternalDNS")   # names, not addresses


def _host_network(host: str | None) -> list[Network]:
    address = canonical_address(host) if host else None
    return [ipaddress.ip_network(address)] if address is not None else []


def read_cluster_networks(api: KubeApi, configured: tuple[str, ...], environ=None
                          ) -> tuple[list[Network], list[str]]:
    """(the cluster's networks, what could not be read). `configured`: registry.service_cidrs,
    which replaces the ServiceCIDRs when not empty."""
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
        for page in api.pages(NODES, LIST_PAGE_SIZE):
            for node in page.get("items") or []:
                networks += node_networks(node)
    except (ApiError, AttributeError) as e:
        problems.append(f"the Nodes' addresses: {e}")
    return list(dict.fromkeys(networks)), problems


def node_networks(node: dict) -> list[Network]:
    """A Node's addresses (status.addresses but names) and pod ranges (spec.podCIDRs)."""
    status, spec = node.get("status") or {}, node.get("spec") or {}
    networks = [network for entry in status.get("addresses") or []
                if isinstance(entry, dict) and entry.get("type") not in _NAME_TYPES
                for network in _host_network(str(entry.get("address") or ""))]
    cidrs = spec.get("podCIDRs") or ([spec["podCIDR"]] if spec.get("podCIDR") else [])
    try:
        networks += parse_networks([str(c) for c in cidrs], "a Node's spec.podCIDRs")
    except ValueError:
        pass     # the apiserver validates them; one that does not parse is no range
    return networks


class ClusterRanges:
    """Keeps `cluster` (the resolver's policy's ClusterAddresses) up to date from the API."""

    def __init__(self, api: KubeApi, cluster: ClusterAddresses, configured: tuple[str, ...],
                 refresh_seconds: float = REFRESH_SECONDS):
        self.api = api
        self.cluster = cluster
        self.configured = configured
        self.refresh_seconds = refresh_seconds
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def refresh(self) -> None:
        networks, problems = read_cluster_networks(self.api, self.configured)
        for problem in problems:
            log.warning("cluster addresses archway refuses to contact: cannot read %s", problem)
        if problems and self.cluster.networks:
            networks = list(dict.fromkeys([*self.cluster.networks, *networks]))  # keep the last
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
        while not self._stop.wait(self.refresh_seconds):
            self.refresh()


    @classmethod
    def for_resolver(cls, config, api_client, resolver) -> "ClusterRanges | None":
        """The keeper of `resolver`'s refused cluster addresses, with an API client; None
        without one (then only registry.service_cidrs, loopback and kubelet ports apply)."""
        cluster = getattr(getattr(getattr(resolver, "http", None), "policy", None), "cluster", None)
        if api_client is None or cluster is None:
            return None
        return cls(KubeApi(api_client, timeout_seconds=5), cluster, config.registry.service_cidrs)


def keep_cluster_ranges(config, api_client, resolver) -> ClusterRanges | None:
    """Start keeping `resolver`'s refused cluster addresses up to date (ClusterRanges.start)."""
    ranges = ClusterRanges.for_resolver(config, api_client, resolver)
    return ranges.start() if ranges is not None else None
