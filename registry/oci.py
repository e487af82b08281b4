"""OCI / Docker registry client: which platforms an image in a registry supports.

One manifest GET answers a multi-platform image (index / manifest list). A single-platform
manifest costs one more request, for its config blob. An oras SIF artifact costs ranged reads
of its SIF layer's header (through archway.registry.sif.BlockReader: usually one 32 KiB read).

Decisions (what a manifest means) are pure functions near the bottom; the client class only
does I/O: scheme choice, auth retries, bounded reads and turning HTTP answers into typed errors.
"""
import base64
import copy
import hashlib
import re
import threading
from dataclasses import dataclass

from archway.config import RegistrySettings
from archway.errors import (
    AuthError,
    CredentialsRequired,
    InvalidReference,
    NotFound,
    RegistryError,
    ResponseTooLarge,
    TransportError,
    UnsupportedImage,
)

from .auth import Authorization, RegistryAuth
from .credentials import Keyring
from .http import HttpClient, Response, parse_json, rate_limited
from .model import ImageInfo
from .platforms import Platform, is_attestation, normalize
from .reference import ImageReference
from .sif import BlockReader, read_sif_platforms

OCI_INDEX = "application/vnd.oci.image.index.v1+json"
OCI_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
DOCKER_LIST = "application/vnd.docker.distribution.manifest.list.v2+json"
DOCKER_MANIFEST = "application/vnd.docker.distribution.manifest.v2+json"
SCHEMA1 = "application/vnd.docker.distribution.manifest.v1+json"
SCHEMA1_SIGNED = "application/vnd.docker.distribution.manifest.v1+prettyjws"
OCI_CONFIG = "application/vnd.oci.image.config.v1+json"
DOCKER_CONFIG = "application/vnd.docker.container.image.v1+json"
SIF_CONFIG = "application/vnd.sylabs.sif.config.v1+json"
SIF_LAYER = "application/vnd.sylabs.sif.layer.v1.sif"

INDEX_TYPES = {OCI_INDEX, DOCKER_LIST}
MANIFEST_TYPES = {OCI_MANIFEST, DOCKER_MANIFEST}
SCHEMA1_TYPES = {SCHEMA1, SCHEMA1_SIGNED}
# Without the index types in Accept, registries answer a multi-arch tag with 404 or with one
# platform's manifest; without schema1 some old registries answer 404.
ACCEPT = ", ".join([OCI_INDEX, DOCKER_LIST, OCI_MANIFEST, DOCKER_MANIFEST, SCHEMA1_SIGNED, SCHEMA1])
IMAGE_CONFIG_TYPES = {OCI_CONFIG, DOCKER_CONFIG}
MAX_CONFIG_BYTES = 8 * 1024 * 1024   # configs carry the build history: allow more than a manifest
# The largest real indexes list a few dozen platforms (twice the entries with attestations).
# An index far past that is hostile or broken: refused, before it can fill the cache (100,000
# platforms took 27 MB per cached tag).
MAX_PLATFORMS = 256
MAX_INDEX_ENTRIES = 4 * MAX_PLATFORMS

SOURCE_BY_TYPE = {OCI_INDEX: "oci-index", DOCKER_LIST: "docker-manifest-list",
                  OCI_MANIFEST: "oci-manifest", DOCKER_MANIFEST: "docker-manifest",
                  SCHEMA1: "docker-schema1", SCHEMA1_SIGNED: "docker-schema1"}
_HASHES = {"sha256": hashlib.sha256, "sha512": hashlib.sha512}
_SHA256_DIGEST = re.compile(r"sha256:[0-9a-f]{64}")


@dataclass(frozen=True)
class Manifest:
    media_type: str
    document: dict
    digest: str
    size: int


