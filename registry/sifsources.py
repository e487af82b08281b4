"""SIF images that live outside OCI registries: plain https:// files and the Sylabs library.

- `resolve_https`: HTTP Range requests for the SIF header and descriptor table (one request of
  32 KiB for a default-layout image); never the whole file. A server that ignores Range and
  answers 200 with the whole body is refused as soon as its Content-Length shows more than was
  asked for (the HttpClient bound), so archway reads no body bytes at all; a small file that fits
  in the bound is simply used, since its whole body is the prefix archway wanted.
- `resolve_library`: the library API (wire-formats.md section 2): `GET /v1/containers/<path>`
  lists every architecture that carries the tag in `data.archTags`; `GET /v1/images/<path>:<tag>`
  is the fallback for hash references (`sha256.<hex>`) and for servers without archTags.

The oras:// flavour is in registry/oci.py (it needs registry auth); it uses the same parser.
"""
import re
from urllib.parse import quote, urlsplit

from archway.config import SifSettings
from archway.errors import (
    AuthError,
    ConfigError,
    HostRefused,
    NotFound,
    RegistryError,
    ResponseTooLarge,
    SIFError,
)
from archway.logsafe import redact_url

from .http import HttpClient, parse_json, rate_limited
from .imageref import ImageReference, without_userinfo
from .model import ImageInfo
from .platforms import normalize
from .sif import BlockReader, read_sif_platforms

FIRST_BLOCK = 32768             # header + default descriptor table (32176 bytes) in one request
MAX_LIBRARY_JSON = 1024 * 1024  # a container record with thousands of tags is still far smaller
MAX_TOKEN_FILE = 64 * 1024
_CONTENT_RANGE = re.compile(r"^bytes (\d+)-(\d+)/(\d+|\*)$")
_IDENTITY = {"Accept-Encoding": "identity"}  # byte offsets must be offsets into the file itself


# ---------------------------------------------------------------------------------------------
# https:// (and http:// for insecure hosts)


def resolve_https(ref: ImageReference, http: HttpClient, deadline: float | None) -> ImageInfo:
    url = ref.url or f"{ref.scheme}://{ref.host}/{ref.repository}"
    if urlsplit(url).scheme == "http" and not http.is_insecure(ref.host):
        raise HostRefused(f"{ref}: plain http is allowed only for hosts listed in "
                          f"registry.insecure_hosts", rule="plain_http")
    reader = BlockReader(lambda offset, length: fetch_range(http, url, offset, length, deadline),
                         FIRST_BLOCK)
    try:
        found = read_sif_platforms(reader)
    except SIFError as e:
        raise SIFError(f"{ref}: {e}") from None
    # No digest: an ETag is an opaque validator (weak, per server, often a mtime), not a content
    # digest, and showing it as one would invite caching it as one.
    return ImageInfo(str(ref), found.platforms, None, "sif-https", found.note)


def fetch_range(http: HttpClient, url: str, offset: int, length: int,
                deadline: float | None) -> bytes:
    """`length` bytes at `offset` of the file at `url` (fewer at its end) with one Range request.
    Errors name the URL without the user:password it may carry."""
    netloc, shown = without_userinfo(urlsplit(url).netloc), redact_url(url)
    headers = {"Range": f"bytes={offset}-{offset + length - 1}", **_IDENTITY}
    try:
        response = http.get(url, headers=headers, deadline=deadline, max_bytes=length)
    except ResponseTooLarge as e:
        if e.status == 200:
            raise ResponseTooLarge(
                f"{shown}: the server ignored the Range request and answered with the whole file; "
                f"archway reads only the {length} bytes it needs and never downloads whole "
                f"images (serve the file from a server that supports HTTP Range)", host=netloc,
                status=200) from None
        raise
    if response.status == 206:
        _check_content_range(response, shown, offset)
        return response.body
    if response.status == 200:
        return response.body[offset:offset + length]  # the whole (small) file: take our slice
    if response.status == 416:
        return b""  # the range starts past the end: the parser reports the truncation
    if response.status == 429:
        raise rate_limited(response, f"{shown}: 429", host=netloc, status=429)
    raise _http_error(response.status, shown, netloc, "@" in urlsplit(url).netloc)


def _check_content_range(response, url: str, offset: int) -> None:
    match = _CONTENT_RANGE.match(response.headers.get("content-range", "").strip())
    if not match or int(match.group(1)) != offset:
        raise RegistryError(f"{url}: answered 206 with Content-Range "
                            f"{response.headers.get('content-range')!r}, not the bytes from "
                            f"{offset} that archway asked for", host=without_userinfo(urlsplit(url).netloc),
                            status=206)


def _http_error(status: int, url: str, netloc: str, userinfo: bool = False) -> RegistryError:
    if status == 404:
        return NotFound(f"{url}: 404 not found", host=netloc, status=status)
    if status in (401, 403) and userinfo:
        return AuthError(f"{status} from {netloc} for {url}: the user and password in the URL "
                         f"were refused", host=netloc, status=status)
    if status in (401, 403):
        return AuthError(f"{status} from {netloc} for {url}: archway sends no credentials with "
                         f"https:// SIF URLs but those in the URL; make the file readable "
                         f"without them", host=netloc, status=status)
    return RegistryError(f"{url}: unexpected HTTP {status}", host=netloc, status=status)


