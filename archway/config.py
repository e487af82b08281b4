"""archway's configuration file (YAML): one schema, one loader, every key documented.

The file is found through --config, else the environment variable ARCHWAY_CONFIG; with neither,
every default applies (the embedded localhost setup). Each section is a frozen dataclass below;
its fields are the keys, their defaults are THE defaults, and `docs/configuration.md` documents
exactly these keys (a test compares the two). Every section is checked the same way: unknown keys
are refused with the file, section and key named; values must have the default's type.
"""
import dataclasses
import os
import re
import typing
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import yaml

from archway.configvalues import arch_tolerations, arch_weights, cidr_ranges, fraction, shown
from archway.errors import ConfigError

# The devices whose traffic counts: physical and bond interfaces, not loopback, pod veths and
# CNI bridges (their bytes also cross a real interface, or never leave the node).
NODE_DEVICES = 'device!~"lo|veth.*|cali.*|flannel.*|cni.*|docker.*"'
# `$window` is replaced by prometheus.window.
DEFAULT_PROMETHEUS_QUERY = (
    'sum by (nodename) ('
    f'(rate(node_network_receive_bytes_total{{{NODE_DEVICES}}}[$window])'
    f' + rate(node_network_transmit_bytes_total{{{NODE_DEVICES}}}[$window]))'
    ' * on(instance) group_left(nodename) node_uname_info)'
)
# What the traffic query's figure could reach: receive + transmit, so twice the link speed of a
# full-duplex interface, over the same devices.
DEFAULT_CAPACITY_QUERY = (
    'sum by (nodename) ('
    f'2 * node_network_speed_bytes{{{NODE_DEVICES}}}'
    ' * on(instance) group_left(nodename) node_uname_info)'
)


def choice(default: str, *choices: str) -> Any:
    """A string field restricted to `choices` (the default first)."""
    return field(default=default, metadata={"choices": (default, *choices)})


def number(default: float, *, minimum: float = 0.0, inclusive: bool = False) -> Any:
    """A number field; by default it must be positive (> 0)."""
    return field(default=default, metadata={"minimum": minimum, "inclusive": inclusive})


def matching(default: str, pattern: str, example: str) -> Any:
    """A string field that must match `pattern` (re.fullmatch); `example` goes in the error."""
    return field(default=default, metadata={"pattern": pattern, "example": example})


def checked(default_factory: Callable[[], Any], check: Callable[[Any, str], Any]) -> Any:
    """A field whose YAML value `check(value, key)` validates and converts (maps, lists of maps)."""
    return field(default_factory=default_factory, metadata={"check": check})


@dataclass(frozen=True)
class CacheSettings:
    digest_ttl_seconds: float = 24 * 3600   # a digest's content never changes
    tag_ttl_seconds: float = 300            # tags move; re-check every few minutes
    negative_ttl_seconds: float = 30        # failures are retried soon
    stale_if_error_seconds: float = 24 * 3600  # past its TTL, an answer is served while the
                                            # registry cannot confirm it, this much longer
    max_entries: int = 10_000
    max_bytes: int = 64 * 1024 * 1024       # approximate memory the cache may hold


@dataclass(frozen=True)
class CredentialProviderSettings:
    config: str | None = None               # a kubelet CredentialProviderConfig file or directory
    bin_dir: str | None = None              # where the provider executables are
    timeout_seconds: float = 10.0           # a plugin still running after this is killed


@dataclass(frozen=True)
class ProxySettings:
    url: str | None = None                  # forward proxy for every registry request
    no_proxy: tuple[str, ...] = ()          # hosts reached directly (NO_PROXY syntax)
    from_environment: bool = True           # without url: HTTPS_PROXY, HTTP_PROXY, NO_PROXY

    def __post_init__(self):
        object.__setattr__(self, "no_proxy", tuple(h.strip().lower() for h in self.no_proxy))


@dataclass(frozen=True)
class PrewarmSettings:
    enabled: bool = True                    # with a Kubernetes API: read the cluster's images at start
    requests_per_second: float = 5.0        # lookups (one manifest request each) per registry host


