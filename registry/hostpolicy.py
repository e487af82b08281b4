"""Which hosts archway may contact.

Pod specs are written by users, so an image reference is untrusted input: without this check a
pod could make archway probe a cloud metadata service or an internal link-local address.

Addresses compare as addresses, not text: `2130706433`, `0x7f000001`, `127.1`, `0177.0.0.1` and
`[::ffff:127.0.0.1]` all connect to 127.0.0.1 (the C resolver accepts every inet_aton spelling),
so each is matched as 127.0.0.1. An address or CIDR range in deny_hosts also refuses a name that
resolves into it, checked again on the connected socket.

The cluster's own addresses are refused unless the operator names the host: loopback, the
Service ranges and the API server's addresses (ClusterAddresses, discovered by the webhook's
wiring or set in registry.service_cidrs), and the kubelet's ports on any address. Without this,
any pod creator could make archway open connections to them: a port scanner inside the cluster.
A host is named when registry.allow_hosts matches it, or it is an insecure_hosts entry, a mirror
of hosts_dir, the proxy or the SIF library: hosts only the operator writes.
"""
import fnmatch
import ipaddress
import re
import socket
from dataclasses import dataclass

from archway.errors import DeadlineExceeded, HostRefused
from archway.hostport import join_host_port, split_host_port

from .dns import LOOKUPS, LookupTimeout, NameLookups

# Cloud metadata services that are not inside the link-local ranges.
_METADATA_ADDRESSES = {
    ipaddress.ip_address("100.100.100.200"),   # Alibaba Cloud
    ipaddress.ip_address("fd00:ec2::254"),     # AWS IMDS over IPv6
}
_CLOUD_METADATA = ipaddress.ip_address("169.254.169.254")   # AWS, GCP, Azure...: link-local
_METADATA_NAMES = {"metadata.google.internal", "metadata", "instance-data", "metadata.azure.com"}
# The kubelet's authenticated API and its read-only port, on every node.
KUBELET_PORTS = frozenset({10250, 10255})
KUBE_PROXY_PORTS = frozenset({10249, 10256})   # its metrics and health, on every node


def _host_port(netloc: str) -> tuple[str, int | None]:
    try:
        host, port = split_host_port(netloc)
    except ValueError:
        raise HostRefused(f"malformed host {netloc!r}", rule="malformed") from None
    return host or netloc.lower(), port


IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
Network = ipaddress.IPv4Network | ipaddress.IPv6Network
# NAT64's well-known prefix (RFC 6052): where a NAT64 gateway exists, 64:ff9b::a.b.c.d is a.b.c.d.
_NAT64 = ipaddress.ip_network("64:ff9b::/96")
# What inet_aton may read as IPv4: 1 to 4 parts, each decimal, 0x-hex or 0-octal.
_INET_ATON = re.compile(r"(?:0[xX][0-9a-fA-F]*|[0-9]+)(?:\.(?:0[xX][0-9a-fA-F]*|[0-9]+)){0,3}")


def canonical_address(host: str) -> IPAddress | None:
    """The address a host literal connects to, however it is spelled; None for a name.

    IPv4 in any spelling the C resolver accepts (inet_aton: 127.1, 2130706433, 0x7f.1, 0177.0.0.1),
    IPv6 with or without brackets or zone, and IPv4-mapped, -compatible or NAT64 IPv6 as the
    IPv4 it reaches.
    """
    text = host.strip().strip("[]").split("%", 1)[0]
    try:
        ip: IPAddress = ipaddress.ip_address(text)
    except ValueError:
        if not _INET_ATON.fullmatch(text):
            return None
        try:
            ip = ipaddress.IPv4Address(socket.inet_aton(text))
        except OSError:
            return None
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.ipv4_mapped is not None:
            return ip.ipv4_mapped
        if int(ip) >> 32 == 0 and int(ip) > 1:   # ::a.b.c.d, IPv4-compatible (deprecated)
            return ipaddress.IPv4Address(int(ip))
        if ip in _NAT64:
            return ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF)
    return ip