class RegistryClient:
    """Resolves `docker` and `oras` references against the registries they name. Thread-safe."""

    def __init__(self, http: HttpClient, settings: RegistrySettings,
                 auth: RegistryAuth | None = None):
        self.http = http
        self.settings = settings
        self.auth = auth or RegistryAuth(http)
        self._schemes: dict[str, str] = {}   # insecure host -> the scheme that answered
        self._lock = threading.Lock()
        self.host = None   # a mirrors.RegistryHost on the copies via() makes

    def via(self, host) -> "RegistryClient":
        """This client, sending its requests to `host` (a hosts.toml mirror or server, with its
        own scheme, API root and headers) instead of the host a reference names."""
        clone = copy.copy(self)
        clone.host = host
        return clone

    # -- public API
    def resolve(self, ref: ImageReference, keyring: Keyring | None = None,
                deadline: float | None = None) -> ImageInfo:
        if ref.scheme not in ("docker", "oras"):
            raise InvalidReference(f"{ref}: the registry client resolves docker:// and oras:// only")
        keyring = keyring if keyring is not None else Keyring.empty()
        manifest = self.fetch_manifest(ref, keyring, deadline)
        if manifest.media_type in INDEX_TYPES:
            platforms, note = platforms_from_index(manifest.document, ref)
            return ImageInfo(str(ref), platforms, manifest.digest,
                             SOURCE_BY_TYPE[manifest.media_type], note)
        if manifest.media_type in SCHEMA1_TYPES:
            platforms, note = platforms_from_schema1(manifest.document)
            return ImageInfo(str(ref), platforms, manifest.digest, "docker-schema1", note)
        config = config_descriptor(manifest.document, str(ref))
        if config.get("mediaType") == SIF_CONFIG:
            return self._resolve_sif(ref, manifest, keyring, deadline)
        if config.get("mediaType") not in IMAGE_CONFIG_TYPES | {None}:
            raise UnsupportedImage(
                f"{ref} is an OCI artifact of type {str(config.get('mediaType'))[:100]!r}, not a "
                f"container image or SIF image: it has no architecture", host=ref.api_host,
                repository=ref.repository)
        document = self._fetch_config(ref, config, keyring, deadline)
        platforms, note = platforms_from_config(document)
        return ImageInfo(str(ref), platforms, manifest.digest,
                         SOURCE_BY_TYPE[manifest.media_type], note)

    def head_digest(self, ref: ImageReference, keyring: Keyring | None = None,
                    deadline: float | None = None) -> str | None:
        """The digest a tag points to now, by `HEAD /v2/<repo>/manifests/<tag>` (free where a GET
        counts as a pull): the Docker-Content-Digest header, or None when the registry sends
        none usable (then only a GET can tell). A digest reference is its own answer."""
        if ref.scheme not in ("docker", "oras"):
            raise InvalidReference(f"{ref}: the registry client resolves docker:// and oras:// only")
        if ref.digest:
            return ref.digest
        keyring = keyring if keyring is not None else Keyring.empty()
        path = f"/v2/{ref.repository}/manifests/{ref.manifest_reference}"
        response = self._request(ref, path, keyring, deadline, {"Accept": ACCEPT},
                                 self.settings.max_manifest_bytes, what="manifest", method="HEAD")
        return head_digest_of(response)

    def fetch_manifest(self, ref: ImageReference, keyring: Keyring, deadline) -> Manifest:
        path = f"/v2/{ref.repository}/manifests/{ref.manifest_reference}"
        try:
            response = self._request(ref, path, keyring, deadline, {"Accept": ACCEPT},
                                     self.settings.max_manifest_bytes, what="manifest")
        except ResponseTooLarge:
            raise ResponseTooLarge(
                f"the manifest of {ref} on {ref.api_host} is larger than "
                f"{self.settings.max_manifest_bytes} bytes (registry.max_manifest_bytes; the OCI "
                f"spec caps manifests at 4 MiB): refused", host=ref.api_host,
                repository=ref.repository) from None
        return parse_manifest(response, ref)

    def read_blob_range(self, ref: ImageReference, digest: str, offset: int, length: int,
                        keyring: Keyring | None = None, deadline: float | None = None) -> bytes:
        """The bytes [offset, offset+length) of a blob (fewer at its end), by an HTTP Range read.

        Callers that know the blob's size should not ask past its end: distribution 2.8 answers
        such a request 416 with a Content-Length of the whole blob and a short body, which
        reads as a broken connection (TransportError).
        """
        if offset < 0 or length <= 0:
            return b""
        keyring = keyring if keyring is not None else Keyring.empty()
        headers = {"Range": f"bytes={offset}-{offset + length - 1}"}
        path = f"/v2/{ref.repository}/blobs/{digest}"
        try:
            response = self._request(ref, path, keyring, deadline, headers, length, what="blob",
                                     ok=(200, 206, 416))
        except ResponseTooLarge:
            raise ResponseTooLarge(
                f"{ref.api_host} ignored the Range request for blob {digest[:19]} of "
                f"{ref.repository} and would send more than the {length} bytes asked for",
                host=ref.api_host, repository=ref.repository) from None
        if response.status == 416:
            return b""   # the offset is at or past the end of the blob
        if response.status == 200:   # range ignored, but the whole blob fit in the bound
            return response.body[offset:offset + length]
        return response.body[:length]

    # -- resolution steps
    def _fetch_config(self, ref, config: dict, keyring, deadline) -> dict:
        digest: str = config["digest"]   # config_descriptor() checked it
        size = config.get("size")
        if isinstance(size, int) and size > MAX_CONFIG_BYTES:
            raise ResponseTooLarge(f"the config blob of {ref} declares {size} bytes, more than the "
                                   f"{MAX_CONFIG_BYTES} archway reads", host=ref.api_host,
                                   repository=ref.repository)
        response = self._request(ref, f"/v2/{ref.repository}/blobs/{digest}", keyring, deadline,
                                 {}, MAX_CONFIG_BYTES, what="config blob")
        verify_digest(response.body, digest, ref, "config blob")
        document = parse_json(response.body)
        if not isinstance(document, dict):
            raise RegistryError(f"the config blob of {ref} on {ref.api_host} is not a JSON object",
                                host=ref.api_host, repository=ref.repository, status=200)
        return document

    def _resolve_sif(self, ref, manifest: Manifest, keyring, deadline) -> ImageInfo:
        layer = sif_layer(manifest.document, str(ref))
        size = layer.get("size") if isinstance(layer.get("size"), int) else None

        def fetch_range(offset: int, length: int) -> bytes:
            if size is not None:   # never ask for bytes past the end: no 416 round trips
                length = min(length, size - offset)
            if length <= 0:
                return b""
            return self.read_blob_range(ref, layer["digest"], offset, length, keyring, deadline)

        sif = read_sif_platforms(BlockReader(fetch_range))
        note = sif.note or ""
        return ImageInfo(str(ref), sif.platforms, manifest.digest, "sif-oras", note)

    # -- HTTP with auth
    def _request(self, ref: ImageReference, path: str, keyring: Keyring, deadline, headers: dict,
                 max_bytes: int, *, what: str, ok=(200,), method: str = "GET") -> Response:
        authz = self.auth.authorization(ref, keyring, deadline)
        for attempt in range(2):
            sent = dict(headers)
            if authz.header:
                sent["Authorization"] = authz.header
            response = self._send(ref.api_host, path, sent, deadline, max_bytes, method)
            if response.status != 401:
                break
            challenge = response.headers.get("WWW-Authenticate", "")
            if attempt == 1 or not challenge:
                raise self._unauthorized(ref, authz, keyring, challenge)
            fresh = self.auth.answer_challenge(ref, challenge, keyring, deadline, rejected=authz)
            if fresh.header is None or fresh.header == authz.header:
                raise self._unauthorized(ref, fresh, keyring, challenge)
            authz = fresh
        self.auth.accepted(ref, authz)   # not a 401: its challenge serves the host up front
        if response.status not in ok:
            raise status_error(response, ref, what, authz)
        return response

    def _send(self, netloc: str, path: str, headers: dict, deadline, max_bytes: int,
              method: str = "GET") -> Response:
        """https, verified; for hosts in insecure_hosts https unverified, then plain http on a
        TLS or connection failure (as Docker does), remembering what worked. A hosts.toml host
        says its own scheme and API root."""
        if self.host is not None:
            return self.http.get(self.host.url(path), headers={**dict(self.host.headers), **headers},
                                 deadline=deadline, max_bytes=max_bytes, method=method)
        with self._lock:
            scheme = self._schemes.get(netloc, "https")
        try:
            response = self.http.get(f"{scheme}://{netloc}{path}", headers=headers,
                                     deadline=deadline, max_bytes=max_bytes, method=method)
        except TransportError:
            if scheme != "https" or not self.http.is_insecure(netloc):
                raise
            scheme = "http"
            response = self.http.get(f"http://{netloc}{path}", headers=headers,
                                     deadline=deadline, max_bytes=max_bytes, method=method)
        if self.http.is_insecure(netloc):
            with self._lock:
                self._schemes[netloc] = scheme
        return response

    def _unauthorized(self, ref: ImageReference, authz: Authorization, keyring: Keyring,
                      challenge: str) -> AuthError:
        where = f"401 from {ref.api_host} for {ref.repository}"
        if authz.credential is not None:
            return AuthError(f"{where}: the credentials for this host were rejected",
                             host=ref.api_host, repository=ref.repository, status=401)
        if keyring.lookup(ref.host) is not None:
            detail = ("a pull secret names this host, but its token service is on another host "
                      "and gets no password: add a credential naming the token service's host")
            if "basic" in challenge.lower():
                detail = "the pull secret for this host has no username or password"
        else:
            detail = "no pull secret matched this host"
        return CredentialsRequired(f"{where}: {detail}", host=ref.api_host,
                                   repository=ref.repository, status=401)


