"""Safe defaults (issue 38, finding 5): a pod's image reference cannot make archway connect to
the cluster's own places (loopback in every spelling, the Service ranges, the API server, a
kubelet's port) unless the operator lists the host, and the admission warning does not tell a
refused connection from a TLS error, a timeout or archway's own refusal (a port scanner).

Real sockets on loopback: a listener that records every connection shows that a refused host
is never reached, and the admission service runs over the real resolver."""
import ipaddress
import socket

import pytest

from archway.config import RegistrySettings
from archway.errors import HostRefused
from archway.registry.hostpolicy import HostPolicy
from archway.registry.http import HttpClient
from archway.registry.resolver import Resolver
from lab.procs import free_port, wait_until
from lab.servers.faults import BlackHole, ScriptedServer
from tests.test_service import response, review, service

SERVICE_RANGE = "10.96.0.0/12"
LOOPBACK_SPELLINGS = ["127.0.0.1", "127.1", "127.0.0.2", "2130706433", "0x7f000001", "0177.0.0.1",
                      "0x7f.1", "[::1]", "[::ffff:127.0.0.1]", "[0:0:0:0:0:ffff:7f00:1]",
                      "[::127.0.0.1]", "[64:ff9b::7f00:1]", "localhost"]


def no_dns(host, port, *args, **kwargs):
    """getaddrinfo for tests: `localhost` and literals only, no name is looked up."""
    if host == "localhost":
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", ("127.0.0.1", port))]
    raise socket.gaierror("no such name")


def policy(**kw) -> HostPolicy:
    from archway.registry.hostpolicy import ClusterAddresses, parse_networks
    return HostPolicy(resolve=no_dns, cluster=ClusterAddresses(parse_networks(
        [SERVICE_RANGE, "192.0.2.10"], "test")), **kw)


@pytest.mark.parametrize("host", LOOPBACK_SPELLINGS)
def test_loopback_is_refused_in_every_spelling_unless_listed(host):
    with pytest.raises(HostRefused, match="loopback"):
        policy().check(f"{host}:5000")
    policy(allow_hosts=("127.0.0.0/8", "[::1]:5000", "localhost:5000")).check(f"{host}:5000")


@pytest.mark.parametrize("netloc, why", [
    ("10.96.0.1", "Service range"),             # the `kubernetes` Service
    ("10.100.7.9:5000", "Service range"),
    ("192.0.2.10:6443", "API server"),          # its EndpointSlice address
    ("192.0.2.10:5000", "API server"),          # any port of it
    ("198.51.100.7:10250", "kubelet port"),     # any node's kubelet
    ("198.51.100.7:10255", "kubelet port"),     # its read-only port
    ("198.51.100.7:10256", "kube-proxy port"),  # kube-proxy's health
    ("198.51.100.7:10249", "kube-proxy port"),  # and metrics
    ("[::ffff:10.96.0.10]:53", "Service range"),
])
def test_the_clusters_own_addresses_are_refused_unless_listed(netloc, why):
    with pytest.raises(HostRefused, match=why):
        policy().check(netloc)
    policy(allow_hosts=(netloc,)).check(netloc)                 # listed by name
    policy(named_hosts=(netloc,)).check(netloc)                 # insecure_hosts, a mirror, the proxy


def test_other_addresses_and_ports_are_not_the_clusters():
    for netloc in ("198.51.100.7:5000", "registry.example:443", "203.0.113.5"):
        policy().check(netloc)


def test_the_connected_socket_is_checked_with_its_own_port():
    """A name that resolved elsewhere at check time but connected to loopback or a kubelet port."""
    with pytest.raises(HostRefused, match="loopback"):
        policy().check_peer("127.0.0.1", "reg.example", 443)
    with pytest.raises(HostRefused, match="kubelet"):
        policy().check_peer("198.51.100.7", "reg.example:10250", 10250)
    policy(allow_hosts=("reg.example",)).check_peer("127.0.0.1", "reg.example", 443)


def test_a_refused_host_is_never_connected_to():
    listener = BlackHole()
    try:
        client = HttpClient(RegistrySettings(timeout_seconds=1))
        for host in (f"127.0.0.1:{listener.port}", f"127.1:{listener.port}",
                     f"[::ffff:127.0.0.1]:{listener.port}", f"localhost:{listener.port}"):
            with pytest.raises(HostRefused):
                client.get(f"https://{host}/v2/", max_bytes=100)
        assert listener.accepted == 0
    finally:
        listener.stop()