# ---------------------------------------------------------------------------------------------
# library://


def resolve_library(ref: ImageReference, http: HttpClient, settings: SifSettings,
                    deadline: float | None) -> ImageInfo:
    base = library_base_url(ref, settings)
    headers = {"Accept": "application/json", **_library_auth(base, settings)}
    tag = _library_tag(ref)
    if tag.startswith("sha256."):
        return _resolve_image(ref, http, base, headers, tag, deadline)
    container = _library_get(http, f"{base}/v1/containers/{_path(ref)}", headers, deadline, ref)
    arch_tags = container.get("archTags")
    if not arch_tags:  # a library that predates archTags: ask for the image itself
        return _resolve_image(ref, http, base, headers, tag, deadline)
    if not isinstance(arch_tags, dict) or not all(isinstance(v, dict) for v in arch_tags.values()):
        raise RegistryError(f"{ref}: the library's archTags is not a map of arch to tags",
                            host=ref.host, repository=ref.repository)
    images = {arch: tags[tag] for arch, tags in arch_tags.items()
              if isinstance(arch, str) and tag in tags}
    if not images:
        raise NotFound(f"{ref}: no architecture has the tag {tag!r} in the library at {base}",
                       host=ref.host, repository=ref.repository, status=404)
    platforms = frozenset(normalize("linux", arch) for arch in images)
    ids = set(map(str, images.values()))
    digest = ids.pop() if len(ids) == 1 else None  # one image per arch: no single identity
    return ImageInfo(str(ref), platforms, digest, "sif-library")


def library_base_url(ref: ImageReference, settings: SifSettings) -> str:
    """settings.library_url for the configured library; https://<host> for any other host."""
    configured = settings.library_url
    if ref.host == urlsplit(configured).netloc:
        return configured
    return f"https://{ref.host}"


def _library_auth(base: str, settings: SifSettings) -> dict:
    """The bearer token belongs to the configured library: never sent to another host."""
    if not settings.library_token_file:
        return {}
    if urlsplit(base).netloc != urlsplit(settings.library_url).netloc:
        return {}
    try:
        with open(settings.library_token_file, "rb") as f:
            raw = f.read(MAX_TOKEN_FILE + 1)
    except OSError as e:
        raise ConfigError(f"cannot read sif.library_token_file "
                          f"{settings.library_token_file}: {e.strerror}") from None
    if len(raw) > MAX_TOKEN_FILE:
        raise ConfigError(f"sif.library_token_file {settings.library_token_file} is larger than "
                          f"{MAX_TOKEN_FILE} bytes: not a token")
    token = raw.decode("utf-8", "replace").strip()
    return {"Authorization": f"Bearer {token}"} if token else {}


def _library_tag(ref: ImageReference) -> str:
    if ref.digest:  # library://e/c/x@sha256:<hex> is the library's own sha256.<hex>
        algorithm, _, value = ref.digest.partition(":")
        return f"{algorithm}.{value}"
    return ref.tag or "latest"


def _path(ref: ImageReference) -> str:
    return "/".join(quote(part, safe="") for part in ref.repository.split("/"))


def _resolve_image(ref, http, base, headers, tag, deadline) -> ImageInfo:
    image = _library_get(http, f"{base}/v1/images/{_path(ref)}:{quote(tag, safe='.')}",
                         headers, deadline, ref)
    arch = image.get("arch")
    if arch is not None and not isinstance(arch, str):
        raise RegistryError(f"{ref}: the library's image arch is not a string", host=ref.host,
                            repository=ref.repository)
    digest = image.get("hash") or image.get("id")
    platforms = frozenset({normalize("linux", arch)}) if arch else frozenset()
    note = "" if arch else "the library records no architecture for this image"
    return ImageInfo(str(ref), platforms, digest if isinstance(digest, str) else None,
                     "sif-library", note)


def _library_get(http: HttpClient, url: str, headers: dict, deadline, ref) -> dict:
    """GET a library API object and return its `data`; `{"error": ...}` bodies become typed errors."""
    netloc = urlsplit(url).netloc
    response = http.get(url, headers=headers, deadline=deadline, max_bytes=MAX_LIBRARY_JSON)
    body = parse_json(response.body)
    if response.status == 429:
        raise rate_limited(response, f"{ref}: library {netloc} answered 429", host=netloc,
                           repository=ref.repository, status=429)
    if response.status != 200:
        message = _error_message(body) or f"HTTP {response.status}"
        kind = {404: NotFound, 401: AuthError, 403: AuthError}.get(response.status, RegistryError)
        hint = (" (set sif.library_token_file to a library access token)"
                if kind is AuthError else "")
        raise kind(f"{ref}: library {netloc} answered {response.status}: {message}{hint}",
                   host=netloc, repository=ref.repository, status=response.status)
    if not isinstance(body, dict) or not isinstance(body.get("data"), dict):
        raise RegistryError(f"{ref}: library {netloc} answered 200 without a JSON `data` object",
                            host=netloc, repository=ref.repository, status=200)
    return body["data"]


def _error_message(body) -> str:
    error = body.get("error") if isinstance(body, dict) else None
    if isinstance(error, dict) and isinstance(error.get("message"), str):
        return error["message"][:300]
    return ""
