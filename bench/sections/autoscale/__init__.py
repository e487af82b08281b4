"""Figures 29-29e (issue 29): archway beside Karpenter. One real control plane with KWOK and
Karpenter's KWOK provider (lab/cluster/karpenter.py: arm64 offerings at 0.8x amd64's price), no
Node a pod could run on until Karpenter launches one, archway installed by its chart, images in a
real registry. Every measurement starts from no NodeClaim and no Node in its NodePools.

29:  time from the client's create to Running on a node Karpenter launched for it: 100 pods of
     mixed images (40 amd64-only, 30 arm64-only, 30 two-arch) placed by archway and 100 more
     archway never sees (the chart's skip label), created interleaved one by one in the same
     moment, each arm in a NodePool of its own (the same settings: `default`'s, 4- and 8-CPU
     instance types); ROUNDS rounds, the arm created first alternating. p99 ratio <= 1.2.
29b: NodeClaims Karpenter launched per 100 pods, with archway vs without (target: equal or
     fewer).
29c: pods Running on a node whose architecture none of their images has (target with: 0).
29d: a gated pod's release against Karpenter's batching window: 10 amd64-only pods of one image,
     and 10 of ten images, created while their registry is too slow (gated) and released when it
     is back, vs 10 created ungated in the same moment; NodeClaims launched for each group (one
     would do).
29e: archway's preferred architectures and Karpenter's cost choice: two-arch pods in namespaces
     with no preference, arm64 preferred, amd64 preferred and equal weights; the architecture
     of the nodes launched for each.
"""
import time
from concurrent.futures import ThreadPoolExecutor

from bench.common.lab import Lab
from bench.common.report import Figure, load_average
from bench.common.section import Started, measured
from bench.common.stats import percentile
from lab.cluster.chart import ChartInstall
from lab.cluster.controlplane import ControlPlane
from lab.cluster.karpenter import NODEPOOL_LABEL, start_with_kwok
from lab.kube import Kube, pod_path
from lab.servers.proxy import DelayProxy
from lab.servers.registry import RegistryServer

from .provisioning import (
    BENCH_LABEL,
    PodWatch,
    claim_summary,
    claim_timeline,
    claims,
    clear,
    create_pools,
    node_archs,
    wrong_placements,
)

PODS = 100                 # per arm and round
ROUNDS = 2
IMAGES = (("amd64-only", ("amd64",), 4), ("arm64-only", ("arm64",), 3),
          ("two-arch", ("amd64", "arm64"), 3))     # (repository, architectures, images of it)
ARMS = ("archway", "skipped")
POOLS = {"archway": "bench-archway", "skipped": "bench-skipped"}
SKIP_LABEL = "archway.dev/skip"
REQUESTS = {"cpu": "250m", "memory": "256Mi"}
RATIO_TARGET = 1.2
GATE_PODS = 10
GATE_TRIALS = 3
GATE_GROUPS = ("ungated", "one-image", "ten-images")
GATE_POOLS = tuple(f"bench-gate-{group}" for group in GATE_GROUPS)
SLOW_REGISTRY_SECONDS = 6.0    # beyond the chart's deadline (3 s) and registry timeout (5 s)
PREFERENCES = (("none", ""), ("arm64", "arm64=80,amd64=20"), ("amd64", "amd64=80,arm64=20"),
               ("equal", "amd64=50,arm64=50"))
PREFERENCE_PODS = 5
SPECS = (("29", f"create -> Running on a new Karpenter node, {PODS} mixed pods, p99 with archway "
                "/ without", f"<= {RATIO_TARGET:g}"),
         ("29b", f"NodeClaims Karpenter launched per {PODS} pods, with archway vs without",
          "with <= without"),
         ("29c", "pods Running on a node of an architecture their image lacks, without vs with "
                 "archway", "with: 0"),
         ("29d", f"NodeClaims for {GATE_PODS} pods released by the gate vs created ungated",
          "info"),
         ("29e", "node architecture Karpenter launched per archway preference (arm64 cheapest)",
          "info"))


def run(lab: Lab) -> list[Figure]:
    return measured(SPECS, lambda started: _measure(lab, started))