def test_the_operators_inspect_and_prometheus_may_reach_loopback():
    """`archway inspect IMAGE` asks about what the operator typed; Prometheus is the operator's
    URL: neither is a pod author's reference."""
    client = HttpClient(RegistrySettings(timeout_seconds=1), refuse_cluster=False)
    client.policy.check("127.0.0.1:5000")


def test_service_cidrs_config_is_checked_and_used():
    from archway.config import config_from_dict
    from archway.errors import ConfigError
    with pytest.raises(ConfigError, match="registry.service_cidrs: '10.96.0.0/40' is not a CIDR"):
        config_from_dict({"registry": {"service_cidrs": ["10.96.0.0/40"]}})
    assert config_from_dict({"registry": {"service_cidrs": ["fd00:10:96::/112"]}}
                            ).registry.service_cidrs == ("fd00:10:96::/112",)
    client = HttpClient(RegistrySettings(service_cidrs=("10.200.0.0/16",)))
    with pytest.raises(HostRefused):
        client.policy.check("10.200.3.4:5000")


class _Api:
    """A KubeApi stand-in answering the two reads of clusterranges."""

    class client:
        class configuration:
            host = "https://192.0.2.10:6443"

    def request(self, method, path, **kw):
        if path.endswith("/servicecidrs"):
            return {"items": [{"spec": {"cidrs": ["10.96.0.0/12", "fd00:10:96::/112"]}}]}
        return {"endpoints": [{"addresses": ["192.0.2.11"]}]}

    def pages(self, path, page_size, **kw):
        assert path == "/api/v1/nodes"
        yield {"items": [{"metadata": {"name": "n1"},
                          "spec": {"podCIDR": "10.244.1.0/24", "podCIDRs": ["10.244.1.0/24", "fd00:244:1::/64"]},
                          "status": {"addresses": [{"type": "InternalIP", "address": "192.0.2.21"},
                                                   {"type": "InternalIP", "address": "2001:db8::21"},
                                                   {"type": "Hostname", "address": "n1"}]}}]}


def test_the_cluster_ranges_are_read_from_the_api():
    from archway.cluster.ranges import read_cluster_networks
    from archway.registry.hostpolicy import ClusterAddresses
    networks, problems = read_cluster_networks(_Api(), (), {"KUBERNETES_SERVICE_HOST": "10.96.0.1"})
    assert not problems
    assert set(map(str, networks)) == {"10.96.0.0/12", "fd00:10:96::/112", "10.96.0.1/32",
                                       "192.0.2.10/32", "192.0.2.11/32",
                                       "192.0.2.21/32", "2001:db8::21/128",    # a Node's addresses
                                       "10.244.1.0/24", "fd00:244:1::/64"}     # and pod ranges
    cluster = ClusterAddresses(networks)
    for refused in ("10.244.1.1", "10.244.1.7", "2001:db8::21", "192.0.2.21"):   # gateway, pod
        assert cluster.covers(ipaddress.ip_address(refused)), refused
    assert not cluster.covers(ipaddress.ip_address("192.0.2.99"))
    configured, _ = read_cluster_networks(_Api(), ("10.0.0.0/16",), {})
    assert ipaddress.ip_network("10.0.0.0/16") in configured
    assert ipaddress.ip_network("10.96.0.0/12") not in configured   # the override replaces them


class _Nodes:
    """A node cache as ClusterRanges reads it (synced, version, items of NodeFacts)."""

    def __init__(self, synced: bool):
        from archway.cluster.nodes import NodeFacts
        self.synced, self.version = synced, 1
        self.items = {"n2": NodeFacts("n2", "arm64", ("192.0.2.22", "n2"), pod_cidrs=("10.244.2.0/24",))}


