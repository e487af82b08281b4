"""Redirects, a pure decision: whether and how a request follows one; and URLs as a message may
show them (no user:password, no query)."""
from urllib.parse import SplitResult, urlsplit

from archway.hostport import join_host_port

from .imageref import without_userinfo


def redirect_step(url: str, target: str, status: int, method: str, has_body: bool,
                  target_insecure: bool) -> tuple[str, bool, bool] | str:
    """How to follow a redirect from `url` to `target`: (method, keep the body, same origin),
    or why it must not be followed.

    303, and 301/302 after a POST, become a GET without body (as browsers and requests do);
    307/308 repeat the request as it was, so one that carries a body (a token form with a
    password or refresh token) is followed only to the same origin. Leaving https for http
    would put credentials and the manifest in cleartext: only for a host in insecure_hosts.
    """
    source, dest = urlsplit(url), urlsplit(target)
    if dest.scheme not in ("http", "https") or not dest.netloc:
        return "the target is not an http(s) URL"
    if source.scheme == "https" and dest.scheme == "http" and not target_insecure:
        return "it leaves https for plain http (list the target in registry.insecure_hosts to allow it)"
    if status == 303 or (status in (301, 302) and method == "POST"):
        method, has_body = ("HEAD" if method == "HEAD" else "GET"), False
    same = _origin(source) == _origin(dest)
    if has_body and not same:
        return "it would send the request body (which can hold a credential) to another host"
    return method, has_body, same


def _origin(parts: SplitResult) -> tuple[str, str, int | None]:
    try:
        port = parts.port or {"https": 443, "http": 80}.get(parts.scheme)
    except ValueError:
        port = None
    return parts.scheme, (parts.hostname or "").lower(), port


def authority(url: str) -> str:
    """host[:port] of a URL, without the user:password it may carry (which must never reach a
    message, a log line or an error's host)."""
    return without_userinfo(urlsplit(url).netloc)


def safe_url(url: str) -> str:
    """A URL fit for a message: no user:password, no query (it can carry a token)."""
    parts = urlsplit(url)
    try:
        port = parts.port or None
    except ValueError:
        port = None
    return f"{parts.scheme}://{join_host_port(parts.hostname or '', port)}{parts.path}"[:300]

