"""The admission policy: what the configuration asks of a placement (deny or admit, pin or only
annotate, which scheduler, which architectures to prefer, allow, exclude or fall back to, which
to tolerate). A new policy knob is a field here, read in `from_config`, and used by
placement.decide; a PlacementPolicy (placement/policies.py) and a Namespace's label and
annotation (namespaces.py) say some of it over the configuration's."""
from dataclasses import dataclass

from archway.podview import PodView
from archway.vocabulary import SKIP_ANNOTATION

MODES = ("enforce", "audit", "off")
UNRESOLVED = ("admit", "gate", "deny")
DEFAULT_SCHEDULER = "default-scheduler"
# What shaped a policy when no PlacementPolicy did (the annotation archway.dev/policy says it).
SOURCE_CONFIG = "config"
SOURCE_NAMESPACE = "namespace label"


@dataclass(frozen=True)
class Policy:
    fail_closed: bool = False        # deny pods with an image that could not be resolved
    deny_on_conflict: bool = False   # deny pods whose own arch constraint excludes every arch of S
    deny_on_empty: bool = True       # deny pods whose images share no architecture (in policy)
    scheduler_name: str | None = None
    mode: str = "enforce"            # audit: annotate only; Decision.would says what enforce does
    deny_unschedulable: bool = False  # deny pods whose archs no node they tolerate has
    preferred: tuple[tuple[str, int], ...] = ()     # (arch, weight 1..100), heaviest first
    tolerations: tuple[tuple[str, tuple[dict, ...]], ...] = ()   # (arch, tolerations to add)
    allowed: frozenset[str] | None = None   # the pod runs only on these (None: any)
    excluded: frozenset[str] = frozenset()  # ... and never on these
    fallback: tuple[str, ...] = ()   # what an image that could not be read is taken to run on
    unresolved: str = "admit"        # admit | gate | deny an image not read in time
    source: str = ""                 # what shaped it, for archway.dev/policy ("": not written)
    # A pod pinned to its images' architectures and OS gets scheduler_name too: archway's
    # scheduler scores or caps nodes, or placement.scheduler_for is all (else it adds nothing).
    scheduler_for_pinned: bool = True

    @classmethod
    def from_config(cls, config) -> "Policy":
        """From a `archway.config.Config` (its admission and placement sections)."""
        return cls(fail_closed=config.admission.unresolved == "deny",
                   deny_on_conflict=config.admission.deny_on_conflict,
                   deny_on_empty=config.admission.deny_on_empty,
                   scheduler_name=config.placement.scheduler_name or None,
                   mode=config.admission.mode,
                   deny_unschedulable=config.admission.deny_unschedulable,
                   preferred=config.placement.preferred_architectures,
                   tolerations=config.placement.tolerations,
                   fallback=tuple(config.placement.fallback_architectures),
                   unresolved=config.admission.unresolved,
                   source=SOURCE_CONFIG,
                   scheduler_for_pinned=(config.placement.scheduler_for == "all"
                                         or bool(config.prometheus.url)
                                         or bool(config.extender.max_utilisation)))

    def within(self, archs: frozenset[str]) -> frozenset[str]:
        """Of `archs`, the ones this policy lets a pod run on."""
        allowed = archs if self.allowed is None else archs & self.allowed
        return allowed - self.excluded

    @property
    def scheduler_only_when_needed(self) -> bool:
        """scheduler_name goes only to pods whose node archway's extender could still change."""
        return bool(self.scheduler_name) and not self.scheduler_for_pinned

    @property
    def limits(self) -> bool:
        return self.allowed is not None or bool(self.excluded)

    def describe_limits(self) -> str:
        said = []
        if self.allowed is not None:
            said.append("allowed " + (",".join(sorted(self.allowed)) or "none"))
        if self.excluded:
            said.append("excluded " + ",".join(sorted(self.excluded)))
        return "; ".join(said)


def opt_out_reason(pod: PodView, exclude_namespaces) -> str | None:
    """Why archway leaves `pod` alone whenever it is created: its namespace is excluded, or the
    pod opts out (annotation, or the chart's objectSelector label). The leader's revisit of pods
    archway never saw (gate/unseen.py) applies the same rule."""
    if pod.namespace in exclude_namespaces:
        return f"namespace {pod.namespace} is excluded"
    if pod.annotations.get(SKIP_ANNOTATION) == "true":
        return f"annotation {SKIP_ANNOTATION}=true"
    if pod.labels.get(SKIP_ANNOTATION) == "true":   # the chart's webhook.skipLabel by default
        return f"label {SKIP_ANNOTATION}=true"
    return None
