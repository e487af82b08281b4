"""Registry credentials from Kubernetes pull secrets (dockerconfigjson / legacy dockercfg).

A `Keyring` holds credentials under the keys they were written with (`host[:port][/path]`, globs
allowed in the host) and finds the ones for an image exactly as the kubelet does
(archway.registry.imagematch): most specific key first, every match kept, because the kubelet
tries them in turn until one pull succeeds. Secrets never appear in a repr, a log line or an
error message: errors name the offending key, never its value.
"""
import base64
import hashlib
import hmac
import json
import os
import secrets
from dataclasses import dataclass, field, replace

from archway.errors import ConfigError

from .imagematch import image_matches, registry_key

MAX_CONFIG_BYTES = 1024 * 1024   # a Kubernetes Secret cannot be larger

# Fingerprints are HMACs under a per-process key: stable for cache keys inside this process,
# useless to anyone trying to guess a password from a fingerprint that ended up in a log.
_FINGERPRINT_KEY = secrets.token_bytes(32)



@dataclass(frozen=True)
class Credential:
    registry: str                      # the key it is filed under: host[:port][/path]
    username: str = field(default="", repr=False)
    password: str = field(default="", repr=False)
    identity_token: str = field(default="", repr=False)

    def __repr__(self):
        kinds = [k for k, v in (("password", self.password), ("identitytoken", self.identity_token)) if v]
        return f"Credential(registry={self.registry!r}, user={self.username!r}, has={'+'.join(kinds) or 'nothing'})"

    __str__ = __repr__

    def basic_header(self) -> str:
        raw = f"{self.username}:{self.password}".encode()
        return "Basic " + base64.b64encode(raw).decode()

    def secret_fingerprint(self) -> str:
        """Identity of the secret material alone, whatever key it is filed under."""
        material = "\0".join((self.username, self.password, self.identity_token))
        return hmac.new(_FINGERPRINT_KEY, material.encode(), hashlib.sha256).hexdigest()[:32]

    def fingerprint(self) -> str:
        material = "\0".join((self.registry, self.username, self.password, self.identity_token))
        return hmac.new(_FINGERPRINT_KEY, material.encode(), hashlib.sha256).hexdigest()[:32]


class Keyring:
    """Credentials in the order they were added; immutable once built.

    One Keyring is what the kubelet calls a BasicDockerKeyring (all of a pod's pull secrets go
    into one). `then(other)` is its union keyring: this keyring's matches first, then the
    other's (the pod's secrets before the node's credentials).
    """

    def __init__(self, credentials=(), *, fallback: "Keyring | None" = None):
        self._entries: tuple[Credential, ...] = tuple(
            credentials.values() if isinstance(credentials, dict) else credentials)
        self._fallback = fallback
        # Reverse-sorted keys: `quay.io/team` is tried before `quay.io` (the kubelet's index).
        self._index = sorted({c.registry for c in self._entries}, reverse=True)

    @classmethod
    def empty(cls) -> "Keyring":
        return cls()

    @classmethod
    def from_file(cls, path: str) -> "Keyring":
        try:
            with open(os.path.expanduser(path), "rb") as f:
                data = f.read(MAX_CONFIG_BYTES + 1)
        except OSError as e:
            raise ConfigError(f"cannot read credentials file {path}: {e.strerror}") from None
        return cls.from_dockerconfigjson(data, source=path)

    @classmethod
    def from_dockerconfigjson(cls, data, source: str = "dockerconfigjson") -> "Keyring":
        """Parse `{"auths": {host: {auth | username+password, identitytoken}}}`.

        Also accepts the legacy `.dockercfg` form (the host map without "auths"), which the
        Secret type kubernetes.io/dockercfg carries.
        """
        config = _load(data, source)
        auths = config.get("auths") if "auths" in config else config
        if not isinstance(auths, dict):
            raise ConfigError(f"{source}: 'auths' must be a JSON object mapping hosts to credentials")
        found = [_parse_entry(key, entry, source) for key, entry in auths.items()]
        return cls([c for c in found if c is not None])

    def candidates(self, image: str) -> list[Credential]:
        """Every credential for `image` (a repository name such as `docker.io/library/nginx`),
        in the order the kubelet tries them; the same secret only once."""
        found = [c for key in self._index if image_matches(key, image)
                 for c in self._entries if c.registry == key]
        if self._fallback is not None:
            found += self._fallback.candidates(image)
        seen, unique = set(), []
        for credential in found:
            if credential.secret_fingerprint() not in seen:
                seen.add(credential.secret_fingerprint())
                unique.append(credential)
        return unique

    def lookup(self, host: str) -> Credential | None:
        """The first credential for a registry host[:port] (a key with a path needs an image)."""
        if not host:
            return None
        found = self.candidates(registry_key(host) or host.lower())
        return found[0] if found else None

    def pinned(self, host: str, credential: Credential) -> "Keyring":
        """This keyring with `credential` answering first for `host`: the one being tried."""
        return Keyring([replace(credential, registry=registry_key(host))], fallback=self)

    def merged(self, other: "Keyring | None") -> "Keyring":
        """Both sets of credentials in one keyring, `self`'s first where keys are equal."""
        if other is None:
            return self
        return Keyring(self._all() + other._all())

    def then(self, other: "Keyring | None") -> "Keyring":
        """A union keyring: this keyring's matches, then `other`'s."""
        if other is None or not other:
            return self
        if not self:
            return other
        rest = self._fallback.then(other) if self._fallback is not None else other
        return Keyring(self._entries, fallback=rest)

    def hosts(self) -> list[str]:
        return sorted({c.registry for c in self._all()})

    def fingerprint(self) -> str:
        """Stable (per process) identity of these credentials for cache keys; reveals nothing."""
        return _fingerprint(self._all()) if self else "anonymous"

    def fingerprint_for(self, image: str) -> str:
        """Identity of the credentials `image` would be pulled with; '' when none."""
        found = self.candidates(image)
        return _fingerprint(found) if found else ""

    def _all(self) -> tuple[Credential, ...]:
        return self._entries + (self._fallback._all() if self._fallback is not None else ())

    def __len__(self):
        return len(self._all())

    def __bool__(self):
        return bool(self._entries) or bool(self._fallback)

    def __eq__(self, other):
        return isinstance(other, Keyring) and self._all() == other._all()

    def __hash__(self):
        return hash(self.fingerprint())

    def __repr__(self):
        return f"Keyring(hosts={self.hosts()})"


