"""Figure 10: what the arch policy costs the placement decision, in process.

`placement.decide` on a pod of 3 multi-arch images: the plain decision (no policy, no nodes)
side by side with the full policy (preferred weights, tolerations, audit or enforce) and the
cluster check against a node cache of 5,000 nodes — once where the first nodes can run the pod
(the healthy case: the check stops there), once where none can (every node is looked at).
"""
import time

from archway.placement.decision import decide
from archway.placement.policy import Policy
from archway.podview import PodView
from archway.registry.model import ImageInfo
from archway.registry.platforms import parse_platform
from bench.common.lab import Lab
from bench.common.report import Figure
from bench.common.rounds import ratios, rounds

NODES = 5_000
ROUNDS = 2_000
TARGET_RATIO = 2.0


class _Node:
    __slots__ = ("arch", "taints")

    def __init__(self, arch, taints=()):
        self.arch, self.taints = arch, taints


def _per_call(**fns) -> dict[str, list[float]]:
    """Seconds per call of each function, per round: the functions taking turns within each
    round so that a burst of load elsewhere hits them all alike."""
    per_round: dict[str, list[float]] = {name: [] for name in fns}
    for fn in fns.values():
        for _ in range(50):
            fn()
    for _ in range(rounds(7)):
        for name, fn in fns.items():
            start = time.perf_counter()
            for _ in range(ROUNDS):
                fn()
            per_round[name].append((time.perf_counter() - start) / ROUNDS)
    return per_round


def run(lab: Lab) -> list[Figure]:
    images = [f"registry.example/team/app-{i}:1.{i}" for i in range(3)]
    platforms = frozenset(parse_platform(p) for p in ("linux/amd64", "linux/arm64", "linux/arm/v7"))
    results = {im: ImageInfo(im, platforms, "sha256:" + "0" * 64, "oci-index") for im in images}
    pod = PodView.of({"apiVersion": "v1", "kind": "Pod",
                      "metadata": {"generateName": "web-", "namespace": "shop"},
                      "spec": {"containers": [{"name": f"c{i}", "image": im}
                                              for i, im in enumerate(images)]}})
    taint = ("kubernetes.io/arch", "arm64", "NoSchedule")
    policy = Policy(preferred=(("arm64", 80), ("amd64", 20)), tolerations=(
        ("arm64", ({"key": "kubernetes.io/arch", "operator": "Equal", "value": "arm64",
                    "effect": "NoSchedule"},)),))
    healthy = [_Node("arm64", (taint,)) if i % 2 else _Node("amd64") for i in range(NODES)]
    hopeless = [_Node("s390x") for _ in range(NODES)]
    audit_policy = Policy(mode="audit", preferred=policy.preferred,
                          tolerations=policy.tolerations)
    times = _per_call(plain=lambda: decide(pod, results, Policy()),
                      full=lambda: decide(pod, results, policy, nodes=healthy),
                      audit=lambda: decide(pod, results, audit_policy, nodes=healthy),
                      worst=lambda: decide(pod, results, policy, nodes=hopeless))
    steady = ratios(times["full"], times["plain"])
    plain, full, audit, worst = (min(times[k]) for k in ("plain", "full", "audit", "worst"))
    ratio = steady.median
    return [Figure("15", "decide() with the arch policy vs plain",
                   f"{steady.describe(unit='x')} ({full * 1e6:.0f} vs {plain * 1e6:.0f} µs)",
                   f"<= {TARGET_RATIO:g}x", ratio <= TARGET_RATIO, [
        (f"in process, {len(steady.values)} rounds x {ROUNDS} calls, taking turns; figure = "
         f"median of the per-round ratios, times = best round: a pod of 3 images (amd64, "
         f"arm64, arm); plain = Policy() without nodes: {plain * 1e6:.1f} µs; with preferred "
         f"weights, a toleration and {NODES:,} cached nodes (half arm64 tainted): "
         f"{full * 1e6:.1f} µs; audit mode: {audit * 1e6:.1f} µs"),
        (f"worst case, {NODES:,} nodes none of which can run the pod (every node checked, "
         f"then a warning): {worst * 1e6:.0f} µs ({worst / plain:.1f}x plain)"),
    ], rounds=steady)]
