"""Image references of every kind archway reads, keyed by scheme: how each kind is written, how
it is resolved, and what its answers are cached by. Parse any of them with parse_reference.

    nginx                       -> docker.io/library/nginx:latest
    ghcr.io/org/app@sha256:...  -> by digest
    oras://host/repo:tag        -> SIF artifact in an OCI registry
    library://entity/coll/c:tag -> Sylabs library API
    https://host/path/x.sif     -> plain file, read with Range requests

Adding a kind of registry is one module that resolves it and one entry in KINDS: the resolver,
the cache, `archway inspect` and the webhook's metrics read everything else from the entry.
"""
import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from archway.config import SifSettings
from archway.errors import ArchwayError, InvalidReference
from archway.logsafe import redact_url

from . import sifsources
from .access import RegistryAccess
from .credentials import Keyring
from .http import HttpClient
from .imageref import ImageReference, docker_syntax, library_syntax, url_syntax
from .model import ImageInfo

MAX_REFERENCE_LENGTH = 4096


class Clients(Protocol):
    """What a kind resolves with: the resolver's clients, shared by every lookup."""
    access: RegistryAccess   # OCI registries: mirrors, credentials, auth
    http: HttpClient         # any other HTTP server
    sif: SifSettings


@dataclass(frozen=True)
class RegistryKind:
    """One kind of image reference."""
    # How a reference is written: (scheme, the text after "scheme://", the whole text, the
    # default library host) -> ImageReference (registry.imageref).
    syntax: Callable[[str, str, str, str], ImageReference]
    # Its platforms, by the deadline, with the pod's keyring (the node's is added by `access`).
    resolve: Callable[[Clients, ImageReference, Keyring, float], ImageInfo]
    # Content addressed by digest, as in an OCI registry: the digest a tag names now, or None
    # when the registry does not say. With it, a cached tag is checked by this (a HEAD) before
    # its manifest is fetched again, answers are also filed under their digest, and `archway
    # inspect` prints `name@digest`. None: a kind whose references have no digest.
    head_digest: Callable[[Clients, ImageReference, Keyring, float], str | None] | None = None
    # Registry credentials (pull secrets, the node's) apply: answers are cached per credential.
    pull_secrets: bool = False


_OCI = RegistryKind(docker_syntax,
                    resolve=lambda clients, ref, keys, deadline: clients.access.resolve(
                        ref, keys, deadline),
                    head_digest=lambda clients, ref, keys, deadline: clients.access.head_digest(
                        ref, keys, deadline),
                    pull_secrets=True)
_SIF_URL = RegistryKind(url_syntax, resolve=lambda clients, ref, keys, deadline:
                        sifsources.resolve_https(ref, clients.http, deadline))
_SIF_LIBRARY = RegistryKind(library_syntax, resolve=lambda clients, ref, keys, deadline:
                            sifsources.resolve_library(ref, clients.http, clients.sif, deadline))

# The one registration of each kind, by the scheme its references start with ("scheme://";
# a reference without one is "docker"). A parsed reference's scheme is always one of these:
# KINDS[ref.scheme] is its kind.
KINDS: dict[str, RegistryKind] = {
    "docker": _OCI,
    "oras": _OCI,               # a SIF image stored in an OCI registry as an oras artifact
    "library": _SIF_LIBRARY,
    "https": _SIF_URL,
    "http": _SIF_URL,
}


def parse_reference(text: str, default_library_host: str = "library.sylabs.io") -> ImageReference:
    """Parse and normalise an image reference; raise InvalidReference saying what is wrong."""
    if not isinstance(text, str) or not text.strip():
        raise InvalidReference("empty image reference")
    try:
        return _parse(text, default_library_host)
    except InvalidReference as e:
        shown = redact_url(text.strip())
        if shown == text.strip():
            raise
        raise InvalidReference(str(e).replace(text.strip(), shown)) from None


def scheme_of(image: str) -> str:
    """The scheme of an image reference, "invalid" when it cannot be parsed: a metric label."""
    try:
        return parse_reference(image).scheme
    except ArchwayError:
        return "invalid"


@functools.lru_cache(maxsize=4096)  # pods repeat the same few images; parsing is pure
def _parse(text: str, default_library_host: str) -> ImageReference:
    text = text.strip()
    if len(text) > MAX_REFERENCE_LENGTH:
        raise InvalidReference(f"image reference longer than {MAX_REFERENCE_LENGTH} characters")
    scheme, sep, rest = text.partition("://")
    if not sep:
        scheme, rest = "docker", text
    kind = KINDS.get(scheme.lower())
    if kind is None:
        # Plain http:// is https:// without TLS: not suggested.
        known = ", ".join(f"{s}://" for s in KINDS if s != "http")
        raise InvalidReference(f"{text!r}: unsupported scheme {scheme.lower()!r} (use {known})")
    return kind.syntax(scheme.lower(), rest, text, default_library_host)
