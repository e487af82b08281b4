"""PlacementPolicy and ClusterPlacementPolicy objects (archway.dev/v1alpha1), read: the few facts
archway uses of each, and why archway cannot apply one the apiserver accepted (an architecture
it does not know, a selector that does not parse). Pure; the list + watch caches of both kinds
are at the end.

The CRDs' schema and CEL rules (charts/archway/templates/crds/) reject most bad policies at the
apiserver; this reading does not trust them (an older CRD, a policy written before the rule):
whatever it cannot apply makes the policy invalid, and an invalid policy is skipped, never an
admission's failure.
"""
import re

from archway.labelselector import Selector, compiled, selector_matches
from archway.placement.policies import PolicyObject, PolicySettings
from archway.placement.policy import MODES, UNRESOLVED
from archway.vocabulary import normal_architecture
from archway.watchcache import WatchCache

GROUP = "archway.dev"
VERSION = "v1alpha1"
NAMESPACED_KIND = "PlacementPolicy"
CLUSTER_KIND = "ClusterPlacementPolicy"
NAMESPACED_PLURAL = "placementpolicies"
CLUSTER_PLURAL = "clusterplacementpolicies"
# The architectures Go (and so containerd and the kubelet's kubernetes.io/arch) knows.
KNOWN_ARCHITECTURES = frozenset({
    "386", "amd64", "arm", "arm64", "loong64", "mips", "mips64", "mips64le", "mipsle", "ppc64",
    "ppc64le", "riscv64", "s390x", "wasm"})
_OPERATORS = {"In": True, "NotIn": True, "Exists": False, "DoesNotExist": False}  # values?
_TOLERATION_KEYS = ("key", "operator", "value", "effect", "tolerationSeconds")
_MEMO_ENTRIES = 4096   # label sets of Namespaces remembered per version of the cache
# What one selector may hold, as the CRDs' schema says (docs/policies.md, "Limits"): a tenant's
# largest legal policy costs every replica a few KB, not megabytes.
MAX_MATCH_LABELS = MAX_EXPRESSIONS = MAX_VALUES = 16
# The apiserver's own rules for a label's key (an optional DNS-subdomain prefix, a name of at
# most 63 characters) and value: a selector outside them can never match a label.
_LABEL_NAME = r"([A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?)"
_LABEL_KEY = re.compile(rf"^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?{_LABEL_NAME}$")
_LABEL_VALUE = re.compile(rf"^{_LABEL_NAME}?$")
NOTHING = compiled({"matchExpressions": [{"key": "archway.dev/invalid", "operator": "In"}]})  # no pod


def policy_object(obj: dict, kind: str) -> PolicyObject | None:
    """The facts of one listed or watched policy object; None when it has no name."""
    meta = obj.get("metadata") if isinstance(obj, dict) else None
    meta = meta if isinstance(meta, dict) else {}
    name, namespace = meta.get("name"), meta.get("namespace") or ""
    if not isinstance(name, str) or not name:
        return None
    spec = obj.get("spec")
    spec = spec if isinstance(spec, dict) else {}
    problems: list[str] = []
    priority = spec.get("priority", 0)
    if not isinstance(priority, int) or isinstance(priority, bool):
        problems.append(f"priority {priority!r} is not an integer")
        priority = 0
    pod_selector = _selector(spec, "podSelector", problems)
    namespace_selector = _selector(spec, "namespaceSelector", problems) \
        if kind == CLUSTER_KIND else None
    settings = read_settings(spec, problems)
    generation = meta.get("generation")
    status = obj.get("status")
    status = status if isinstance(status, dict) else {}
    observed = status.get("observedGeneration")
    return PolicyObject(kind, f"{namespace}/{name}" if namespace else name, namespace,
                        generation if isinstance(generation, int) else 0,
                        str(meta.get("uid") or ""), priority, pod_selector, namespace_selector,
                        settings, tuple(problems), str(meta.get("resourceVersion") or ""),
                        _conditions(status.get("conditions")),
                        observed if isinstance(observed, int) else 0)


def _conditions(raw: object) -> tuple[tuple[str, str, str, str, str], ...]:
    if not isinstance(raw, list):
        return ()
    return tuple(sorted((str(c.get("type") or ""), str(c.get("status") or ""),
                         str(c.get("reason") or ""), str(c.get("message") or ""),
                         str(c.get("lastTransitionTime") or ""))
                        for c in raw if isinstance(c, dict)))


