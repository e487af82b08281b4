"""Registry credentials a pod pulls with as its own workload identity (KEP-4412): the credential
provider plugins whose config has `tokenAttributes`, run as the kubelet runs them for the pod.

For each of the pod's images such a provider serves, archway requests a token of the pod's own
ServiceAccount (TokenRequest, for the provider's audience only, with the shortest lifetime the
API server allows) and gives it to the plugin with the annotations the provider names, as the
kubelet does. A ServiceAccount that lacks a required annotation (or is missing, when the provider
requires one) gets nothing from that provider: the kubelet would pull without its credentials,
so archway reads the image so too, and the pod's warnings say why.

This lets archway act as the workload, so it is off unless the operator opts namespaces in
(kubernetes.service_account_token_namespaces; the chart's rbac.serviceAccountTokenNamespaces
grants `create serviceaccounts/token` there and nowhere else). A token is reused while it has
more than a fifth of its life left (the kubelet's token manager does the same) and is never
logged, put in an error, an Event or a metric. The plugin runs within the caller's deadline, as
the API reads do (the gate controller's retries have more time than an admission).
"""
import logging
import threading
import time
from datetime import datetime

from archway.errors import ArchwayError, CredentialProviderError
from archway.kubeapi import KubeApi
from archway.podview import PodView
from archway.registry.access import image_name
from archway.registry.cache import TTLCache
from archway.registry.credentials import Credential, Keyring
from archway.registry.providerconfig import TokenAttributes
from archway.registry.providerplugin import WorkloadIdentity
from archway.registry.providers import CredentialProviders, PluginProvider
from archway.registry.reference import KINDS, parse_reference

from .apireads import MIN_CALL_TIMEOUT, ReadFailed, call_api

log = logging.getLogger(__name__)

TOKEN_SECONDS = 600          # the API server's minimum expirationSeconds
REUSE_FRACTION = 0.8         # a token older than this part of its life is requested again
MAX_ENTRIES = 10_000
LOCK_STRIPES = 64            # TokenRequests under way at once, at most, each for its own key


