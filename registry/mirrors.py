"""Registry mirrors in containerd's own format: a directory laid out like /etc/containerd/certs.d.

For an image on `HOST`, `<hosts_dir>/HOST/hosts.toml` (`host_port_` or `host:port` for a port;
else `<hosts_dir>/_default/hosts.toml`) names the hosts to try, as containerd reads it:

    server = "https://registry-1.docker.io"        # the upstream, tried last (default: HOST)
    [host."https://mirror.example:5000"]           # tried first, in file order
      capabilities = ["pull", "resolve"]           # resolve: tags; pull: content by digest
      ca = "mirror-ca.crt"                         # or a list; relative to this directory
      skip_verify = false
      override_path = false                        # true: the URL already holds the API root
      [host."https://mirror.example:5000".header]
        x-team = "platform"

A directory without hosts.toml but with `*.crt` files (Docker's certs.d layout) only adds CAs
for the upstream. Files are read again when they change (e.g. a node's certs.d mounted
read-only). A hosts.toml that cannot be parsed is ignored with a warning: the upstream alone.
"""
import glob
import logging
import os
import threading
import tomllib
from dataclasses import dataclass, replace
from urllib.parse import quote, urlsplit

from archway.errors import ArchwayError, ConfigError

from .filewatch import WatchedFile
from .imageref import DOCKER_HUB, DOCKER_HUB_API, ImageReference

log = logging.getLogger(__name__)

ALL_CAPABILITIES = frozenset({"pull", "resolve", "push"})
MAX_HOSTS_FILE_BYTES = 1024 * 1024


@dataclass(frozen=True)
class RegistryHost:
    """One place to ask for an image: a mirror, or the upstream (`server`)."""
    scheme: str
    netloc: str
    path: str                                  # the API root: "/v2" unless override_path
    capabilities: frozenset = ALL_CAPABILITIES
    ca_files: tuple[str, ...] = ()
    skip_verify: bool = False
    headers: tuple[tuple[str, str], ...] = ()
    mirror: bool = True                        # False: the `server` entry
    namespace: str | None = None               # the image's own host, sent as ?ns= to others
    default: bool = False                      # the upstream nobody configured: archway's own rules

    def serves(self, ref: ImageReference) -> bool:
        """containerd's rule: tags are resolved only by `resolve` hosts, digests pulled from `pull` hosts."""
        return ("pull" if ref.digest else "resolve") in self.capabilities

    def reference(self, ref: ImageReference) -> ImageReference:
        """`ref` as asked of this host: credentials and tokens then belong to this host alone."""
        if self.netloc == ref.api_host:
            return ref
        return replace(ref, host=self.netloc)

    def url(self, api_path: str) -> str:
        """The URL of a `/v2/...` API path on this host."""
        rest = api_path[len("/v2"):] if api_path.startswith("/v2") else api_path
        url = f"{self.scheme}://{self.netloc}{self.path}{rest}"
        if self.namespace:
            url += ("&" if "?" in url else "?") + "ns=" + quote(self.namespace, safe="")
        return url

    def describe(self) -> str:
        return f"{self.scheme}://{self.netloc}{self.path}"


class Mirrors:
    """The hosts to try for each registry, from registry.hosts_dir."""

    def __init__(self, hosts_dir: str):
        self.hosts_dir = os.path.expanduser(hosts_dir)
        self._watches: dict[str, WatchedFile] = {}
        self._lock = threading.Lock()

    def hosts_for(self, ref: ImageReference) -> list[RegistryHost] | None:
        """The hosts to try for `ref`, in order (the upstream last); None when nothing is
        configured for its registry (archway's usual single host)."""
        directory = self._directory(ref.host)
        if directory is None:
            return None
        parsed = self._watch(directory).get()
        if isinstance(parsed, _Unusable):
            return None
        return [_for_image(entry, ref) for entry in parsed]

    def _directory(self, host: str) -> str | None:
        names = []
        if ":" in host:
            name, _, port = host.rpartition(":")
            names.append(f"{name}_{port}_")
        names += [host, "_default"]
        try:   # a directory named Registry.Example:5000 is registry.example:5000's
            entries = {entry.lower(): entry for entry in os.listdir(self.hosts_dir)}
        except OSError:
            return None
        for name in names:
            path = os.path.join(self.hosts_dir, entries.get(name.lower(), name))
            if os.path.isdir(path):
                return path
        return None

    def _watch(self, directory: str) -> WatchedFile:
        with self._lock:
            watch = self._watches.get(directory)
            if watch is None:
                watch = self._watches[directory] = WatchedFile(directory, _load_directory,
                                                               what="registry.hosts_dir")
            return watch


@dataclass(frozen=True)
class _Unusable:
    reason: str


def _load_directory(directory: str):
    """The parsed hosts of one host directory; never raises (a bad file means: upstream only)."""
    try:
        return parse_hosts_dir(directory)
    except ArchwayError as e:
        log.warning("ignoring %s: %s; using the registry itself", directory, e)
        return _Unusable(str(e))


