"""Typed errors. Every message says what went wrong and, where it can, what to fix."""
from dataclasses import dataclass


class ArchwayError(Exception):
    """Base of every error archway raises on purpose."""


class InvalidReference(ArchwayError):
    """The image reference cannot be parsed."""


class HostRefused(ArchwayError):
    """Configuration or policy forbids contacting this host (deny list, allow list, link-local).

    `rule` names which rule refused it (a key of POLICY_RULES: loopback, link-local, metadata,
    cluster, kubelet, deny_hosts, allow_hosts...), so a warning can say so in fixed words."""

    def __init__(self, message, *, rule: str = ""):
        super().__init__(message)
        self.rule = rule


class PeerRefused(HostRefused):
    """A connection landed on an address the host policy refuses (a name that resolved to a
    harmless address when checked and to a refused one when connected). Its warning reads as
    any failure to reach a host: the refusal comes only after the port answered, so naming it
    would tell the pod's author an open port from a closed one."""


class RegistryError(ArchwayError):
    """A registry answered with something archway cannot use."""

    def __init__(self, message, *, host="", repository="", status=None):
        super().__init__(message)
        self.host = host
        self.repository = repository
        self.status = status


class AuthError(RegistryError):
    """401/403: missing or wrong credentials."""


class CredentialsRequired(AuthError):
    """401/403 to a request that carried no credential: the registry wants one that none of the
    pod's pull secrets (nor the node's) provide for it. Nothing was refused."""


class NotFound(RegistryError):
    """The manifest, blob or library image does not exist."""


class ResponseTooLarge(RegistryError):
    """A peer sent more than archway is willing to read."""


class UnsupportedImage(RegistryError):
    """A manifest or artifact of a kind archway does not understand."""


class TransportError(RegistryError):
    """Connection refused, reset, TLS failure or a read that timed out."""


class ProxyFailed(TransportError):
    """The egress proxy (registry.proxy, HTTPS_PROXY...) could not be reached, or would not
    carry the request to the registry: the registry itself was never asked."""


class RateLimited(RegistryError):
    """429: the registry (or its token service) asks archway to slow down. `retry_after` is the
    wait it asked for in seconds (from Retry-After), None when it named none."""

    def __init__(self, message, *, retry_after: float | None = None, **kwargs):
        super().__init__(message, **kwargs)
        self.retry_after = retry_after


class Overloaded(ArchwayError):
    """archway refused to start more lookups: too many are queued, or a pod names too many
    images. Never cached: it says nothing about the image."""


class DeadlineExceeded(ArchwayError):
    """The caller's overall deadline passed before the answer arrived."""


class SIFError(ArchwayError):
    """A SIF image is truncated, corrupt or internally inconsistent."""


class ConfigError(ArchwayError):
    """The configuration file is missing, unreadable or holds a wrong value."""


class CredentialProviderError(AuthError):
    """A kubelet credential provider plugin failed (it hung, exited non-zero, answered garbage
    or too much): the image is looked up without its credentials."""

    def __init__(self, message, *, provider="", reason="", **kwargs):
        super().__init__(message, **kwargs)
        self.provider = provider
        self.reason = reason   # timeout, exit_status, invalid_response, output_too_large, exec_error


# Failures that no wait can change: the reference cannot be parsed, or archway's own host policy
# refuses its host (a metadata or link-local address, deny_hosts, allow_hosts, plain http). A
# registry that times out, is down, answers 5xx, or has not got the tag yet (404) may answer later.
_NEVER_RESOLVES = (InvalidReference, HostRefused)


def never_resolves(error: BaseException | None) -> bool:
    """Whether an image whose lookup failed with `error` can never be read, however long the pod
    waits (None: no answer came in time, which says nothing)."""
    return isinstance(error, _NEVER_RESOLVES)


# --- naming a failed image resolution: a metric label and a few words for a warning ---------

@dataclass(frozen=True)
class ErrorClass:
    label: str   # for the image_resolutions metric: a small fixed set
    words: str   # for a warning: a few words, never the error's message (it can hold URLs)
    hint: str = ""   # a line of its own beside the warning: what would change the outcome


