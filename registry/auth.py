"""Registry authentication: WWW-Authenticate challenges, bearer tokens, and where credentials may go.

Flow (distribution token spec): a request answered 401 carries a challenge. `Basic` -> send the
host's credential. `Bearer realm=...,service=...,scope=...` -> get a token from the realm
(anonymously, or with the credential that belongs to the realm's host) and retry. Tokens are
cached per (realm, service, scope, credential) until shortly before `expires_in`.

A host's challenge is remembered, so that later repositories get their token up front instead of
paying a 401 round trip, only once a token from it was accepted by the registry (any answer but
401), and for CHALLENGE_SECONDS after that. A challenge one repository's 401 names is used for
that repository alone until then: a realm that hangs, answers 10 MB or refuses cannot become the
host's, and a remembered realm that fails up front costs the lookup only its anonymous first
request, whose 401 names the repository's own challenge (issue 21).
"""
import re
import threading
import time
from dataclasses import dataclass
from urllib.parse import SplitResult, urlencode, urlsplit

from archway.errors import (
    ArchwayError,
    AuthError,
    CredentialsRequired,
    DeadlineExceeded,
    RegistryError,
    ResponseTooLarge,
    classify_error,
)
from archway.hostport import host_of

from .credentials import Credential, Keyring
from .http import HttpClient, Response, parse_json, rate_limited
from .imageref import DOCKER_HUB, ImageReference

MAX_TOKEN_RESPONSE_BYTES = 64 * 1024
CHALLENGE_SECONDS = 600          # a host's challenge, since its last accepted token
MAX_REMEMBERED_HOSTS = 10_000
DEFAULT_EXPIRES_IN = 60          # seconds, per the token spec when the answer names none
MAX_EXPIRES_IN = 24 * 3600       # a lying server cannot pin a token in the cache for years
# Docker Hub serves tokens from another host than its registry; its credentials belong there too.
DOCKER_HUB_TOKEN_HOSTS = {"auth.docker.io"}


@dataclass(frozen=True)
class Challenge:
    scheme: str          # lower case: "bearer" or "basic" (others are ignored)
    params: dict         # lower-case keys: realm, service, scope, error, ...

    @property
    def realm(self) -> str:
        return self.params.get("realm", "")


_PARAM = re.compile(r'([!#$%&\'*+.^_`|~0-9A-Za-z-]+)[ \t]*=[ \t]*("(?:[^"\\]|\\.)*"|[^\s,]*)')
_SCHEME = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+")


def parse_www_authenticate(header: str) -> list[Challenge]:
    """Parse a WWW-Authenticate value into its challenges (RFC 7235; quoted commas are fine).

    `name=value` continues the current challenge; a bare token starts the next one. What cannot
    be parsed ends the parse: an odd header must end in a clear auth error later, not a crash.
    """
    challenges: list[Challenge] = []
    text, pos = header or "", 0
    while pos < len(text):
        if text[pos] in ", \t":
            pos += 1
            continue
        param = _PARAM.match(text, pos)
        if param and challenges:
            value = param.group(2)
            if value.startswith('"'):
                value = re.sub(r"\\(.)", r"\1", value[1:-1])
            challenges[-1].params[param.group(1).lower()] = value
            pos = param.end()
            continue
        scheme = _SCHEME.match(text, pos)
        if not scheme:
            break
        challenges.append(Challenge(scheme.group(0).lower(), {}))
        pos = scheme.end()
    return challenges


def pick_challenge(challenges: list[Challenge]) -> Challenge | None:
    """Bearer when offered (it keeps passwords away from the registry), else Basic."""
    for wanted in ("bearer", "basic"):
        for challenge in challenges:
            if challenge.scheme == wanted and (wanted == "basic" or challenge.realm):
                return challenge
    return None


def credential_for_realm(keyring: Keyring, ref: ImageReference, realm_netloc: str
                         ) -> Credential | None:
    """Which credential, if any, may be sent to a token realm.

    A credential belongs to the host it names. The realm may receive the registry's credential
    only when it is on the same machine (same host name, any port); a realm elsewhere gets only
    a credential that names the realm's own host. Docker Hub's auth.docker.io is Hub's own token
    service and is treated as part of Hub.
    """
    own = keyring.lookup(realm_netloc) or keyring.lookup(host_of(realm_netloc))
    if own is not None:
        return own
    realm_host = host_of(realm_netloc)
    if realm_host == host_of(ref.api_host) or realm_host == host_of(ref.host):
        return keyring.lookup(ref.host)
    if ref.host == DOCKER_HUB and realm_host in DOCKER_HUB_TOKEN_HOSTS:
        return keyring.lookup(ref.host)
    return None