def _measure(lab: Lab, started: Started) -> list[Figure]:
    registry = started(RegistryServer(lab.path("autoscale-registry")))
    images = _push_images(registry)
    slow = started(DelayProxy(registry.port))
    plane = started(ControlPlane(lab.path("autoscale-plane"), nodes=(), audit=False))
    plane.start()
    install = ChartInstall(plane, archway_config={
        "registry": {"insecure_hosts": [registry.host, slow.host]}})
    started.callback(install.stop_processes)
    install.install()
    # The chart's Deployments idled first: their pods stand in for processes running here.
    start_with_kwok(plane, install.namespace)
    kube = plane.kube
    assert kube is not None
    create_pools(kube, POOLS.values())
    create_pools(kube, [*GATE_POOLS, *(f"bench-pref-{name}" for name, _ in PREFERENCES)],
                 cpus=None)
    watch = started(PodWatch(kube))
    rounds = [_mixed_round(plane, watch, images, r) for r in range(ROUNDS)]
    figures = _mixed_figures(rounds)
    trials = [_gate_trial(plane, watch, registry, slow, t) for t in range(GATE_TRIALS)]
    return [*figures, _gate_figure(trials),
            _preference_figure(_preferences(plane, watch, registry))]


def _push_images(registry: RegistryServer) -> list[tuple[str, frozenset[str]]]:
    """(reference, architectures) of every image: single-platform manifests for the one-arch
    repositories (as most such images are), an index for the two-arch one."""
    images = []
    for repo, archs, count in IMAGES:
        for i in range(count):
            platforms = [f"linux/{a}" for a in archs]
            if len(platforms) == 1:
                registry.push_image(f"bench/{repo}", f"v{i}", platforms[0])
            else:
                registry.push_index(f"bench/{repo}", f"v{i}", platforms)
            images.append((f"{registry.host}/bench/{repo}:v{i}", frozenset(archs)))
    return images


def _pod(name: str, image: str, pool: str, *, skip: bool = False) -> dict:
    labels = {BENCH_LABEL: "autoscale", **({SKIP_LABEL: "true"} if skip else {})}
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "labels": labels},
            "spec": {"containers": [{"name": "c", "image": image,
                                     "resources": {"requests": REQUESTS}}],
                     "nodeSelector": {NODEPOOL_LABEL: pool},
                     "terminationGracePeriodSeconds": 0}}


def _timed_create(kube: Kube, namespace: str, body: dict) -> tuple[str, float, dict]:
    started = time.monotonic()
    stored = kube.create(pod_path(namespace), body)
    return f"{namespace}/{body['metadata']['name']}", started, stored


def _mixed_round(plane: ControlPlane, watch: PodWatch, images, index: int) -> dict:
    kube = plane.kube
    assert kube is not None
    namespaces = {arm: plane.new_namespace(f"autoscale-{arm}-{index}") for arm in ARMS}
    if node_archs(kube, POOLS.values()):
        raise RuntimeError("the NodePools hold Nodes before the round")
    wall = time.time()
    created, stored_at = _create_interleaved(kube, namespaces, images, index)
    running = watch.wait_running([key for _, key, _, _ in created], timeout=300)
    _check_placed(kube, namespaces)
    archs = node_archs(kube, POOLS.values())
    starts = [started for _, _, started, _ in created]
    result: dict = {"load": load_average(), "creates": max(starts) - min(starts)}
    for arm in ARMS:
        mine = [(key, started, image_archs) for a, key, started, image_archs in created if a == arm]
        result[arm] = _arm_result(kube, watch, POOLS[arm], namespaces[arm], mine, running,
                                  stored_at, archs, wall)
    clear(kube, namespaces.values(), POOLS.values())
    return result


