"""OCI / Docker registry client: which platforms an image in a registry supports.

One manifest GET answers a multi-platform image (index / manifest list). A single-platform
manifest costs one more request, for its config blob. An oras SIF artifact costs ranged reads
of its SIF layer's header (through archway.registry.sif.BlockReader: usually one 32 KiB read).

What a manifest means is decided by registry.manifests (pure functions); the client class only
does I/O: scheme choice, auth retries, bounded reads and turning HTTP answers into typed errors.
"""
import copy
import threading

from archway.config import RegistrySettings
from archway.errors import (
    AuthError,
    CredentialsRequired,
    InvalidReference,
    NotFound,
    RegistryError,
    ResponseTooLarge,
    TransportError,
)
from archway.logsafe import clip

from .auth import Authorization, RegistryAuth
from .credentials import Keyring
from .http import HttpClient, Response, parse_json, rate_limited
from .imageref import ImageReference
from .manifests import (
    ACCEPT,
    INDEX_TYPES,
    SCHEMA1_TYPES,
    SIF_CONFIG,
    SOURCE_BY_TYPE,
    Manifest,
    artifact_type,
    config_descriptor,
    head_digest_of,
    parse_manifest,
    platforms_from_config,
    platforms_from_index,
    platforms_from_schema1,
    sif_layer,
    verify_digest,
)
from .model import ARTIFACT_SOURCE, ImageInfo
from .sif import BlockReader, read_sif_platforms

MAX_CONFIG_BYTES = 8 * 1024 * 1024   # configs carry the build history: allow more than a manifest


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
        held = artifact_type(manifest.document)
        if held is not None:
            return ImageInfo(str(ref), frozenset(), manifest.digest, ARTIFACT_SOURCE,
                             f"an OCI artifact ({clip(held, 100)}): no platform")
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
# A non-success answer, as a typed error


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
