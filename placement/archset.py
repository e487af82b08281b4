"""The pod's own architecture constraint: what its nodeSelector and required node affinity already
allow of kubernetes.io/arch, as a set that may be co-finite (`NotIn [s390x]`). Pure.

Node affinity semantics relied on (k8s.io/component-helpers nodeaffinity): nodeSelectorTerms are
ORed, the requirements inside one term are ANDed, and a term with no requirements matches no node.
"""
from dataclasses import dataclass

from archway.podview import NodeSelectorTerm, PodView, Requirement
from archway.vocabulary import ARCH_KEYS, join_architectures


@dataclass(frozen=True)
class ArchSet:
    """A set of architectures that may be co-finite: `NotIn [s390x]` allows every arch but one."""
    values: frozenset[str]
    complement: bool = False

    def __and__(self, other: "ArchSet") -> "ArchSet":
        if not self.complement and not other.complement:
            return ArchSet(self.values & other.values)
        if self.complement and other.complement:
            return ArchSet(self.values | other.values, True)
        finite, cofinite = (other, self) if self.complement else (self, other)
        return ArchSet(finite.values - cofinite.values)

    def __or__(self, other: "ArchSet") -> "ArchSet":
        if not self.complement and not other.complement:
            return ArchSet(self.values | other.values)
        if self.complement and other.complement:
            return ArchSet(self.values & other.values, True)
        finite, cofinite = (other, self) if self.complement else (self, other)
        return ArchSet(cofinite.values - finite.values, True)

    def within(self, archs: frozenset[str]) -> frozenset[str]:
        """The members of `archs` this set allows."""
        return archs - self.values if self.complement else archs & self.values

    def exceeds(self, archs: frozenset[str]) -> bool:
        """True when this set allows some architecture outside `archs`."""
        return self.complement or bool(self.values - archs)

    def describe(self) -> str:
        listed = join_architectures(self.values) or "nothing"
        return f"any but {listed}" if self.complement else listed


NO_ARCH = ArchSet(frozenset())


def _requirement_allows(requirement: Requirement) -> ArchSet | None:
    """What one matchExpression allows of the arch label; None when it is about another key."""
    if requirement.key not in ARCH_KEYS:
        return None
    values = frozenset(requirement.values)
    if requirement.operator == "In":
        return ArchSet(values)
    if requirement.operator == "NotIn":
        return ArchSet(values, True)
    if requirement.operator == "Exists":
        return None  # every node carries the label: no restriction
    # DoesNotExist matches no node (all carry the label); Gt/Lt need integers, arch values are not.
    return NO_ARCH


def _term_allows(term: NodeSelectorTerm) -> ArchSet | None:
    """The archs a term allows; None when the term says nothing about arch.

    matchFields can only name nodes (metadata.name), which says nothing about their arch, so a
    term made only of matchFields (DaemonSet pods) does not constrain arch and gains the arch
    requirement: the pod then stays Pending on a node of the wrong arch instead of crash-looping
    with "exec format error".
    """
    allowed = None
    for requirement in term.match_expressions:
        this = _requirement_allows(requirement)
        if this is not None:
            allowed = this if allowed is None else allowed & this
    return allowed


def pod_arch_constraint(pod: PodView) -> ArchSet | None:
    """The archs the pod itself already restricts itself to; None when it does not restrict.

    nodeSelector and required node affinity are ANDed. The affinity restricts arch only when
    EVERY term does: one term without an arch requirement lets the pod onto any arch.
    """
    constraint = None
    for key in ARCH_KEYS:
        if key in pod.node_selector:
            this = ArchSet(frozenset([pod.node_selector[key]]))
            constraint = this if constraint is None else constraint & this
    # A term with no requirements matches no node, so it adds nothing to the ORed terms.
    terms = [t for t in pod.required_terms or () if not t.matches_nothing]
    if terms:
        allowed = [a for a in map(_term_allows, terms) if a is not None]
        if len(allowed) == len(terms):
            union = NO_ARCH
            for a in allowed:
                union = union | a
            constraint = union if constraint is None else constraint & union
    return constraint
