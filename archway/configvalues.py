"""Checks of the config file's structured values (`config.checked` fields): each takes the
YAML value and its dotted key, and returns the value archway keeps or raises ConfigError naming
the key."""
import ipaddress
from typing import Any

from archway.errors import ConfigError
from archway.vocabulary import normal_architecture


def arch_name(value: Any, key: str) -> str:
    if not isinstance(value, str) or not value.strip():
        raise ConfigError(f"{key}: architecture names must be non-empty strings, got {shown(value)}")
    return normal_architecture(value)   # aarch64 -> arm64, x86_64 -> amd64


def arch_weights(value: Any, key: str) -> tuple[tuple[str, int], ...]:
    """{arch: weight 1..100} -> ((arch, weight), ...) sorted by weight, heaviest first."""
    if not isinstance(value, dict):
        raise ConfigError(f"{key} must be a mapping of architecture to weight, got {shown(value)}")
    weights: dict[str, int] = {}
    for arch, weight in value.items():
        if isinstance(weight, bool) or not isinstance(weight, int) or not 1 <= weight <= 100:
            raise ConfigError(f"{key}.{arch} must be a whole number from 1 to 100 (the "
                              f"preferred node affinity weight), got {shown(weight)}")
        weights[arch_name(arch, key)] = weight
    return tuple(sorted(weights.items(), key=lambda item: (-item[1], item[0])))


TOLERATION_KEYS = {"key": str, "operator": str, "value": str, "effect": str,
                    "tolerationSeconds": int}


def arch_tolerations(value: Any, key: str) -> tuple[tuple[str, tuple[dict, ...]], ...]:
    """{arch: [Toleration, ...]} -> ((arch, (toleration, ...)), ...), each toleration checked."""
    if not isinstance(value, dict):
        raise ConfigError(f"{key} must be a mapping of architecture to a list of tolerations, "
                          f"got {shown(value)}")
    result = []
    for arch, tolerations in value.items():
        where = f"{key}.{arch}"
        if not isinstance(tolerations, list):
            raise ConfigError(f"{where} must be a list of tolerations, got {shown(tolerations)}")
        for i, toleration in enumerate(tolerations):
            if not isinstance(toleration, dict) or not toleration:
                raise ConfigError(f"{where}[{i}] must be a toleration mapping, got "
                                  f"{shown(toleration)}")
            for name, item in toleration.items():
                kind = TOLERATION_KEYS.get(name)
                if kind is None or isinstance(item, bool) or not isinstance(item, kind):
                    raise ConfigError(f"{where}[{i}].{name}: a toleration has key, operator "
                                      f"(Equal|Exists), value, effect (strings) and "
                                      f"tolerationSeconds (a whole number), got {shown(item)}")
            if toleration.get("operator", "Equal") not in ("Equal", "Exists"):
                raise ConfigError(f"{where}[{i}].operator must be Equal or Exists")
            if toleration.get("effect", "") not in ("", "NoSchedule", "PreferNoSchedule",
                                                    "NoExecute"):
                raise ConfigError(f"{where}[{i}].effect must be NoSchedule, PreferNoSchedule "
                                  f"or NoExecute")
        result.append((arch_name(arch, key), tuple(dict(t) for t in tolerations)))
    return tuple(result)


def fraction(value: Any, key: str) -> float:
    """A share of a whole: above 0, at most 1."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1:
        raise ConfigError(f"{key} must be a fraction above 0 and at most 1 (0.8 is 80 %), "
                          f"got {shown(value)}")
    return float(value)


def cidr_ranges(value: Any, key: str) -> tuple[str, ...]:
    """CIDR ranges (or single addresses), each checked at load: a typo is named here, not met
    at the first pod."""
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ConfigError(f"{key} must be a list of CIDR ranges, got {shown(value)}")
    for cidr in value:
        try:
            ipaddress.ip_network(cidr.strip().strip("[]"), strict=False)
        except ValueError:
            raise ConfigError(f"{key}: {cidr!r} is not a CIDR range") from None
    return tuple(v.strip() for v in value)


def shown(value: Any) -> str:
    if isinstance(value, bool):
        return str(value).lower()
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