# ---------------------------------------------------------------------------------------------
# Pure decisions


def parse_manifest(response: Response, ref: ImageReference) -> Manifest:
    """Decide what a manifest answer is (Content-Type first, then the body) and check its digest."""
    body = response.body
    document = parse_json(body)
    if not isinstance(document, dict):
        raise RegistryError(f"{ref.api_host} answered the manifest of {ref} with something that "
                            f"is not a JSON object ({len(body)} bytes)", host=ref.api_host,
                            repository=ref.repository, status=response.status)
    media_type = manifest_media_type(response.headers.get("Content-Type", ""), document)
    if media_type is None:
        raise UnsupportedImage(
            f"{ref} on {ref.api_host}: unknown manifest type "
            f"{response.headers.get('Content-Type', '')[:100]!r}", host=ref.api_host,
            repository=ref.repository, status=response.status)
    signed_payload = schema1_payload(body) if media_type in SCHEMA1_TYPES else None
    if ref.digest:
        verify_digest(body, ref.digest, ref, "manifest", signed_payload)
        digest = ref.digest
    else:
        header = response.headers.get("Docker-Content-Digest", "").strip()
        if header and header.split(":", 1)[0] in _HASHES:
            verify_digest(body, header, ref, "manifest", signed_payload)
            digest = header
        else:
            digest = "sha256:" + hashlib.sha256(signed_payload or body).hexdigest()
    return Manifest(media_type, document, digest, len(body))