@dataclass(frozen=True)
class RegistryEventsSettings:
    listen: str | None = None               # host:port of POST /registry-events; None: no listener
    token_file: str | None = None           # the bearer token registries send (required with listen)
    tls: bool = True                        # false: plain HTTP on listen (registries inside the cluster)
    max_body_bytes: int = 1024 * 1024       # a larger envelope is a 413
    per_source_per_second: float = 20.0     # requests a second from one address; past it a 429


@dataclass(frozen=True)
class RegistrySettings:
    insecure_hosts: tuple[str, ...] = ()    # host[:port] reached over plain HTTP or unverified TLS
    ca_file: str | None = None              # extra CA bundle trusted for registries
    credentials_file: str | None = None     # a dockerconfigjson used for every pod
    allow_hosts: tuple[str, ...] = ()       # when non-empty, only these hosts are contacted
    deny_hosts: tuple[str, ...] = ()        # never contacted
    # The cluster's Service ranges; empty: read from the API (ServiceCIDRs).
    service_cidrs: tuple[str, ...] = checked(tuple, cidr_ranges)
    timeout_seconds: float = 5.0            # per request; a lookup may take twice this
    max_lookups_per_host: int = 8           # lookups of one host at once: a hung host holds no more
    max_queued_lookups: int = 1024          # lookups waiting in all; past it new images fail at once
    max_manifest_bytes: int = 4 * 1024 * 1024
    cache: CacheSettings = field(default_factory=CacheSettings)
    hosts_dir: str | None = None            # containerd's certs.d layout: mirrors per registry
    credential_providers: CredentialProviderSettings = field(default_factory=CredentialProviderSettings)
    proxy: ProxySettings = field(default_factory=ProxySettings)
    prewarm: PrewarmSettings = field(default_factory=PrewarmSettings)
    events: RegistryEventsSettings = field(default_factory=RegistryEventsSettings)

    def __post_init__(self):
        # Host lists compare case-insensitively, with the surrounding blanks of a hand-edited file.
        for name in ("insecure_hosts", "allow_hosts", "deny_hosts"):
            object.__setattr__(self, name, tuple(h.strip().lower() for h in getattr(self, name)))


@dataclass(frozen=True)
class SifSettings:
    library_url: str = "https://library.sylabs.io"
    library_token_file: str | None = None

    def __post_init__(self):
        object.__setattr__(self, "library_url", self.library_url.rstrip("/"))


@dataclass(frozen=True)
class ServerSettings:
    product: str = choice("all", "webhook", "extender")  # what this server answers
    bind: str = "127.0.0.1:8443"
    # A second address answering only /metrics, /healthz and /readyz: scrapers on the pod
    # network reach those while the product's routes stay on `bind` (localhost).
    metrics_bind: str | None = None
    tls: bool = True                      # false: plain HTTP (localhost extender sidecar only)
    cert_file: str | None = None          # none: a self-signed pair generated into state_dir
    key_file: str | None = None
    state_dir: str = "~/.local/state/archway"
    workers: int = 2
    threads: int = 8
    max_body_bytes: int = 3 * 1024 * 1024  # the apiserver caps request bodies at 3 MiB
    log_every_admission: bool = False     # false: a line only for denied / fail-open / errors
    log_format: str = choice("text", "json")  # json: one JSON object per line (log pipelines)