def _create_interleaved(kube: Kube, namespaces: dict[str, str], images,
                        index: int) -> tuple[list, dict[str, float]]:
    """Both arms' pods, created one by one in turns (the arm first alternating with `index`) by
    8 client threads: (arm, key, when its create started, its image's architectures) of each,
    and key -> seconds its create took."""
    order = []
    for i in range(PODS):
        pair = ARMS if (i + index) % 2 == 0 else ARMS[::-1]
        order += [(arm, i) for arm in pair]

    def create(item):
        arm, i = item
        image, archs = images[i % len(images)]
        body = _pod(f"p-{i:03d}", image, POOLS[arm], skip=arm == "skipped")
        key, started, _ = _timed_create(kube, namespaces[arm], body)
        stored_at[key] = time.monotonic() - started
        return arm, key, started, archs
    stored_at: dict[str, float] = {}
    with ThreadPoolExecutor(8) as pool:
        created = list(pool.map(create, order))
    return created, stored_at


def _check_placed(kube: Kube, namespaces: dict[str, str]) -> None:
    """archway placed every pod of its arm (at admission, or by the gate controller when it was
    gated) and none of the skipped arm."""
    for arm in ARMS:
        placed = sum("archway.dev/architectures" in (p["metadata"].get("annotations") or {})
                     for p in kube.items(pod_path(namespaces[arm])))
        if placed != (PODS if arm == "archway" else 0):
            raise RuntimeError(f"{placed} of the {arm} arm's {PODS} pods were placed by archway")


def _arm_result(kube: Kube, watch: PodWatch, pool: str, namespace: str, mine: list,
                running: dict, stored_at: dict[str, float], archs: dict[str, str],
                wall: float) -> dict:
    """One arm's round: `mine` its (key, create started, image architectures)."""
    return {
        "seconds": [running[key][0] - started for key, started, _ in mine],
        "wrong": wrong_placements({key: (a, running[key][1]) for key, _, a in mine}, archs),
        "claims": claims(kube, pool),
        "timeline": claim_timeline(claims(kube, pool), wall),
        "gated": sum(1 for key, _, _ in mine if key in watch.gated_seen),
        "warned": len(kube.items(f"/api/v1/namespaces/{namespace}/events",
                                 fieldSelector="reason=ArchwayUnschedulable")),
        "create_p99": percentile([stored_at[key] for key, _, _ in mine], 99),
        "stored_over": max(started + stored_at[key] for key, started, _ in mine)
        - min(started + stored_at[key] for key, started, _ in mine)}


def _mixed_figures(rounds: list[dict]) -> list[Figure]:
    seconds = {arm: [s for r in rounds for s in r[arm]["seconds"]] for arm in ARMS}
    p = {arm: (percentile(v, 50), percentile(v, 99)) for arm, v in seconds.items()}
    ratio = p["archway"][1] / p["skipped"][1]
    counts = {arm: [len(r[arm]["claims"]) for r in rounds] for arm in ARMS}
    wrong = {arm: sum(r[arm]["wrong"] for r in rounds) for arm in ARMS}
    total = PODS * len(rounds)
    per_round = [f"round {i + 1} (load {r['load']}; the {2 * PODS} creates spanned "
                 f"{r['creates']:.1f} s): with {len(r['archway']['claims'])} "
                 f"({claim_summary(r['archway']['claims'])}), without "
                 f"{len(r['skipped']['claims'])} ({claim_summary(r['skipped']['claims'])}); "
                 f"p99 {percentile(r['archway']['seconds'], 99):.2f} vs "
                 f"{percentile(r['skipped']['seconds'], 99):.2f} s; with: {r['archway']['timeline']}, "
                 f"without: {r['skipped']['timeline']} after the first create; creates p99 "
                 f"{r['archway']['create_p99']:.2f} vs {r['skipped']['create_p99']:.2f} s, each "
                 f"arm's pods stored over {r['archway']['stored_over']:.1f} vs "
                 f"{r['skipped']['stored_over']:.1f} s; archway's pods gated: "
                 f"{r['archway']['gated']}, ArchwayUnschedulable Events: {r['archway']['warned']}"
                 for i, r in enumerate(rounds)]
    how = (f"{ROUNDS} rounds of {PODS} pods per arm ({', '.join(f'{n} {repo} images' for repo, _, n in IMAGES)}, "
           f"{PODS // 10} pods each; requests {REQUESTS['cpu']} CPU, {REQUESTS['memory']}), "
           "both arms created interleaved one by one by 8 client threads, the first arm "
           "alternating; each arm's pods select their own NodePool (`default`'s settings, "
           "4- and 8-CPU instance types, consolidation off); round 1 with archway's cache cold, "
           "round 2 warm; Running seen by a watch; after each round every pod, NodeClaim and "
           "Node was deleted")
    with_, without = (sum(counts[a]) * PODS / total for a in ARMS)
    return [
        Figure("29", SPECS[0][1], f"{ratio:.2f} (p99 {p['archway'][1]:.2f} vs {p['skipped'][1]:.2f} s;"
                                  f" p50 {p['archway'][0]:.2f} vs {p['skipped'][0]:.2f} s)",
               SPECS[0][2], ratio <= RATIO_TARGET, [how, *per_round]),
        Figure("29b", SPECS[1][1], f"{with_:g} vs {without:g} (rounds: "
                                   f"{'/'.join(map(str, counts['archway']))} vs "
                                   f"{'/'.join(map(str, counts['skipped']))})",
               SPECS[1][2], with_ <= without, []),
        Figure("29c", SPECS[2][1], f"{wrong['skipped']} of {total} vs {wrong['archway']} of {total}",
               SPECS[2][2], wrong["archway"] == 0,
               ["a pod is wrongly placed when its node's kubernetes.io/arch is not among its "
                "image's architectures (on a real node: exec format error)"])]


