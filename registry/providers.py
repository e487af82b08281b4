"""Kubelet image credential provider plugins, run the way the kubelet runs them.

The same files as the kubelet's `--image-credential-provider-config` and
`--image-credential-provider-bin-dir`: a CredentialProviderConfig (registry.providerconfig)
lists plugins (ecr-credential-provider, auth-provider-gcp, acr-credential-provider...) with the
images they serve. For a matching image, archway executes the plugin (registry.providerplugin)
and caches its credentials per image, per registry or globally for cacheDuration (else the
provider's defaultCacheDuration), exactly as the kubelet caches them
(pkg/credentialprovider/plugin/plugin.go).

A provider with `tokenAttributes` (KEP-4412) is run for a pod only, as its workload identity
(cluster/workloadidentity.py gives it the token): its answers are cached, as `cacheType` says, per
ServiceAccount (namespace, name, UID and the annotations it was given) or per token (and never
past the token's expiry). The node's lookups (`keyring_for`) run the other providers only.

When a plugin fails, the failure is a typed CredentialProviderError carrying its stderr, a
warning in the log, and the image is looked up without that plugin's credentials.
"""
import logging
import os
import threading
import time
from concurrent.futures import Future

from archway.errors import ConfigError, CredentialProviderError

from .credentials import Credential, Keyring
from .filewatch import WatchedFile
from .imagematch import image_matches, registry_key, registry_of
from .providerconfig import ProviderSpec, read_provider_config
from .providerplugin import WorkloadIdentity, count_call, run_plugin

log = logging.getLogger(__name__)

GLOBAL_CACHE_KEY = "global"
CACHE_PURGE_SECONDS = 15 * 60         # the kubelet's cachePurgeInterval
MAX_CACHE_ENTRIES = 10_000


class PluginProvider:
    """One configured plugin with its credential cache; thread-safe, one run per image at a time."""

    def __init__(self, spec: ProviderSpec, bin_dir: str, timeout: float, *, clock=time.monotonic,
                 run=run_plugin):
        self.spec = spec
        self.bin_dir = bin_dir
        self.timeout = timeout
        self._clock = clock
        self._run = run
        self._lock = threading.Lock()
        self._cache: dict[tuple, tuple[float, tuple[Credential, ...]]] = {}
        self._flights: dict[tuple, Future] = {}
        self._last_purge = clock()

    def matches(self, image: str) -> bool:
        return any(image_matches(pattern, image) for pattern in self.spec.match_images)

    def provide(self, image: str, identity: WorkloadIdentity | None = None,
                timeout: float | None = None) -> tuple[Credential, ...]:
        """Credentials for `image` (a repository name), as `identity` in token mode; () when the
        plugin does not serve it. `timeout`: a run ends then, if sooner than the provider's."""
        if not self.matches(image):
            return ()
        who = self._identity_key(identity)
        cached = self._cached(image, who)
        if cached is not None:
            return cached
        with self._lock:
            running = self._flights.get((image, who))
            if running is None:
                flight: Future = Future()
                self._flights[(image, who)] = flight
        if running is not None:
            return running.result()   # another thread is running the plugin for this image
        try:
            credentials = self._fetch(image, who, identity,
                                      self.timeout if timeout is None else min(timeout, self.timeout))
            flight.set_result(credentials)
            return credentials
        except BaseException as e:
            flight.set_exception(e)
            raise
        finally:
            with self._lock:
                self._flights.pop((image, who), None)

    def _identity_key(self, identity: WorkloadIdentity | None) -> tuple:
        """Whose answers an answer may be handed to: anyone (the node's), the ServiceAccount
        (that very object, with the same annotations) or the holder of that very token."""
        if identity is None or self.spec.token is None:
            return ()
        if self.spec.token.cache_type == "Token":
            return ("token", Credential("", password=identity.token).secret_fingerprint())
        return ("serviceaccount", identity.namespace, identity.name, identity.uid,
                identity.annotations)

    def _fetch(self, image: str, who: tuple, identity: WorkloadIdentity | None,
               timeout: float) -> tuple[Credential, ...]:
        response = self._run(self.spec, self.bin_dir, image, timeout, identity=identity)
        count_call(self.spec.name, "success")
        credentials = tuple(Credential(registry_key(key), user, password)
                            for key, user, password in response.auth)
        duration = response.cache_duration
        if duration is None:
            duration = self.spec.default_cache_duration
            if duration == 0:
                return credentials
        elif duration == 0:
            return credentials   # "0": do not cache this answer at all
        key = {"Image": image, "Registry": registry_of(image), "Global": GLOBAL_CACHE_KEY}[
            response.cache_key_type]
        expires = self._clock() + duration
        if who[:1] == ("token",) and identity is not None:
            expires = min(expires, identity.expires)   # not past the token it was read with
        with self._lock:
            self._cache[(key, who)] = (expires, credentials)
            while len(self._cache) > MAX_CACHE_ENTRIES:
                self._cache.pop(next(iter(self._cache)))
        return credentials

    def _cached(self, image: str, who: tuple) -> tuple[Credential, ...] | None:
        """The unexpired entry for the image, else its registry, else the global one; `who`'s."""
        now = self._clock()
        with self._lock:
            if now - self._last_purge > CACHE_PURGE_SECONDS:
                self._cache = {k: v for k, v in self._cache.items() if v[0] >= now}
                self._last_purge = now
            for key in ((image, who), (registry_of(image), who), (GLOBAL_CACHE_KEY, who)):
                entry = self._cache.get(key)
                if entry is None:
                    continue
                if now > entry[0]:
                    del self._cache[key]
                    continue
                return entry[1]
        return None


