"""Registry and SIF settings: the `registry:` and `sif:` sections of archway's config file."""
from dataclasses import dataclass, field

from archway.errors import ConfigError


@dataclass(frozen=True)
class CacheSettings:
    digest_ttl_seconds: float = 24 * 3600   # a digest's content never changes
    tag_ttl_seconds: float = 300            # tags move; re-check every few minutes
    negative_ttl_seconds: float = 30        # failures are retried soon
    max_entries: int = 10_000


@dataclass(frozen=True)
class RegistrySettings:
    insecure_hosts: tuple[str, ...] = ()    # host[:port] reached over plain HTTP or unverified TLS
    ca_file: str | None = None              # extra CA bundle trusted for registries
    credentials_file: str | None = None     # a dockerconfigjson used for every pod
    allow_hosts: tuple[str, ...] = ()       # when non-empty, only these hosts are contacted
    deny_hosts: tuple[str, ...] = ()        # never contacted
    timeout_seconds: float = 5.0            # per network read
    max_manifest_bytes: int = 4 * 1024 * 1024
    library_url: str = "https://library.sylabs.io"
    library_token_file: str | None = None
    cache: CacheSettings = field(default_factory=CacheSettings)

    @classmethod
    def from_config(cls, config: dict | None) -> "RegistrySettings":
        """Build from the whole parsed config file (its `registry` and `sif` sections)."""
        config = config or {}
        reg = _section(config, "registry")
        sif = _section(config, "sif")
        cache = _section(reg, "cache", "registry.")
        return cls(
            insecure_hosts=_str_tuple(reg, "insecure_hosts"),
            ca_file=_opt_str(reg, "ca_file"),
            credentials_file=_opt_str(reg, "credentials_file"),
            allow_hosts=_str_tuple(reg, "allow_hosts"),
            deny_hosts=_str_tuple(reg, "deny_hosts"),
            timeout_seconds=_positive(reg, "timeout_seconds", cls.timeout_seconds),
            library_url=(_opt_str(sif, "library_url") or cls.library_url).rstrip("/"),
            library_token_file=_opt_str(sif, "library_token_file"),
            cache=CacheSettings(
                digest_ttl_seconds=_positive(cache, "digest_ttl_seconds", CacheSettings.digest_ttl_seconds),
                tag_ttl_seconds=_positive(cache, "tag_ttl_seconds", CacheSettings.tag_ttl_seconds),
                negative_ttl_seconds=_positive(cache, "negative_ttl_seconds", CacheSettings.negative_ttl_seconds),
                max_entries=int(_positive(cache, "max_entries", CacheSettings.max_entries)),
            ),
        )


def _section(config: dict, name: str, prefix: str = "") -> dict:
    value = config.get(name) or {}
    if not isinstance(value, dict):
        raise ConfigError(f"config key {prefix}{name} must be a mapping")
    return value


def _str_tuple(section: dict, key: str) -> tuple[str, ...]:
    value = section.get(key) or []
    if isinstance(value, str) or not all(isinstance(v, str) for v in value):
        raise ConfigError(f"config key {key} must be a list of strings")
    return tuple(v.strip().lower() for v in value)


def _opt_str(section: dict, key: str) -> str | None:
    value = section.get(key)
    if value is not None and not isinstance(value, str):
        raise ConfigError(f"config key {key} must be a string")
    return value or None


def _positive(section: dict, key: str, default: float) -> float:
    value = section.get(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        raise ConfigError(f"config key {key} must be a positive number, got {value!r}")
    return float(value)
