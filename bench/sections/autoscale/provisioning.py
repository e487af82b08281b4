"""What the `autoscale` section (__init__.py here) needs around Karpenter: NodePools of its own,
a watch that times pods to Running, and the clean slate (no pod, no NodeClaim, no Node) each
measurement starts from.

Pure helpers (`bench_pool`, `wrong_placements`, `claim_summary`) are tested in tests/test_bench_tools.py;
the rest talks to the apiserver.
"""
import copy
import datetime
import json
import threading
import time

import requests

from lab.cluster.karpenter import KARPENTER_API, NODEPOOL_LABEL, nodepool
from lab.kube import Kube, KubeError, pod_path

BENCH_LABEL = "archway.dev/bench"            # on every pod the section creates
INSTANCE_CPU = "karpenter.kwok.sh/instance-cpu"
# 4- and 8-CPU instance types, as production NodePools usually allow: 100 pods then need several
# nodes with or without archway, and the count says what archway's split by architecture costs.
# Without a size limit Karpenter packs each arm into one large node per architecture.
INSTANCE_CPUS = ("4", "8")


def bench_pool(name: str, *, cpus=INSTANCE_CPUS, cpu_limit: int = 1000) -> dict:
    """The infrastructure's NodePool `default` (amd64 + arm64, linux, on-demand + spot, arm64
    cheaper), renamed, limited to `cpus`-CPU instance types (None: every size), and never
    consolidated: what was launched for the pods is what is counted."""
    pool = copy.deepcopy(nodepool(cpu_limit=cpu_limit))
    pool["metadata"]["name"] = name
    spec = pool["spec"]
    if cpus:
        spec["template"]["spec"]["requirements"].append(
            {"key": INSTANCE_CPU, "operator": "In", "values": list(cpus)})
    spec["disruption"] = {"consolidationPolicy": "WhenEmptyOrUnderutilized",
                          "consolidateAfter": "Never"}
    return pool


def create_pools(kube: Kube, names, *, cpus=INSTANCE_CPUS) -> None:
    for name in names:
        kube.create(f"{KARPENTER_API}/nodepools", bench_pool(name, cpus=cpus))


def claims(kube: Kube, pool: str) -> list[dict]:
    return kube.items(f"{KARPENTER_API}/nodeclaims", labelSelector=f"{NODEPOOL_LABEL}={pool}")


def node_archs(kube: Kube, pools) -> dict[str, str]:
    """name -> kubernetes.io/arch of every Node of `pools`."""
    wanted = set(pools)
    return {n["metadata"]["name"]: n["metadata"]["labels"].get("kubernetes.io/arch", "?")
            for n in kube.items("/api/v1/nodes", labelSelector=NODEPOOL_LABEL)
            if n["metadata"]["labels"].get(NODEPOOL_LABEL) in wanted}


def claim_summary(claimed: list[dict]) -> str:
    """"2 arm64 (c-8x-arm64-linux), 1 amd64 (...)": what Karpenter launched."""
    kinds: dict[str, int] = {}
    for claim in claimed:
        labels = claim["metadata"].get("labels") or {}
        key = f"{labels.get('kubernetes.io/arch', '?')} {labels.get('node.kubernetes.io/instance-type', '?')}"
        kinds[key] = kinds.get(key, 0) + 1
    return ", ".join(f"{n}x {k}" for k, n in sorted(kinds.items())) or "none"


def _epoch(stamp: str) -> float:
    return datetime.datetime.strptime(stamp, "%Y-%m-%dT%H:%M:%SZ").replace(
        tzinfo=datetime.UTC).timestamp()


