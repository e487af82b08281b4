"""The one place archway talks HTTP to registries and file servers.

Every request here is checked against the host policy (redirect targets too), bounded in time
by both the per-read timeout and the caller's deadline, and bounded in size: a peer can neither
hang archway nor make it buffer an unbounded body.

The deadline is enforced on the socket (registry.deadlines), the connections check where they
landed (registry.connections), redirects are a pure decision (registry.redirects) and trust is
one CA bundle per set of CA files (registry.trust): this module puts them together.
"""
import email.utils
import http.client
import http.cookiejar
import json
import threading
import time
from dataclasses import dataclass
from typing import Any
from urllib.parse import urljoin, urlsplit

import requests
import urllib3
from requests.structures import CaseInsensitiveDict

from archway.config import RegistrySettings
from archway.errors import (
    ArchwayError,
    DeadlineExceeded,
    ProxyFailed,
    RateLimited,
    ResponseTooLarge,
    TransportError,
    classify_error,
)
from archway.vocabulary import USER_AGENT

from .connections import CheckedAdapter
from .deadlines import sockets_end_at
from .hostpolicy import ClusterAddresses, HostPolicy, parse_networks
from .proxy import ProxyRules
from .redirects import authority, redirect_step, safe_url
from .trust import trust_bundle

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
                 pool_size: int = 32, environ=None, *, refuse_cluster: bool = True):
        """`refuse_cluster=False`: the cluster's own addresses are not refused (a peer the
        operator configured, the operator's own `archway inspect`; see registry.hostpolicy)."""
        self.settings = settings
        self.proxies = ProxyRules.from_settings(settings.proxy, environ)
        self.policy = policy or HostPolicy(
            settings.allow_hosts, settings.deny_hosts,
            named_hosts=settings.insecure_hosts + self.proxies.netlocs(),
            cluster=ClusterAddresses(parse_networks(settings.service_cidrs, "registry.service_cidrs"))
            if refuse_cluster else None)
        self.session = requests.Session()
        # No CA bundle from the environment overriding config; proxies come from ProxyRules.
        self.session.trust_env = False
        self.session.headers["User-Agent"] = USER_AGENT   # not python-requests'
        # No cookies kept: the session serves every pod, and a cookie a token service set for
        # one pod's credentials must not authenticate another pod's lookup.
        self.session.cookies.set_policy(http.cookiejar.DefaultCookiePolicy(allowed_domains=[]))
        self.stats = Stats()
        self._lock = threading.Lock()
        self._trust = trust_bundle(settings.ca_file) if settings.ca_file else True
        self._host_trust: dict[str, bool | str] = {}   # netloc -> verify, from hosts.toml
        self._host_trust_source: dict[str, tuple] = {}
        adapter = CheckedAdapter(self._trust, self.policy, pool_connections=pool_size,
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
                self._host_trust[netloc.lower()] = trust_bundle(self.settings.ca_file, *ca_files)
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
            netloc = authority(url)
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
                                 self.is_insecure(authority(target)))
            if isinstance(step, str):
                raise TransportError(f"{netloc} redirected to {safe_url(target)}: not followed, "
                                     f"{step}", host=netloc, status=response.status)
            method, keep_body, same_origin = step
            data = data if keep_body else None
            if not same_origin:
                headers = {k: v for k, v in headers.items() if k.lower() not in CREDENTIAL_HEADERS}
            url = target
        raise TransportError(f"more than {MAX_REDIRECTS} redirects from {safe_url(url)}",
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
        # A peer (a proxy, a load balancer) may close a kept-alive connection just as it is
        # reused: the request then dies unanswered. An idempotent one is sent once more, on a
        # new connection, as browsers and Go's HTTP client do.
        try:
            return self._exchange_once(method, url, headers, deadline, max_bytes, data)
        except _Unanswered as e:
            if method not in ("GET", "HEAD") or time.monotonic() >= deadline:
                raise e.error from None
            return self._exchange_once(method, url, headers, deadline, max_bytes, data,
                                       last_try=True)

    def _exchange_once(self, method, url, headers, deadline, max_bytes, data=None, *,
                       last_try: bool = False) -> Response:
        netloc = authority(url)
        timeout = self._timeout(deadline, netloc)
        with self._lock:
            self.stats.requests += 1
        proxies = self.proxies.for_url(url)
        answered = False
        try:
            with sockets_end_at(deadline), self.session.request(
                    method, url, headers=headers, data=data, timeout=timeout, stream=True,
                    allow_redirects=False, verify=self.verify_for(netloc),
                    proxies=proxies) as r:
                answered = True
                declared = r.headers.get("content-length", "")
                if declared.isdigit() and int(declared) > max_bytes and r.status_code < 300:
                    raise ResponseTooLarge(
                        f"{safe_url(url)} declares {declared} bytes, more than the {max_bytes} "
                        f"archway reads",
                        host=netloc, status=r.status_code)
                body = self._read_bounded(r, url, netloc, deadline, max_bytes)
                return Response(r.status_code, r.headers, body, url)
        except (requests.exceptions.RequestException, urllib3.exceptions.HTTPError, OSError) as e:
            if time.monotonic() >= deadline:   # the watchdog cut it, or a read timed out at it
                raise DeadlineExceeded(f"deadline passed waiting for {netloc}") from None
            error = _transport_error(e, netloc, timeout[1], next(iter(proxies.values()), None))
            if not answered and not last_try and _closed_unanswered(e):
                raise _Unanswered(error) from None
            raise error from None
        except ValueError as e:   # e.g. requests parsing a malformed Location for its own use
            raise TransportError(f"{netloc} answered something archway cannot use: "
                                 f"{str(e)[:100]}", host=netloc) from None

    def _read_bounded(self, r, url, netloc, deadline, max_bytes) -> bytes:
        chunks, size = [], 0
        for chunk in r.iter_content(_CHUNK):
            size += len(chunk)
            if size > max_bytes:
                raise ResponseTooLarge(f"{safe_url(url)} sent more than the {max_bytes} bytes "
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


class _Unanswered(Exception):
    """The connection closed before any answer came: `error` is what to say if it stays so."""

    def __init__(self, error: TransportError):
        super().__init__(str(error))
        self.error = error


def _closed_unanswered(error: BaseException) -> bool:
    """Did the peer close (or reset) the connection before sending a status line?"""
    seen: BaseException | None = error
    for _ in range(8):   # requests -> urllib3 -> http.client, as deep as they wrap
        if seen is None:
            return False
        if isinstance(seen, (http.client.RemoteDisconnected, ConnectionResetError, BrokenPipeError)):
            return True
        following = getattr(seen, "reason", None) or (seen.args[-1] if seen.args else None)
        seen = following if isinstance(following, BaseException) else seen.__context__
    return False


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
    shown = safe_url(proxy)
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

