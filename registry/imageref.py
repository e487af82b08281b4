"""An image reference as a value, and the three ways one is written: Docker's (docker://, oras://),
a Sylabs library's (library://) and a URL (https://, http://). Which scheme is written which way
is registry.reference's table of kinds, which parses a reference of any kind (parse_reference).

Host names come out lowercased, once, here (DNS names are case-insensitive; repository paths,
tags and URL paths are not): back-off, cache keys, metrics, credentials and host policy all see
one spelling of a host.
"""
import re
from dataclasses import dataclass
from urllib.parse import urlsplit

from archway.errors import InvalidReference
from archway.hostport import host_of
from archway.logsafe import redact_url

DOCKER_HUB = "docker.io"
DOCKER_HUB_API = "registry-1.docker.io"
_HUB_ALIASES = {"docker.io", "index.docker.io", "registry-1.docker.io"}

_COMPONENT = r"[a-z0-9]+(?:(?:\.|_|__|-+)[a-z0-9]+)*"
# fullmatch everywhere: `$` would let a trailing newline through.
_REPOSITORY = re.compile(rf"{_COMPONENT}(?:/{_COMPONENT})*")
_TAG = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}")
_DIGEST = re.compile(r"sha256:[a-f0-9]{64}|sha512:[a-f0-9]{128}|"
                     r"(?!sha256:|sha512:)[a-z0-9]+(?:[.+_-][a-z0-9]+)*:[a-zA-Z0-9=_-]{32,}")
_HOST = re.compile(r"(?:\[[0-9a-fA-F:.]+\]|[a-zA-Z0-9.-]+)(?::[0-9]+)?")
# Each dot-separated label of a host name (RFC 1123): `.`, `..`, `a..b` or `-x.io` are none.
_LABEL = re.compile(r"[a-zA-Z0-9](?:[a-zA-Z0-9-]{0,61}[a-zA-Z0-9])?")
# A reference written as a file path: a local SIF file is read only by `archway inspect`
# (registry.inspect.looks_like_path); anywhere else it names no image, and must not be read as
# the host "." or "..".
PATH_PREFIXES = ("/", "./", "../", "~/")


@dataclass(frozen=True)
class ImageReference:
    scheme: str            # "docker", "oras", "library" or "https"/"http"
    host: str              # registry or library host ("docker.io" for Docker Hub), or URL host
    repository: str        # path inside the host; for library: entity/collection/container
    tag: str | None = None
    digest: str | None = None
    url: str | None = None  # the full URL for http(s) references

    @property
    def api_host(self) -> str:
        """Host the registry API is served from (Docker Hub's differs from its name)."""
        return DOCKER_HUB_API if self.host == DOCKER_HUB else self.host

    @property
    def hostname(self) -> str:
        """The host without port or IPv6 brackets, for address checks."""
        return host_of(self.api_host)

    @property
    def manifest_reference(self) -> str:
        """What goes after /manifests/: the digest when there is one, else the tag."""
        return self.digest or self.tag or "latest"

    def __str__(self):
        if self.url:
            return redact_url(self.url)   # never a user:password a URL carries
        text = f"{self.host}/{self.repository}"
        if self.tag:
            text += f":{self.tag}"
        if self.digest:
            text += f"@{self.digest}"
        return text if self.scheme == "docker" else f"{self.scheme}://{text}"


def _lowercase_host(url: str) -> str:
    """The URL with its host (not its user:password, not its path) lowercased."""
    scheme, _, rest = url.partition("://")
    end = min((i for i in (rest.find(c) for c in "/?#") if i >= 0), default=len(rest))
    userinfo, at, host = rest[:end].rpartition("@")
    return f"{scheme}://{userinfo}{at}{host.lower()}{rest[end:]}"


def without_userinfo(netloc: str) -> str:
    """host[:port] of a URL authority, without any user:password@."""
    return netloc.rpartition("@")[2]


def _split_tag_digest(remainder: str, original: str):
    name, _, digest = remainder.partition("@")
    if digest and not _DIGEST.fullmatch(digest):
        raise InvalidReference(f"{original!r}: malformed digest {digest!r}")
    tag = None
    last = name.rsplit("/", 1)[-1]
    if ":" in last:
        name, tag = name.rsplit(":", 1)
        if not _TAG.fullmatch(tag):
            raise InvalidReference(f"{original!r}: malformed tag {tag!r}")
    return name, tag, digest or None


def _valid_labels(host: str) -> bool:
    """Whether a host[:port] names a host: an [IPv6] literal, or labels each valid."""
    if host.startswith("["):
        return True
    name = host.rsplit(":", 1)[0] if ":" in host else host
    return all(_LABEL.fullmatch(label) for label in name.split("."))


# The syntaxes: (scheme, what follows "scheme://", the whole text, the default library host) ->
# the reference, or InvalidReference saying what is wrong.

def docker_syntax(scheme: str, remainder: str, original: str, default_library_host: str
                  ) -> ImageReference:
    """[host[:port]/]repository[:tag][@digest], Docker Hub's defaults filled in."""
    if remainder.startswith(PATH_PREFIXES) or remainder in (".", ".."):
        raise InvalidReference(f"invalid image reference {original!r}: a file path names no "
                               f"image (only `archway inspect` reads a local SIF file)")
    name, tag, digest = _split_tag_digest(remainder, original)
    first, slash, path = name.partition("/")
    if slash and ("." in first or ":" in first or first == "localhost" or first.startswith("[")):
        host = first
    else:
        host, path = DOCKER_HUB, name
    if not _HOST.fullmatch(host) or not _valid_labels(host):
        raise InvalidReference(f"{original!r}: malformed registry host {host!r}")
    host = host.lower()   # names are case-insensitive: one host for back-off, cache, credentials
    if host in _HUB_ALIASES:
        host = DOCKER_HUB
    if host == DOCKER_HUB and "/" not in path:
        path = f"library/{path}"
    if not _REPOSITORY.fullmatch(path):
        raise InvalidReference(
            f"{original!r}: repository {path!r} must be lowercase letters, digits and separators")
    if not tag and not digest:
        tag = "latest"
    return ImageReference(scheme, host, path, tag, digest)


def library_syntax(scheme: str, remainder: str, original: str, default_library_host: str
                   ) -> ImageReference:
    """[host/]entity/collection/container[:tag][@digest] of a Sylabs library."""
    name, tag, digest = _split_tag_digest(remainder, original)
    parts = [p for p in name.split("/") if p]
    host = default_library_host
    if len(parts) == 4 or (len(parts) > 1 and ("." in parts[0] or ":" in parts[0])):
        host, parts = parts[0].lower(), parts[1:]
    if len(parts) == 1:
        parts = ["library", "default"] + parts
    elif len(parts) == 2:
        parts = [parts[0], "default", parts[1]]
    if len(parts) != 3 or not all(_REPOSITORY.fullmatch(p) for p in parts):
        raise InvalidReference(
            f"{original!r}: expected library://[host/]entity/collection/container[:tag]")
    return ImageReference(scheme, host, "/".join(parts), tag or (None if digest else "latest"),
                          digest)


def url_syntax(scheme: str, remainder: str, original: str, default_library_host: str
               ) -> ImageReference:
    """A URL with a host; the reference keeps the whole URL (its user:password too, to fetch it)."""
    parts = urlsplit(original)
    if not parts.hostname:
        raise InvalidReference(f"{original!r}: URL has no host")
    url = _lowercase_host(f"{scheme}://{remainder}")
    return ImageReference(scheme, without_userinfo(urlsplit(url).netloc), parts.path.lstrip("/"),
                          url=url)