def _gate_trial(plane: ControlPlane, watch: PodWatch, registry: RegistryServer,
                slow: DelayProxy, index: int) -> dict:
    """GATE_PODS pods per group, each group in its NodePool, created in the same moment."""
    kube = plane.kube
    assert kube is not None
    for k in range(GATE_PODS):
        registry.push_image("bench/gate", f"t{index}-{k}", "linux/amd64")
    namespace = plane.new_namespace(f"autoscale-gate-{index}")
    fast = f"{registry.host}/bench/gate:t{index}-0"
    for i in range(4):   # warm both webhook workers' caches: these pods are never gated
        kube.create(pod_path(namespace), _pod(f"warm-{i}", fast, GATE_POOLS[0]), dryRun="All")
    slow.delay = SLOW_REGISTRY_SECONDS
    images = {GATE_GROUPS[0]: lambda k: fast, GATE_GROUPS[1]: lambda k: f"{slow.host}/bench/gate:t{index}-0",
              GATE_GROUPS[2]: lambda k: f"{slow.host}/bench/gate:t{index}-{k}"}
    bodies = [_pod(f"{group}-{k}", image(k), pool) for (group, image), pool
              in zip(images.items(), GATE_POOLS) for k in range(GATE_PODS)]
    with ThreadPoolExecutor(8) as executor:
        created = list(executor.map(lambda body: _timed_create(kube, namespace, body), bodies))
    time.sleep(4.0)            # gated a while: the controller is in its back-off
    while_gated = sum(len(claims(kube, pool)) for pool in GATE_POOLS[1:])
    slow.delay = 0.0
    back = time.monotonic()
    running = watch.wait_running([key for key, _, _ in created], timeout=180)
    result: dict = {"while_gated": while_gated, "load": load_average(), "groups": {}}
    for group, pool in zip(GATE_GROUPS, GATE_POOLS):
        mine = [key for key, _, _ in created if f"/{group}-" in key]
        times = sorted(running[key][0] - back for key in mine)
        result["groups"][group] = {
            "gated": sum(1 for key, _, stored in created if key in mine
                         and stored["spec"].get("schedulingGates")),
            "claims": claims(kube, pool), "spread": times[-1] - times[0]}
    clear(kube, [namespace], GATE_POOLS)
    return result