@dataclass(frozen=True)
class AdmissionSettings:
    mode: str = choice("enforce", "audit")  # audit: annotate and count, change no placement
    deadline_seconds: float = 3.0         # keep below the webhook's timeoutSeconds
    # A pod with an image not resolved in time: admit it unplaced (with a warning), gate it
    # (spec.schedulingGates) until the gate controller places it, or deny it.
    unresolved: str = choice("admit", "gate", "deny")
    gate_max_seconds: float = 120.0       # a gated pod is released (unplaced) after this long
    gate_lease_seconds: float = 15.0      # the gate controller leader's Lease duration
    fail_closed: bool | None = None       # deprecated: true is unresolved: deny, false admit
    deny_on_conflict: bool = False        # true: deny when the pod's own arch constraint excludes S
    deny_on_empty: bool = True            # false: admit pods with no common arch, with a warning
    deny_unschedulable: bool = False      # true: deny pods whose archs no (tolerated) node has
    exclude_namespaces: tuple[str, ...] = ("kube-system",)
    max_images_per_pod: int = 64          # distinct images resolved per pod; past it: unresolved
    # A debug container (pods/ephemeralcontainers) whose image has no platform for its pod's
    # node: a warning (kubectl debug prints it), a refusal, or not checked.
    debug_containers: str = choice("warn", "deny", "off")

    def __post_init__(self):
        # The deprecated key still works when the new one is left at its default.
        if self.fail_closed is not None and self.unresolved == "admit":
            object.__setattr__(self, "unresolved", "deny" if self.fail_closed else "admit")


@dataclass(frozen=True)
class PlacementSettings:
    scheduler_name: str | None = None     # set on pods that ask for the default scheduler
    # arch -> weight: preferred node affinity for the archs a pod can run on
    preferred_architectures: tuple[tuple[str, int], ...] = checked(tuple, arch_weights)
    # arch -> tolerations added when the pod may run on that arch (tainted arm64 pools)
    tolerations: tuple[tuple[str, tuple[dict, ...]], ...] = checked(tuple, arch_tolerations)
    # Where a gated pod goes when released after admission.gate_max_seconds unresolved;
    # empty: released unplaced.
    fallback_architectures: tuple[str, ...] = ()
    # archway's own scheduler, for PlacementPolicies that send pods to it (archwayScheduler)
    archway_scheduler: str | None = None
    # Which pods get scheduler_name (or a policy's archwayScheduler): `needed`, those whose
    # node archway's extender could still change; `all`, every pod asking for the default.
    scheduler_for: str = choice("needed", "all")


@dataclass(frozen=True)
class ImageRecordSettings:
    enabled: bool = True                  # share answers as ImageRecord/ClusterImageRecord objects
    expire_seconds: float = 7 * 24 * 3600  # a record no pod or workload uses is deleted this late
    max_queued_writes: int = 1000         # record writes waiting; past it an offer is dropped
    start_wait_seconds: float = 5.0       # a starting worker waits this long for the records


@dataclass(frozen=True)
class KubernetesSettings:
    enabled: str = choice("auto", "off")  # auto: kubeconfig, in-cluster, ~/.kube/config, or none
    kubeconfig: str | None = None
    context: str | None = None            # the kubeconfig's context to use; none: its current one
    secret_cache_seconds: float = 60.0
    pull_secret_namespaces: tuple[str, ...] = ("*",)  # where pull secrets are read; "*": everywhere
    # Where a pod's ServiceAccount token may be requested for token-mode credential providers
    # (KEP-4412); "*": everywhere; empty (the default): nowhere.
    service_account_token_namespaces: tuple[str, ...] = ()
    namespace_cache: bool = True          # list+watch Namespaces for per-namespace mode/preferences
    placement_policies: bool = True       # list+watch (Cluster)PlacementPolicies (archway.dev)
    karpenter_node_pools: bool = False    # count Karpenter NodePools' archs as nodes that may join
    namespace: str | None = None          # the gate controller's Lease; none: the pod's own
    webhook_configuration: str | None = None  # archway's own: its caBundle checked (trust path)
    trust_repair: tuple[str, ...] = ()    # `archway certs bootstrap` arguments: the leader repairs
    image_records: ImageRecordSettings = field(default_factory=ImageRecordSettings)


