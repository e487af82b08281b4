"""The one place archway talks HTTP to registries and file servers.

Every request here is checked against the host policy (redirect targets too), bounded in time
by both the per-read timeout and the caller's deadline, and bounded in size: a peer can neither
hang archway nor make it buffer an unbounded body.

The deadline is enforced on the socket: a peer that sends one byte a second satisfies every
per-read timeout, so each socket a request uses is handed to a watchdog thread that shuts it
down when the request's deadline passes, wherever the request is (connect, TLS handshake,
headers, body), and the blocked read returns at once.
"""
import atexit
import email.utils
import heapq
import http.cookiejar
import itertools
import json
import os
import socket
import ssl
import tempfile
import threading
import time
from dataclasses import dataclass
from typing import Any
from urllib.parse import SplitResult, urljoin, urlsplit

import certifi
import requests
import urllib3
from requests.adapters import HTTPAdapter
from requests.structures import CaseInsensitiveDict
from urllib3.connectionpool import HTTPConnectionPool, HTTPSConnectionPool
from urllib3.exceptions import ConnectTimeoutError, NameResolutionError, NewConnectionError
from urllib3.util.connection import allowed_gai_family
from urllib3.util.ssl_ import create_urllib3_context

from archway.config import RegistrySettings
from archway.errors import (
    ArchwayError,
    ConfigError,
    DeadlineExceeded,
    HostRefused,
    ProxyFailed,
    RateLimited,
    ResponseTooLarge,
    TransportError,
    classify_error,
)
from archway.hostport import join_host_port

from .dns import LOOKUPS, LookupTimeout
from .hostpolicy import HostPolicy
from .proxy import ProxyRules
from .reference import without_userinfo

MAX_REDIRECTS = 5
# Without a caller's deadline a request still ends: after this many per-read timeouts in all.
UNBOUNDED_REQUEST_READS = 3
# Headers that carry a credential: never sent to a host other than the one they were meant for.
CREDENTIAL_HEADERS = ("authorization", "proxy-authorization", "cookie")
_CHUNK = 64 * 1024
# A Retry-After is the registry's word, but not one that may switch a host off for a day: the one
# cap of every wait a 429 asks for (the host's back-off, the pause of a cached answer's checks).
MAX_RETRY_AFTER_SECONDS = 3600.0


@dataclass
class Response:
    status: int
    headers: CaseInsensitiveDict
    body: bytes
    url: str

    def json(self):
        return json.loads(self.body)


def parse_json(data: bytes | str) -> Any:
    """A peer's JSON, or None when it is not JSON: not UTF-8, malformed, or nested so deep that
    the parser would recurse past Python's limit (RecursionError, which is no ValueError)."""
    try:
        return json.loads(data)
    except (ValueError, RecursionError):   # UnicodeDecodeError is a ValueError
        return None


@dataclass
class Stats:
    requests: int = 0
    bytes_read: int = 0


