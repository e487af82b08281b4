"""Figures 22, 22b and 23: what the closed loop (issue 24) costs, on a real control plane
(lab/cluster/controlplane.py: etcd, kube-apiserver, kube-controller-manager built from source).

22:  the leading gate controller's pod watch (gate/remediation.py FailingPods) at 10,000
     pods: CPU per status update. Two watch processes side by side on the same apiserver and the
     same events: archway's, and one that parses the same list and watch and keeps nothing (what
     any watch of all pods costs); each pod's status is then updated once (10,000 updates, 1 in
     20 an exec format error) and each process's CPU time (/proc) divided by the events it saw.
22b: the same processes' memory: RSS after the first list (100 of the 10,000 pods failing) and
     the peak (VmHWM) while the pages went by.
23:  admission p99 with the owner lookup vs without: AdmissionService.review (the webhook's whole
     server-side admission: parse, resolve from a warm cache, decide, answer) of pods owned by
     ReplicaSets of 1,000 Deployments, with the workload caches synced from the apiserver vs
     without them (remediation.learn_failed_architectures off), interleaved one by one in one
     process; 1 in 10 Deployments learned arm64 (their pods get the exclusion).
"""
import json
import random
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from bench.common.lab import Lab
from bench.common.report import Figure
from bench.common.rounds import blocks, ratios, rounds
from bench.common.section import Started, measured
from bench.common.servers import cpu_seconds, rss_bytes
from bench.common.stats import percentile
from lab.cluster.controlplane import ControlPlane
from lab.kube import pod_path
from lab.procs import REPO
from lab.servers.registry import RegistryServer

PODS = 10_000
FAILING_AT_LIST = 100
FAILING_EVERY = 20          # of the status updates, one in this many says exec format error
DEPLOYMENTS = 1_000
LEARNED_EVERY = 10
REVIEWS = 5_000
CPU_RATIO_TARGET = 1.25     # archway's watch vs one keeping nothing, CPU per status update
RETAINED_TARGET_MB = 10.0   # RSS archway's watch holds beyond a watch keeping nothing
ADDED_P99_TARGET_MS = 0.1
NAMESPACES = 10
MB = 1024 * 1024
SPECS = (("22", f"leader's pod watch at {PODS:,} pods: CPU per status update, vs a watch "
                "keeping nothing", f"<= {CPU_RATIO_TARGET:g}x"),
         ("22b", f"leader's pod watch at {PODS:,} pods: memory beyond a watch keeping nothing",
          f"<= {RETAINED_TARGET_MB:g} MB"),
         ("23", f"admission p99 with the owner lookup vs without ({DEPLOYMENTS:,} Deployments)",
          f"+<= {ADDED_P99_TARGET_MS:g} ms"))


def run(lab: Lab) -> list[Figure]:
    def measure(started: Started) -> list[Figure]:
        plane = started(ControlPlane(lab.path("loop-plane"), nodes=(("node-a", "amd64"),
                                                                   ("node-b", "arm64"))))
        plane.start()
        registry = started(RegistryServer(lab.path("loop-registry")))
        digest = registry.push_index("bench/app", "1", ["linux/amd64", "linux/arm64"]).digest
        image = f"{registry.host}/bench/app:1"
        namespaces = [plane.new_namespace(f"loop-{i}") for i in range(NAMESPACES)]
        return [*_pod_watch(plane, namespaces, image, digest),
                _admission(plane, namespaces, registry, image, digest)]
    return measured(SPECS, measure)


# --- figure 22 -------------------------------------------------------------------------------

def _pod(name: str, image: str, digest: str, node: str) -> dict:
    """A pod as a Deployment's: env, resources, probes, a projected token, archway's
    annotations; bound (spec.nodeName) as the scheduler leaves it (no kubelet runs here)."""
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {
        "name": name, "labels": {"app": name.rsplit("-", 2)[0], "pod-template-hash": "7c9d6b5f8d",
                                 "team": "shop", "tier": "web"},
        "annotations": {"archway.dev/architectures": "amd64,arm64",
                        "archway.dev/images": json.dumps([{"image": image, "digest": digest,
                                                           "architectures": ["amd64", "arm64"],
                                                           "source": "oci-index"}])}},
        "spec": {"nodeName": node, "terminationGracePeriodSeconds": 0, "containers": [{
            "name": "app", "image": image, "ports": [{"containerPort": 8080, "name": "http"}],
            "env": [{"name": f"SETTING_{i}", "value": f"value-{i}"} for i in range(6)],
            "resources": {"requests": {"cpu": "100m", "memory": "128Mi"},
                          "limits": {"memory": "256Mi"}},
            "readinessProbe": {"httpGet": {"path": "/healthz", "port": 8080}},
            "livenessProbe": {"httpGet": {"path": "/healthz", "port": 8080}}}]}}


