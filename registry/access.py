"""Reaching an image the way the node that will pull it does.

Credentials, in the kubelet's order: the pod's pull secrets and its ServiceAccount's, then the
node's (credential provider plugins, then registry.credentials_file); every credential that
matches the image is tried in turn, as the kubelet retries a pull with the next one. Hosts, in
containerd's order: the mirrors of registry.hosts_dir, then the upstream. Each host gets only the
credentials filed under its own name: a mirror never sees the upstream's password.
"""
import logging
from collections.abc import Callable
from typing import TypeVar

from archway.errors import (
    ArchwayError,
    AuthError,
    CredentialProviderError,
    DeadlineExceeded,
    NotFound,
    classify_error,
)

from .credentials import Keyring
from .imageref import ImageReference
from .mirrors import Mirrors
from .model import ImageInfo
from .nodecredentials import NodeCredentials
from .oci import RegistryClient

log = logging.getLogger(__name__)
T = TypeVar("T")
# One registry call: (client, reference on that host, keyring, deadline) -> its answer.
Call = Callable[[RegistryClient, ImageReference, Keyring, float], T]


def image_name(ref: ImageReference) -> str:
    """The repository name the kubelet matches credentials against and sends to credential
    provider plugins: `docker.io/library/nginx`, `reg.example:5000/team/app` (no tag or digest)."""
    return f"{ref.host}/{ref.repository}"


class RegistryAccess:
    def __init__(self, client: RegistryClient, node: NodeCredentials, mirrors: Mirrors | None = None):
        self.client = client
        self.node = node
        self.mirrors = mirrors

    def resolve(self, ref: ImageReference, keyring: Keyring, deadline: float) -> ImageInfo:
        """Resolve a docker:// or oras:// reference; `keyring` holds the pod's pull secrets."""
        return self._through_hosts(ref, keyring, deadline, RegistryClient.resolve)

    def head_digest(self, ref: ImageReference, keyring: Keyring, deadline: float) -> str | None:
        """The digest the tag points to now (HEAD), asked of the hosts and with the credentials
        `resolve` would use; None when the host that answered gives no digest on HEAD."""
        return self._through_hosts(ref, keyring, deadline, RegistryClient.head_digest)

    def _through_hosts(self, ref: ImageReference, keyring: Keyring, deadline: float,
                       call: "Call[T]") -> T:
        hosts = self.mirrors.hosts_for(ref) if self.mirrors is not None else None
        if not hosts:
            return self._with_credentials(self.client, ref, keyring, deadline, call)
        usable = [host for host in hosts if host.serves(ref) or not host.mirror]
        for host in usable:
            if not host.default:   # written by the operator (hosts.toml), not by a pod
                self.client.http.policy.name_host(host.netloc)
                self.client.http.trust_host(host.netloc, host.ca_files, host.skip_verify)
            client = self.client if host.default else self.client.via(host)
            try:
                answer = self._with_credentials(client, host.reference(ref), keyring, deadline, call)
            except DeadlineExceeded:
                raise
            except ArchwayError as e:
                if not host.mirror:
                    raise
                _count_mirror(classify_error(e).label)
                log.info("mirror %s could not serve %s (%s); trying the next host",
                         host.describe(), ref, e)
                continue
            if host.mirror:
                _count_mirror("answered")
            return answer
        raise AssertionError("the upstream host is always last")   # pragma: no cover

    def _with_credentials(self, client: RegistryClient, ref: ImageReference, keyring: Keyring,
                          deadline: float, call: "Call[T]") -> T:
        node, provider_errors = self.node.for_image(image_name(ref))
        keys = keyring.then(node)
        candidates = keys.candidates(image_name(ref))
        if not candidates:
            try:
                return call(client, ref, keys, deadline)
            except AuthError as e:
                raise _explained(e, provider_errors) from None
        first = None
        for credential in candidates:
            try:
                return call(client, ref, keys.pinned(ref.host, credential), deadline)
            except (AuthError, NotFound) as e:   # the kubelet, too, tries the next credential
                first = first or e
        if isinstance(first, AuthError):
            raise _explained(first, provider_errors) from None
        assert first is not None   # candidates is not empty
        raise first


def _explained(error: AuthError, provider_errors) -> AuthError:
    """A refusal that a failed credential provider may explain says so."""
    if not provider_errors or isinstance(error, CredentialProviderError):
        return error
    failed = provider_errors[0]
    return CredentialProviderError(
        f"{error} (credential provider {failed.provider} failed: {failed.reason})",
        provider=failed.provider, reason=failed.reason, host=error.host,
        repository=error.repository, status=error.status)


def _count_mirror(outcome: str) -> None:
    # Imported on first use: only the serving processes record metrics (see archway.metrics).
    from archway import metrics
    metrics.MIRROR_REQUESTS.labels(outcome).inc()