def head_digest_of(response: Response) -> str | None:
    """The Docker-Content-Digest of a HEAD answer when it is a well-formed sha256 digest."""
    header = response.headers.get("Docker-Content-Digest", "").strip()
    return header if _SHA256_DIGEST.fullmatch(header) else None


def manifest_media_type(content_type: str, document: dict) -> str | None:
    declared = content_type.split(";", 1)[0].strip().lower()
    known = INDEX_TYPES | MANIFEST_TYPES | SCHEMA1_TYPES
    if declared in known:
        return declared
    body_type = document.get("mediaType")
    if isinstance(body_type, str) and body_type in known:
        return body_type
    # Neither says: infer from the shape (the OCI spec makes mediaType optional in old images).
    if document.get("schemaVersion") == 1:
        return SCHEMA1_SIGNED if "signatures" in document else SCHEMA1
    if isinstance(document.get("manifests"), list):
        return OCI_INDEX
    if isinstance(document.get("config"), dict):
        return OCI_MANIFEST
    return None


def verify_digest(body: bytes, expected: str, ref: ImageReference, what: str,
                  alternative: bytes | None = None) -> None:
    """The content must hash to the digest it was asked for (or announced with)."""
    algorithm, _, hex_value = (expected or "").partition(":")
    hasher = _HASHES.get(algorithm)
    if hasher is None:
        raise UnsupportedImage(f"{ref}: {what} digest {str(expected)[:80]!r} uses an algorithm "
                               f"archway cannot verify (sha256, sha512)", host=ref.api_host,
                               repository=ref.repository)
    candidates = [body] + ([alternative] if alternative is not None else [])
    if not any(hasher(c).hexdigest() == hex_value.lower() for c in candidates):
        raise RegistryError(f"{ref.api_host} served a {what} for {ref} whose content does not "
                            f"match its digest {expected[:80]}: refused", host=ref.api_host,
                            repository=ref.repository, status=200)


