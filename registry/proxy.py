"""Which forward (egress) proxy a registry request goes through, if any.

From `registry.proxy.url`, else (with `registry.proxy.from_environment`) from the variables curl
and requests read: `https_proxy`/`HTTPS_PROXY` for https URLs, `http_proxy`/`HTTP_PROXY` for
http URLs, `all_proxy`/`ALL_PROXY` for both, the lower-case spelling first. `NO_PROXY` (or
`registry.proxy.no_proxy`) lists what is reached directly: `*` for everything, a host name (which
also covers its subdomains; a leading `.` or `*.` means the same), an IP address or a CIDR range,
each optionally with `:port`. As with curl and requests, nothing is exempt implicitly: a
loopback target goes through the proxy too unless NO_PROXY lists it.

The host policy is checked against the TARGET host before any request (http.py), and
credentials still go only to the target host: the proxy sees a CONNECT for https.
"""
import ipaddress
import os
from dataclasses import dataclass
from urllib.parse import urlsplit

from archway.errors import ConfigError
from archway.logsafe import redact_url


@dataclass(frozen=True)
class ProxyRules:
    https: str | None = None
    http: str | None = None
    no_proxy: tuple[str, ...] = ()

    @classmethod
    def from_settings(cls, settings, environ=None) -> "ProxyRules":
        """The rules of a ProxySettings; ConfigError naming the key or variable when unusable."""
        if settings.url:
            url = proxy_url(settings.url, "registry.proxy.url")
            return cls(url, url, tuple(settings.no_proxy))
        if not settings.from_environment:
            return cls(no_proxy=tuple(settings.no_proxy))
        env = os.environ if environ is None else environ

        def variable(*names):
            for name in names:
                if env.get(name, "").strip():
                    return proxy_url(env[name], name)
            return None

        fallback = variable("all_proxy", "ALL_PROXY")
        no_proxy = (env.get("no_proxy") or env.get("NO_PROXY") or "").replace(" ", "").split(",")
        return cls(variable("https_proxy", "HTTPS_PROXY") or fallback,
                   variable("http_proxy", "HTTP_PROXY") or fallback,
                   tuple(settings.no_proxy) + tuple(h.lower() for h in no_proxy if h))

    def for_url(self, url: str) -> dict:
        """The `proxies` mapping requests takes for this URL: empty means a direct connection."""
        parts = urlsplit(url)
        proxy = self.https if parts.scheme == "https" else self.http
        if proxy is None or bypassed(parts.hostname or "", parts.port, self.no_proxy):
            return {}
        return {parts.scheme: proxy}

    def netlocs(self) -> tuple[str, ...]:
        """host:port of the proxies: hosts the operator named (registry.hostpolicy)."""
        return tuple(urlsplit(url).netloc.rsplit("@", 1)[-1].lower()
                     for url in (self.https, self.http) if url)

    def __repr__(self):   # a proxy URL may carry a password
        return (f"ProxyRules(https={self.https and redact_url(self.https)}, "
                f"http={self.http and redact_url(self.http)}, "
                f"no_proxy={list(self.no_proxy)})")


def proxy_url(value: str, where: str) -> str:
    """`host:port` or `http[s]://[user:pass@]host:port`; a missing scheme means http, as in curl."""
    text = value.strip()
    if "://" not in text:
        text = "http://" + text
    try:
        parts = urlsplit(text)
        _ = parts.port   # raises ValueError on a port that is not a number
    except ValueError:
        raise ConfigError(f"{where} is not a proxy URL: {redact_url(text)}") from None
    if parts.scheme not in ("http", "https"):
        raise ConfigError(f"{where}: archway speaks to http:// and https:// proxies only, not "
                          f"{parts.scheme}://")
    if not parts.hostname:
        raise ConfigError(f"{where} names no proxy host: {redact_url(text)}")
    return text


def bypassed(host: str, port: int | None, no_proxy) -> bool:
    """Does a NO_PROXY list exempt host[:port]? (curl's rules; see the module docstring)"""
    host = host.lower().strip("[]").rstrip(".")
    address = _ip(host)
    for entry in no_proxy:
        if entry == "*":
            return True
        name, entry_port = _split(entry)
        if entry_port is not None and entry_port != port:
            continue
        if address is not None:
            if "/" in name:
                try:
                    if address in ipaddress.ip_network(name, strict=False):
                        return True
                except ValueError:
                    pass
            elif _ip(name) == address:
                return True
            continue
        name = name.removeprefix("*").lstrip(".")
        if name and (host == name or host.endswith("." + name)):
            return True
    return False


def _split(entry: str) -> tuple[str, int | None]:
    """'host:443' -> ('host', 443); '[::1]:80' -> ('::1', 80); '10.0.0.0/8' -> (it, None)."""
    entry = entry.strip().lower()
    if entry.startswith("["):
        name, _, rest = entry[1:].partition("]")
        return name, int(rest[1:]) if rest.startswith(":") and rest[1:].isdigit() else None
    if entry.count(":") == 1:
        name, port = entry.split(":")
        return name, int(port) if port.isdigit() else None
    return entry, None


def _ip(text: str):
    try:
        return ipaddress.ip_address(text)
    except ValueError:
        return None
