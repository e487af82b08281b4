"""What a manifest means, as pure functions: its media type, whether its content matches its
digest, and the platforms an index, an image config or a schema1 manifest records. The client
(registry.oci) fetches; this decides.
"""
import base64
import hashlib
import re
from dataclasses import dataclass

from archway.errors import RegistryError, UnsupportedImage

from .http import Response, parse_json
from .imageref import ImageReference
from .platforms import Platform, is_attestation, normalize

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
    """The platforms of an index / manifest list, of every OS (a pod's OS picks its own),
    skipping attestations and entries without a platform; the note says so when nothing is
    left. UnsupportedImage past MAX_INDEX_ENTRIES entries or MAX_PLATFORMS platforms."""
    entries = document.get("manifests")
    if not isinstance(entries, list):
        raise RegistryError("malformed image index: 'manifests' is not a list")
    where = {"host": ref.api_host, "repository": ref.repository} if ref else {}
    if len(entries) > MAX_INDEX_ENTRIES:
        raise UnsupportedImage(f"the index of {ref or 'this image'} lists {len(entries)} manifests, "
                               f"more than the {MAX_INDEX_ENTRIES} archway reads: refused", **where)
    platforms = set()
    for entry in entries:
        if not isinstance(entry, dict) or is_attestation(entry):
            continue
        fields = entry.get("platform")
        if not isinstance(fields, dict):
            continue
        platform = _platform(fields)
        if platform is not None:
            platforms.add(platform)
    if len(platforms) > MAX_PLATFORMS:
        raise UnsupportedImage(f"the index of {ref or 'this image'} lists {len(platforms)} "
                               f"platforms, more than the {MAX_PLATFORMS} archway accepts: "
                               f"refused", **where)
    note = "" if platforms else "the index lists no platform"
    return frozenset(platforms), note


def artifact_type(document: dict) -> str | None:
    """What an OCI artifact manifest holds (its `artifactType`, else its config's media type
    when that is not an image config: application/vnd.oci.empty.v1+json for most), or None
    for an image. An artifact (a model, a config bundle mounted as an image volume) has no
    platform: the runtime pulls it alike on every node."""
    declared = document.get("artifactType")
    if isinstance(declared, str) and declared.strip():
        return declared
    config = document.get("config")
    config_type = config.get("mediaType") if isinstance(config, dict) else None
    if isinstance(config_type, str) and config_type not in IMAGE_CONFIG_TYPES | {SIF_CONFIG}:
        return config_type
    return None


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
