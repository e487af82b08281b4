"""archway's configuration file (YAML). Every key is documented in docs/configuration.md.

The file is found through --config, else the environment variable ARCHWAY_CONFIG; with neither,
every default applies (the embedded localhost setup).
"""
import os
from dataclasses import dataclass, field

import yaml

from archway.errors import ConfigError
from archway.registry.settings import RegistrySettings

DEFAULT_PROMETHEUS_QUERY = (
    'sum by (nodename) ('
    '(rate(node_network_receive_bytes_total{device!~"lo|veth.*|cali.*|flannel.*|cni.*|docker.*"}[2m])'
    ' + rate(node_network_transmit_bytes_total{device!~"lo|veth.*|cali.*|flannel.*|cni.*|docker.*"}[2m]))'
    ' * on(instance) group_left(nodename) node_uname_info)'
)


@dataclass(frozen=True)
class ServerSettings:
    bind: str = "127.0.0.1:8443"
    tls: bool = True                      # false: plain HTTP (localhost extender sidecar only)
    cert_file: str | None = None          # none: a self-signed pair generated into state_dir
    key_file: str | None = None
    state_dir: str = "~/.local/state/archway"
    workers: int = 2
    threads: int = 8
    max_body_bytes: int = 3 * 1024 * 1024  # the apiserver caps request bodies at 3 MiB
    log_every_admission: bool = False     # false: a line only for denied / fail-open / errors


@dataclass(frozen=True)
class AdmissionSettings:
    deadline_seconds: float = 3.0         # keep below the webhook's timeoutSeconds
    fail_closed: bool = False             # true: deny pods whose images could not be resolved
    deny_on_conflict: bool = False        # true: deny when the pod's own arch constraint excludes S
    deny_on_empty: bool = True            # false: admit pods with no common arch, with a warning
    exclude_namespaces: tuple[str, ...] = ("kube-system",)


@dataclass(frozen=True)
class PlacementSettings:
    scheduler_name: str | None = None     # set on pods that ask for the default scheduler


@dataclass(frozen=True)
class KubernetesSettings:
    enabled: str = "auto"                 # auto: in-cluster, else kubeconfig, else none; or "off"
    kubeconfig: str | None = None
    secret_cache_seconds: float = 60.0


@dataclass(frozen=True)
class PrometheusSettings:
    url: str | None = None                # none: prioritize gives every node a neutral score
    query: str = DEFAULT_PROMETHEUS_QUERY
    refresh_seconds: float = 15.0
    stale_after_seconds: float = 120.0
    timeout_seconds: float = 5.0
    node_label: str = "nodename"          # series label that names the node
    match: str = "name"                   # "name" (short/FQDN tolerant) or "address" (IP:port vs node addresses)


@dataclass(frozen=True)
class ExtenderSettings:
    deadline_seconds: float = 2.0         # well below kube-scheduler's 5 s httpTimeout
    node_cache: bool = True               # list+watch nodes for NodeNames (nodeCacheCapable) mode


@dataclass(frozen=True)
class Config:
    registry: RegistrySettings = field(default_factory=RegistrySettings)
    server: ServerSettings = field(default_factory=ServerSettings)
    admission: AdmissionSettings = field(default_factory=AdmissionSettings)
    placement: PlacementSettings = field(default_factory=PlacementSettings)
    kubernetes: KubernetesSettings = field(default_factory=KubernetesSettings)
    prometheus: PrometheusSettings = field(default_factory=PrometheusSettings)
    extender: ExtenderSettings = field(default_factory=ExtenderSettings)


_SECTIONS = {
    "server": ServerSettings, "admission": AdmissionSettings, "placement": PlacementSettings,
    "kubernetes": KubernetesSettings, "prometheus": PrometheusSettings,
    "extender": ExtenderSettings,
}


def load_config(path: str | None = None) -> Config:
    """Load the config file named by `path` or $ARCHWAY_CONFIG; defaults when neither is set."""
    path = path or os.environ.get("ARCHWAY_CONFIG")
    if not path:
        return Config()
    try:
        with open(path, encoding="utf-8") as f:
            data = yaml.safe_load(f) or {}
    except OSError as e:
        raise ConfigError(f"cannot read config file {path}: {e.strerror}") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"config file {path} is not valid YAML: {e}") from None
    return config_from_dict(data, origin=path)


def config_from_dict(data: dict, origin: str = "config") -> Config:
    if not isinstance(data, dict):
        raise ConfigError(f"{origin}: the top level must be a mapping")
    unknown = set(data) - set(_SECTIONS) - {"registry", "sif"}
    if unknown:
        raise ConfigError(f"{origin}: unknown section(s) {', '.join(sorted(unknown))}")
    sections = {name: _build(cls, data.get(name), name, origin) for name, cls in _SECTIONS.items()}
    return Config(registry=RegistrySettings.from_config(data), **sections)


def _build(cls, values, name: str, origin: str):
    if values is None:
        return cls()
    if not isinstance(values, dict):
        raise ConfigError(f"{origin}: section {name} must be a mapping")
    defaults = cls()
    kwargs = {}
    for key, value in values.items():
        if not hasattr(defaults, key):
            raise ConfigError(f"{origin}: unknown key {name}.{key}")
        kwargs[key] = _coerce(getattr(defaults, key), value, f"{name}.{key}", origin)
    return cls(**kwargs)


def _coerce(default, value, key: str, origin: str):
    """Check a value against the type of its default, so typos fail at start-up, not at 3 am."""
    if value is None:
        return default if not isinstance(default, (str, type(None))) else None
    if isinstance(default, bool):
        if not isinstance(value, bool):
            raise ConfigError(f"{origin}: {key} must be true or false, got {value!r}")
        return value
    if isinstance(default, (int, float)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
            raise ConfigError(f"{origin}: {key} must be a positive number, got {value!r}")
        return type(default)(value)
    if isinstance(default, tuple):
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise ConfigError(f"{origin}: {key} must be a list of strings")
        return tuple(value)
    if not isinstance(value, str):
        raise ConfigError(f"{origin}: {key} must be a string, got {value!r}")
    return value