def schema1_payload(body: bytes) -> bytes | None:
    """The signed payload of a schema1 pretty-JWS manifest, which is what its digest covers."""
    try:
        document = parse_json(body)
        protected = document["signatures"][0]["protected"]
        header = parse_json(base64.urlsafe_b64decode(protected + "=" * (-len(protected) % 4)))
        length = int(header["formatLength"])
        tail = header["formatTail"]
        tail = base64.urlsafe_b64decode(tail + "=" * (-len(tail) % 4))
    except (ValueError, KeyError, IndexError, TypeError, UnicodeDecodeError):
        return None
    if not 0 < length <= len(body):
        return None
    return body[:length] + tail


def platforms_from_index(document: dict, ref: ImageReference | None = None
                         ) -> tuple[frozenset[Platform], str]:
    """Linux platforms of an index / manifest list, skipping attestations and entries without
    a platform; the note names what was left out when nothing is left. UnsupportedImage past
    MAX_INDEX_ENTRIES entries or MAX_PLATFORMS platforms."""
    entries = document.get("manifests")
    if not isinstance(entries, list):
        raise RegistryError("malformed image index: 'manifests' is not a list")
    where = {"host": ref.api_host, "repository": ref.repository} if ref else {}
    if len(entries) > MAX_INDEX_ENTRIES:
        raise UnsupportedImage(f"the index of {ref or 'this image'} lists {len(entries)} manifests, "
                               f"more than the {MAX_INDEX_ENTRIES} archway reads: refused", **where)
    platforms, other_os = set(), set()
    for entry in entries:
        if not isinstance(entry, dict) or is_attestation(entry):
            continue
        fields = entry.get("platform")
        if not isinstance(fields, dict):
            continue
        platform = _platform(fields)
        if platform is None:
            continue
        if platform.os == "linux":
            platforms.add(platform)
        else:
            other_os.add(str(platform))
    if len(platforms) + len(other_os) > MAX_PLATFORMS:
        raise UnsupportedImage(f"the index of {ref or 'this image'} lists "
                               f"{len(platforms) + len(other_os)} platforms, more than the "
                               f"{MAX_PLATFORMS} archway accepts: refused", **where)
    note = ""
    if not platforms:
        note = ("the index lists no linux platform" +
                (f" (only {', '.join(sorted(other_os))})" if other_os else ""))
    return frozenset(platforms), note


def platforms_from_config(document: dict) -> tuple[frozenset[Platform], str]:
    platform = _platform(document)
    if platform is None:
        return frozenset(), "the image config records no architecture"
    return frozenset({platform}), ""


