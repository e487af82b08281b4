"""The policy in force for a pod, and which object shaped it. Pure.

Precedence, first that applies wins (docs/policies.md):
  1. the pod's own constraints (its arch affinity, preferences, schedulerName, tolerations:
     placement.decide never overrides them);
  2. the PlacementPolicies of the pod's namespace whose podSelector selects it;
  3. the ClusterPlacementPolicies whose namespaceSelector selects its namespace and whose
     podSelector selects it;
  4. the Namespace's label archway.dev/mode and annotation archway.dev/preferred-architectures;
  5. the configuration.
One policy object shapes a pod: within a level the highest priority wins, and what it leaves
unset comes from levels 4 and 5. Two policies of the top priority of a level that select the pod
and say different things conflict: neither applies, the next level does, and a warning says so.
An invalid policy is skipped (the gate controller's leader sets its status and an Event).
"""
import json
from collections.abc import Iterable
from dataclasses import dataclass, field, replace

from archway.labelselector import Selector, selector_matches

from .namespaces import NamespaceFacts, namespace_policy
from .policy import SOURCE_NAMESPACE, Policy

NAME_LABEL = "kubernetes.io/metadata.name"   # the apiserver sets it on every Namespace


@dataclass(frozen=True)
class PolicySettings:
    """What a policy says; None: left to the rules below it (the Namespace, the config)."""
    mode: str | None = None
    preferred: tuple[tuple[str, int], ...] | None = None
    allowed: frozenset[str] | None = None
    excluded: frozenset[str] | None = None
    fallback: tuple[str, ...] | None = None
    tolerations: tuple[tuple[str, tuple[dict, ...]], ...] | None = None
    archway_scheduler: bool | None = None
    unresolved: str | None = None


@dataclass(frozen=True)
class PolicyObject:
    kind: str                       # PlacementPolicy | ClusterPlacementPolicy
    name: str                       # namespace/name, or name (the cache's key)
    namespace: str = ""             # "" for a ClusterPlacementPolicy
    generation: int = 0
    uid: str = ""
    priority: int = 0
    pod_selector: Selector | None = None         # None: every pod
    namespace_selector: Selector | None = None   # None: every namespace (cluster kind only)
    settings: PolicySettings = field(default_factory=PolicySettings)
    problems: tuple[str, ...] = ()           # why archway cannot apply it; (): valid
    resource_version: str = ""               # for the leader's status update
    # status.conditions as stored: (type, status, reason, message, lastTransitionTime), and
    # status.observedGeneration: the leader writes only what differs
    conditions: tuple[tuple[str, str, str, str, str], ...] = ()
    observed_generation: int = 0

    @property
    def display(self) -> str:
        """`PlacementPolicy ml/batch-arm64`: the annotation archway.dev/policy says this."""
        return f"{self.kind} {self.name}"

    @property
    def object_name(self) -> str:
        return self.name.rpartition("/")[2]

    @property
    def valid(self) -> bool:
        return not self.problems


@dataclass(frozen=True)
class InForce:
    """The policy a pod is admitted under, what shaped it, and what was passed over."""
    policy: Policy
    shaped_by: PolicyObject | None = None           # None: the Namespace or the config
    warnings: tuple[str, ...] = ()
    conflicts: tuple[tuple[PolicyObject, ...], ...] = ()   # the groups passed over, per level

    @property
    def source(self) -> str:
        return self.policy.source


def namespace_labels(namespace: str, facts: NamespaceFacts | None) -> dict[str, str]:
    labels = dict(facts.labels) if facts is not None else {}
    labels.setdefault(NAME_LABEL, namespace)
    return labels