@dataclass(frozen=True)
class PrometheusSettings:
    url: str | None = None                # none: prioritize gives every node a neutral score
    query: str = DEFAULT_PROMETHEUS_QUERY
    capacity_query: str = DEFAULT_CAPACITY_QUERY  # "": score absolute traffic only
    # The rate() window: `$window` in the queries.
    window: str = matching("2m", r"([0-9]+(ms|s|m|h|d|w|y))+",
                           "a Prometheus duration such as 2m or 90s")
    refresh_seconds: float = 15.0
    stale_after_seconds: float = 120.0
    timeout_seconds: float = 5.0
    node_label: str = "nodename"          # series label that names the node
    match: str = choice("name", "address")  # name: short/FQDN tolerant; address: IP:port vs node


@dataclass(frozen=True)
class ExtenderSettings:
    deadline_seconds: float = 2.0         # well below kube-scheduler's 5 s httpTimeout
    node_cache: bool = True               # list+watch nodes for NodeNames (nodeCacheCapable) mode
    herd_control: bool = True             # count pods placed since the last traffic sample
    default_pod_bytes_per_second: float = number(1_000_000.0)  # a placed pod's traffic, unknown
    # Link utilisation above which /scheduler/filter turns a node away (FailedNodes) unless every
    # candidate is above it; None: no ceiling.
    max_utilisation: float | None = checked(lambda: None, fraction)


@dataclass(frozen=True)
class RemediationSettings:
    # An exec format error on a node of arch X keeps the workload's new pods off X
    # (annotation archway.dev/failed-architectures on the workload).
    learn_failed_architectures: bool = True
    # Evict the failing pods (Eviction API, PDBs respected): they serve nothing where they are.
    evict: bool = True
    # With learning on: a failed container whose status says nothing of why (containerd + runc)
    # has the tail of its log read for the words (pods/log get).
    read_logs: bool = True
    # The gate controller's leader checks the tags of the cluster's workloads every
    # registry.cache.tag_ttl_seconds: a tag moved to a digest lacking an architecture the old one
    # had raises ArchitecturesDropped.
    watch_tags: bool = True


@dataclass(frozen=True)
class Config:
    registry: RegistrySettings = field(default_factory=RegistrySettings)
    sif: SifSettings = field(default_factory=SifSettings)
    server: ServerSettings = field(default_factory=ServerSettings)
    admission: AdmissionSettings = field(default_factory=AdmissionSettings)
    placement: PlacementSettings = field(default_factory=PlacementSettings)
    kubernetes: KubernetesSettings = field(default_factory=KubernetesSettings)
    prometheus: PrometheusSettings = field(default_factory=PrometheusSettings)
    extender: ExtenderSettings = field(default_factory=ExtenderSettings)
    remediation: RemediationSettings = field(default_factory=RemediationSettings)


def load_config(path: str | None = None) -> Config:
    """Load the config file named by `path` or $ARCHWAY_CONFIG; defaults when neither is set."""
    path = path or os.environ.get("ARCHWAY_CONFIG")
    if not path:
        return Config()
    try:
        with open(path, encoding="utf-8") as f:
            data = yaml.safe_load(f)
    except OSError as e:
        raise ConfigError(f"cannot read config file {path}: {e.strerror}") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"config file {path} is not valid YAML: {e}") from None
    return config_from_dict(data or {}, origin=path)


def deprecations(config: Config) -> list[str]:
    """Warnings to log at start-up about deprecated keys the file still uses."""
    found = []
    if config.admission.fail_closed is not None:
        found.append(f"admission.fail_closed is deprecated: write admission.unresolved: "
                     f"{config.admission.unresolved} instead")
    return found


def config_from_dict(data: Any, origin: str = "config") -> Config:
    """Build and check a Config from parsed YAML; `origin` (the file) starts every error."""
    return _build(Config, data, "", origin)


def documented_keys(cls: type = Config, prefix: str = "") -> list[str]:
    """Every dotted key of the schema (`registry.cache.tag_ttl_seconds`, ...): what the docs list."""
    keys = []
    for f in dataclasses.fields(cls):
        kind = _field_type(cls, f)
        if dataclasses.is_dataclass(kind) and "check" not in f.metadata:
            keys.extend(documented_keys(kind, f"{prefix}{f.name}."))  # type: ignore[arg-type]
        else:
            keys.append(prefix + f.name)
    return keys


