"""host[:port] text, read and written in one place: registry hosts, credential keys, host-policy
patterns, bind addresses (server.bind, --bind). IPv6 addresses travel in brackets
([fd00::1]:5000) and come out without them; host names compare lowercased."""
from urllib.parse import urlsplit

from archway.errors import ConfigError


def split_host_port(netloc: str) -> tuple[str, int | None]:
    """'Reg.example:5000' -> ('reg.example', 5000); '[fd00::1]:443' -> ('fd00::1', 443);
    'host' -> ('host', None); ':8443' -> ('', 8443). ValueError when it is not host[:port]
    (an unbalanced bracket, a port that is not a number up to 65535)."""
    parts = urlsplit("//" + netloc)
    return parts.hostname or "", parts.port


def host_of(netloc: str) -> str:
    """The host part of `netloc`, lowercased; all of it, lowercased, when it does not parse."""
    try:
        return split_host_port(netloc)[0] or netloc.lower()
    except ValueError:
        return netloc.lower()


def join_host_port(host: str, port: int | None) -> str:
    """('fd00::1', 5000) -> '[fd00::1]:5000'; ('reg', None) -> 'reg'."""
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return host if port is None else f"{host}:{port}"


def split_bind(bind: str) -> tuple[str, int]:
    """'127.0.0.1:8443' / '[::1]:8443' / ':8443' -> (host, port); ConfigError when malformed."""
    try:
        host, port = split_host_port(bind)
    except ValueError:
        port = None
    if not port or "/" in bind:
        raise ConfigError(f"bind address {bind!r} must be HOST:PORT, e.g. 127.0.0.1:8443")
    return host or "0.0.0.0", port