def test_a_worker_takes_the_nodes_from_its_node_cache_once_synced_and_follows_it(monkeypatch):
    """Not every worker listing every Node every 5 minutes: once its node cache (a watch it
    keeps anyway) has synced, the Nodes' addresses come from there, and a change there is
    refused within NODE_LOOK_SECONDS; until then they are listed, as at a worker's start."""
    from archway.cluster import ranges
    from archway.registry.hostpolicy import ClusterAddresses
    listed = []

    class Counting(_Api):
        def pages(self, path, page_size, **kw):
            listed.append(path)
            return super().pages(path, page_size, **kw)
    nodes = _Nodes(synced=False)
    cluster = ClusterAddresses([])
    keeper = ranges.ClusterRanges(Counting(), cluster, (), nodes=nodes)
    keeper.refresh()
    assert listed == ["/api/v1/nodes"] and cluster.covers(ipaddress.ip_address("192.0.2.21"))
    nodes.synced = True
    keeper.refresh()
    assert listed == ["/api/v1/nodes"]        # not listed again
    for refused in ("192.0.2.22", "10.244.2.9"):
        assert cluster.covers(ipaddress.ip_address(refused)), refused
    assert cluster.covers(ipaddress.ip_address("10.96.0.5"))     # the API's parts still read
    monkeypatch.setattr(ranges, "NODE_LOOK_SECONDS", 0.05)
    keeper.start()
    try:
        from archway.cluster.nodes import NodeFacts
        nodes.items = {**nodes.items, "n3": NodeFacts("n3", "amd64", ("2001:db8::23",))}
        nodes.version += 1
        wait_until(lambda: cluster.covers(ipaddress.ip_address("2001:db8::23")), timeout=10,
                   what="a Node the cache brought refused")
    finally:
        keeper.stop()
    assert listed == ["/api/v1/nodes"]


# --- the warning a pod's author reads -----------------------------------------------------------

def test_the_warning_does_not_tell_one_network_error_from_another():
    """Connection refused, a TLS error (a plain-HTTP port), a timeout (a port that accepts and
    never answers): one text. archway's own refusal before any connection (loopback not listed,
    a kubelet port) says so, the same whether the port is open or closed (issue 47)."""
    hole, plain = BlackHole(), ScriptedServer(lambda request: (200, {}, b"{}"))
    unlisted = BlackHole()
    try:
        closed = free_port()
        hosts = {"refused": f"127.0.0.1:{closed}", "tls": f"127.0.0.1:{plain.port}",
                 "timeout": f"127.0.0.1:{hole.port}", "policy": f"127.0.0.1:{unlisted.port}",
                 "kubelet": "127.0.0.1:10250"}
        listed = tuple(hosts[k] for k in ("refused", "tls", "timeout"))
        resolver = Resolver(RegistrySettings(allow_hosts=listed, timeout_seconds=1))
        texts = {}
        for kind, host in hosts.items():
            image = f"{host}/team/app:1"
            answer = response(service(resolver=resolver, deadline_seconds=1.5).review(
                review(image)))
            assert answer["allowed"], answer
            texts[kind] = [w.replace(image, "IMAGE") for w in answer["warnings"]]
        network = {tuple(texts[k]) for k in ("refused", "tls", "timeout")}
        assert network == {("could not inspect IMAGE (registry unreachable); it does not "
                            "restrict placement",)}, texts
        # An open port (policy) and a closed one (kubelet) alike: the policy's answer.
        assert texts["policy"] == texts["kubelet"] == [
            "could not inspect IMAGE (refused by policy: unlisted host); it does not "
            "restrict placement", "archway contacts only the hosts registry.allow_hosts lists"]
        assert unlisted.accepted == 0
    finally:
        for server in (hole, plain, unlisted):
            server.stop()


def test_pull_secrets_are_read_only_where_archway_may_read_secrets():
    """kubernetes.pull_secret_namespaces (the chart's rbac.pullSecretNamespaces): elsewhere no
    Secret is asked for, so no 403 per pod, and the node's credentials are used; the pod's
    author is told why the secrets it names went unread."""
    from archway.cluster.pullsecrets import PullSecrets
    from archway.podview import PodView

    class NoApi:
        def param_serialize(self, *args, **kwargs):
            raise AssertionError("the API was asked for a Secret")

    reader = PullSecrets(NoApi(), namespaces=())
    pod = PodView.of({"metadata": {"namespace": "shop"}, "spec": {
        "imagePullSecrets": [{"name": "regcred"}], "containers": [{"name": "c", "image": "x"}]}})
    credentials = reader.credentials_for(pod, deadline=1e12)
    assert credentials.secrets_used == 0
    assert credentials.warnings == ("pull secrets not read (namespace shop is not in archway's "
                                    "rbac.pullSecretNamespaces): regcred",)
