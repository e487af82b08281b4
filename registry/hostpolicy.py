"""Which hosts archway may contact.

Pod specs are written by users, so an image reference is untrusted input: without this check a
pod could make archway probe a cloud metadata service or an internal link-local address.
"""
import fnmatch
import ipaddress
import socket

from archway.errors import HostRefused
from archway.hostport import split_host_port

# Cloud metadata services that are not inside the link-local ranges.
_METADATA_ADDRESSES = {
    ipaddress.ip_address("100.100.100.200"),   # Alibaba Cloud
    ipaddress.ip_address("fd00:ec2::254"),     # AWS IMDS over IPv6
}
_METADATA_NAMES = {"metadata.google.internal", "metadata", "instance-data", "metadata.azure.com"}


def _host_port(netloc: str) -> tuple[str, int | None]:
    try:
        host, port = split_host_port(netloc)
    except ValueError:
        raise HostRefused(f"malformed host {netloc!r}") from None
    return host or netloc.lower(), port


def _matches(host: str, port: int | None, patterns) -> bool:
    if ":" in host:  # IPv6: configs write it in brackets, which fnmatch would read as a class
        host = f"[{host}]"
    names = {host, f"{host}:{port}"} if port else {host}
    return any(n == p or fnmatch.fnmatchcase(n, p) for n in names for p in patterns)


def forbidden_address(address: str) -> bool:
    ip = ipaddress.ip_address(address.split("%", 1)[0])
    if getattr(ip, "ipv4_mapped", None):
        ip = ip.ipv4_mapped
    if ip.is_loopback:
        return False  # ::1 sits inside the reserved ::/8, but a local registry is legitimate
    return (ip.is_link_local or ip.is_multicast or ip.is_unspecified or ip.is_reserved
            or ip in _METADATA_ADDRESSES)


class HostPolicy:
    """Allow and deny lists from config, plus the addresses that are always refused."""

    def __init__(self, allow_hosts=(), deny_hosts=(), resolve=socket.getaddrinfo,
                 forbidden=forbidden_address):
        self.allow_hosts = tuple(allow_hosts)
        self.deny_hosts = tuple(deny_hosts)
        self._resolve = resolve
        self._forbidden = forbidden

    def check(self, netloc: str) -> None:
        """Raise HostRefused unless archway may connect to `netloc` (host[:port])."""
        host, port = _host_port(netloc)
        if host in _METADATA_NAMES:
            raise HostRefused(f"{host} is a cloud metadata service: archway never contacts it")
        if _matches(host, port, self.deny_hosts):
            raise HostRefused(f"{netloc} is in registry.deny_hosts")
        if self.allow_hosts and not _matches(host, port, self.allow_hosts):
            raise HostRefused(f"{netloc} is not in registry.allow_hosts")
        for address in self._addresses(host, port):
            self.check_peer(address, netloc)

    def check_peer(self, address: str, netloc: str) -> None:
        """Raise HostRefused if `address`, where a connection to `netloc` landed, is forbidden.

        Checked again on the connected socket: a name may resolve to a harmless address when
        checked and to a metadata address a moment later, when the connection resolves it.
        """
        if self._forbidden(address):
            raise HostRefused(
                f"{netloc} resolves to {address}, a link-local or metadata address: refused")

    def _addresses(self, host: str, port: int | None) -> set[str]:
        try:
            return {str(ipaddress.ip_address(host))}
        except ValueError:
            pass
        try:
            infos = self._resolve(host, port or 443, proto=socket.IPPROTO_TCP)
        except (socket.gaierror, UnicodeError):
            return set()  # unresolvable: the connection itself will fail with a clear error
        return {info[4][0] for info in infos}