def realm_parts(realm: str, ref: ImageReference) -> SplitResult:
    """The parts of a challenge's token realm: an http(s) URL with a host, else AuthError (a
    registry's typed failure, cached like any other, never an internal error)."""
    try:
        parts = urlsplit(realm)
        parts.port   # noqa: B018 - raises ValueError on a malformed host or port
    except ValueError:
        parts = None
    if parts is None or parts.scheme not in ("https", "http") or not parts.hostname:
        raise AuthError(f"{ref.api_host} named an unusable token realm {realm[:200]!r}",
                        host=ref.api_host, repository=ref.repository, status=401)
    return parts


def token_lifetime(answer: dict) -> float:
    value = answer.get("expires_in", DEFAULT_EXPIRES_IN)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        value = DEFAULT_EXPIRES_IN
    return float(min(value, MAX_EXPIRES_IN))


def cache_until(now: float, lifetime: float) -> float:
    """Stop using a token a little before it expires, so it cannot expire in flight."""
    margin = min(10.0, lifetime / 4)
    return now + lifetime - margin


def token_request(realm: str, parts: SplitResult, service: str, scope: str,
                  credential: Credential | None) -> tuple[str, dict, dict | None]:
    """(URL, headers, form) of a token request to `realm`: a GET with the credential as Basic
    auth, or for an identity token (an OAuth2 refresh token, distribution's token spec) a form
    POST, never Basic auth."""
    query = {k: v for k, v in (("service", service), ("scope", scope)) if v}
    if credential is not None and credential.identity_token and not credential.password:
        form = {**query, "grant_type": "refresh_token", "client_id": "archway",
                "refresh_token": credential.identity_token}
        return realm, {}, form
    headers = {}
    if credential is not None and (credential.username or credential.password):
        headers["Authorization"] = credential.basic_header()
    return realm + ("&" if parts.query else "?") + urlencode(query), headers, None


def token_service(token_host: str, ref: ImageReference) -> str:
    return f"token service {token_host} (for {ref.api_host}/{ref.repository})"


def token_answer(response: Response, ref: ImageReference, token_host: str, *, sent: bool
                 ) -> tuple[str, float]:
    """(token, lifetime) from the answer of the token service on `token_host`; the typed error
    of any other answer. `sent`: whether the request carried a credential."""
    where = token_service(token_host, ref)
    if response.status in (401, 403):
        detail = ("the credentials for this host were rejected" if sent
                  else "no pull secret matched this host and anonymous access was refused")
        refused = AuthError if sent else CredentialsRequired
        raise refused(f"{response.status} from {ref.api_host} for {ref.repository}: {detail} "
                      f"(by its token service {token_host})",
                      host=ref.api_host, repository=ref.repository, status=response.status)
    if response.status == 429:
        raise rate_limited(response, where, host=ref.api_host, repository=ref.repository,
                           status=429)
    if response.status != 200:
        raise RegistryError(f"{where} answered HTTP {response.status}",
                            host=ref.api_host, repository=ref.repository, status=response.status)
    answer = parse_json(response.body)
    token = (answer.get("token") or answer.get("access_token")) if isinstance(answer, dict) else None
    if not isinstance(token, str) or not token or any(c in token for c in "\r\n"):
        raise RegistryError(f"{where} answered without a usable token",
                            host=ref.api_host, repository=ref.repository, status=200)
    return token, token_lifetime(answer)


@dataclass
class Authorization:
    header: str | None          # the Authorization header value, None = anonymous
    credential: Credential | None   # the credential the header was built from, if any
    challenge: Challenge | None = None   # the challenge it answers, if any