@dataclass(frozen=True)
class HostPatterns:
    """allow_hosts / deny_hosts entries: fnmatch patterns on `host` or `host:port`, addresses
    (any spelling, optionally with :port) and CIDR ranges, which match by address."""
    globs: tuple[str, ...]
    networks: tuple[tuple[Network, int | None], ...]

    @classmethod
    def parse(cls, patterns) -> "HostPatterns":
        globs: list[str] = []
        networks: list[tuple[Network, int | None]] = []
        for pattern in patterns:
            whole = canonical_address(pattern) if "*" not in pattern else None
            if whole is not None:
                networks.append((ipaddress.ip_network(whole), None))
                continue
            if "/" in pattern:
                try:
                    networks.append((ipaddress.ip_network(pattern.strip("[]"), strict=False), None))
                    continue
                except ValueError:
                    pass
            try:
                host, port = split_host_port(pattern)
            except ValueError:
                host, port = pattern, None
            address = canonical_address(host) if host and "*" not in pattern else None
            if address is not None:
                networks.append((ipaddress.ip_network(address), port))
            else:
                globs.append(pattern)
        return cls(tuple(globs), tuple(networks))

    def __bool__(self) -> bool:
        return bool(self.globs or self.networks)

    def matches(self, host: str, port: int | None) -> bool:
        """Whether `host`, as written or as the address it spells, matches."""
        canonical = canonical_address(host)
        spellings = {host} | ({str(canonical)} if canonical else set())
        names = {join_host_port(n, None) for n in spellings} | (
            {join_host_port(n, port) for n in spellings} if port else set())
        if any(n == p or fnmatch.fnmatchcase(n, p) for n in names for p in self.globs):
            return True
        return canonical is not None and self.covers(canonical, port)

    def covers(self, address: IPAddress, port: int | None) -> bool:
        """Whether an address (where a name resolved, where a socket landed) is listed."""
        return any(address in network and (wanted is None or wanted == port)
                   for network, wanted in self.networks if address.version == network.version)


def forbidden_address(address: str) -> bool:
    ip = canonical_address(address)
    if ip is None:
        return True   # not an address: nothing a socket reports
    if ip.is_loopback:
        return False  # ::1 sits inside the reserved ::/8, but a local registry is legitimate
    return (ip.is_link_local or ip.is_multicast or ip.is_unspecified or ip.is_reserved
            or ip in _METADATA_ADDRESSES)


def parse_networks(entries, key: str) -> tuple[Network, ...]:
    """CIDR ranges or single addresses (any spelling); ValueError naming `key` otherwise."""
    networks = []
    for entry in entries:
        address = canonical_address(entry)
        try:
            networks.append(ipaddress.ip_network(address) if address is not None
                            else ipaddress.ip_network(entry.strip().strip("[]"), strict=False))
        except ValueError:
            raise ValueError(f"{key}: {entry!r} is not an address or CIDR range") from None
    return tuple(networks)


class ClusterAddresses:
    """The cluster's Service ranges, API server and Node addresses and pod ranges, as last
    discovered or configured: replaced whole (`update`), read without a lock. Single addresses
    (two per Node: thousands) are looked up in a set, ranges walked."""

    def __init__(self, networks: tuple[Network, ...] = ()):
        self.update(networks)

    def update(self, networks) -> None:
        networks = tuple(networks)
        single = frozenset(n.network_address for n in networks
                           if n.prefixlen == n.max_prefixlen)
        ranges = tuple(n for n in networks if n.prefixlen != n.max_prefixlen)
        self._lookup = (single, ranges)
        self.networks = networks

    def covers(self, address: IPAddress) -> bool:
        single, ranges = self._lookup
        return address in single or any(address in network for network in ranges
                                        if address.version == network.version)


_INTERNAL = {"loopback": "a loopback address", "kubelet": "a kubelet port",
             "kube-proxy": "a kube-proxy port",
             "cluster": "in the cluster's Service range or the API server's"}


def internal_rule(address: IPAddress, port: int | None, cluster: ClusterAddresses) -> str | None:
    """Which rule (archway.errors.POLICY_RULES) makes `address:port` one of the cluster's own
    places, or None when it is not."""
    if address.is_loopback:
        return "loopback"
    if port in KUBELET_PORTS:
        return "kubelet"
    if port in KUBE_PROXY_PORTS:
        return "kube-proxy"
    if cluster.covers(address):
        return "cluster"
    return None


def forbidden_rule(address: str) -> str:
    """Which rule an address `forbidden_address` refuses falls under."""
    ip = canonical_address(address)
    if ip is not None and (ip in _METADATA_ADDRESSES or ip == _CLOUD_METADATA):
        return "metadata"
    if ip is not None and ip.is_link_local:
        return "link-local"
    return "reserved"