class HttpClient:
    def __init__(self, settings: RegistrySettings, policy: HostPolicy | None = None,
                 pool_size: int = 32, environ=None):
        self.settings = settings
        self.policy = policy or HostPolicy(settings.allow_hosts, settings.deny_hosts)
        self.session = requests.Session()
        # No CA bundle from the environment overriding config; proxies come from ProxyRules.
        self.session.trust_env = False
        # No cookies kept: the session serves every pod, and a cookie a token service set for
        # one pod's credentials must not authenticate another pod's lookup.
        self.session.cookies.set_policy(http.cookiejar.DefaultCookiePolicy(allowed_domains=[]))
        self.proxies = ProxyRules.from_settings(settings.proxy, environ)
        self.stats = Stats()
        self._lock = threading.Lock()
        self._trust = _trust_bundle(settings.ca_file) if settings.ca_file else True
        self._host_trust: dict[str, bool | str] = {}   # netloc -> verify, from hosts.toml
        self._host_trust_source: dict[str, tuple] = {}
        adapter = _Adapter(self._trust, self.policy, pool_connections=pool_size,
                           pool_maxsize=pool_size, max_retries=0)
        self.session.mount("https://", adapter)
        self.session.mount("http://", adapter)

    def is_insecure(self, netloc: str) -> bool:
        return netloc.lower() in self.settings.insecure_hosts

    def verify_for(self, netloc: str):
        trust = self._host_trust.get(netloc.lower())
        if trust is not None:
            return trust
        return False if self.is_insecure(netloc) else self._trust

    def trust_host(self, netloc: str, ca_files: tuple[str, ...] = (),
                   skip_verify: bool = False) -> None:
        """TLS verification for one host as a hosts.toml sets it: not at all (skip_verify), or
        with its `ca` files trusted besides the usual CAs. Only that host is affected."""
        wanted = (tuple(ca_files), bool(skip_verify))
        with self._lock:
            if self._host_trust_source.get(netloc.lower()) == wanted:
                return
            self._host_trust_source[netloc.lower()] = wanted
            if skip_verify:
                self._host_trust[netloc.lower()] = False
            elif ca_files:
                self._host_trust[netloc.lower()] = _trust_bundle(self.settings.ca_file, *ca_files)
            else:
                self._host_trust.pop(netloc.lower(), None)

    def get(self, url: str, *, headers: dict | None = None, deadline: float | None = None,
            max_bytes: int, method: str = "GET", data: dict | None = None) -> Response:
        """Send a request and read at most `max_bytes` of body (ResponseTooLarge past that).

        The whole exchange, redirects included, ends by `deadline` (DeadlineExceeded); without
        one, after UNBOUNDED_REQUEST_READS per-read timeouts. Redirects are followed by hand:
        each target passes the host policy, https is never left for http (unless the target is
        in insecure_hosts), and no credential header or request body goes to another host.
        """
        if deadline is None:
            deadline = time.monotonic() + UNBOUNDED_REQUEST_READS * self.settings.timeout_seconds
        headers = dict(headers or {})
        for _ in range(MAX_REDIRECTS + 1):
            netloc = _authority(url)
            self.policy.check(netloc, deadline)
            response = self._send(method, url, headers, deadline, max_bytes, data)
            if response.status not in (301, 302, 303, 307, 308) or "location" not in response.headers:
                return response
            try:
                target = urljoin(url, response.headers["location"])
                urlsplit(target).port   # noqa: B018 - raises ValueError on a malformed authority
            except ValueError:
                raise TransportError(f"{netloc} redirected to an unusable Location "
                                     f"{response.headers['location'][:100]!r}", host=netloc,
                                     status=response.status) from None
            step = redirect_step(url, target, response.status, method, data is not None,
                                 self.is_insecure(_authority(target)))
            if isinstance(step, str):
                raise TransportError(f"{netloc} redirected to {_safe_url(target)}: not followed, "
                                     f"{step}", host=netloc, status=response.status)
            method, keep_body, same_origin = step
            data = data if keep_body else None
            if not same_origin:
                headers = {k: v for k, v in headers.items() if k.lower() not in CREDENTIAL_HEADERS}
            url = target
        raise TransportError(f"more than {MAX_REDIRECTS} redirects from {_safe_url(url)}",
                             host=netloc)

    def _send(self, method, url, headers, deadline, max_bytes, data=None) -> Response:
        try:
            response = self._exchange(method, url, headers, deadline, max_bytes, data)
        except ArchwayError as e:
            _count_request(method, classify_error(e).label)
            raise
        _count_request(method, request_outcome(response.status))
        return response

    def _exchange(self, method, url, headers, deadline, max_bytes, data=None) -> Response:
        netloc = _authority(url)
        timeout = self._timeout(deadline, netloc)
        with self._lock:
            self.stats.requests += 1
        proxies = self.proxies.for_url(url)
        try:
            with _sockets_end_at(deadline), self.session.request(
                    method, url, headers=headers, data=data, timeout=timeout, stream=True,
                    allow_redirects=False, verify=self.verify_for(netloc),
                    proxies=proxies) as r:
                declared = r.headers.get("content-length", "")
                if declared.isdigit() and int(declared) > max_bytes and r.status_code < 300:
                    raise ResponseTooLarge(
                        f"{_safe_url(url)} declares {declared} bytes, more than the {max_bytes} "
                        f"archway reads",
                        host=netloc, status=r.status_code)
                body = self._read_bounded(r, url, netloc, deadline, max_bytes)
                return Response(r.status_code, r.headers, body, url)
        except (requests.exceptions.RequestException, urllib3.exceptions.HTTPError, OSError) as e:
            if time.monotonic() >= deadline:   # the watchdog cut it, or a read timed out at it
                raise DeadlineExceeded(f"deadline passed waiting for {netloc}") from None
            raise _transport_error(e, netloc, timeout[1], next(iter(proxies.values()), None)
                                   ) from None
        except ValueError as e:   # e.g. requests parsing a malformed Location for its own use
            raise TransportError(f"{netloc} answered something archway cannot use: "
                                 f"{str(e)[:100]}", host=netloc) from None

    def _read_bounded(self, r, url, netloc, deadline, max_bytes) -> bytes:
        chunks, size = [], 0
        for chunk in r.iter_content(_CHUNK):
            size += len(chunk)
            if size > max_bytes:
                raise ResponseTooLarge(f"{_safe_url(url)} sent more than the {max_bytes} bytes "
                                       f"archway reads",
                                       host=netloc, status=r.status_code)
            if time.monotonic() >= deadline:
                raise DeadlineExceeded(f"deadline passed reading from {netloc}")
            chunks.append(chunk)
        with self._lock:
            self.stats.bytes_read += size
        return b"".join(chunks)

    def _timeout(self, deadline: float, netloc: str) -> tuple[float, float]:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise DeadlineExceeded(f"deadline passed before contacting {netloc}")
        limit = min(self.settings.timeout_seconds, remaining)
        return (limit, limit)


