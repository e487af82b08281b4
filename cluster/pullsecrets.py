"""Registry credentials of a pod: its imagePullSecrets and those of its ServiceAccount.

Read through the Kubernetes API with the process's client (archway.kubeclient: a configured
kubeconfig, else in-cluster config, else $KUBECONFIG or ~/.kube/config, else none) and cached
for kubernetes.secret_cache_seconds. Anything that goes wrong (API down, 403, a missing or
malformed secret) costs only that secret: the pod is resolved with what is left, and a short
warning says what was skipped. The global keyring of registry.credentials_file is merged in by
the resolver, not here.

A ServiceAccount's imagePullSecrets come from a list + watch of ServiceAccounts
(serviceaccounts.py) when one is given (from_config's): no request per pod, and a change is seen
when the watch delivers it. A GET, cached as above, only for one the watch has not delivered yet
(just created, or the list is not in: no RBAC to list, API down). The ServiceAccount's secrets
are used even when the pod lists its own: whoever may create a pod with that ServiceAccount may
also pull with them (leaving imagePullSecrets out makes the ServiceAccount admission plugin copy
them in), so this leaks nothing.

Then what the pod pulls with as its own identity: the credential provider plugins in service
account token mode (workloadidentity.py), after the pull secrets, as in the kubelet.
"""
import base64
import binascii
import logging
import time
from dataclasses import dataclass

from archway.errors import ArchwayError, ConfigError
from archway.kubeapi import KubeApi
from archway.kubeclient import api_client_factory, api_kind, build_api_client
from archway.podview import PodView
from archway.registry.cache import TTLCache
from archway.registry.credentials import Keyring
from archway.registry.providers import CredentialProviders

from .apireads import ReadFailed, call_api
from .serviceaccounts import ServiceAccountCache
from .workloadidentity import WorkloadIdentities

log = logging.getLogger(__name__)

_SECRET_KEYS = {"kubernetes.io/dockerconfigjson": ".dockerconfigjson",
                "kubernetes.io/dockercfg": ".dockercfg"}


@dataclass(frozen=True)
class PullCredentials:
    keyring: Keyring
    warnings: tuple[str, ...] = ()
    secrets_used: int = 0
    complete: bool = True   # False: an object was not read, for the deadline had passed


@dataclass(frozen=True)
class _Unavailable:
    """A failure: the warning to repeat while it lasts (cached), or `late`: not read at all,
    the deadline had passed (never cached)."""
    warning: str
    late: bool = False