# The words of every failure to reach a host: a timeout, a refused connection, a TLS error and a
# proxy's failure read alike to the pod's author, who could otherwise use archway to tell open
# ports from closed ones (a port scanner). The label and the log keep the difference for the
# operator.
UNREACHABLE = "registry unreachable"

# A host the policy refuses before any connection is named as refused, with the rule, and a
# hint says which key would allow it: that answer follows from the image's name, its port, its
# DNS answer and the config alone, never from whether anything listens, so it tells no port's
# state. Fixed words only: the error's message holds the host and the address it resolved to.
# The words fit a warning under 120 characters with the image; the hint is a line of its own.
_ALLOWED = "only when registry.allow_hosts lists its host"
POLICY_RULES: dict[str, tuple[str, str]] = {   # rule: (its words, the hint: what would allow it)
    "loopback": ("loopback", f"archway contacts a loopback address {_ALLOWED}"),
    "cluster": ("cluster address", f"archway contacts a Service or API server address {_ALLOWED}"),
    "kubelet": ("kubelet port", f"archway contacts a kubelet port (10250, 10255) {_ALLOWED}"),
    "kube-proxy": ("kube-proxy port", f"archway contacts a kube-proxy port (10249, 10256) {_ALLOWED}"),
    "allow_hosts": ("unlisted host", "archway contacts only the hosts registry.allow_hosts lists"),
    "deny_hosts": ("denied host", "archway never contacts a host registry.deny_hosts lists"),
    "plain_http": ("plain http", "archway speaks plain http only to the hosts registry.insecure_hosts "
                                 "lists"),
    "metadata": ("metadata service", "archway never contacts a cloud metadata service"),
    "link-local": ("link-local", "archway never contacts a link-local address"),
    "reserved": ("reserved address", "archway never contacts a multicast, unspecified or reserved "
                                     "address"),
    "malformed": ("malformed host", ""),
}
REFUSED = "refused by policy"   # the hint says whose


def _refused(error: HostRefused) -> "ErrorClass":
    words, hint = POLICY_RULES.get(getattr(error, "rule", ""), ("", ""))
    return ErrorClass("host_refused", f"{REFUSED}: {words}" if words else REFUSED, hint)


_ERROR_CLASSES = (  # most specific first: the classes form a hierarchy
    (DeadlineExceeded, ErrorClass("deadline_exceeded", UNREACHABLE)),
    (Overloaded, ErrorClass("overloaded", "archway is resolving too many images at once")),
    (CredentialProviderError, ErrorClass("credential_provider_error", "credential provider failed")),
    (CredentialsRequired, ErrorClass("auth_error", "credentials required; none sent")),
    (AuthError, ErrorClass("auth_error", "registry refused the credentials")),
    (NotFound, ErrorClass("not_found", "not found")),
    (RateLimited, ErrorClass("rate_limited", "registry rate limit (HTTP 429)")),
    (ResponseTooLarge, ErrorClass("response_too_large", "registry response too large")),
    (UnsupportedImage, ErrorClass("unsupported_image", "unsupported image format")),
    (ProxyFailed, ErrorClass("proxy_error", UNREACHABLE)),
    (TransportError, ErrorClass("transport_error", UNREACHABLE)),
    (PeerRefused, ErrorClass("host_refused", UNREACHABLE)),
    (InvalidReference, ErrorClass("invalid_reference", "invalid image reference")),
    (SIFError, ErrorClass("sif_error", "unreadable SIF image")),
)
_NO_ANSWER = ErrorClass("deadline_exceeded", UNREACHABLE)


def classify_error(error: BaseException | None) -> ErrorClass:
    """How an image's failed resolution is named; `error` None: no answer came in time."""
    if error is None:
        return _NO_ANSWER
    for cls, found in _ERROR_CLASSES:
        if isinstance(error, cls):
            return found
    if isinstance(error, HostRefused):
        return _refused(error)
    if isinstance(error, RegistryError):
        return ErrorClass("registry_error", f"registry answered HTTP {error.status}"
                          if error.status else "registry error")
    return ErrorClass("resolver_error", "resolver error")