def policy_in_force(base: Policy, pod_labels: dict, namespace: str,
                    facts: NamespaceFacts | None, namespaced: Iterable[PolicyObject] = (),
                    cluster: Iterable[PolicyObject] = (), *,
                    archway_scheduler: str | None = None) -> InForce:
    """The policy for a pod with `pod_labels` in `namespace` (its Namespace's `facts`, None:
    not known), given the configured policy `base` and the policy objects (`namespaced`: those
    of the pod's namespace; others are ignored). `archway_scheduler`: the name of archway's
    scheduler (placement.archway_scheduler), for policies that send pods to it."""
    below = namespace_policy(base, facts)
    if facts is not None and (facts.mode is not None or facts.preferred is not None):
        below = replace(below, source=SOURCE_NAMESPACE)
    warnings = list(facts.problems) if facts is not None else []
    conflicts: list[tuple[PolicyObject, ...]] = []
    ns_labels = namespace_labels(namespace, facts)
    levels = (
        [p for p in namespaced if p.namespace == namespace],
        [p for p in cluster if selector_matches(p.namespace_selector, ns_labels)],
    )
    for candidates in levels:
        selecting = [p for p in candidates if applicable(p, archway_scheduler)
                     and selector_matches(p.pod_selector, pod_labels)]
        winner, tied = choose(selecting)
        if winner is not None:
            return InForce(apply_settings(below, winner, archway_scheduler), winner,
                           tuple(warnings), tuple(conflicts))
        if tied:
            conflicts.append(tied)
            warnings.append(conflict_words(tied))
    return InForce(below, None, tuple(warnings), tuple(conflicts))


def applicable(policy: PolicyObject, archway_scheduler: str | None) -> bool:
    """Valid, and applicable here (archwayScheduler: true needs archway's scheduler)."""
    return policy.valid and not unsupported(policy, archway_scheduler)


def unsupported(policy: PolicyObject, archway_scheduler: str | None) -> str:
    """Why this archway cannot apply a policy the apiserver and archway's reading accept."""
    if policy.settings.archway_scheduler and not archway_scheduler:
        return ("archwayScheduler is true but archway's scheduler is not installed "
                "(placement.archway_scheduler is not set)")
    return ""


def choose(selecting: list[PolicyObject]
           ) -> tuple[PolicyObject | None, tuple[PolicyObject, ...]]:
    """(the policy that applies, ()) or (None, the conflicting policies) or (None, ()) when
    none selects. Policies of the same top priority that say the same agree: the first by
    name is named."""
    if not selecting:
        return None, ()
    top = max(p.priority for p in selecting)
    tied = sorted((p for p in selecting if p.priority == top), key=lambda p: p.name)
    if len({_said(p.settings) for p in tied}) > 1:
        return None, tuple(tied)
    return tied[0], ()


def _said(settings: PolicySettings) -> str:
    """What `settings` say, canonical: equal settings give the same text in every process.
    (A frozenset's repr follows the string hash seed; tolerations hold dicts.) The order of
    fallback architectures is kept: the first is tried first."""
    def sets(value):
        return None if value is None else sorted(value)
    tolerations = None if settings.tolerations is None else sorted(
        (arch, sorted(json.dumps(t, sort_keys=True) for t in items))
        for arch, items in settings.tolerations)
    return json.dumps([settings.mode, sets(settings.preferred), sets(settings.allowed),
                       sets(settings.excluded), settings.fallback, tolerations,
                       settings.archway_scheduler, settings.unresolved])


def conflict_words(tied: tuple[PolicyObject, ...]) -> str:
    """The warning: what matters first (a warning is cut at 120 characters)."""
    return (f"conflicting policies skipped (same priority {tied[0].priority}, different "
            f"settings): " + ", ".join(p.display for p in tied))


def apply_settings(below: Policy, policy: PolicyObject, archway_scheduler: str | None
                   ) -> Policy:
    """What `policy` says over `below` (the Namespace's and the config's policy)."""
    said = policy.settings
    changes: dict = {"source": policy.display}
    for name in ("mode", "preferred", "allowed", "excluded", "fallback", "tolerations"):
        value = getattr(said, name)
        if value is not None:
            changes[name] = value
    if said.archway_scheduler is not None:
        changes["scheduler_name"] = archway_scheduler if said.archway_scheduler else None
    if said.unresolved is not None:
        changes.update(unresolved=said.unresolved, fail_closed=said.unresolved == "deny")
    return replace(below, **changes)


