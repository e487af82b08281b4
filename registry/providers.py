"""Kubelet image credential provider plugins, run the way the kubelet runs them.

The same files as the kubelet's `--image-credential-provider-config` and
`--image-credential-provider-bin-dir`: a CredentialProviderConfig (kubelet.config.k8s.io/v1)
lists plugins (ecr-credential-provider, auth-provider-gcp, acr-credential-provider...) with the
images they serve. For a matching image, archway executes the plugin (never through a shell) with
a CredentialProviderRequest on stdin and reads a CredentialProviderResponse from stdout; its
credentials are cached per image, per registry or globally for cacheDuration (else the provider's
defaultCacheDuration), exactly as the kubelet caches them.

A plugin is bounded in time (killed with its process group) and in output; when it fails, the
failure is a typed CredentialProviderError carrying its stderr, a warning in the log, and the
image is looked up without that plugin's credentials.
"""
import json
import logging
import os
import re
import selectors
import signal
import subprocess
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass

import yaml

from archway.errors import ConfigError, CredentialProviderError

from .credentials import Credential, Keyring
from .filewatch import WatchedFile
from .imagematch import image_matches, registry_key, registry_of

log = logging.getLogger(__name__)

CONFIG_API_VERSIONS = ("kubelet.config.k8s.io/v1", "kubelet.config.k8s.io/v1beta1",
                       "kubelet.config.k8s.io/v1alpha1")
PLUGIN_API_VERSIONS = ("credentialprovider.kubelet.k8s.io/v1",
                       "credentialprovider.kubelet.k8s.io/v1beta1",
                       "credentialprovider.kubelet.k8s.io/v1alpha1")
CACHE_KEY_TYPES = ("Image", "Registry", "Global")
GLOBAL_CACHE_KEY = "global"
MAX_CONFIG_BYTES = 1024 * 1024
MAX_STDOUT_BYTES = 1024 * 1024        # real answers are a few KiB (one token per registry)
MAX_STDERR_SHOWN = 1000               # characters of stderr kept for the error message
CACHE_PURGE_SECONDS = 15 * 60         # the kubelet's cachePurgeInterval
MAX_CACHE_ENTRIES = 10_000


@dataclass(frozen=True)
class ProviderSpec:
    """One `providers[]` entry of a CredentialProviderConfig."""
    name: str
    match_images: tuple[str, ...]
    default_cache_duration: float      # seconds
    api_version: str
    args: tuple[str, ...] = ()
    env: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True)
class PluginResponse:
    cache_key_type: str
    cache_duration: float | None       # None: the provider's defaultCacheDuration
    auth: tuple[tuple[str, str, str], ...]   # (key, username, password)


# --------------------------------------------------------------------------------------------
# The CredentialProviderConfig file (or directory of files, as the kubelet reads it)


def read_provider_config(path: str) -> tuple[ProviderSpec, ...]:
    """Every provider of the config at `path` (a file, or a directory whose *.json/*.yaml/*.yml
    files are read in lexical order and merged); ConfigError saying what is wrong."""
    if os.path.isdir(path):
        try:
            names = sorted(n for n in os.listdir(path)
                           if os.path.splitext(n)[1] in (".json", ".yaml", ".yml")
                           and not os.path.isdir(os.path.join(path, n)))
        except OSError as e:
            raise ConfigError(f"cannot read credential provider config directory {path}: "
                              f"{e.strerror}") from None
        if not names:
            raise ConfigError(f"credential provider config directory {path} holds no "
                              f"*.json, *.yaml or *.yml file")
        files = [os.path.join(path, n) for n in names]
    else:
        files = [path]
    providers: list[ProviderSpec] = []
    for file in files:
        for spec in parse_provider_config(_read(file), file):
            if any(p.name == spec.name for p in providers):
                raise ConfigError(f"{file}: duplicate provider name {spec.name!r}")
            providers.append(spec)
    return tuple(providers)


def _read(path: str) -> bytes:
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_CONFIG_BYTES + 1)
    except OSError as e:
        raise ConfigError(f"cannot read credential provider config {path}: {e.strerror}") from None
    if len(data) > MAX_CONFIG_BYTES:
        raise ConfigError(f"credential provider config {path} is larger than {MAX_CONFIG_BYTES} bytes")
    return data


_CONFIG_FIELDS = {"apiVersion", "kind", "providers"}
_PROVIDER_FIELDS = {"name", "matchImages", "defaultCacheDuration", "apiVersion", "args", "env",
                    "tokenAttributes"}


