"""The connections registry.http's requests travel on: each checks where it landed, finds its
address by the request's deadline, and is shut at that deadline; verified TLS connections share
one SSLContext per trust bundle."""
import socket
import threading

from requests.adapters import HTTPAdapter
from urllib3.connectionpool import HTTPConnectionPool, HTTPSConnectionPool
from urllib3.exceptions import ConnectTimeoutError, NameResolutionError, NewConnectionError
from urllib3.util.connection import allowed_gai_family

from archway.errors import HostRefused, PeerRefused
from archway.hostport import join_host_port

from .deadlines import current_deadline, watch_current
from .dns import LOOKUPS, LookupTimeout
from .hostpolicy import HostPolicy
from .trust import verifying_context


class CheckedAdapter(HTTPAdapter):
    """Connections that check where they landed, and share one SSLContext.

    Every new socket's peer address passes the host policy again, so DNS answering differently
    at connect time than at check time cannot reach a metadata address. Every verified TLS
    connection shares one SSLContext: left alone, requests/urllib3 build a context per
    connection and load the whole CA bundle into it, about 0.7 MB per pooled connection.
    Unverified connections (insecure_hosts) keep urllib3's own per-connection context, so the
    shared one is never switched to CERT_NONE."""

    def __init__(self, trust, policy: HostPolicy, **kwargs):
        self._trust = trust
        self._contexts = {trust: verifying_context(trust)}   # trust bundle -> its SSLContext
        self._contexts_lock = threading.Lock()
        self._pools = {scheme: _checked_pool(pool, policy)
                       for scheme, pool in (("http", HTTPConnectionPool), ("https", _HTTPSPool))}
        super().__init__(**kwargs)

    def init_poolmanager(self, *args, **kwargs):
        super().init_poolmanager(*args, **kwargs)
        self.poolmanager.pool_classes_by_scheme = self._pools

    def build_connection_pool_key_attributes(self, request, verify, cert=None):
        host_params, pool_kwargs = super().build_connection_pool_key_attributes(request, verify, cert)
        if verify is not False:
            pool_kwargs["ssl_context"] = self._context_for(verify)
            pool_kwargs.pop("ca_certs", None)   # already in the shared context
            pool_kwargs.pop("ca_cert_dir", None)
        return host_params, pool_kwargs

    def _context_for(self, verify):
        """The shared context of a trust bundle (a hosts.toml `ca` makes a bundle of its own)."""
        key = self._trust if verify is True else verify
        with self._contexts_lock:
            if key not in self._contexts:
                self._contexts[key] = verifying_context(key)
            return self._contexts[key]

    def cert_verify(self, conn, url, verify, cert):
        super().cert_verify(conn, url, verify, cert)
        if verify is not False:
            conn.ca_certs = conn.ca_cert_dir = None   # loading them again would cost each connect


class _HTTPSPool(HTTPSConnectionPool):
    """urllib3 warns (InsecureRequestWarning) on every request over unverified TLS. archway asks
    for that (verify=False, so cert_reqs CERT_NONE in the pool's key) only for the hosts the
    operator listed in registry.insecure_hosts, where a warning per request would bury real log
    lines: those pools connect without it. Every other pool warns as usual, and nothing
    process-wide (warning filters) is changed."""

    def _validate_conn(self, conn) -> None:
        if self.cert_reqs != "CERT_NONE":
            super()._validate_conn(conn)
        elif conn.is_closed:
            conn.connect()


def _checked_pool(pool_class, policy: HostPolicy):
    class CheckedConnection(pool_class.ConnectionCls):
        def _new_conn(self):
            sock = self._connect_by(current_deadline())
            try:
                peer = sock.getpeername()
                policy.check_peer(peer[0], join_host_port(self.host, self.port), peer[1],
                                  refused=PeerRefused)
            except HostRefused:
                sock.close()
                raise
            watch_current(sock)   # from here on (TLS handshake included) the deadline holds
            return sock

        def request(self, *args, **kwargs):
            watch_current(self.sock)   # a pooled connection, reused: None when not yet open
            return super().request(*args, **kwargs)

        def _connect_by(self, deadline: float | None):
            """urllib3's connect, with the name looked up by `deadline` (registry.dns), then
            each address tried in turn as urllib3 does."""
            name: str = self._dns_host  # type: ignore[has-type]  # urllib3 sets it untyped
            try:
                infos = LOOKUPS.getaddrinfo(name.strip("[]"), self.port,
                                            allowed_gai_family(), socket.SOCK_STREAM,
                                            deadline=deadline)
            except socket.gaierror as e:
                raise NameResolutionError(self.host, self, e) from e
            except LookupTimeout as e:
                raise ConnectTimeoutError(self, str(e)) from None
            error: Exception = NewConnectionError(self, f"{name} resolves to no address")
            try:
                for address in dict.fromkeys(info[4][0] for info in infos):
                    self._dns_host = address
                    try:
                        return super()._new_conn()
                    except (NewConnectionError, ConnectTimeoutError) as e:
                        error = e
            finally:
                self._dns_host = name
            raise error

    return type(f"Checked{pool_class.__name__}", (pool_class,), {"ConnectionCls": CheckedConnection})