def _gate_figure(trials: list[dict]) -> Figure:
    counts = {group: "/".join(str(len(t["groups"][group]["claims"])) for t in trials)
              for group in GATE_GROUPS}
    rows = [f"trial {i + 1} (load {t['load']}): {t['while_gated']} NodeClaims while gated; " +
            "; ".join(f"{group}: {g['gated']}/{GATE_PODS} gated at create -> "
                      f"{claim_summary(g['claims'])}, Running over {g['spread']:.2f} s"
                      for group, g in t["groups"].items()) for i, t in enumerate(trials)]
    return Figure("29d", SPECS[3][1], f"one image {counts[GATE_GROUPS[1]]}, ten images "
                                      f"{counts[GATE_GROUPS[2]]} vs ungated "
                                      f"{counts[GATE_GROUPS[0]]} NodeClaims", SPECS[3][2], None, [
                      f"{GATE_TRIALS} trials of 3 x {GATE_PODS} amd64-only pods (requests "
                      f"{REQUESTS['cpu']} CPU: {GATE_PODS} fit one 4-CPU node), each group in "
                      "a NodePool of `default`'s settings (every instance size), all created in "
                      f"the same moment: `{GATE_GROUPS[0]}` straight from the registry (cache "
                      f"warm), `{GATE_GROUPS[1]}` ({GATE_PODS} pods, one image) and "
                      f"`{GATE_GROUPS[2]}` (one image each) through a proxy delaying the "
                      f"registry {SLOW_REGISTRY_SECONDS:g} s (the chart's deadline 3 s: gated); "
                      "after 4 s the delay went to 0; Running over: first to last pod of the "
                      "group", *rows])


def _preferences(plane: ControlPlane, watch: PodWatch, registry: RegistryServer) -> dict:
    kube = plane.kube
    assert kube is not None
    registry.push_index("bench/preferred", "v1", ["linux/amd64", "linux/arm64"])
    namespaces = {}
    for name, annotation in PREFERENCES:
        namespaces[name] = namespace = f"autoscale-prefer-{name}"
        kube.create("/api/v1/namespaces", {"apiVersion": "v1", "kind": "Namespace", "metadata": {
            "name": namespace, "annotations": {"archway.dev/preferred-architectures": annotation}}})
    time.sleep(3.0)            # archway's namespace cache has seen the annotations
    keys: dict[str, list[str]] = {name: [] for name in namespaces}
    terms: dict[str, list[str]] = {}
    for name, namespace in namespaces.items():
        kube.wait_for(lambda ns=namespace: kube.get(f"/api/v1/namespaces/{ns}/serviceaccounts/default"),
                      timeout=30, what=f"the default ServiceAccount of {namespace}")
        for i in range(PREFERENCE_PODS):
            key, _, stored = _timed_create(kube, namespace, _pod(
                f"p-{i}", f"{registry.host}/bench/preferred:v1", f"bench-pref-{name}"))
            keys[name].append(key)
            if i == 0:
                affinity = (stored["spec"].get("affinity") or {}).get("nodeAffinity") or {}
                terms[name] = [
                    f"{t['preference']['matchExpressions'][0]['values'][0]}={t['weight']}"
                    for t in affinity.get("preferredDuringSchedulingIgnoredDuringExecution") or []]
    running = watch.wait_running([k for name in namespaces for k in keys[name]], timeout=180)
    pools = [f"bench-pref-{name}" for name in namespaces]
    archs = node_archs(kube, pools)
    result = {name: {"terms": terms[name],
                     "nodes": sorted({archs.get(running[k][1], "?") for k in keys[name]}),
                     "claims": claim_summary(claims(kube, f"bench-pref-{name}"))}
              for name in namespaces}
    clear(kube, namespaces.values(), pools)
    return result


def _preference_figure(cases: dict) -> Figure:
    measured = "; ".join(f"{name}: {'/'.join(case['nodes'])}" for name, case in cases.items())
    rows = [f"{name}: archway wrote preferred terms [{', '.join(case['terms']) or 'none'}]; "
            f"Karpenter launched {case['claims']}" for name, case in cases.items()]
    return Figure("29e", SPECS[4][1], measured, SPECS[4][2], None, [
        f"{PREFERENCE_PODS} two-arch pods per namespace (annotation "
        "archway.dev/preferred-architectures), each namespace's pods in a NodePool of their own "
        "(`default`'s settings, every size), all created in the same moment; Karpenter takes a "
        "pod's heaviest preferred term as a requirement and relaxes it only when nothing fits",
        *rows])