def parse_provider_config(data: bytes, source: str) -> tuple[ProviderSpec, ...]:
    """Decode and validate one CredentialProviderConfig document, as strictly as the kubelet."""
    try:
        document = yaml.safe_load(data)
    except yaml.YAMLError as e:
        raise ConfigError(f"{source}: not valid YAML or JSON ({e})") from None
    if not isinstance(document, dict):
        raise ConfigError(f"{source}: expected a CredentialProviderConfig object")
    _no_unknown(document, _CONFIG_FIELDS, source)
    if document.get("kind") != "CredentialProviderConfig":
        raise ConfigError(f"{source}: kind must be CredentialProviderConfig, got "
                          f"{document.get('kind')!r}")
    if document.get("apiVersion") not in CONFIG_API_VERSIONS:
        raise ConfigError(f"{source}: apiVersion must be one of {', '.join(CONFIG_API_VERSIONS)}, "
                          f"got {document.get('apiVersion')!r}")
    entries = document.get("providers")
    if not isinstance(entries, list) or not entries:
        raise ConfigError(f"{source}: providers: at least 1 item is required")
    specs, seen = [], set()
    for i, entry in enumerate(entries):
        spec = _provider(entry, f"{source}: providers[{i}]")
        if spec.name in seen:
            raise ConfigError(f"{source}: providers[{i}].name: duplicate value {spec.name!r}")
        seen.add(spec.name)
        specs.append(spec)
    return tuple(specs)


def _provider(entry, where: str) -> ProviderSpec:
    if not isinstance(entry, dict):
        raise ConfigError(f"{where} must be an object")
    _no_unknown(entry, _PROVIDER_FIELDS, where)
    name = entry.get("name")
    if not isinstance(name, str) or not name or name in (".", "..") or "/" in name or " " in name:
        raise ConfigError(f"{where}.name must be the executable's file name in the bin dir "
                          f"(no '/', no spaces, not '.' or '..'), got {name!r}")
    api_version = entry.get("apiVersion")
    if api_version not in PLUGIN_API_VERSIONS:
        raise ConfigError(f"{where}.apiVersion must be one of {', '.join(PLUGIN_API_VERSIONS)}, "
                          f"got {api_version!r}")
    match_images = entry.get("matchImages")
    if not isinstance(match_images, list) or not match_images \
            or not all(isinstance(m, str) and registry_key(m) for m in match_images):
        raise ConfigError(f"{where}.matchImages must be a non-empty list of image patterns "
                          f"(host[:port][/path], '*' globs in host labels)")
    duration = entry.get("defaultCacheDuration")
    if duration is None:
        raise ConfigError(f"{where}.defaultCacheDuration is required (e.g. \"12h\")")
    try:
        default_cache = parse_duration(duration)
    except ValueError as e:
        raise ConfigError(f"{where}.defaultCacheDuration: {e}") from None
    if default_cache < 0:
        raise ConfigError(f"{where}.defaultCacheDuration must be greater than or equal to 0")
    if entry.get("tokenAttributes") is not None:
        raise ConfigError(f"{where}.tokenAttributes: service account token mode needs a token of "
                          f"the pod's ServiceAccount, which archway does not request; remove it")
    args = entry.get("args") or []
    if not isinstance(args, list) or not all(isinstance(a, str) for a in args):
        raise ConfigError(f"{where}.args must be a list of strings")
    env = entry.get("env") or []
    if not isinstance(env, list) or not all(
            isinstance(e, dict) and set(e) <= {"name", "value"} and isinstance(e.get("name"), str)
            and e["name"] and isinstance(e.get("value", ""), str) for e in env):
        raise ConfigError(f"{where}.env must be a list of {{name, value}} strings")
    return ProviderSpec(name, tuple(match_images), default_cache, api_version, tuple(args),
                        tuple((e["name"], e.get("value", "")) for e in env))


def _no_unknown(obj: dict, known: set, where: str) -> None:
    unknown = sorted(str(k) for k in obj if k not in known)
    if unknown:
        raise ConfigError(f"{where}: unknown field(s) {', '.join(unknown)}")


_DURATION_PART = re.compile(r"(\d+\.?\d*|\.\d+)(ns|us|µs|μs|ms|s|m|h)")
_UNITS = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "μs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0,
          "h": 3600.0}


def parse_duration(text) -> float:
    """A Go duration string (metav1.Duration: "12h", "1h30m", "1.5s", "0") in seconds."""
    if not isinstance(text, str):
        raise ValueError(f"must be a duration string such as \"5m\", got {text!r}")
    body = text[1:] if text[:1] in "+-" else text
    sign = -1.0 if text.startswith("-") else 1.0
    if body == "0":
        return 0.0
    total, pos = 0.0, 0
    while pos < len(body):
        part = _DURATION_PART.match(body, pos)
        if part is None:
            break
        total += float(part.group(1)) * _UNITS[part.group(2)]
        pos = part.end()
    if not body or pos != len(body):
        raise ValueError(f"invalid duration {text!r} (use a number and a unit: 300ms, 5m, 12h)")
    return sign * total


