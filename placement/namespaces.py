"""Per-namespace policy: the Namespace label `archway.dev/mode` and annotation
`archway.dev/preferred-architectures`, read through a list + watch cache (never a request per
admission) and applied over the configured policy by a pure function.

A team turns archway on for its namespace by label (`off` -> `audit` -> `enforce`); a value
archway does not understand leaves the configured policy in force and says so once per pod.
"""
from dataclasses import dataclass, replace

from archway.vocabulary import ANNOTATION_PREFERRED, LABEL_MODE, normal_architecture

from .policy import MODES, Policy


@dataclass(frozen=True)
class NamespaceFacts:
    name: str
    mode: str | None = None                              # None: no (usable) label
    preferred: tuple[tuple[str, int], ...] | None = None  # None: no (usable) annotation
    problems: tuple[str, ...] = ()                        # what was ignored, and why
    terminating: bool = False                             # being deleted: nothing new goes in
    labels: tuple[tuple[str, str], ...] = ()              # all of them: a webhook's selector


def parse_preferred(text: str) -> tuple[tuple[str, int], ...]:
    """"arm64=80,amd64=20" -> (("arm64", 80), ("amd64", 20)), heaviest first; "" or "none":
    no preference. ValueError says what is wrong."""
    text = text.strip()
    if text.lower() in ("", "none"):
        return ()
    weights: dict[str, int] = {}
    for part in text.split(","):
        arch, sep, weight = part.partition("=")
        arch, weight = arch.strip(), weight.strip()
        if not sep or not arch or not weight.isdigit() or not 1 <= int(weight) <= 100:
            raise ValueError(f"{part.strip()!r} is not ARCH=WEIGHT with a weight from 1 to 100")
        weights[normal_architecture(arch)] = int(weight)
    return tuple(sorted(weights.items(), key=lambda item: (-item[1], item[0])))


def namespace_facts(obj: dict) -> NamespaceFacts | None:
    meta = _mapping(obj.get("metadata") if isinstance(obj, dict) else None)
    name = meta.get("name")
    if not isinstance(name, str) or not name:
        return None
    labels, annotations = _mapping(meta.get("labels")), _mapping(meta.get("annotations"))
    problems = []
    mode = labels.get(LABEL_MODE)
    if mode is not None and mode not in MODES:
        problems.append(f"namespace label {LABEL_MODE}={mode!r} is not one of "
                        f"{', '.join(MODES)}; ignored")
        mode = None
    preferred = None
    raw = annotations.get(ANNOTATION_PREFERRED)
    if isinstance(raw, str):
        try:
            preferred = parse_preferred(raw)
        except ValueError as e:
            problems.append(f"namespace annotation {ANNOTATION_PREFERRED}: {e}; ignored")
    return NamespaceFacts(name, mode, preferred, tuple(problems),
                          terminating=bool(meta.get("deletionTimestamp")),
                          labels=tuple(sorted((str(key), str(value))
                                              for key, value in labels.items())))


def _mapping(value: object) -> dict:
    return value if isinstance(value, dict) else {}


def namespace_mode(namespace: str, base: Policy, cache, exclude_namespaces) -> str:
    """enforce | audit | off for pods of `namespace`, as the leading gate controller acts on
    them: off when excluded, labelled off, or being deleted (it takes no new Event, and its
    workloads are going). `cache`: the NamespaceCache, or None (the config alone)."""
    if namespace in exclude_namespaces:
        return "off"
    facts = cache.items.get(namespace) if cache is not None else None
    if facts is not None and facts.terminating:
        return "off"
    return namespace_policy(base, facts).mode


def namespace_policy(base: Policy, facts: NamespaceFacts | None) -> Policy:
    """The policy for pods of a namespace: the namespace's mode and preferences over `base`."""
    if facts is None:
        return base
    changes: dict = {}
    if facts.mode is not None:
        changes["mode"] = facts.mode
    if facts.preferred is not None:
        changes["preferred"] = facts.preferred
    return replace(base, **changes) if changes else base