def _fingerprint(credentials) -> str:
    digest = hmac.new(_FINGERPRINT_KEY, digestmod=hashlib.sha256)
    for credential in credentials:
        digest.update(credential.fingerprint().encode() + b"\0")
    return digest.hexdigest()[:32]


def _load(data, source: str) -> dict:
    if isinstance(data, dict):
        return data
    if isinstance(data, str):
        data = data.encode("utf-8", "replace")
    if not isinstance(data, (bytes, bytearray)):
        raise ConfigError(f"{source}: expected JSON text or a mapping, got {type(data).__name__}")
    if len(data) > MAX_CONFIG_BYTES:
        raise ConfigError(f"{source}: larger than {MAX_CONFIG_BYTES} bytes")
    try:
        config = json.loads(data)
    except (ValueError, UnicodeDecodeError) as e:
        # The position only: the text around it may be a password.
        raise ConfigError(f"{source}: not valid JSON (at character {getattr(e, 'pos', '?')})") from None
    if not isinstance(config, dict):
        raise ConfigError(f"{source}: the top level must be a JSON object")
    return config


def _text(entry: dict, name: str, where: str) -> str:
    value = entry.get(name) or ""
    if not isinstance(value, str):
        raise ConfigError(f"{where}.{name} must be a string")
    return value


def _parse_entry(key, entry, source: str) -> Credential | None:
    where = f"{source}: auths[{key!r}]"
    if not isinstance(key, str) or not registry_key(key):
        raise ConfigError(f"{where}: the key must name a registry host")
    if not isinstance(entry, dict):
        raise ConfigError(f"{where} must be a JSON object")
    username = _text(entry, "username", where)
    password = _text(entry, "password", where)
    token = _text(entry, "identitytoken", where) or _text(entry, "identityToken", where)
    encoded = _text(entry, "auth", where)
    if encoded:
        # As in Docker and the kubelet, `auth` overrides username/password when both are present.
        try:
            decoded = base64.b64decode(encoded.strip(), validate=True).decode("utf-8")
        except ValueError:   # binascii.Error, UnicodeDecodeError, a non-ASCII string
            raise ConfigError(f"{where}.auth is not base64 of 'user:password'") from None
        if ":" not in decoded:
            raise ConfigError(f"{where}.auth decodes to no 'user:password' pair (missing ':')")
        username, password = decoded.split(":", 1)
    if not (username or password or token):
        return None  # e.g. an entry served by a credential helper: nothing usable here
    return Credential(registry_key(key), username, password, token)