def _field_type(cls: type, f: dataclasses.Field) -> Any:
    return typing.get_type_hints(cls)[f.name]


def _build(cls: type, values: Any, path: str, origin: str) -> Any:
    where = f"section {path.rstrip('.')}" if path else "the top level"
    if values is None:
        return cls()
    if not isinstance(values, dict):
        raise ConfigError(f"{origin}: {where} must be a mapping, got {shown(values)}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(str(k) for k in values if k not in fields)
    if unknown:
        known = ", ".join(fields)
        what = "section(s)" if not path else "key(s)"
        raise ConfigError(f"{origin}: unknown {what} {', '.join(path + k for k in unknown)} "
                          f"(known in {where}: {known})")
    kwargs = {}
    for name, value in values.items():
        f = fields[name]
        kind = _field_type(cls, f)
        key = path + name
        if "check" in f.metadata:
            kwargs[name] = f.metadata["check"](value, f"{origin}: {key}") if value is not None \
                else f.default_factory()  # type: ignore[misc, operator]
        elif dataclasses.is_dataclass(kind):
            kwargs[name] = _build(typing.cast(type, kind), value, key + ".", origin)
        else:
            kwargs[name] = _coerce(kind, f, value, key, origin)
    return cls(**kwargs)


def _coerce(kind: Any, f: dataclasses.Field, value: Any, key: str, origin: str) -> Any:
    """Check one value against its field's type, so typos fail at start-up, not at 3 am."""
    optional = type(None) in typing.get_args(kind)
    if value is None:
        if optional:
            return None
        return f.default if f.default is not dataclasses.MISSING else None
    base = next((a for a in typing.get_args(kind) if a is not type(None)), kind) if optional else kind
    where = f"{origin}: {key}"
    if base is bool:
        return _as_bool(value, where)
    if base in (int, float):
        return _as_number(base, f, value, where)
    if typing.get_origin(base) is tuple:
        return _as_strings(value, where)
    return _as_string(f, value, where)


def _as_bool(value: Any, where: str) -> bool:
    if not isinstance(value, bool):
        raise ConfigError(f"{where} must be true or false, got {shown(value)}")
    return value


def _as_number(base: type, f: dataclasses.Field, value: Any, where: str) -> int | float:
    minimum, inclusive = f.metadata.get("minimum", 0.0), f.metadata.get("inclusive", False)
    if isinstance(value, bool) or not isinstance(value, (int, float)) \
            or value < minimum or (value == minimum and not inclusive):
        bound = f"at least {minimum:g}" if inclusive else (
            "a positive number" if minimum == 0 else f"above {minimum:g}")
        raise ConfigError(f"{where} must be {bound}, got {shown(value)}")
    if base is int and value != int(value):
        raise ConfigError(f"{where} must be a whole number, got {shown(value)}")
    return base(value)


def _as_strings(value: Any, where: str) -> tuple[str, ...]:
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ConfigError(f"{where} must be a list of strings, got {shown(value)}")
    return tuple(value)


def _as_string(f: dataclasses.Field, value: Any, where: str) -> str:
    """A string, one of the field's `choices` or matching its `pattern` when it has them."""
    choices = f.metadata.get("choices")
    if isinstance(value, bool):
        # YAML 1.1 reads an unquoted off/no/false (on/yes/true) as a boolean.
        if choices and not value and "off" in choices:
            return "off"
        raise ConfigError(f"{where} must be a string, got {shown(value)}: YAML reads "
                          f"unquoted on/off/yes/no/true/false as a boolean; quote the value")
    if not isinstance(value, str):
        raise ConfigError(f"{where} must be a string, got {shown(value)}")
    if choices and value not in choices:
        raise ConfigError(f"{where} must be one of {', '.join(choices)}, got {value!r}")
    pattern = f.metadata.get("pattern")
    if pattern and not re.fullmatch(pattern, value):
        raise ConfigError(f"{where} must be {f.metadata['example']}, got {value!r}")
    return value
