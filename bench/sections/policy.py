"""Figure 10: what the arch policy costs the placement decision, in process.

`placement.decide` on a pod of 3 multi-arch images: the plain decision (no policy, no nodes)
side by side with the full policy (preferred weights, tolerations, audit or enforce) and the
cluster check against a node cache of 5,000 nodes — once where the first nodes can run the pod
(the healthy case: the check stops there), once where none can (every node is looked at).
Figure 15b: what a namespace editor's largest legal policies cost every webhook replica, and the
leader's conflict check over them.
"""
import dataclasses
import gc
import json
import time
import tracemalloc

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
    __slots__ = ("arch", "taints", "os")

    def __init__(self, arch, taints=()):
        self.arch, self.taints, self.os = arch, taints, "linux"


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
    ], rounds=steady), tenant_policies()]


# --- figure 15b: what a tenant's largest legal policies cost every replica -------------------

POLICIES = 1_000
MEMORY_TARGET_MB = 50.0


def _largest_policy(n: int) -> dict:
    """A PlacementPolicy at every limit of the CRDs' schema (docs/policies.md, "Limits"), its
    strings distinct from every other policy's."""
    value = lambda *parts: "-".join(str(p) for p in parts).ljust(63, "x")   # noqa: E731
    return {"apiVersion": "archway.dev/v1alpha1", "kind": "PlacementPolicy",
            "metadata": {"name": f"p{n}", "namespace": "tenant", "uid": f"u{n}", "generation": 1},
            "spec": {"priority": 1, "mode": "audit" if n % 2 else "enforce",
                     "podSelector": {
                         "matchLabels": {f"example.com/l{i}-{n}": value(n, i) for i in range(16)},
                         "matchExpressions": [
                             {"key": f"example.com/e{i}-{n}", "operator": "NotIn",
                              "values": [value(n, i, j) for j in range(16)]} for i in range(16)]}}}


def _held_bytes(make) -> int:
    """Bytes still allocated by what `make()` returns, while it is held."""
    gc.collect()
    tracemalloc.start()
    try:
        held = make()
        gc.collect()
        size = tracemalloc.get_traced_memory()[0]
        del held
        return size
    finally:
        tracemalloc.stop()


def tenant_policies() -> Figure:
    from archway.objects.policies import NAMESPACED_KIND, policy_object
    from archway.placement.policies import conflicts_of
    texts = [json.dumps(_largest_policy(n)) for n in range(POLICIES)]
    kept = _held_bytes(lambda: [policy_object(json.loads(t), NAMESPACED_KIND) for t in texts])
    documents = _held_bytes(lambda: [json.loads(t)["spec"]["podSelector"] for t in texts])
    policies = [policy_object(json.loads(t), NAMESPACED_KIND) for t in texts]
    assert all(p.valid for p in policies)
    overlaps: dict = {}
    start = time.process_time()
    conflicts_of(policies, None, overlaps)
    first = time.process_time() - start
    edited = [*policies[1:], dataclasses.replace(policies[0], generation=2)]
    start = time.process_time()
    conflicts_of(edited, None, overlaps)
    change = time.process_time() - start
    mb, per = kept / 2**20, kept / POLICIES / 1024
    return Figure("15b", f"{POLICIES:,} largest legal PlacementPolicies held by a replica",
                  f"{mb:.1f} MB ({per:.1f} KB each; {documents / kept:.1f}x that as parsed JSON)",
                  f"<= +{MEMORY_TARGET_MB:g} MB", mb <= MEMORY_TARGET_MB, [
        (f"tracemalloc of the PolicyObjects a worker keeps, each at every limit of the schema "
         f"(16 matchLabels, 16 NotIn expressions of 16 values of 63 characters, all distinct); "
         f"the same selectors kept as parsed documents (as before issue 48): "
         f"{documents / 2**20:.1f} MB"),
        (f"the leader's conflict check, all {POLICIES:,} in one namespace and priority, half "
         f"saying something else: {first:.1f} s of CPU at its first look "
         f"({POLICIES // 2 * (POLICIES - POLICIES // 2):,} pairs), {change * 1000:.0f} ms "
         f"after one policy changed (only its own pairs' selectors compared again)"),
    ])