def read_settings(spec: dict, problems: list[str]) -> PolicySettings:
    """The settings of a policy's spec; what cannot be applied is said in `problems`."""
    archs = {key: _architectures(spec, key, problems) for key in
             ("allowedArchitectures", "excludedArchitectures", "fallbackArchitectures")}
    allowed, excluded = archs["allowedArchitectures"], archs["excludedArchitectures"]
    if allowed is not None and excluded is not None and allowed & excluded:
        problems.append(f"{','.join(sorted(allowed & excluded))} both allowed and excluded")
    fallback = archs["fallbackArchitectures"]
    scheduler = spec.get("archwayScheduler")
    if scheduler is not None and not isinstance(scheduler, bool):
        problems.append("archwayScheduler is not true or false")
        scheduler = None
    return PolicySettings(
        mode=_choice(spec, "mode", MODES, problems),
        preferred=_preferred(spec.get("preferredArchitectures"), problems),
        allowed=frozenset(allowed) if allowed is not None else None,
        excluded=frozenset(excluded) if excluded is not None else None,
        fallback=tuple(sorted(fallback)) if fallback is not None else None,
        tolerations=_tolerations(spec.get("tolerations"), problems),
        archway_scheduler=scheduler,
        unresolved=_choice(spec, "unresolved", UNRESOLVED, problems))


def _choice(spec: dict, key: str, choices, problems: list[str]) -> str | None:
    value = spec.get(key)
    if value is None:
        return None
    if value not in choices:
        problems.append(f"{key} {value!r} is not one of {', '.join(choices)}")
        return None
    return value


def _architecture(name: object, where: str, problems: list[str]) -> str | None:
    arch = normal_architecture(name) if isinstance(name, str) else None
    if arch not in KNOWN_ARCHITECTURES:
        problems.append(f"{where}: {name!r} is not an architecture archway knows")
        return None
    return arch


def _architectures(spec: dict, key: str, problems: list[str]) -> set[str] | None:
    values = spec.get(key)
    if values is None:
        return None
    if not isinstance(values, list):
        problems.append(f"{key} is not a list")
        return None
    archs = {_architecture(v, key, problems) for v in values}
    return {a for a in archs if a is not None}


def _preferred(values: object, problems: list[str]) -> tuple[tuple[str, int], ...] | None:
    if values is None:
        return None
    if not isinstance(values, list):
        problems.append("preferredArchitectures is not a list")
        return None
    weights: dict[str, int] = {}
    for entry in values:
        entry = entry if isinstance(entry, dict) else {}
        arch = _architecture(entry.get("architecture"), "preferredArchitectures", problems)
        weight = entry.get("weight")
        if not isinstance(weight, int) or isinstance(weight, bool) or not 1 <= weight <= 100:
            problems.append(f"preferredArchitectures: weight {weight!r} is not 1..100")
        elif arch is not None:
            weights[arch] = weight
    return tuple(sorted(weights.items(), key=lambda item: (-item[1], item[0])))


def _tolerations(values: object, problems: list[str]
                 ) -> tuple[tuple[str, tuple[dict, ...]], ...] | None:
    if values is None:
        return None
    if not isinstance(values, list):
        problems.append("tolerations is not a list")
        return None
    per_arch: dict[str, tuple[dict, ...]] = {}
    for entry in values:
        entry = entry if isinstance(entry, dict) else {}
        arch = _architecture(entry.get("architecture"), "tolerations", problems)
        raws = entry.get("tolerations")
        if not isinstance(raws, list) or not all(_toleration_ok(t) for t in raws):
            problems.append(f"tolerations of {entry.get('architecture')!r} are not tolerations")
        elif arch is not None:
            per_arch[arch] = per_arch.get(arch, ()) + tuple(
                {k: t[k] for k in _TOLERATION_KEYS if k in t} for t in raws)
    return tuple(sorted(per_arch.items()))


def _toleration_ok(raw: object) -> bool:
    return isinstance(raw, dict) and all(
        isinstance(raw.get(k, ""), str) for k in ("key", "operator", "value", "effect"))


def _selector(spec: dict, key: str, problems: list[str]) -> Selector | None:
    """The compiled selector (None: absent, selects all); one that cannot be read selects
    nothing and says why in `problems`."""
    selector = spec.get(key)
    if selector is None:
        return None
    problem = selector_problem(selector)
    if problem:
        problems.append(f"{key}: {problem}")
        return NOTHING
    return compiled(selector)