def _status(pod: dict, digest: str, failing: bool) -> dict:
    container = pod["spec"]["containers"][0]
    now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    state = ({"state": {"waiting": {"reason": "CrashLoopBackOff", "message": "back-off 10s"}},
              "lastState": {"terminated": {"exitCode": 1, "reason": "Error", "startedAt": now,
                                           "finishedAt": now,
                                           "message": "exec /app: exec format error"}}}
             if failing else {"state": {"running": {"startedAt": now}}})
    return {"status": {"phase": "Running", "conditions": [
        {"type": "Ready", "status": "False" if failing else "True", "lastTransitionTime": now}],
        "containerStatuses": [{"name": "app", "image": container["image"], "ready": not failing,
                               "imageID": container["image"].rsplit(":", 1)[0] + "@" + digest,
                               "restartCount": 3 if failing else 0, **state}]}}


class _Watcher:
    """bench/apps/podwatch_worker.py in a process of its own; its stdout lines counted."""

    def __init__(self, kubeconfig: str, mode: str):
        self.mode = mode
        self.process = subprocess.Popen([sys.executable, "-m", "bench.apps.podwatch_worker",
                                          kubeconfig, mode], stdin=subprocess.PIPE,
                                         stdout=subprocess.PIPE, text=True, cwd=REPO)
        self.synced: int | None = None
        self.kept_bytes = 0
        self.seen = 0
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            word, _, number = line.partition(" ")
            if word == "synced":
                count, size = number.split()
                self.synced, self.kept_bytes = int(count), int(size)
            elif word == "seen":
                self.seen = int(number)

    def wait(self, condition, what: str, timeout: float = 300.0) -> None:
        end = time.monotonic() + timeout
        while not condition():
            if self.process.poll() is not None:
                raise RuntimeError(f"the {self.mode} watch exited ({self.process.returncode})")
            if time.monotonic() > end:
                raise RuntimeError(f"the {self.mode} watch: no {what} after {timeout:g} s")
            time.sleep(0.05)

    def peak(self) -> int:
        with open(f"/proc/{self.process.pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
        raise RuntimeError("no VmHWM")

    def stop(self) -> None:
        if self.process.poll() is None:
            assert self.process.stdin is not None
            self.process.stdin.close()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()


def _pod_watch(plane: ControlPlane, namespaces: list[str], image: str,
               digest: str) -> list[Figure]:
    kube = plane.kube
    pods = [(namespaces[i % NAMESPACES], _pod(f"web-{i // 100}-x{i:05d}", image, digest,
                                              "node-a" if i % 2 else "node-b"))
            for i in range(PODS)]
    with ThreadPoolExecutor(16) as pool:
        list(pool.map(lambda p: kube.create(pod_path(p[0]), p[1]), pods))
        list(pool.map(lambda p: kube.patch(pod_path(p[0], p[1]["metadata"]["name"]) + "/status",
                                           _status(p[1], digest, True)),
                      pods[:FAILING_AT_LIST]))
    watchers = [_Watcher(plane.admin_kubeconfig, mode) for mode in ("archway", "parse-only")]
    try:
        for w in watchers:
            w.wait(lambda w=w: w.synced is not None, "first list")
        archway, baseline = watchers
        if archway.synced != FAILING_AT_LIST:
            raise RuntimeError(f"archway's watch kept {archway.synced} pods, not "
                               f"{FAILING_AT_LIST}")
        time.sleep(1.0)   # the watches are open
        rss = {w.mode: rss_bytes(w.process.pid) for w in watchers}
        peak = {w.mode: w.peak() for w in watchers}
        cpu = {w.mode: cpu_seconds(w.process.pid) for w in watchers}
        started = time.monotonic()
        updates = pods[FAILING_AT_LIST:] + pods[:FAILING_AT_LIST]   # every pod once
        # Rounds: blocks of the updates, each process's CPU over each block (both watch the
        # same events at the same time: a round is the same load for both).
        per_block: dict[str, list[float]] = {w.mode: [] for w in watchers}
        done = 0
        for block in blocks(list(enumerate(updates)), rounds()):
            at_start = {w.mode: cpu_seconds(w.process.pid) for w in watchers}
            with ThreadPoolExecutor(16) as pool:
                list(pool.map(lambda ip: kube.patch(
                    pod_path(ip[1][0], ip[1][1]["metadata"]["name"]) + "/status",
                    _status(ip[1][1], digest, ip[0] % FAILING_EVERY == 0)), block))
            done += len(block)
            wanted = done // 500 * 500     # the watch processes say how many in steps of 500
            for w in watchers:
                w.wait(lambda w=w, wanted=wanted: w.seen >= wanted, f"{wanted} events")
                per_block[w.mode].append((cpu_seconds(w.process.pid) - at_start[w.mode]) /
                                         len(block))
        took = time.monotonic() - started
        used = {w.mode: cpu_seconds(w.process.pid) - cpu[w.mode] for w in watchers}
    finally:
        for w in watchers:
            w.stop()
    per_update = {mode: seconds / len(updates) * 1e6 for mode, seconds in used.items()}
    per_round = ratios(per_block["archway"], per_block["parse-only"])
    ratio = per_round.median
    retained = (rss["archway"] - rss["parse-only"]) / MB
    return [
        Figure("22", SPECS[0][1],
               f"{per_round.describe(unit='x')} ({per_update['archway']:.0f} vs "
               f"{per_update['parse-only']:.0f} us)",
               SPECS[0][2], ratio <= CPU_RATIO_TARGET, [
                   f"{PODS:,} pods (~{len(json.dumps(pods[0][1])) / 1024:.1f} KB each as "
                   f"created) on the real apiserver; two watch processes side by side "
                   f"(archway's FailingPods; a ListWatch of the same pages parsing and keeping "
                   f"nothing); each pod's status updated once through pods/status ({len(updates):,}"
                   f" updates in {took:.0f} s, 16 at a time; 1 in {FAILING_EVERY} an exec format "
                   f"error); CPU time of each process (/proc, 10 ms ticks) over the updates "
                   f"divided by their number: {used['archway']:.2f} vs "
                   f"{used['parse-only']:.2f} s in all; figure = median over "
                   f"{len(per_round.values)} rounds (consecutive blocks of the updates) of the "
                   "CPU ratio in each"], rounds=per_round),
        Figure("22b", SPECS[1][1],
               f"+{retained:.1f} MB (RSS {rss['archway'] / MB:.1f} vs "
               f"{rss['parse-only'] / MB:.1f} MB; peak {peak['archway'] / MB:.0f} vs "
               f"{peak['parse-only'] / MB:.0f} MB; kept {archway.kept_bytes / 1024:.0f} KB)",
               SPECS[1][2], retained <= RETAINED_TARGET_MB, [
                   f"RSS of each watch process once its first list of {PODS:,} pods (pages of "
                   f"500) was in and the heap trimmed, {FAILING_AT_LIST} of them failing with "
                   f"exec format error (archway keeps those: {archway.kept_bytes:,} bytes, the "
                   "deep size of its facts); peak = VmHWM during the list"])]


# --- figure 23 -------------------------------------------------------------------------------

def _admission(plane: ControlPlane, namespaces: list[str], registry: RegistryServer,
               image: str, digest: str) -> Figure:
    from archway.cluster.caches import ClusterCaches
    from archway.cluster.pullsecrets import PullCredentials
    from archway.cluster.workloadcache import WorkloadCache
    from archway.config import RegistrySettings
    from archway.kubeclient import build_api_client
    from archway.placement.learning import Evidence, merged_annotations
    from archway.placement.policy import Policy
    from archway.registry.resolver import Resolver
    from archway.webhook.service import AdmissionService, AdmissionSettings

    kube = plane.kube
    learned = merged_annotations({}, "arm64", [Evidence(image, digest, "arm64")])

    def create(i: int) -> None:
        ns = namespaces[i % NAMESPACES]
        meta = {"name": f"app-{i}", **({"annotations": learned} if i % LEARNED_EVERY == 0 else {})}
        kube.create(f"/apis/apps/v1/namespaces/{ns}/deployments", {
            "apiVersion": "apps/v1", "kind": "Deployment", "metadata": meta,
            "spec": {"replicas": 0, "selector": {"matchLabels": {"app": f"app-{i}"}},
                     "template": {"metadata": {"labels": {"app": f"app-{i}"}},
                                  "spec": {"containers": [{"name": "app", "image": image}]}}}})
    with ThreadPoolExecutor(16) as pool:
        list(pool.map(create, range(DEPLOYMENTS)))

    def replica_sets():
        return [rs for ns in namespaces
                for rs in kube.items(f"/apis/apps/v1/namespaces/{ns}/replicasets")]
    end = time.monotonic() + 300
    while len(sets := replica_sets()) < DEPLOYMENTS:
        if time.monotonic() > end:
            raise RuntimeError(f"only {len(sets)} ReplicaSets of {DEPLOYMENTS} Deployments")
        time.sleep(1)

    class NoSecrets:
        def credentials_for(self, pod, deadline):
            from archway.registry.credentials import Keyring
            return PullCredentials(Keyring.empty())

    from archway.config import KubernetesSettings
    settings = KubernetesSettings(kubeconfig=plane.admin_kubeconfig)
    workloads = WorkloadCache(lambda: build_api_client(settings)[0])
    if not workloads.wait_synced(120):
        raise RuntimeError("the workload caches did not sync")
    resolver = Resolver(RegistrySettings(insecure_hosts=(registry.host,)))
    services = {
        name: AdmissionService(AdmissionSettings(policy=Policy(), deadline_seconds=3.0,
                                                 max_body_bytes=3 * MB),
                               resolver=resolver, pull_secrets=NoSecrets(),
                               caches=ClusterCaches(workloads=cache))
        for name, cache in (("without", None), ("with", workloads))}

    def body(rs: dict, uid: str) -> bytes:
        meta = rs["metadata"]
        return json.dumps({"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
                           "request": {"uid": uid, "operation": "CREATE",
                                       "namespace": meta["namespace"],
                                       "kind": {"group": "", "version": "v1", "kind": "Pod"},
                                       "resource": {"group": "", "version": "v1",
                                                    "resource": "pods"},
                                       "object": {"apiVersion": "v1", "kind": "Pod", "metadata": {
                                           "generateName": meta["name"] + "-",
                                           "ownerReferences": [{
                                               "apiVersion": "apps/v1", "kind": "ReplicaSet",
                                               "name": meta["name"], "uid": meta["uid"],
                                               "controller": True}]},
                                           "spec": {"containers": [{"name": "app",
                                                                    "image": image}]}}}}).encode()
    rng = random.Random(24)
    bodies = [body(rng.choice(sets), f"u-{i}") for i in range(REVIEWS)]
    for svc in services.values():      # warm: the resolver's cache, the code paths
        for b in bodies[:200]:
            svc.review(b)
    took: dict[str, list[float]] = {name: [] for name in services}
    excluded = 0
    for b in bodies:
        for name, svc in services.items():
            start = time.perf_counter()
            answer = svc.review(b)
            took[name].append((time.perf_counter() - start) * 1000)
            if name == "with" and "kept off arm64" in json.dumps(answer.body):
                excluded += 1
    workloads.stop()
    p = {name: (percentile(v, 50), percentile(v, 99)) for name, v in took.items()}
    added = p["with"][1] - p["without"][1]
    return Figure(
        "23", SPECS[2][1], f"+{added:.3f} ms (p99 {p['with'][1]:.3f} vs {p['without'][1]:.3f};"
                           f" p50 {p['with'][0]:.3f} vs {p['without'][0]:.3f})",
        SPECS[2][2], added <= ADDED_P99_TARGET_MS and excluded > 0, [
            f"{REVIEWS:,} AdmissionReviews of pods owned by ReplicaSets of {DEPLOYMENTS:,} "
            f"Deployments (replicas 0) in {NAMESPACES} namespaces, each reviewed by a service "
            "with the workload caches (6 list + watch caches synced from the real apiserver) and "
            "one without, interleaved one by one in one process, warm resolver cache; "
            f"{excluded:,} of the reviews with the caches kept the pod off arm64 (1 in "
            f"{LEARNED_EVERY} Deployments learned it)"])