# --------------------------------------------------------------------------------------------
# One plugin run


def request_body(spec: ProviderSpec, image: str) -> bytes:
    """The CredentialProviderRequest, encoded as the kubelet encodes it."""
    return json.dumps({"kind": "CredentialProviderRequest", "apiVersion": spec.api_version,
                       "image": image}, separators=(",", ":")).encode() + b"\n"


def run_plugin(spec: ProviderSpec, bin_dir: str, image: str, timeout: float,
               environ=None) -> PluginResponse:
    """Execute the plugin for `image`; its answer, or CredentialProviderError."""
    path = os.path.join(bin_dir, spec.name)
    env = dict(os.environ if environ is None else environ)
    env.update(spec.env)   # the config's variables win, as in the kubelet
    fail = _failure(spec, image)
    try:
        process = subprocess.Popen([path, *spec.args], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                   stderr=subprocess.PIPE, env=env, close_fds=True,
                                   start_new_session=True)   # its own group: killed as a whole
    except OSError as e:
        raise fail("exec_error", f"cannot execute {path}: {e.strerror}") from None
    try:
        stdout, stderr = _communicate(process, request_body(spec, image), timeout, fail)
    finally:
        _kill(process)
    if process.returncode != 0:
        raise fail("exit_status", f"exited with status {process.returncode}", stderr)
    return parse_response(stdout, spec, fail)


