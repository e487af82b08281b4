"""One bounded call to the Kubernetes API for a pod's credentials (pull secrets, its
ServiceAccount, a token of it): within the admission's deadline, and a failure as ReadFailed,
which says in a few words what went wrong and how long that answer may be repeated."""
import logging

from archway.errors import ArchwayError
from archway.kubeapi import ApiError, KubeApi
from archway.registry.credentials import MAX_CONFIG_BYTES

log = logging.getLogger(__name__)

UNREACHABLE_TTL = 5.0     # an API that is down costs one timeout per few seconds, not per pod
MISSING_TTL = 10.0        # an object created right after the pod is seen soon
MAX_OBJECT_BYTES = 2 * MAX_CONFIG_BYTES  # base64 of a 1 MiB secret, plus metadata
MIN_CALL_TIMEOUT = 0.05


class ReadFailed(ArchwayError):
    def __init__(self, message: str, *, status: int | None = None, ttl: float,
                 late: bool = False):
        super().__init__(message)
        self.status = status
        self.ttl = ttl
        self.late = late


def call_api(api: KubeApi, path: str, deadline: float, clock, *, method: str = "GET",
             body: dict | None = None) -> dict:
    """The object at `path` (or the answer to a POST of `body`); ReadFailed, never the body in
    a message (a TokenRequest's answer is a token)."""
    remaining = deadline - clock()
    if remaining < MIN_CALL_TIMEOUT:
        raise ReadFailed("not read: the admission deadline passed", ttl=0, late=True)
    try:
        return api.request(method, path, body=body, timeout=remaining, max_bytes=MAX_OBJECT_BYTES)
    except ApiError as e:
        if e.status:
            raise ReadFailed(status_words(e.status), status=e.status,
                             ttl=MISSING_TTL if e.status == 404 else UNREACHABLE_TTL) from None
        if e.reason == "TooLarge":
            raise ReadFailed("object too large", ttl=UNREACHABLE_TTL) from None
        if e.reason == "NotJSON":
            raise ReadFailed("Kubernetes API sent something that is not a JSON object",
                             ttl=UNREACHABLE_TTL) from None
        log.warning("Kubernetes API %s of %s failed: %s", method, path, e)
        raise ReadFailed("Kubernetes API unreachable or too slow", ttl=UNREACHABLE_TTL) from None


def status_words(status) -> str:
    if status == 404:
        return "not found"
    if status in (401, 403):
        return f"archway may not read it (HTTP {status}; check its RBAC)"
    return f"Kubernetes API answered HTTP {status}"
