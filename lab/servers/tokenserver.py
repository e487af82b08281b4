"""A token server of the distribution token auth spec, for the registry (registry.py) to trust:
it checks Basic credentials, an identity (refresh) token or a password grant, issues RS256 JWTs
with pull (and push for known users) and records every request it answered.

    tokens = TokenServer(directory, {"alice": "pw"}, anonymous_pull=True)
    tokens.realm, tokens.cert_path       # what the registry's auth.token configuration names
    tokens.count(); tokens.requests      # [TokenRequest(method, params, authorization, user)]
"""
import base64
import json
import threading
import time
import uuid
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler
from urllib.parse import parse_qs, urlsplit

from lab.httpd import BackgroundHTTPServer
from lab.servers.jws import jwt
from lab.tls import IssuedCert, self_signed

SERVICE = "archway-test-registry"
ISSUER = "archway-test-token-issuer"
DEFAULT_USERS = {"alice": "wonderland-7"}


@dataclass
class TokenRequest:
    method: str
    params: dict            # query (GET) or form (POST), single values
    authorization: str | None   # the raw Authorization header (None when absent)
    user: str | None        # the user whose Basic credentials or refresh token were accepted


class TokenServer:
    """Issues RS256 JWTs the registry trusts (header `x5c` = the signing certificate).

    It checks Basic credentials (or an identity/refresh token via POST, per the distribution
    token spec), grants pull+push to known users and, when `anonymous_pull`, pull to anyone.
    Wrong credentials get 401. Every request is recorded in `.requests`.
    """

    def __init__(self, directory, users=None, *, anonymous_pull: bool = False,
                 expires_in: int | None = 300, tls: IssuedCert | None = None,
                 refresh_tokens: dict | None = None, realm_host: str = "127.0.0.1"):
        self.realm_host = realm_host   # "localhost" puts the realm on another host than 127.0.0.1
        self.users = dict(DEFAULT_USERS if users is None else users)
        self.anonymous_pull = anonymous_pull
        self.expires_in = expires_in
        self.refresh_tokens = dict(refresh_tokens or {})   # identity token -> user
        self.signing = self_signed(directory, "token-signing", key_kind="rsa")
        self.requests: list[TokenRequest] = []
        self._lock = threading.Lock()
        self.scheme = "http" if tls is None else "https"
        handler = type("Handler", (TokenRequestHandler,), {"tokens": self})
        self._server = BackgroundHTTPServer(handler, tls=tls)
        self.port = self._server.port

    @property
    def host(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def realm(self) -> str:
        return f"{self.scheme}://{self.realm_host}:{self.port}/token"

    @property
    def cert_path(self) -> str:
        return self.signing.cert_path

    def count(self) -> int:
        with self._lock:
            return len(self.requests)

    def clear(self) -> None:
        with self._lock:
            self.requests.clear()

    def mint(self, subject: str, access: list[dict], expires_in: int = 600) -> str:
        """A signed token; tests use it to push without going through the counted endpoint."""
        now = int(time.time())
        return jwt(self.signing, {"iss": ISSUER, "sub": subject, "aud": SERVICE,
                                  "exp": now + expires_in, "nbf": now - 10, "iat": now,
                                  "jti": uuid.uuid4().hex, "access": access})

    def stop(self) -> None:
        self._server.stop()

    # -- request handling
    def _authenticate(self, authorization: str | None, params: dict) -> tuple[str | None, bool]:
        """(user, rejected): rejected when credentials were offered and are wrong."""
        if params.get("grant_type") == "refresh_token":
            user = self.refresh_tokens.get(params.get("refresh_token", ""))
            return user, user is None
        if params.get("grant_type") == "password":
            user = params.get("username", "")
            ok = self.users.get(user) == params.get("password") and user in self.users
            return (user if ok else None), not ok
        if not authorization:
            return None, False
        scheme, _, value = authorization.partition(" ")
        if scheme.lower() != "basic":
            return None, True
        try:
            user, _, password = base64.b64decode(value).decode().partition(":")
        except Exception:
            return None, True
        ok = user in self.users and self.users[user] == password
        return (user if ok else None), not ok

    def _grant(self, user: str | None, scopes: list[str]) -> list[dict]:
        access = []
        for scope in scopes:
            kind, _, rest = scope.partition(":")
            name, _, actions = rest.rpartition(":")
            if kind != "repository" or not name:
                continue
            wanted = set(actions.split(","))
            allowed = {"pull", "push"} if user else ({"pull"} if self.anonymous_pull else set())
            granted = sorted(wanted & allowed)
            if granted:
                access.append({"type": "repository", "name": name, "actions": granted})
        return access

    def answer(self, method: str, authorization: str | None, params: dict) -> tuple[int, dict]:
        """(HTTP status, JSON body) of one request to the token endpoint."""
        user, rejected = self._authenticate(authorization, params)
        with self._lock:
            self.requests.append(TokenRequest(method, params, authorization, user))
        if rejected:
            return 401, {"errors": [{"code": "UNAUTHORIZED", "message": "bad credentials"}]}
        if params.get("service") != SERVICE:
            return 400, {"errors": [{"code": "DENIED", "message": "unknown service"}]}
        scopes = params.get("scope", "").split(" ") if params.get("scope") else []
        token = self.mint(user or "", self._grant(user, scopes), self.expires_in or 60)
        body: dict[str, str | int] = {"token": token, "access_token": token,
                "issued_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
        if self.expires_in is not None:
            body["expires_in"] = self.expires_in
        if params.get("offline_token") == "true" and user:
            refresh = uuid.uuid4().hex
            self.refresh_tokens[refresh] = user
            body["refresh_token"] = refresh
        return 200, body


class TokenRequestHandler(BaseHTTPRequestHandler):
    """One request to `tokens` (a TokenServer: each server serves a subclass naming itself)."""
    tokens: TokenServer

    def log_message(self, *args):  # keep test output quiet
        pass

    def _reply(self, status, body):
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        parts = urlsplit(self.path)
        params = {}
        for key, values in parse_qs(parts.query).items():
            # several scope= parameters are allowed: join them like one space list
            params[key] = " ".join(values) if key == "scope" else values[0]
        self._reply(*self.tokens.answer("GET", self.headers.get("Authorization"), params))

    def do_POST(self):
        length = int(self.headers.get("Content-Length") or 0)
        form = {k: v[0] for k, v in parse_qs(self.rfile.read(length).decode()).items()}
        self._reply(*self.tokens.answer("POST", self.headers.get("Authorization"), form))