def claim_timeline(claimed: list[dict], since: float) -> str:
    """When the NodeClaims were created and their Nodes became Ready, in seconds after `since`
    (epoch), from the apiserver's timestamps (1 s resolution)."""
    created = [_epoch(c["metadata"]["creationTimestamp"]) - since for c in claimed]
    ready = [_epoch(cond["lastTransitionTime"]) - since for c in claimed
             for cond in (c.get("status") or {}).get("conditions") or []
             if cond.get("type") == "Ready" and cond.get("status") == "True"]
    if not created or not ready:
        return "no NodeClaim"
    return (f"NodeClaims created +{min(created):.0f} to +{max(created):.0f} s, Ready by "
            f"+{max(ready):.0f} s")


def wrong_placements(pods: dict[str, tuple[frozenset[str], str]], archs: dict[str, str]) -> int:
    """Pods on a node whose architecture none of their images has. `pods`: name -> (the
    architectures of its image, its node's name); `archs`: node name -> architecture."""
    return sum(1 for image_archs, node in pods.values() if archs.get(node) not in image_archs)


def clear(kube: Kube, namespaces, pools, timeout: float = 180.0) -> None:
    """Back to no pod, no NodeClaim and no Node of `pools`: pods deleted at once, namespaces and
    NodeClaims deleted (Karpenter drains and deletes their Nodes)."""
    for namespace in namespaces:
        kube.delete(pod_path(namespace), gracePeriodSeconds=0)
        kube.delete(f"/api/v1/namespaces/{namespace}")
    for pool in pools:
        for claim in claims(kube, pool):
            kube.delete(f"{KARPENTER_API}/nodeclaims/{claim['metadata']['name']}")
    kube.wait_for(lambda: not any(claims(kube, p) for p in pools) and not node_archs(kube, pools),
                  timeout=timeout, what=f"no NodeClaim or Node left in {', '.join(pools)}")


class PodWatch:
    """A watch of the bench's pods in a thread of its own: when each was first seen Running
    (time.monotonic, the clock the creates are timed with) and on which node."""

    def __init__(self, kube: Kube):
        self.kube = kube
        self.session = requests.Session()
        self.session.headers.update(kube.session.headers)
        self.session.verify = kube.session.verify
        self.session.trust_env = False
        self.running: dict[str, tuple[float, str]] = {}   # namespace/name -> (when, node)
        self.gated_seen: set[str] = set()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="bench-podwatch")
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self.session.close()

    def _note(self, pod: dict, when: float) -> None:
        key = f"{pod['metadata']['namespace']}/{pod['metadata']['name']}"
        with self._lock:
            if pod["spec"].get("schedulingGates"):
                self.gated_seen.add(key)
            if (pod.get("status") or {}).get("phase") == "Running" and key not in self.running:
                self.running[key] = (when, pod["spec"].get("nodeName", ""))

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                listed = self.kube.get("/api/v1/pods", labelSelector=BENCH_LABEL)
                now = time.monotonic()
                for pod in listed.get("items") or []:
                    self._note(pod, now)
                params = {"watch": "1", "labelSelector": BENCH_LABEL, "timeoutSeconds": "60",
                          "resourceVersion": listed["metadata"]["resourceVersion"]}
                with self.session.get(self.kube.server + "/api/v1/pods", params=params,
                                      stream=True, timeout=(5, 90)) as response:
                    for line in response.iter_lines():
                        if self._stop.is_set():
                            return
                        if line:
                            event = json.loads(line)
                            if event.get("type") in ("ADDED", "MODIFIED"):
                                self._note(event["object"], time.monotonic())
            except (requests.RequestException, ValueError, KubeError, AttributeError):
                if not self._stop.is_set():
                    time.sleep(0.2)

    def wait_running(self, keys, timeout: float) -> dict[str, tuple[float, str]]:
        end = time.monotonic() + timeout
        wanted = set(keys)
        while True:
            with self._lock:
                done = {k: self.running[k] for k in wanted if k in self.running}
            if len(done) == len(wanted):
                return done
            if time.monotonic() > end:
                raise RuntimeError(f"{len(wanted) - len(done)} of {len(wanted)} pods not Running "
                                   f"after {timeout:g} s")
            time.sleep(0.1)