class CredentialProviders:
    """Every plugin of registry.credential_providers; the config is re-read when it changes."""

    def __init__(self, config_path: str, bin_dir: str, timeout: float, *, clock=time.monotonic,
                 run=run_plugin):
        self.bin_dir = os.path.expanduser(bin_dir)
        self.timeout = timeout
        self._clock = clock
        self._run = run
        self._config = WatchedFile(config_path, read_provider_config,
                                   what="registry.credential_providers.config")
        self._lock = threading.Lock()
        self._specs: tuple[ProviderSpec, ...] = ()
        self._plugins: tuple[PluginProvider, ...] = ()
        self._current()   # a broken config fails here, at start-up

    @classmethod
    def from_settings(cls, settings) -> "CredentialProviders | None":
        """None when no provider config is set; ConfigError when it cannot be used."""
        if not settings.config:
            return None
        if not settings.bin_dir:
            raise ConfigError("registry.credential_providers.config is set but "
                              "registry.credential_providers.bin_dir is not (the kubelet's "
                              "--image-credential-provider-bin-dir)")
        if not os.path.isdir(os.path.expanduser(settings.bin_dir)):
            raise ConfigError(f"registry.credential_providers.bin_dir {settings.bin_dir} is not a "
                              f"directory")
        providers = cls(settings.config, settings.bin_dir, settings.timeout_seconds)
        for spec in providers._specs:   # the kubelet, too, refuses to start without them
            path = os.path.join(providers.bin_dir, spec.name)
            if not (os.path.isfile(path) and os.access(path, os.X_OK)):
                raise ConfigError(f"credential provider {spec.name}: {path} is not an executable "
                                  f"file (registry.credential_providers.bin_dir)")
        return providers

    def keyring_for(self, image: str) -> tuple[Keyring, tuple[CredentialProviderError, ...]]:
        """Every matching plugin's credentials for `image`, in config order, as one keyring (for
        a key two plugins return, the first listed is tried first); and what failed."""
        found: list[Credential] = []
        errors: list[CredentialProviderError] = []
        for plugin in self._current():
            if plugin.spec.token is not None:
                continue   # a pod's, run with its identity (token_plugins)
            try:
                found.extend(plugin.provide(image))
            except CredentialProviderError as e:
                log.warning("%s; looking the image up without its credentials", e)
                errors.append(e)
        return Keyring(found), tuple(errors)

    def token_plugins(self) -> tuple[PluginProvider, ...]:
        """The providers with `tokenAttributes`, in config order: run for a pod, as its
        ServiceAccount."""
        return tuple(p for p in self._current() if p.spec.token is not None)

    def _current(self) -> tuple[PluginProvider, ...]:
        specs = self._config.get()
        if specs is self._specs:
            return self._plugins
        with self._lock:
            if specs is not self._specs:
                # A provider whose entry did not change keeps its cache across a config update.
                kept = {p.spec: p for p in self._plugins}
                self._plugins = tuple(
                    kept.get(spec) or PluginProvider(spec, self.bin_dir, self.timeout,
                                                     clock=self._clock, run=self._run)
                    for spec in specs)
                self._specs = specs
            return self._plugins
