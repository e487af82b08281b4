"""The admission policy: what the configuration asks of a placement (deny or admit, pin or only
annotate, which scheduler, which architectures to prefer or tolerate). A new policy knob is a
field here, read in `from_config`, and used by placement.decide."""
from dataclasses import dataclass

MODES = ("enforce", "audit", "off")
DEFAULT_SCHEDULER = "default-scheduler"


@dataclass(frozen=True)
class Policy:
    fail_closed: bool = False        # deny pods with an image that could not be resolved
    deny_on_conflict: bool = False   # deny pods whose own arch constraint excludes every arch of S
    deny_on_empty: bool = True       # deny pods whose images share no architecture
    scheduler_name: str | None = None
    mode: str = "enforce"            # audit: annotate only; Decision.would says what enforce does
    deny_unschedulable: bool = False  # deny pods whose archs no node they tolerate has
    preferred: tuple[tuple[str, int], ...] = ()     # (arch, weight 1..100), heaviest first
    tolerations: tuple[tuple[str, tuple[dict, ...]], ...] = ()   # (arch, tolerations to add)

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
                   tolerations=config.placement.tolerations)