# --- conflicts between policies, for their status ----------------------------------------------

def may_select_together(a: Selector | None, b: Selector | None) -> bool:
    """Whether some set of labels satisfies both selectors."""
    if _apart(a, b):
        return _satisfiable(a) and _satisfiable(b)
    return _satisfiable(a, b)


def _apart(a: Selector | None, b: Selector | None) -> bool:
    """No key in common: each selects what it would alone (the cheap case of 250,000 pairs)."""
    return a is None or b is None or not a.keys & b.keys


def _satisfiable(*selectors: Selector | None) -> bool:
    """Whether some set of labels satisfies all `selectors`."""
    wanted: dict[str, set | None] = {}     # key -> the values it may have (None: any)
    unwanted: dict[str, set] = {}
    exists: set[str] = set()
    absent: set[str] = set()
    for selector in selectors:
        for key, value in (selector or Selector()).labels:
            wanted[key] = _narrow(wanted.get(key), {value})
        for requirement in (selector or Selector()).requirements:
            key, operator = requirement.key, requirement.operator
            if operator == "In":
                wanted[key] = _narrow(wanted.get(key), requirement.values)
            elif operator == "NotIn":
                unwanted.setdefault(key, set()).update(requirement.values)
            elif operator == "Exists":
                exists.add(key)
            else:
                absent.add(key)
    if absent & (exists | set(wanted)):
        return False
    return all(values is None or values - unwanted.get(key, set())
               for key, values in wanted.items())


def _narrow(values: set | None, allowed: set | frozenset) -> set:
    return set(allowed) if values is None else values & allowed


def conflicts_of(policies: Iterable[PolicyObject], archway_scheduler: str | None = None,
                 overlaps: dict | None = None) -> dict[str, tuple[PolicyObject, ...]]:
    """name -> the policies each valid one conflicts with: of its own level and scope (its
    namespace, or the cluster), the same priority, different settings, and selectors that
    can select the same pod (and, cluster policies, the same namespace). Only policies of one
    scope and priority are compared; `overlaps` (kept by the caller between calls) remembers
    each compared pair's selectors by uid and generation, so a change costs its own pairs."""
    groups: dict[tuple, list[tuple[PolicyObject, str]]] = {}
    for p in policies:
        # One that selects nothing alone (Exists and DoesNotExist of a key) conflicts with none.
        if applicable(p, archway_scheduler) and _satisfiable(p.pod_selector) \
                and _satisfiable(p.namespace_selector):
            groups.setdefault((p.kind, p.namespace, p.priority), []).append((p, _said(p.settings)))
    remembered = overlaps if overlaps is not None else {}
    used: set = set()
    found: dict[str, list[PolicyObject]] = {}
    for group in groups.values():
        group.sort(key=lambda entry: entry[0].name)
        for i, (one, said) in enumerate(group):
            for other, other_said in group[i + 1:]:
                if said == other_said:
                    continue
                pair = ((one.uid, one.generation, one.name), (other.uid, other.generation, other.name))
                used.add(pair)
                if pair not in remembered:
                    remembered[pair] = all(
                        _apart(x, y) or _satisfiable(x, y)
                        for x, y in ((one.pod_selector, other.pod_selector),
                                     (one.namespace_selector, other.namespace_selector)))
                if remembered[pair]:
                    found.setdefault(one.name, []).append(other)
                    found.setdefault(other.name, []).append(one)
    for pair in set(remembered) - used:
        del remembered[pair]
    return {name: tuple(sorted(others, key=lambda p: p.name)) for name, others in found.items()}