class PullSecrets:
    def __init__(self, api_client, *, cache_seconds: float = 60.0, source: str = "none",
                 clock=time.monotonic, accounts: ServiceAccountCache | None = None,
                 namespaces: tuple[str, ...] = ("*",),
                 identities: WorkloadIdentities | None = None):
        """`namespaces`: kubernetes.pull_secret_namespaces, where archway may read Secrets
        (the chart's rbac.pullSecretNamespaces); "*" every namespace. `identities`: the
        token-mode credential providers; None: none configured."""
        self.api = KubeApi(api_client) if api_client is not None else None
        self.namespaces = frozenset(namespaces)
        self.accounts = accounts              # the ServiceAccounts' watch; None: GETs only
        self.source = source                  # for the start-up log: where the API was found
        self.cache_seconds = cache_seconds
        self._clock = clock
        self._cache = TTLCache(10_000, clock)
        self.identities = identities

    @property
    def api_kind(self) -> str:
        """Where the API was found, as /readyz may show it: "kubeconfig", "in-cluster"..."""
        return api_kind(self.source, connected=self.api is not None)

    @classmethod
    def from_config(cls, config, client_factory=None) -> "PullSecrets":
        """`client_factory`: the process's (wiring.py's), which the ServiceAccounts' watch reads
        through; None: one of its own."""
        api_client, source = build_api_client(config.kubernetes)
        accounts = None
        if api_client is not None:
            accounts = ServiceAccountCache(client_factory
                                           or api_client_factory(config.kubernetes))
        providers = CredentialProviders.from_settings(config.registry.credential_providers)
        identities = None
        if providers is not None and providers.token_plugins():
            identities = WorkloadIdentities(
                KubeApi(api_client) if api_client is not None else None, providers,
                namespaces=config.kubernetes.service_account_token_namespaces,
                cache_seconds=config.kubernetes.secret_cache_seconds)
        return cls(api_client, cache_seconds=config.kubernetes.secret_cache_seconds,
                   source=source, accounts=accounts,
                   namespaces=config.kubernetes.pull_secret_namespaces, identities=identities)

    def credentials_for(self, pod: PodView, deadline: float) -> PullCredentials:
        """The keyring of `pod` in its namespace, its pull secrets' then its workload
        identity's; stops asking the API at `deadline`."""
        secrets = self._pull_secrets(pod, deadline)
        if self.identities is None:
            return secrets
        keyring, warnings, complete = self.identities.credentials_for(pod, deadline)
        return PullCredentials(secrets.keyring.merged(keyring), secrets.warnings + warnings,
                               secrets.secrets_used, secrets.complete and complete)

    def _pull_secrets(self, pod: PodView, deadline: float) -> PullCredentials:
        names = list(pod.pull_secret_names)
        namespace = pod.namespace
        if self.api is None:
            unread = (f"pull secrets not read (no Kubernetes API configured): "
                      f"{_join(names)}",) if names and self.source != "disabled" else ()
            return PullCredentials(Keyring.empty(), unread)
        if "*" not in self.namespaces and namespace not in self.namespaces:
            # Not granted (a 403 per pod would tell nothing new): the node's credentials only,
            # and the pod's author learns why the secrets it names went unread.
            unread = (f"pull secrets not read (namespace {namespace} is not in archway's "
                      f"rbac.pullSecretNamespaces): {_join(names)}",) if names else ()
            return PullCredentials(Keyring.empty(), unread)
        warnings: list[str] = []
        account = pod.service_account or "default"
        account_secrets = self._service_account_secrets(namespace, account, deadline)
        complete = True
        if isinstance(account_secrets, _Unavailable):
            warnings.append(account_secrets.warning)
            complete = not account_secrets.late
        else:
            names += [n for n in account_secrets if n not in names]
        keyring, used = Keyring.empty(), 0
        for name in names:
            found = self._secret_keyring(namespace, name, deadline)
            if isinstance(found, _Unavailable):
                if found.warning not in warnings:
                    warnings.append(found.warning)
                complete = complete and not found.late
                continue
            keyring = keyring.merged(found)  # earlier secrets win for the same registry
            used += 1
        return PullCredentials(keyring, tuple(warnings), used, complete)

    # --- API reads, cached -----------------------------------------------------------------
    def _service_account_secrets(self, namespace: str, name: str, deadline: float):
        if self.accounts is not None:
            self.accounts.ensure_started()   # in this process: threads do not survive a fork
            watched = self.accounts.pull_secrets(namespace, name)
            if watched is not None:
                return watched
        key = ("serviceaccount", namespace, name)
        cached = self._cache.get(key)
        if cached is not None:
            return cached
        value: tuple[str, ...] | _Unavailable
        try:
            account = self._read(f"/api/v1/namespaces/{namespace}/serviceaccounts/{name}",
                                 deadline)
            value = tuple(_secret_names(account.get("imagePullSecrets")))
            ttl = self.cache_seconds
        except ReadFailed as e:
            value, ttl = _Unavailable(f"ServiceAccount {namespace}/{name}: {e}", e.late), e.ttl
            if e.status == 404:
                # No such ServiceAccount yet (the pod would be rejected later): nothing to use.
                value = ()
        if ttl > 0:
            self._cache.put(key, value, ttl)
        return value

    def _secret_keyring(self, namespace: str, name: str, deadline: float):
        key = ("secret", namespace, name)
        cached = self._cache.get(key)
        if cached is not None:
            return cached
        where = f"pull secret {namespace}/{name}"
        ttl = self.cache_seconds
        value: Keyring | _Unavailable
        try:
            value = _keyring_of(self._read(f"/api/v1/namespaces/{namespace}/secrets/{name}",
                                           deadline), where)
        except ReadFailed as e:
            value, ttl = _Unavailable(f"{where}: {e}", e.late), e.ttl
        except ArchwayError as e:
            log.warning("%s is unusable: %s", where, e)
            value = _Unavailable(f"{where} is not a usable docker config secret")
        if ttl > 0:
            self._cache.put(key, value, ttl)
        return value

    def _read(self, path: str, deadline: float) -> dict:
        assert self.api is not None  # credentials_for reads nothing without an API
        return call_api(self.api, path, deadline, self._clock)


def _secret_names(refs) -> list[str]:
    """Names from a list of LocalObjectReference; anything else is ignored (validation's job)."""
    if not isinstance(refs, list):
        return []
    return [r["name"] for r in refs if isinstance(r, dict) and isinstance(r.get("name"), str)
            and r["name"]]


def _keyring_of(secret: dict, where: str) -> Keyring:
    """Raise ConfigError when the secret is not a docker config secret."""
    secret_type = secret.get("type")
    data_key = _SECRET_KEYS.get(secret_type) if isinstance(secret_type, str) else None
    if data_key is None:
        raise ConfigError(f"{where} has type {secret_type!r}, not kubernetes.io/dockerconfigjson")
    encoded = (secret.get("data") or {}).get(data_key)
    if not isinstance(encoded, str):
        raise ConfigError(f"{where} has no {data_key} key")
    try:
        raw = base64.b64decode(encoded, validate=True)
    except (binascii.Error, ValueError):
        raise ConfigError(f"{where}: {data_key} is not base64") from None
    return Keyring.from_dockerconfigjson(raw, source=where)


def _join(names) -> str:
    text = ", ".join(names)
    return text if len(text) <= 50 else text[:47] + "..."