def _transport_error(error: Exception, netloc: str, read_timeout: float,
                     proxy: str | None = None) -> TransportError:
    if proxy is not None and isinstance(error, requests.exceptions.ProxyError):
        return _proxy_failed(error, netloc, proxy)
    if isinstance(error, requests.exceptions.SSLError):
        return TransportError(f"TLS error talking to {netloc}: {_reason(error)} (set "
                              f"registry.ca_file, or list the host in registry.insecure_hosts)",
                              host=netloc)
    if isinstance(error, requests.exceptions.Timeout):
        return TransportError(f"{netloc} did not answer within {read_timeout:.1f} s", host=netloc)
    return TransportError(f"cannot reach {netloc}: {_reason(error)}", host=netloc)


def _proxy_failed(error: Exception, netloc: str, proxy: str) -> ProxyFailed:
    """Said of the proxy, not of the registry it was asked to reach."""
    shown = _safe_url(proxy)
    cause = error.args[0] if error.args else error
    cause = getattr(cause, "reason", None) or cause      # MaxRetryError -> urllib3's ProxyError
    inner = cause.args[1] if isinstance(cause, urllib3.exceptions.ProxyError) \
        and len(cause.args) > 1 else cause
    if str(inner).startswith("Tunnel connection failed: "):   # the proxy answered CONNECT
        answer = str(inner).split(": ", 1)[1][:100]
        return ProxyFailed(f"the egress proxy {shown} could not reach {netloc}: {answer}",
                           host=netloc)
    return ProxyFailed(f"cannot reach the egress proxy {shown} (for {netloc}): {_reason(error)}",
                       host=netloc)


# --- redirects: a pure decision ------------------------------------------------------------------

def redirect_step(url: str, target: str, status: int, method: str, has_body: bool,
                  target_insecure: bool) -> tuple[str, bool, bool] | str:
    """How to follow a redirect from `url` to `target`: (method, keep the body, same origin),
    or why it must not be followed.

    303, and 301/302 after a POST, become a GET without body (as browsers and requests do);
    307/308 repeat the request as it was, so one that carries a body (a token form with a
    password or refresh token) is followed only to the same origin. Leaving https for http
    would put credentials and the manifest in cleartext: only for a host in insecure_hosts.
    """
    source, dest = urlsplit(url), urlsplit(target)
    if dest.scheme not in ("http", "https") or not dest.netloc:
        return "the target is not an http(s) URL"
    if source.scheme == "https" and dest.scheme == "http" and not target_insecure:
        return "it leaves https for plain http (list the target in registry.insecure_hosts to allow it)"
    if status == 303 or (status in (301, 302) and method == "POST"):
        method, has_body = ("HEAD" if method == "HEAD" else "GET"), False
    same = _origin(source) == _origin(dest)
    if has_body and not same:
        return "it would send the request body (which can hold a credential) to another host"
    return method, has_body, same


def _origin(parts: SplitResult) -> tuple[str, str, int | None]:
    try:
        port = parts.port or {"https": 443, "http": 80}.get(parts.scheme)
    except ValueError:
        port = None
    return parts.scheme, (parts.hostname or "").lower(), port


def _authority(url: str) -> str:
    """host[:port] of a URL, without the user:password it may carry (which must never reach a
    message, a log line or an error's host)."""
    return without_userinfo(urlsplit(url).netloc)


