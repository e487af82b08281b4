"""Registry credentials from Kubernetes pull secrets (dockerconfigjson / legacy dockercfg).

A `Keyring` maps a registry host[:port] to one `Credential`. Secrets never appear in a repr, a
log line or an error message: errors name the offending key, never its value.
"""
import base64
import binascii
import hashlib
import hmac
import json
import os
import secrets
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from archway.errors import ConfigError

MAX_CONFIG_BYTES = 1024 * 1024   # a Kubernetes Secret cannot be larger
DOCKER_HUB = "docker.io"
# Every name Docker Hub's credentials may be stored under (Docker writes the first one).
DOCKER_HUB_KEYS = {"index.docker.io", "docker.io", "registry-1.docker.io"}

# Fingerprints are HMACs under a per-process key: stable for cache keys inside this process,
# useless to anyone trying to guess a password from a fingerprint that ended up in a log.
_FINGERPRINT_KEY = secrets.token_bytes(32)


def normalize_registry_key(key: str) -> str:
    """'https://index.docker.io/v1/' -> 'docker.io'; 'HTTP://Reg:5000/v2/' -> 'reg:5000'."""
    text = key.strip()
    if "://" not in text:
        text = "//" + text
    try:
        netloc = urlsplit(text).netloc.lower()
    except ValueError:   # e.g. an unbalanced "[": not a host at all
        return ""
    return DOCKER_HUB if netloc in DOCKER_HUB_KEYS else netloc


@dataclass(frozen=True)
class Credential:
    registry: str                      # normalised host[:port] this credential belongs to
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

    def fingerprint(self) -> str:
        material = "\0".join((self.registry, self.username, self.password, self.identity_token))
        return hmac.new(_FINGERPRINT_KEY, material.encode(), hashlib.sha256).hexdigest()[:32]


class Keyring:
    """Credentials by registry host[:port]; immutable once built."""

    def __init__(self, credentials: dict[str, Credential] | None = None):
        self._by_host = dict(credentials or {})

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
        found: dict[str, Credential] = {}
        for key, entry in auths.items():
            credential = _parse_entry(key, entry, source)
            # Several keys may alias one host (Docker Hub): the first one written wins.
            if credential and credential.registry not in found:
                found[credential.registry] = credential
        return cls(found)

    def lookup(self, host: str) -> Credential | None:
        """The credential naming exactly this host[:port] (Docker Hub's aliases count as one)."""
        return self._by_host.get(normalize_registry_key(host)) if host else None

    def merged(self, other: "Keyring | None") -> "Keyring":
        """A keyring with both sets of credentials; on the same host, `self` wins."""
        if other is None:
            return self
        return Keyring({**other._by_host, **self._by_host})

    def hosts(self) -> list[str]:
        return sorted(self._by_host)

    def fingerprint(self) -> str:
        """Stable (per process) identity of these credentials for cache keys; reveals nothing."""
        if not self._by_host:
            return "anonymous"
        digest = hmac.new(_FINGERPRINT_KEY, digestmod=hashlib.sha256)
        for host in sorted(self._by_host):
            digest.update(self._by_host[host].fingerprint().encode() + b"\0")
        return digest.hexdigest()[:32]

    def __len__(self):
        return len(self._by_host)

    def __bool__(self):
        return bool(self._by_host)

    def __eq__(self, other):
        return isinstance(other, Keyring) and self._by_host == other._by_host

    def __hash__(self):
        return hash(self.fingerprint())

    def __repr__(self):
        return f"Keyring(hosts={self.hosts()})"


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
    if not isinstance(key, str) or not normalize_registry_key(key):
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
        except (binascii.Error, UnicodeDecodeError):
            raise ConfigError(f"{where}.auth is not base64 of 'user:password'") from None
        if ":" not in decoded:
            raise ConfigError(f"{where}.auth decodes to no 'user:password' pair (missing ':')")
        username, password = decoded.split(":", 1)
    if not (username or password or token):
        return None  # e.g. an entry served by a credential helper: nothing usable here
    return Credential(normalize_registry_key(key), username, password, token)