def selector_problem(selector: object) -> str:
    """Why `selector` is not a metav1.LabelSelector archway can evaluate ("": it is)."""
    if not isinstance(selector, dict):
        return "not a label selector"
    labels = selector.get("matchLabels") or {}
    if not isinstance(labels, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in labels.items()):
        return "matchLabels is not a map of strings"
    expressions = selector.get("matchExpressions") or []
    if not isinstance(expressions, list):
        return "matchExpressions is not a list"
    if len(labels) > MAX_MATCH_LABELS or len(expressions) > MAX_EXPRESSIONS:
        return (f"more than {MAX_MATCH_LABELS} matchLabels or {MAX_EXPRESSIONS} "
                f"matchExpressions ({len(labels)}, {len(expressions)})")
    for key, value in labels.items():
        problem = _label_problem(key, value)
        if problem:
            return f"matchLabels: {problem}"
    for expression in expressions:
        problem = _expression_problem(expression)
        if problem:
            return problem
    return ""


def _expression_problem(expression: object) -> str:
    if not isinstance(expression, dict) or not isinstance(expression.get("key"), str):
        return "a matchExpressions entry has no key"
    key, operator, values = expression["key"], expression.get("operator"), expression.get("values") or []
    if operator not in _OPERATORS:
        return f"operator {operator!r} is not In, NotIn, Exists or DoesNotExist"
    if not isinstance(values, list) or bool(values) != _OPERATORS[operator]:
        return f"{operator} on {key[:63]!r} " + (
            "needs values" if _OPERATORS[operator] else "takes no values")
    if len(values) > MAX_VALUES:
        return f"{operator} on {key[:63]!r} has {len(values)} values (at most {MAX_VALUES})"
    for value in values or [""]:
        problem = _label_problem(key, value)
        if problem:
            return f"matchExpressions: {problem}"
    return ""


def _label_problem(key: str, value: object) -> str:
    """Why no label of the apiserver's could be `key`=`value` ("": one could)."""
    if len(key) > 317 or not _LABEL_KEY.match(key) or len(key.rpartition("/")[0]) > 253:
        return f"{key[:63]!r} is not a label key (an optional DNS prefix and '/', then a name of 1-63 characters)"
    if not isinstance(value, str) or not _LABEL_VALUE.match(value):
        return (f"{str(value)[:63]!r} is not a label value of {key[:63]!r} "
                "(at most 63 letters, digits, '-', '_' or '.', alphanumeric at both ends)")
    return ""


# --- the caches --------------------------------------------------------------------------------

class PolicyCache(WatchCache[PolicyObject]):
    """One kind's policies, keyed as PolicyObject.name is; `in_namespace` indexes the
    namespaced kind by namespace once per change, not per admission."""

    def __init__(self, api_client_factory, kind: str, **kwargs):
        plural = NAMESPACED_PLURAL if kind == NAMESPACED_KIND else CLUSTER_PLURAL
        super().__init__(api_client_factory, what=plural.removesuffix("ies") + "y",
                         path=f"/apis/{GROUP}/{VERSION}/{plural}",
                         facts=lambda obj: policy_object(obj, kind), **kwargs)
        self.kind = kind
        self._index: tuple[int, dict[str, tuple[PolicyObject, ...]]] = (-1, {})
        self._memo: tuple[int, dict[tuple, tuple[PolicyObject, ...]]] = (-1, {})

    def _name_of(self, obj: dict):
        meta = obj.get("metadata") or {}
        namespace = meta.get("namespace")
        return f"{namespace}/{meta.get('name')}" if namespace else meta.get("name")

    def in_namespace(self, namespace: str) -> tuple[PolicyObject, ...]:
        version, index = self._index
        if version != self.version:
            version = self.version
            grouped: dict[str, list[PolicyObject]] = {}
            for policy in self.items.values():
                grouped.setdefault(policy.namespace, []).append(policy)
            index = {ns: tuple(policies) for ns, policies in grouped.items()}
            self._index = (version, index)
        return index.get(namespace, ())

    def selecting_namespace(self, labels: dict[str, str]) -> tuple[PolicyObject, ...]:
        """The (cluster) policies whose namespaceSelector selects a Namespace with `labels`:
        worked out once per label set and version, not per admission (1,000 cluster
        policies cost ~1 ms of selectors per pod otherwise)."""
        version, memo = self._memo
        if version != self.version:
            memo = {}
            self._memo = (self.version, memo)
        key = tuple(sorted(labels.items()))
        found = memo.get(key)
        if found is None:
            found = tuple(p for p in self.items.values()
                          if selector_matches(p.namespace_selector, labels))
            if len(memo) < _MEMO_ENTRIES:
                memo[key] = found
        return found