def _safe_url(url: str) -> str:
    """A URL fit for a message: no user:password, no query (it can carry a token)."""
    parts = urlsplit(url)
    try:
        port = parts.port or None
    except ValueError:
        port = None
    return f"{parts.scheme}://{join_host_port(parts.hostname or '', port)}{parts.path}"[:300]


# --- the deadline on the socket ------------------------------------------------------------------

class _Watchdog:
    """Shuts sockets down at their deadline, from one thread for the whole process.

    A watched socket is a dup of the connection's descriptor: shutting it down ends the TCP
    connection the request is blocked on, and holding it means a descriptor number freed and
    reused meanwhile can never be hit. Cost per request: a dup, a heap push, a close.
    """

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._heap: list[tuple[float, int]] = []
        self._watched: dict[int, socket.socket] = {}
        self._ids = itertools.count()
        self._pid = 0

    def watch(self, sock: socket.socket, deadline: float) -> int:
        dup = socket.socket(fileno=os.dup(sock.fileno()))
        with self._cond:
            if self._pid != os.getpid():   # first use, or a forked worker: the thread is not here
                self._pid, self._heap, self._watched = os.getpid(), [], {}
                threading.Thread(target=self._run, name="archway-deadlines", daemon=True).start()
            ticket = next(self._ids)
            self._watched[ticket] = dup
            if len(self._heap) > 2 * len(self._watched) + 1024:   # mostly released entries
                self._heap = [entry for entry in self._heap if entry[1] in self._watched]
                heapq.heapify(self._heap)
            heapq.heappush(self._heap, (deadline, ticket))
            if self._heap[0][1] == ticket:
                self._cond.notify()
        return ticket

    def release(self, ticket: int) -> None:
        with self._cond:
            dup = self._watched.pop(ticket, None)
        if dup is not None:
            dup.close()

    def _run(self) -> None:
        while True:
            with self._cond:
                while self._heap and self._heap[0][1] not in self._watched:
                    heapq.heappop(self._heap)   # released before its deadline
                if not self._heap:
                    self._cond.wait()
                    continue
                deadline, ticket = self._heap[0]
                if deadline > time.monotonic():
                    self._cond.wait(deadline - time.monotonic())
                    continue
                heapq.heappop(self._heap)
                dup = self._watched.pop(ticket)
            try:
                dup.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass   # already closed by the peer
            dup.close()


_WATCHDOG = _Watchdog()
_current = threading.local()   # the deadline of the request this thread is making, and its tickets


class _sockets_end_at:
    """Within it, every socket this thread's request connects or reuses is shut at `deadline`."""

    def __init__(self, deadline: float) -> None:
        self.deadline = deadline

    def __enter__(self) -> None:
        _current.deadline, _current.tickets = self.deadline, []

    def __exit__(self, *exc) -> None:
        tickets, _current.deadline, _current.tickets = _current.tickets, None, []
        for ticket in tickets:
            _WATCHDOG.release(ticket)


def _watch_current(sock: socket.socket | None) -> None:
    deadline = getattr(_current, "deadline", None)
    if sock is not None and deadline is not None:
        _current.tickets.append(_WATCHDOG.watch(sock, deadline))


class _Adapter(HTTPAdapter):
    """Connections that check where they landed, and share one SSLContext.

    Every new socket's peer address passes the host policy again, so DNS answering differently
    at connect time than at check time cannot reach a metadata address. Every verified TLS
    connection shares one SSLContext: left alone, requests/urllib3 build a context per
    connection and load the whole CA bundle into it, about 0.7 MB per pooled connection.
    Unverified connections (insecure_hosts) keep urllib3's own per-connection context, so the
    shared one is never switched to CERT_NONE."""

    def __init__(self, trust, policy: HostPolicy, **kwargs):
        self._trust = trust
        self._contexts = {trust: _verifying_context(trust)}   # trust bundle -> its SSLContext
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
                self._contexts[key] = _verifying_context(key)
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
            sock = self._connect_by(getattr(_current, "deadline", None))
            try:
                policy.check_peer(sock.getpeername()[0], join_host_port(self.host, self.port))
            except HostRefused:
                sock.close()
                raise
            _watch_current(sock)   # from here on (TLS handshake included) the deadline holds
            return sock

        def request(self, *args, **kwargs):
            _watch_current(self.sock)   # a pooled connection, reused: None when not yet open
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