def parse_hosts_dir(directory: str) -> list[RegistryHost]:
    """Hosts of `directory`/hosts.toml (namespace and default upstream not yet filled in)."""
    path = os.path.join(directory, "hosts.toml")
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_HOSTS_FILE_BYTES + 1)
    except FileNotFoundError:
        data = b""
    except OSError as e:
        raise ConfigError(f"cannot read {path}: {e.strerror}") from None
    if not data.strip():
        # Docker's certs.d layout: *.crt files are CAs of the registry itself.
        cas = tuple(sorted(glob.glob(os.path.join(directory, "*.crt"))))
        return [RegistryHost("https", "", "/v2", ca_files=cas, mirror=False, default=not cas)]
    if len(data) > MAX_HOSTS_FILE_BYTES:
        raise ConfigError(f"{path} is larger than {MAX_HOSTS_FILE_BYTES} bytes")
    try:
        document = tomllib.loads(data.decode("utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path} is not valid TOML: {e}") from None
    hosts_table = document.get("host") or {}
    if not isinstance(hosts_table, dict):
        raise ConfigError(f"{path}: `host` must be a table of [host.\"URL\"] tables")
    hosts = [_host(url, options, directory, path, mirror=True)
             for url, options in hosts_table.items()]   # TOML tables keep their file order
    server = document.get("server") or ""
    if not isinstance(server, str):
        raise ConfigError(f"{path}: server must be a string")
    upstream = _host(server, document, directory, path, mirror=False)
    return hosts + [upstream]


def _host(url: str, options, directory: str, path: str, *, mirror: bool) -> RegistryHost:
    where = f"{path}: [host.{url!r}]" if mirror else path
    if not isinstance(options, dict):
        raise ConfigError(f"{where} must be a table")
    capabilities = _capabilities(options.get("capabilities"), where)
    ca_files = _ca_files(options.get("ca"), directory, where)
    skip_verify = options.get("skip_verify", False)
    override_path = options.get("override_path", False)
    if not isinstance(skip_verify, bool) or not isinstance(override_path, bool):
        raise ConfigError(f"{where}: skip_verify and override_path must be true or false")
    if options.get("client") is not None:
        log.warning("%s: client certificates are not supported by archway: ignored", where)
    headers = _headers(options.get("header"), where)
    if not url:   # no `server`: the registry itself, as containerd fills it in
        default = not (ca_files or skip_verify or headers)
        return RegistryHost("https", "", "/v2", ALL_CAPABILITIES, ca_files, skip_verify, headers,
                            mirror=False, default=default)
    scheme, netloc, api_root = _api_root(url, override_path, where)
    return RegistryHost(scheme, netloc, api_root, capabilities, ca_files, skip_verify, headers,
                        mirror=mirror)


def _capabilities(capabilities, where: str) -> frozenset:
    if capabilities is None or capabilities == []:
        return ALL_CAPABILITIES
    if not (isinstance(capabilities, list) and all(isinstance(c, str) for c in capabilities)):
        raise ConfigError(f"{where}: capabilities must be a list such as [\"pull\", \"resolve\"]")
    named = frozenset(c.lower() for c in capabilities)
    unknown = named - ALL_CAPABILITIES
    if unknown:
        raise ConfigError(f"{where}: unknown capability {sorted(unknown)[0]!r} (pull, resolve, push)")
    return named


def _ca_files(ca, directory: str, where: str) -> tuple[str, ...]:
    """`ca`: a file name or a list of them, relative to the host's directory."""
    if isinstance(ca, str):
        ca = [ca]
    if ca is not None and not (isinstance(ca, list) and all(isinstance(c, str) for c in ca)):
        raise ConfigError(f"{where}: ca must be a file name or a list of them")
    return tuple(c if os.path.isabs(c) else os.path.join(directory, c) for c in ca or ())


def _api_root(url: str, override_path: bool, where: str) -> tuple[str, str, str]:
    """(scheme, netloc, API root) of a host's URL: the root ends in /v2 unless override_path."""
    if "://" not in url:
        url = "https://" + url
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ConfigError(f"{where}: {url!r} is not an http(s) URL")
    api_root = os.path.normpath(parts.path).rstrip("/") if parts.path else ""
    if not override_path and not api_root.endswith("/v2"):
        api_root += "/v2"
    return parts.scheme, parts.netloc.lower(), api_root


def _headers(table, where: str) -> tuple[tuple[str, str], ...]:
    if table is None:
        return ()
    if not isinstance(table, dict):
        raise ConfigError(f"{where}: header must be a table")
    headers = []
    for name, value in table.items():
        values = [value] if isinstance(value, str) else value
        if not isinstance(values, list) or not all(isinstance(v, str) for v in values) \
                or any(c in "\r\n" for v in values for c in v) or name.lower() == "authorization":
            raise ConfigError(f"{where}: header {name!r} must be a string or a list of strings "
                              f"(and not Authorization: credentials come from pull secrets)")
        headers.append((name, ", ".join(values)))
    return tuple(headers)


def _for_image(entry: RegistryHost, ref: ImageReference) -> RegistryHost:
    """An entry of the host's file, completed for `ref`: the default upstream's address, and
    the `ns` parameter containerd adds when asking a host other than the image's own."""
    if not entry.netloc:
        netloc = DOCKER_HUB_API if ref.host == DOCKER_HUB else ref.host
        entry = replace(entry, netloc=netloc)
    own = entry.netloc == ref.host or (ref.host == DOCKER_HUB and entry.netloc == DOCKER_HUB_API)
    return replace(entry, namespace=None if own else ref.host)
