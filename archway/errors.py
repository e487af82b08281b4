"""Typed errors. Every message says what went wrong and, where it can, what to fix."""


class ArchwayError(Exception):
    """Base of every error archway raises on purpose."""


class InvalidReference(ArchwayError):
    """The image reference cannot be parsed."""


class HostRefused(ArchwayError):
    """Configuration or policy forbids contacting this host (deny list, allow list, link-local)."""


class RegistryError(ArchwayError):
    """A registry answered with something archway cannot use."""

    def __init__(self, message, *, host="", repository="", status=None):
        super().__init__(message)
        self.host = host
        self.repository = repository
        self.status = status


class AuthError(RegistryError):
    """401/403: missing or wrong credentials."""


class NotFound(RegistryError):
    """The manifest, blob or library image does not exist."""


class ResponseTooLarge(RegistryError):
    """A peer sent more than archway is willing to read."""


class UnsupportedImage(RegistryError):
    """A manifest or artifact of a kind archway does not understand."""


class TransportError(RegistryError):
    """Connection refused, reset, TLS failure or a read that timed out."""


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


def error_kind(error: BaseException | None) -> str:
    """snake_case of the error class, a bounded metric label: DeadlineExceeded ->
    deadline_exceeded (None, an answer that never came, counts as deadline_exceeded)."""
    name = type(error).__name__ if error is not None else "DeadlineExceeded"
    return "".join("_" + c.lower() if c.isupper() else c for c in name).lstrip("_")