def _verifying_context(trust):
    """A client context trusting `trust` (True: certifi's public CAs; else a bundle path)."""
    context = create_urllib3_context(cert_reqs=ssl.CERT_REQUIRED)
    context.load_verify_locations(certifi.where() if trust is True else trust)
    return context


MAX_CA_FILE_BYTES = 4 * 1024 * 1024


def read_ca_file(ca_file: str, what: str = "registry.ca_file") -> bytes:
    """The PEM certificates of a CA file; ConfigError naming `what` when unusable."""
    try:
        with open(os.path.expanduser(ca_file), "rb") as f:
            pem = f.read(MAX_CA_FILE_BYTES)
    except OSError as e:
        raise ConfigError(f"cannot read {what} {ca_file}: {e.strerror}") from None
    if b"-----BEGIN CERTIFICATE-----" not in pem:
        raise ConfigError(f"{what} {ca_file} holds no PEM certificate")
    return pem


def _trust_bundle(ca_file: str | None, *more_ca_files: str) -> str:
    """The public CAs plus the extra ones: requests takes one bundle path, and an extra CA must
    add to the system's trust, not replace it. registry.ca_file first, then hosts.toml `ca`s."""
    extra = [read_ca_file(ca_file)] if ca_file else []
    extra += [read_ca_file(f, "hosts.toml ca") for f in more_ca_files]
    with open(certifi.where(), "rb") as f:
        public = f.read()
    bundle = tempfile.NamedTemporaryFile(prefix="archway-ca-", suffix=".pem", delete=False)
    with bundle:
        bundle.write(b"\n".join([public, *extra]))
    atexit.register(_remove_if_mine, bundle.name, os.getpid())
    return bundle.name


def _remove_if_mine(path: str, creator_pid: int) -> None:
    """Forked children inherit atexit hooks: only the process that made the file removes it."""
    if os.getpid() == creator_pid:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass


def request_outcome(status: int) -> str:
    """The outcome label of an answered request: its status class, 429 on its own."""
    return "429" if status == 429 else f"{status // 100}xx"


def _count_request(method: str, outcome: str) -> None:
    # Imported on first use: only the serving processes record metrics (see archway.metrics).
    from archway import metrics
    metrics.REGISTRY_REQUESTS.labels(method, outcome).inc()


def parse_retry_after(value: str | None, now: float | None = None) -> float | None:
    """Seconds to wait from a Retry-After value: delta-seconds or an HTTP-date (RFC 9110 10.2.3),
    at most MAX_RETRY_AFTER_SECONDS; None when absent or unreadable. `now` is Unix time (the
    HTTP-date is wall-clock)."""
    text = (value or "").strip()
    if not text:
        return None
    if text.isdigit():
        seconds = float(text[:12])
    else:
        try:
            when = email.utils.parsedate_to_datetime(text)
        except (TypeError, ValueError, IndexError):
            return None
        if when.tzinfo is None:
            return None   # an HTTP-date is always GMT; a date without a zone is not one
        seconds = when.timestamp() - (time.time() if now is None else now)
    return min(max(seconds, 0.0), MAX_RETRY_AFTER_SECONDS)


def rate_limited(response: Response, where: str, **kw) -> RateLimited:
    """The typed error of a 429 answer, with the wait its Retry-After asks for."""
    retry_after = parse_retry_after(response.headers.get("Retry-After"))
    when = f"retry after {retry_after:g} s" if retry_after is not None else "try again later"
    return RateLimited(f"{where}: rate limited; {when}, or use credentials with a higher pull "
                       f"limit", retry_after=retry_after, **kw)


def _reason(error: Exception) -> str:
    """A one-line cause from a requests/urllib3 error chain, without the noise."""
    cause = error.args[0] if error.args else error
    cause = getattr(cause, "reason", None) or cause  # urllib3's MaxRetryError wraps the cause
    text = str(cause)
    for known, short in (("Failed to resolve", "the host name does not resolve"),
                         ("Name or service not known", "the host name does not resolve"),
                         ("Connection refused", "connection refused"),
                         ("CERTIFICATE_VERIFY_FAILED", "certificate verify failed"),
                         ("WRONG_VERSION_NUMBER", "the server does not speak TLS"),
                         ("RemoteDisconnected", "the server closed the connection")):
        if known in text:
            return short
    return text.split(": ", 1)[-1].strip("()'\" ")[:200]

