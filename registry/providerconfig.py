"""The kubelet's CredentialProviderConfig (kubelet.config.k8s.io/v1), read as strictly as the
kubelet reads it: which plugins serve which images, with what arguments, environment and cache
duration, and which want a token of the pod's ServiceAccount (`tokenAttributes`, KEP-4412). A
file, or a directory of files merged in lexical order; ConfigError saying what is wrong."""
import os
import re
from dataclasses import dataclass

import yaml

from archway.errors import ConfigError

from .imagematch import registry_key

CONFIG_API_VERSIONS = ("kubelet.config.k8s.io/v1", "kubelet.config.k8s.io/v1beta1",
                       "kubelet.config.k8s.io/v1alpha1")
PLUGIN_API_VERSIONS = ("credentialprovider.kubelet.k8s.io/v1",
                       "credentialprovider.kubelet.k8s.io/v1beta1",
                       "credentialprovider.kubelet.k8s.io/v1alpha1")
MAX_CONFIG_BYTES = 1024 * 1024
TOKEN_CACHE_TYPES = ("Token", "ServiceAccount")
# An annotation key: an optional DNS-subdomain prefix and a name (a Kubernetes qualified name).
_QUALIFIED_NAME = re.compile(
    r"(?:(?=.{1,253}/)[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?"
    r"(?=.{1,63}$)[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?")


@dataclass(frozen=True)
class TokenAttributes:
    """A provider's `tokenAttributes`: the plugin is given a token of the pod's ServiceAccount
    for `audience` and these of its annotations; its answers are cached per ServiceAccount or
    per token (`cache_type`)."""
    audience: str
    cache_type: str                    # Token | ServiceAccount
    require_service_account: bool
    required_annotations: tuple[str, ...] = ()
    optional_annotations: tuple[str, ...] = ()


@dataclass(frozen=True)
class ProviderSpec:
    """One `providers[]` entry of a CredentialProviderConfig."""
    name: str
    match_images: tuple[str, ...]
    default_cache_duration: float      # seconds
    api_version: str
    args: tuple[str, ...] = ()
    env: tuple[tuple[str, str], ...] = ()
    token: TokenAttributes | None = None   # None: the node's plugin, run with no pod identity


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
    name = _name(entry.get("name"), where)
    api_version = _api_version(entry.get("apiVersion"), where)
    match_images = _match_images(entry.get("matchImages"), where)
    default_cache = _default_cache_duration(entry.get("defaultCacheDuration"), where)
    token = None
    if entry.get("tokenAttributes") is not None:
        token = _token_attributes(entry["tokenAttributes"], api_version, f"{where}.tokenAttributes")
    return ProviderSpec(name, match_images, default_cache, api_version,
                        _args(entry.get("args") or [], where), _env(entry.get("env") or [], where),
                        token)


_TOKEN_FIELDS = {"serviceAccountTokenAudience", "cacheType", "requireServiceAccount",
                 "requiredServiceAccountAnnotationKeys", "optionalServiceAccountAnnotationKeys"}


def _token_attributes(attributes, api_version: str, where: str) -> TokenAttributes:
    """Validated as the kubelet validates it (pkg/kubelet/apis/config/validation)."""
    if not isinstance(attributes, dict):
        raise ConfigError(f"{where} must be an object")
    _no_unknown(attributes, _TOKEN_FIELDS, where)
    if api_version != PLUGIN_API_VERSIONS[0]:
        raise ConfigError(f"{where} needs apiVersion {PLUGIN_API_VERSIONS[0]} (the older "
                          f"request carries no token), got {api_version}")
    audience = attributes.get("serviceAccountTokenAudience")
    if not isinstance(audience, str) or not audience.strip():
        raise ConfigError(f"{where}.serviceAccountTokenAudience is required (the audience of the "
                          f"ServiceAccount token the plugin is given)")
    cache_type = attributes.get("cacheType")
    if cache_type not in TOKEN_CACHE_TYPES:
        raise ConfigError(f"{where}.cacheType is required: Token or ServiceAccount, got "
                          f"{cache_type!r}")
    require = attributes.get("requireServiceAccount")
    if not isinstance(require, bool):
        raise ConfigError(f"{where}.requireServiceAccount is required: true or false")
    required = _annotation_keys(attributes, "requiredServiceAccountAnnotationKeys", where)
    optional = _annotation_keys(attributes, "optionalServiceAccountAnnotationKeys", where)
    both = sorted(set(required) & set(optional))
    if both:
        raise ConfigError(f"{where}: annotation key(s) {', '.join(both)} are both required and "
                          f"optional")
    if required and not require:
        raise ConfigError(f"{where}.requiredServiceAccountAnnotationKeys needs "
                          f"requireServiceAccount: true")
    return TokenAttributes(audience, cache_type, require, required, optional)


def _annotation_keys(attributes: dict, name: str, where: str) -> tuple[str, ...]:
    keys = attributes.get(name) or []
    if not isinstance(keys, list) or not all(isinstance(k, str) and _QUALIFIED_NAME.fullmatch(k)
                                            for k in keys):
        raise ConfigError(f"{where}.{name} must be a list of annotation keys ([prefix/]name)")
    if len(set(keys)) != len(keys):
        raise ConfigError(f"{where}.{name} lists a key twice")
    return tuple(keys)


def _name(name, where: str) -> str:
    if not isinstance(name, str) or not name or name in (".", "..") or "/" in name or " " in name:
        raise ConfigError(f"{where}.name must be the executable's file name in the bin dir "
                          f"(no '/', no spaces, not '.' or '..'), got {name!r}")
    return name


def _api_version(api_version, where: str) -> str:
    if api_version not in PLUGIN_API_VERSIONS:
        raise ConfigError(f"{where}.apiVersion must be one of {', '.join(PLUGIN_API_VERSIONS)}, "
                          f"got {api_version!r}")
    return api_version


def _match_images(match_images, where: str) -> tuple[str, ...]:
    if not isinstance(match_images, list) or not match_images \
            or not all(isinstance(m, str) and registry_key(m) for m in match_images):
        raise ConfigError(f"{where}.matchImages must be a non-empty list of image patterns "
                          f"(host[:port][/path], '*' globs in host labels)")
    return tuple(match_images)


def _default_cache_duration(duration, where: str) -> float:
    if duration is None:
        raise ConfigError(f"{where}.defaultCacheDuration is required (e.g. \"12h\")")
    try:
        seconds = parse_duration(duration)
    except ValueError as e:
        raise ConfigError(f"{where}.defaultCacheDuration: {e}") from None
    if seconds < 0:
        raise ConfigError(f"{where}.defaultCacheDuration must be greater than or equal to 0")
    return seconds


def _args(args, where: str) -> tuple[str, ...]:
    if not isinstance(args, list) or not all(isinstance(a, str) for a in args):
        raise ConfigError(f"{where}.args must be a list of strings")
    return tuple(args)


def _env(env, where: str) -> tuple[tuple[str, str], ...]:
    if not isinstance(env, list) or not all(_is_env_var(e) for e in env):
        raise ConfigError(f"{where}.env must be a list of {{name, value}} strings")
    return tuple((e["name"], e.get("value", "")) for e in env)


def _is_env_var(entry) -> bool:
    return isinstance(entry, dict) and set(entry) <= {"name", "value"} \
        and isinstance(entry.get("name"), str) and bool(entry["name"]) \
        and isinstance(entry.get("value", ""), str)


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