class WorkloadIdentities:
    def __init__(self, api: KubeApi | None, providers: CredentialProviders, *,
                 namespaces: tuple[str, ...] = (), cache_seconds: float = 60.0,
                 clock=time.monotonic):
        """`namespaces`: kubernetes.service_account_token_namespaces, where archway may request
        tokens of a pod's ServiceAccount ("*": every namespace; empty: nowhere)."""
        self.api = api
        self.providers = providers
        self.namespaces = frozenset(namespaces)
        self.cache_seconds = cache_seconds
        self._clock = clock
        self._accounts = TTLCache(MAX_ENTRIES, clock)   # ServiceAccounts read (uid, annotations)
        self._tokens = TTLCache(MAX_ENTRIES, clock)     # (namespace, name, uid, audience) -> identity
        self._stripes = [threading.Lock() for _ in range(LOCK_STRIPES)]
        if providers.token_plugins() and not self.namespaces:
            log.warning("credential provider(s) %s want the pod's ServiceAccount token, but no "
                        "namespace is in kubernetes.service_account_token_namespaces: their "
                        "images are read without their credentials",
                        ", ".join(p.spec.name for p in providers.token_plugins()))

    def credentials_for(self, pod: PodView, deadline: float) -> tuple[Keyring, tuple[str, ...], bool]:
        """The token-mode providers' credentials for the pod's images, the warnings to show
        its author, and whether everything was read (False: the deadline passed)."""
        wanted = self._wanted(pod)
        if not wanted:
            return Keyring.empty(), (), True
        names = ", ".join(sorted({p.spec.name for _, p in wanted}))
        namespace, account = pod.namespace, pod.service_account or "default"
        if self.api is None:
            return Keyring.empty(), (f"images not read as ServiceAccount {namespace}/{account} "
                                     f"(no Kubernetes API configured): credential provider "
                                     f"{names}",), True
        if "*" not in self.namespaces and namespace not in self.namespaces:
            # Not opted in: no token is requested, and the pod's author learns why.
            return Keyring.empty(), (f"images not read as ServiceAccount {namespace}/{account} "
                                     f"(namespace {namespace} is not in archway's "
                                     f"rbac.serviceAccountTokenNamespaces): credential provider "
                                     f"{names}",), True
        found: list[Credential] = []
        warnings: list[str] = []
        complete = True
        for image, plugin in wanted:
            try:
                identity = self._identity(plugin, namespace, account, deadline)
                found.extend(plugin.provide(image, identity, self._remaining(deadline)))
            except ReadFailed as e:
                complete = complete and not e.late
                _add(warnings, str(e))
            except CredentialProviderError as e:
                log.warning("%s; looking the image up without its credentials", e)
                _add(warnings, f"{e}; read without its credentials")
        return Keyring(found), tuple(warnings), complete

    def _remaining(self, deadline: float) -> float:
        """The plugin runs within the caller's (the admission's) time, like the API reads."""
        remaining = deadline - self._clock()
        if remaining < MIN_CALL_TIMEOUT:
            raise ReadFailed("credential provider not run: the admission deadline passed",
                             ttl=0, late=True)
        return remaining

    def _wanted(self, pod: PodView) -> list[tuple[str, PluginProvider]]:
        """(repository name, token-mode provider) for each of the pod's images it serves."""
        plugins = self.providers.token_plugins()
        if not plugins:
            return []
        wanted = []
        for image in pod.images:
            try:
                ref = parse_reference(image)
            except ArchwayError:
                continue   # the resolver says what is wrong with it
            if not KINDS[ref.scheme].pull_secrets:
                continue
            name = image_name(ref)
            wanted += [(name, p) for p in plugins if p.matches(name)]
        return wanted

    def _identity(self, plugin: PluginProvider, namespace: str, account: str,
                  deadline: float) -> WorkloadIdentity | None:
        """The ServiceAccount's token for the provider's audience, with the annotations it
        names; None when the ServiceAccount does not exist. ReadFailed saying what is missing."""
        attributes = _attributes(plugin)
        found = self._account(namespace, account, deadline)
        if found is None:
            if attributes.require_service_account:
                raise ReadFailed(f"ServiceAccount {namespace}/{account} not found: credential "
                                 f"provider {plugin.spec.name} requires one, so the kubelet "
                                 f"pulls without its credentials", ttl=0)
            return None
        uid, annotations = found
        missing = [k for k in attributes.required_annotations if k not in annotations]
        if missing:
            raise ReadFailed(f"ServiceAccount {namespace}/{account} lacks the annotation "
                             f"{', '.join(missing)} that credential provider {plugin.spec.name} "
                             f"requires: the kubelet pulls without its credentials, and so "
                             f"archway reads the image", ttl=0)
        named = tuple((k, annotations[k]) for k in attributes.required_annotations
                      + attributes.optional_annotations if k in annotations)
        key = (namespace, account, uid, attributes.audience)
        token = self._tokens.get(key) or self._token(key, deadline)
        if isinstance(token, ReadFailed):
            raise token
        return WorkloadIdentity(namespace, account, uid, token.token, token.expires, named)

    def _token(self, key: tuple, deadline: float):
        """A new token for `key`, or the failure to repeat; one request at a time per key: a
        burst of a ServiceAccount's pods waits for the first one's token."""
        lock = self._stripes[hash(key) % len(self._stripes)]
        if not lock.acquire(timeout=max(0.0, deadline - self._clock())):
            raise ReadFailed("not read: the admission deadline passed", ttl=0, late=True)
        try:
            token = self._tokens.get(key)
            if token is not None:
                return token   # the pod before this one asked
            try:
                namespace, name, uid, audience = key
                token = self._request_token(namespace, name, uid, audience, deadline)
            except ReadFailed as e:
                if e.ttl > 0:   # a refusal is repeated for a few seconds, not asked per pod
                    self._tokens.put(key, e, e.ttl)
                raise
            self._tokens.put(key, token, (token.expires - self._clock()) * REUSE_FRACTION)
            return token
        finally:
            lock.release()

    def _account(self, namespace: str, name: str, deadline: float):
        """(uid, annotations) of the ServiceAccount, read at most once per cache_seconds;
        None when it does not exist."""
        key = (namespace, name)
        cached = self._accounts.get(key)
        if isinstance(cached, ReadFailed):
            raise cached
        if cached is not None:
            return cached or None
        assert self.api is not None   # credentials_for asks nothing without an API
        try:
            obj = call_api(self.api, f"/api/v1/namespaces/{namespace}/serviceaccounts/{name}",
                           deadline, self._clock)
        except ReadFailed as e:
            if e.status == 404:
                self._accounts.put(key, (), e.ttl)
                return None
            failed = ReadFailed(f"ServiceAccount {namespace}/{name}: {e}", ttl=e.ttl, late=e.late)
            if e.ttl > 0:
                self._accounts.put(key, failed, e.ttl)
            raise failed from None
        meta = _mapping(obj.get("metadata"))
        annotations = _mapping(meta.get("annotations"))
        found = (str(meta.get("uid") or ""),
                 {k: v for k, v in annotations.items() if isinstance(v, str)})
        self._accounts.put(key, found, self.cache_seconds)
        return found

    def _request_token(self, namespace: str, name: str, uid: str, audience: str,
                       deadline: float) -> WorkloadIdentity:
        from archway import metrics  # only the serving processes record metrics
        path = f"/api/v1/namespaces/{namespace}/serviceaccounts/{name}/token"
        body = {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest",
                "spec": {"audiences": [audience], "expirationSeconds": TOKEN_SECONDS}}
        asked = self._clock()
        assert self.api is not None   # credentials_for asks nothing without an API
        try:
            answer = call_api(self.api, path, deadline, self._clock, method="POST", body=body)
        except ReadFailed as e:
            metrics.SERVICE_ACCOUNT_TOKENS.labels("refused" if e.status else "failed").inc()
            words = (f"archway may not request its token (HTTP {e.status}; check "
                     f"rbac.serviceAccountTokenNamespaces)") if e.status in (401, 403) else str(e)
            raise ReadFailed(f"ServiceAccount {namespace}/{name}: {words}", status=e.status,
                             ttl=e.ttl, late=e.late) from None
        status = _mapping(answer.get("status"))
        token = status.get("token")
        if not isinstance(token, str) or not token:
            metrics.SERVICE_ACCOUNT_TOKENS.labels("failed").inc()
            raise ReadFailed(f"ServiceAccount {namespace}/{name}: the TokenRequest's answer "
                             f"holds no token", ttl=0)
        metrics.SERVICE_ACCOUNT_TOKENS.labels("issued").inc()
        return WorkloadIdentity(namespace, name, uid, token,
                                asked + _lifetime(status.get("expirationTimestamp")))


def _lifetime(timestamp) -> float:
    """Seconds until the token's expirationTimestamp; TOKEN_SECONDS when it says nothing usable
    (never longer: the clock of the API server may be ahead)."""
    try:
        expires = datetime.fromisoformat(str(timestamp).replace("Z", "+00:00")).timestamp()
    except ValueError:
        return float(TOKEN_SECONDS)
    return max(0.0, min(float(TOKEN_SECONDS), expires - time.time()))


def _attributes(plugin: PluginProvider) -> TokenAttributes:
    assert plugin.spec.token is not None   # token_plugins() are the providers that have them
    return plugin.spec.token


def _mapping(value) -> dict:
    return value if isinstance(value, dict) else {}


def _add(warnings: list[str], warning: str) -> None:
    if warning not in warnings:
        warnings.append(warning)