class RegistryAuth:
    """Authorization headers for registry requests; thread-safe, shared by all resolutions."""

    def __init__(self, http: HttpClient, clock=time.monotonic):
        self.http = http
        self.clock = clock
        self._lock = threading.Lock()
        self._tokens: dict[tuple, tuple[str, float]] = {}  # key -> (token, usable until)
        # registry netloc -> (a challenge whose token it accepted, remembered until)
        self._challenges: dict[str, tuple[Challenge, float]] = {}
        self._fetching: dict[tuple, threading.Lock] = {}   # key -> lock held while fetching

    # -- used by the registry client
    def authorization(self, ref: ImageReference, keyring: Keyring, deadline) -> Authorization:
        """The header to send up front: from the host's remembered challenge, else anonymous
        (also when that challenge's realm fails now: the registry's 401 will say what to do)."""
        with self._lock:
            remembered = self._challenges.get(ref.api_host)
        if remembered is None or remembered[1] <= self.clock():
            return Authorization(None, None)
        try:
            return self._for_challenge(remembered[0], ref, keyring, deadline, scope=None)
        except DeadlineExceeded:
            raise
        except ArchwayError:
            return Authorization(None, None)

    def accepted(self, ref: ImageReference, authz: Authorization) -> None:
        """The registry answered a request carrying `authz` with something else than 401: its
        challenge is the host's, for later repositories."""
        if authz.challenge is None or authz.header is None:
            return
        with self._lock:
            if len(self._challenges) >= MAX_REMEMBERED_HOSTS and ref.api_host not in self._challenges:
                now = self.clock()
                self._challenges = {h: c for h, c in self._challenges.items() if c[1] > now}
                if len(self._challenges) >= MAX_REMEMBERED_HOSTS:
                    return
            self._challenges[ref.api_host] = (authz.challenge, self.clock() + CHALLENGE_SECONDS)

    def answer_challenge(self, ref: ImageReference, header: str, keyring: Keyring, deadline,
                         rejected: Authorization | None = None) -> Authorization:
        """Build the header for a 401's challenge; `rejected` is what the 401 answered."""
        challenge = pick_challenge(parse_www_authenticate(header))
        if challenge is None:
            raise AuthError(f"401 from {ref.api_host} for {ref.repository}: the registry asked for "
                            f"an authentication scheme archway does not speak ({header[:100]!r})",
                            host=ref.api_host, repository=ref.repository, status=401)
        if rejected is not None and rejected.header:
            self._forget(rejected.header)
        return self._for_challenge(challenge, ref, keyring, deadline,
                                   scope=challenge.params.get("scope"))

    # -- internals
    def _for_challenge(self, challenge: Challenge, ref, keyring, deadline, scope) -> Authorization:
        if challenge.scheme == "basic":
            credential = keyring.lookup(ref.host)
            if credential is None or not (credential.username or credential.password):
                return Authorization(None, None)
            return Authorization(credential.basic_header(), credential, challenge)
        scope = scope or f"repository:{ref.repository}:pull"
        realm = realm_parts(challenge.realm, ref)
        credential = credential_for_realm(keyring, ref, realm.netloc)
        if credential is not None and not self._may_send_secret(realm):
            credential = None  # never a password over plain HTTP to a host not marked insecure
        token = self._token(challenge, realm, scope, credential, ref, deadline)
        return Authorization("Bearer " + token, credential, challenge)

    def _may_send_secret(self, realm: SplitResult) -> bool:
        return realm.scheme == "https" or self.http.is_insecure(realm.netloc)

    def _token(self, challenge: Challenge, realm: SplitResult, scope: str, credential, ref,
               deadline) -> str:
        """A token for `scope` from the challenge's realm (`realm`: its parts, parsed once)."""
        service = challenge.params.get("service", "")
        key = (challenge.realm, service, scope, credential.fingerprint() if credential else "")
        token = self._cached(key)
        if token is not None:
            return token
        # One fetch per key at a time: concurrent lookups of one repository share the token.
        with self._lock:
            key_lock = self._fetching.setdefault(key, threading.Lock())
        # Wait for another lookup's fetch of the same token no longer than this one may take.
        wait = -1 if deadline is None else max(0.0, deadline - time.monotonic())
        if not key_lock.acquire(timeout=wait):
            raise DeadlineExceeded(f"deadline passed waiting for a token from {realm.netloc}")
        try:
            token = self._cached(key)
            if token is not None:
                return token
            try:
                try:
                    token, lifetime = self._fetch_token(challenge.realm, realm, service, scope,
                                                        credential, ref, deadline)
                except ArchwayError as e:
                    _count_token(classify_error(e).label)
                    raise
                _count_token("success")
                with self._lock:
                    now = self.clock()
                    self._tokens[key] = (token, cache_until(now, lifetime))
                    if len(self._tokens) > 10_000:  # bounded: keep the live, newest entries
                        live = {k: v for k, v in self._tokens.items() if v[1] > now}
                        self._tokens = dict(list(live.items())[-5_000:])
            finally:
                with self._lock:
                    self._fetching.pop(key, None)
        finally:
            key_lock.release()
        return token

    def _cached(self, key) -> str | None:
        with self._lock:
            cached = self._tokens.get(key)
            return cached[0] if cached and cached[1] > self.clock() else None

    def _fetch_token(self, realm: str, parts: SplitResult, service, scope, credential, ref,
                     deadline) -> tuple[str, float]:
        url, headers, form = token_request(realm, parts, service, scope, credential)
        try:
            response = self.http.get(url, headers=headers, deadline=deadline, data=form,
                                     method="POST" if form else "GET",
                                     max_bytes=MAX_TOKEN_RESPONSE_BYTES)
        except ResponseTooLarge:   # said here: the manifest's own bound must not be blamed
            raise RegistryError(f"{token_service(parts.netloc, ref)} answered more than "
                                f"{MAX_TOKEN_RESPONSE_BYTES} bytes",
                                host=ref.api_host, repository=ref.repository) from None
        return token_answer(response, ref, parts.netloc, sent=bool(headers or form))

    def _forget(self, header: str) -> None:
        """Drop a token the registry just refused (revoked or expired early)."""
        if not header.startswith("Bearer "):
            return
        token = header[len("Bearer "):]
        with self._lock:
            for key in [k for k, v in self._tokens.items() if v[0] == token]:
                del self._tokens[key]


def _count_token(outcome: str) -> None:
    # Imported on first use: only the serving processes record metrics (see archway.metrics).
    from archway import metrics
    metrics.TOKEN_REQUESTS.labels(outcome).inc()