def platforms_from_schema1(document: dict) -> tuple[frozenset[Platform], str]:
    os_name = "linux"
    history = document.get("history")
    if isinstance(history, list) and history and isinstance(history[0], dict):
        compatibility = history[0].get("v1Compatibility")
        first = parse_json(compatibility) if isinstance(compatibility, str) else None
        if isinstance(first, dict) and isinstance(first.get("os"), str) and first["os"]:
            os_name = first["os"]
    platform = _platform({"os": os_name, "architecture": document.get("architecture")})
    if platform is None:
        return frozenset(), "the schema1 manifest records no architecture"
    return frozenset({platform}), ""


def _platform(fields: dict) -> Platform | None:
    arch, os_name, variant = (fields.get(k) for k in ("architecture", "os", "variant"))
    if not isinstance(arch, str) or not arch.strip():
        return None
    os_name = os_name if isinstance(os_name, str) and os_name.strip() else "linux"
    variant = variant if isinstance(variant, str) else None
    platform = normalize(os_name, arch, variant)
    return None if platform.architecture == "unknown" else platform


def config_descriptor(document: dict, image: str) -> dict:
    config = document.get("config")
    if not isinstance(config, dict) or not isinstance(config.get("digest"), str) \
            or ":" not in config["digest"] or "/" in config["digest"]:
        raise RegistryError(f"malformed manifest for {image}: no usable config descriptor")
    return config


def sif_layer(document: dict, image: str) -> dict:
    layers = document.get("layers")
    sif = [layer for layer in layers if isinstance(layer, dict)
           and layer.get("mediaType") == SIF_LAYER] if isinstance(layers, list) else []
    if len(sif) != 1:
        raise UnsupportedImage(f"{image} is a SIF artifact with {len(sif)} SIF layers; "
                               f"expected exactly one ({SIF_LAYER})")
    digest = sif[0].get("digest")
    if not isinstance(digest, str) or ":" not in digest or "/" in digest:
        raise RegistryError(f"malformed manifest for {image}: the SIF layer has no usable digest")
    return sif[0]


def status_error(response: Response, ref: ImageReference, what: str,
                 authz: Authorization | None = None) -> RegistryError:
    """A typed error for a non-success answer that says what happened and what to do."""
    status, host, repo = response.status, ref.api_host, ref.repository
    detail = registry_message(response.body)
    suffix = f" ({detail})" if detail else ""
    kw = dict(host=host, repository=repo, status=status)
    if status == 404:
        if what == "manifest":
            return NotFound(f"manifest unknown: {repo}:{ref.manifest_reference} not found on "
                            f"{host}{suffix}", **kw)
        return NotFound(f"{what} of {ref} not found on {host}{suffix}", **kw)
    if status == 403:
        if authz and authz.credential:
            return AuthError(f"403 from {host} for {repo}: the credentials used may not pull "
                             f"this repository{suffix}", **kw)
        return CredentialsRequired(f"403 from {host} for {repo}: anonymous access may not pull "
                                   f"this repository{suffix}", **kw)
    if status == 429:
        return rate_limited(response, f"429 from {host} for {repo}", **kw)
    if status >= 500:
        return RegistryError(f"registry {host} failed with HTTP {status} for {repo} ({what})"
                             f"{suffix}: a server-side error, try again later", **kw)
    return RegistryError(f"unexpected HTTP {status} from {host} for the {what} of {ref}{suffix}",
                         **kw)


def registry_message(body: bytes) -> str:
    """The first error a registry reported (`{"errors":[{"code","message"}]}`), short and printable."""
    try:
        errors = parse_json(body).get("errors")
        first = errors[0]
        text = f"{first.get('code', '')}: {first.get('message', '')}".strip(": ")
    except (ValueError, AttributeError, IndexError, KeyError, TypeError, UnicodeDecodeError):
        return ""
    return "".join(c for c in str(text) if c.isprintable())[:200]