def _communicate(process, request: bytes, timeout: float, fail) -> tuple[bytes, bytes]:
    """Write the request, read stdout and stderr until both close, within `timeout` and with
    stdout bounded; then wait for the exit status."""
    deadline = time.monotonic() + timeout
    try:
        process.stdin.write(request)   # far below a pipe buffer: never blocks
        process.stdin.close()
    except BrokenPipeError:
        pass   # it exited or closed stdin without reading: its exit status will tell
    out, err = bytearray(), bytearray()
    with selectors.DefaultSelector() as selector:
        selector.register(process.stdout, selectors.EVENT_READ, out)
        selector.register(process.stderr, selectors.EVENT_READ, err)
        while selector.get_map():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise fail("timeout", f"did not answer within {timeout:g} s: killed", err)
            for key, _ in selector.select(remaining):
                chunk = os.read(key.fd, 65536)
                if not chunk:
                    selector.unregister(key.fileobj)
                    continue
                buffer = key.data
                if buffer is out and len(out) + len(chunk) > MAX_STDOUT_BYTES:
                    raise fail("output_too_large",
                               f"wrote more than {MAX_STDOUT_BYTES} bytes to stdout: killed", err)
                if buffer is out or len(err) < MAX_STDERR_SHOWN * 4:
                    buffer.extend(chunk)
    try:
        process.wait(max(0.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        raise fail("timeout", f"did not exit within {timeout:g} s: killed", err) from None
    return bytes(out), bytes(err)


def _kill(process) -> None:
    """The plugin and anything it left running, by its process group (the plugin's own session:
    nothing else is in it); then reap it."""
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    process.wait()
    for pipe in (process.stdin, process.stdout, process.stderr):
        if pipe is not None and not pipe.closed:
            pipe.close()


def _failure(spec: ProviderSpec, image: str):
    def fail(reason: str, what: str, stderr: bytes = b"") -> CredentialProviderError:
        text = f"credential provider {spec.name} for {image} {what}"
        shown = _printable(stderr)
        if shown:
            text += f"; its stderr: {shown}"
        _count(spec.name, reason)
        return CredentialProviderError(text, provider=spec.name, reason=reason,
                                       host=registry_of(image))
    return fail


def _count(provider: str, outcome: str) -> None:
    # Imported on first use: `archway serve` must choose the metrics storage before anything
    # imports prometheus_client, and its start-up check reads the provider config.
    from archway import metrics
    metrics.CREDENTIAL_PROVIDER_CALLS.labels(provider, outcome).inc()


def _printable(data: bytes) -> str:
    text = data.decode("utf-8", "replace").strip()
    text = "".join(c if c.isprintable() else " " for c in text)
    return text if len(text) <= MAX_STDERR_SHOWN else text[:MAX_STDERR_SHOWN - 3] + "..."


_RESPONSE_FIELDS = {"apiVersion", "kind", "cacheKeyType", "cacheDuration", "auth"}


def parse_response(data: bytes, spec: ProviderSpec, fail=None) -> PluginResponse:
    """Decode a CredentialProviderResponse as strictly as the kubelet. Errors never quote the
    answer: it holds credentials."""
    fail = fail or _failure(spec, "?")

    def invalid(what: str) -> CredentialProviderError:
        return fail("invalid_response", f"answered an unusable CredentialProviderResponse: {what}")

    try:
        document = json.loads(data, object_pairs_hook=_unique_keys)
    except (ValueError, UnicodeDecodeError):
        raise invalid("stdout is not a JSON object") from None
    if not isinstance(document, dict):
        raise invalid("stdout is not a JSON object")
    if document.get("apiVersion") != spec.api_version:
        raise invalid(f"apiVersion {str(document.get('apiVersion'))[:80]!r} is not the "
                      f"configured {spec.api_version}")
    if document.get("kind") != "CredentialProviderResponse":
        raise invalid(f"kind {str(document.get('kind'))[:80]!r} is not CredentialProviderResponse")
    unknown = sorted(k for k in document if k not in _RESPONSE_FIELDS)
    if unknown:
        raise invalid(f"unknown field(s) {', '.join(k[:40] for k in unknown[:5])}")
    key_type = document.get("cacheKeyType")
    if key_type not in CACHE_KEY_TYPES:
        raise invalid(f"cacheKeyType must be Image, Registry or Global, got {str(key_type)[:40]!r}")
    duration = document.get("cacheDuration")
    if duration is not None:
        try:
            duration = parse_duration(duration)
        except ValueError:
            raise invalid("cacheDuration is not a duration") from None
    auth = document.get("auth") or {}
    if not isinstance(auth, dict):
        raise invalid("auth is not an object")
    entries = []
    for key, entry in auth.items():
        if not isinstance(entry, dict) or not set(entry) <= {"username", "password"} \
                or not all(isinstance(v, str) for v in entry.values()):
            raise invalid("an auth entry is not {username, password}")
        if not registry_key(key):
            raise invalid("an auth key names no registry")
        entries.append((key, entry.get("username", ""), entry.get("password", "")))
    return PluginResponse(key_type, duration, tuple(entries))


def _unique_keys(pairs):
    keys = [k for k, _ in pairs]
    if len(keys) != len(set(keys)):
        raise ValueError("duplicate field")
    return dict(pairs)


# --------------------------------------------------------------------------------------------
# Caching as the kubelet caches (pkg/credentialprovider/plugin/plugin.go)


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
        self._cache: dict[str, tuple[float, tuple[Credential, ...]]] = {}
        self._flights: dict[str, Future] = {}
        self._last_purge = clock()

    def matches(self, image: str) -> bool:
        return any(image_matches(pattern, image) for pattern in self.spec.match_images)

    def provide(self, image: str) -> tuple[Credential, ...]:
        """Credentials for `image` (a repository name); () when the plugin does not serve it."""
        if not self.matches(image):
            return ()
        cached = self._cached(image)
        if cached is not None:
            return cached
        with self._lock:
            running = self._flights.get(image)
            if running is None:
                flight: Future = Future()
                self._flights[image] = flight
        if running is not None:
            return running.result()   # another thread is running the plugin for this image
        try:
            credentials = self._fetch(image)
            flight.set_result(credentials)
            return credentials
        except BaseException as e:
            flight.set_exception(e)
            raise
        finally:
            with self._lock:
                self._flights.pop(image, None)

    def _fetch(self, image: str) -> tuple[Credential, ...]:
        response = self._run(self.spec, self.bin_dir, image, self.timeout)
        _count(self.spec.name, "success")
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
        with self._lock:
            self._cache[key] = (self._clock() + duration, credentials)
            while len(self._cache) > MAX_CACHE_ENTRIES:
                self._cache.pop(next(iter(self._cache)))
        return credentials

    def _cached(self, image: str) -> tuple[Credential, ...] | None:
        """The unexpired entry for the image, else its registry, else the global one."""
        now = self._clock()
        with self._lock:
            if now - self._last_purge > CACHE_PURGE_SECONDS:
                self._cache = {k: v for k, v in self._cache.items() if v[0] >= now}
                self._last_purge = now
            for key in (image, registry_of(image), GLOBAL_CACHE_KEY):
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
            try:
                found.extend(plugin.provide(image))
            except CredentialProviderError as e:
                log.warning("%s; looking the image up without its credentials", e)
                errors.append(e)
        return Keyring(found), tuple(errors)

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
