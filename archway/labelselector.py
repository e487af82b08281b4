"""Kubernetes LabelSelector matching (metav1.LabelSelector), as the apiserver applies a webhook's
namespaceSelector and objectSelector: every matchLabels pair AND every matchExpressions
requirement holds. An empty or absent selector matches everything; a selector archway cannot
read (not a map, an unknown operator) matches nothing, which leaves the pod alone. A Selector
(`compiled`) is what a long-lived selector is kept as."""
import sys
from collections.abc import Mapping
from dataclasses import dataclass


def selector_matches(selector: object, labels: dict) -> bool:
    if selector is None:
        return True
    if isinstance(selector, Selector):
        return selector.matches(labels)
    if not isinstance(selector, dict):
        return False
    match_labels = selector.get("matchLabels") or {}
    expressions = selector.get("matchExpressions") or []
    if not isinstance(match_labels, dict) or not isinstance(expressions, list):
        return False
    return all(labels.get(key) == value for key, value in match_labels.items()) \
        and all(requirement_holds(expression, labels) for expression in expressions)


def requirement_holds(expression: object, labels: dict) -> bool:
    """One matchExpressions entry: In, NotIn, Exists, DoesNotExist."""
    if not isinstance(expression, dict):
        return False
    key, operator = expression.get("key"), expression.get("operator")
    values = expression.get("values") or []
    if not isinstance(values, list):
        return False
    if operator == "In":
        return key in labels and labels[key] in values
    if operator == "NotIn":
        return key not in labels or labels[key] not in values
    if operator == "Exists":
        return key in labels
    if operator == "DoesNotExist":
        return key not in labels
    return False


# What a selector held for the lifetime of a process keeps: a tenant's largest legal policy
# costs a few KB (docs/policies.md, "Limits"); parsed JSON costs ~7 bytes per byte of it.
_SEP = "\0"     # never in a label key or value


@dataclass(frozen=True, slots=True)
class Requirement:
    key: str
    operator: str        # In, NotIn, Exists, DoesNotExist
    joined: str = ""     # In, NotIn: the values, sorted, each between two _SEP ("": none)

    @property
    def values(self) -> frozenset[str]:
        return frozenset(self.joined.split(_SEP)[1:-1])

    def holds(self, labels: Mapping) -> bool:
        value = labels.get(self.key)
        if self.operator in ("In", "NotIn"):
            # A mutating webhook sees labels before the apiserver validates them.
            listed = isinstance(value, str) and _SEP not in value and f"{_SEP}{value}{_SEP}" in self.joined
            return listed if self.operator == "In" else not listed
        return (value is not None) == (self.operator == "Exists")


@dataclass(frozen=True, slots=True)
class Selector:
    """A selector that reads as a metav1.LabelSelector, compiled (`compiled`); it matches as
    selector_matches matches its document."""
    labels: tuple[tuple[str, str], ...] = ()
    requirements: tuple[Requirement, ...] = ()

    def matches(self, labels: Mapping) -> bool:
        return all(labels.get(key) == value for key, value in self.labels) \
            and all(r.holds(labels) for r in self.requirements)

    @property
    def keys(self) -> frozenset[str]:
        return frozenset(key for key, _ in self.labels) | {r.key for r in self.requirements}


def compiled(selector: dict) -> Selector:
    """The Selector of a selector document, matching as selector_matches matches it: what
    does not read as a requirement (not a map, an unknown operator) matches nothing."""
    labels = tuple(sorted((sys.intern(str(k)), str(v))
                          for k, v in _mapping(selector.get("matchLabels")).items()))
    requirements = []
    expressions = selector.get("matchExpressions") or []
    for expression in expressions if isinstance(expressions, list) else [_NEVER]:
        expression = expression if isinstance(expression, dict) else _NEVER
        operator, values = expression.get("operator"), expression.get("values") or []
        if operator not in ("In", "NotIn", "Exists", "DoesNotExist") or not isinstance(values, list):
            operator, values = "In", []      # no value is In nothing: matches nothing
        values = sorted({str(v) for v in values}) if operator in ("In", "NotIn") else []
        joined = "".join(_SEP + v for v in values) + _SEP if values else ""
        requirements.append(Requirement(sys.intern(str(expression.get("key"))), operator, joined))
    return Selector(labels, tuple(requirements))


_NEVER: dict = {"operator": "In", "values": []}


def _mapping(value: object) -> dict:
    return value if isinstance(value, dict) else {}