class HostPolicy:
    """Allow and deny lists from config, plus the addresses that are always refused, and the
    cluster's own addresses (loopback, Service ranges, the API server, kubelet ports) unless
    the host is named. `cluster=None` turns the last check off: for a peer the operator
    configured (Prometheus) and the operator's own `archway inspect`."""

    def __init__(self, allow_hosts=(), deny_hosts=(), resolve=None, forbidden=forbidden_address,
                 *, named_hosts=(), cluster: ClusterAddresses | None = None):
        """`resolve`: a getaddrinfo to use instead of the system's (tests); `named_hosts`:
        host[:port] the operator wrote elsewhere in the config (insecure_hosts, the proxy)."""
        self.allow_hosts = tuple(allow_hosts)
        self.deny_hosts = tuple(deny_hosts)
        self._allow = HostPatterns.parse(self.allow_hosts)
        self._deny = HostPatterns.parse(self.deny_hosts)
        self._named = {n.lower() for n in named_hosts}
        self.lookups = LOOKUPS if resolve is None else NameLookups(resolve)
        self._forbidden = forbidden
        self.cluster = cluster

    def name_host(self, netloc: str) -> None:
        """Count `netloc` as named by the operator (a mirror read from hosts_dir)."""
        self._named = self._named | {netloc.lower()}

    def check(self, netloc: str, deadline: float | None = None) -> None:
        """Raise HostRefused unless archway may connect to `netloc` (host[:port]); a name
        lookup still unanswered at `deadline` raises DeadlineExceeded."""
        host, port = _host_port(netloc)
        if host in _METADATA_NAMES:
            raise HostRefused(f"{host} is a cloud metadata service: archway never contacts it",
                              rule="metadata")
        if self._deny.matches(host, port):
            raise HostRefused(f"{netloc} is in registry.deny_hosts", rule="deny_hosts")
        if self._allow and not self._allow.matches(host, port):
            raise HostRefused(f"{netloc} is not in registry.allow_hosts", rule="allow_hosts")
        try:
            addresses = self._addresses(host, port, deadline)
        except LookupTimeout as e:
            raise DeadlineExceeded(f"deadline passed reaching {netloc}: {e}") from None
        for address in addresses:
            self.check_peer(address, netloc, port)

    def check_peer(self, address: str, netloc: str, port: int | None = None,
                   refused: type[HostRefused] = HostRefused) -> None:
        """Raise HostRefused if `address` (at `port`, else the port of `netloc`), where a
        connection to `netloc` landed, is forbidden.

        Checked again on the connected socket: a name may resolve to a harmless address when
        checked and to a metadata or cluster address a moment later, when the connection
        resolves it. `refused`: the error to raise (PeerRefused where the socket is connected).
        """
        if self._forbidden(address):
            raise refused(f"{netloc} resolves to {address}, a link-local or metadata address: "
                          f"refused", rule=forbidden_rule(address))
        ip = canonical_address(address)
        port = port if port is not None else _port_of(netloc)
        if ip is not None and self._deny.covers(ip, port):
            raise refused(f"{netloc} resolves to {address}, which registry.deny_hosts refuses",
                          rule="deny_hosts")
        if ip is None or self.cluster is None or self._is_named(netloc):
            return
        rule = internal_rule(ip, port, self.cluster)
        if rule is not None:
            raise refused(f"{netloc} resolves to {address}, {_INTERNAL[rule]}: archway contacts "
                          f"it only when registry.allow_hosts lists it", rule=rule)

    def _is_named(self, netloc: str) -> bool:
        if netloc.lower() in self._named:
            return True
        try:
            host, port = split_host_port(netloc)
        except ValueError:
            return False
        return bool(self._allow) and self._allow.matches(host or netloc.lower(), port)

    def _addresses(self, host: str, port: int | None, deadline: float | None) -> set[str]:
        address = canonical_address(host)
        if address is not None:
            return {str(address)}
        try:
            infos = self.lookups.getaddrinfo(host, port or 443, proto=socket.IPPROTO_TCP,
                                             deadline=deadline)
        except (socket.gaierror, UnicodeError):
            return set()  # unresolvable: the connection itself will fail with a clear error
        return {info[4][0] for info in infos}


def _port_of(netloc: str) -> int | None:
    try:
        return split_host_port(netloc)[1]
    except ValueError:
        return None
