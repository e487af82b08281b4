"""Figure 27: what keeping the refused cluster addresses (cluster/ranges.py) costs a webhook
worker at 5,000 Nodes, in process: a refresh that lists every Node (what each worker did every
5 minutes before issue 48's round) against one that takes them from the worker's node cache
(the watch it keeps anyway), taking turns round by round.

The Nodes are what a kubelet writes (addresses, pod range, conditions, capacity, nodeInfo, and
50 images: the kubelet's default node-status-max-images); a page of them is decoded from JSON as
the Kubernetes client decodes it. The bytes are what the apiserver would have sent per refresh.
"""
import json
import time

from archway.cluster.nodes import node_facts
from archway.cluster.ranges import ClusterRanges
from archway.registry.hostpolicy import ClusterAddresses
from bench.common.lab import Lab
from bench.common.report import Figure
from bench.common.rounds import ratios, rounds

NODES = 5_000
PAGE = 500                    # archway.kubeapi.LIST_PAGE_SIZE
WORKERS = 8                   # the chart's webhook.workers
REFRESH_SECONDS = 300
TARGET_RATIO = 0.1            # a refresh from the cache at most a tenth of a listing one


def _node(i: int) -> dict:
    """A Node as a kubelet writes it, its strings distinct from every other's."""
    ip = f"10.{i // 250 % 250}.{i % 250}.{1 + i // 62500}"
    return {
        "kind": "Node", "apiVersion": "v1",
        "metadata": {"name": f"node-{i}", "uid": f"{i:08d}-0000-4000-8000-000000000000",
                     "resourceVersion": str(10_000 + i),
                     "labels": {"kubernetes.io/arch": "arm64" if i % 2 else "amd64",
                                "kubernetes.io/os": "linux", "kubernetes.io/hostname": f"node-{i}",
                                "node.kubernetes.io/instance-type": "m7g.xlarge",
                                "topology.kubernetes.io/zone": f"zone-{i % 3}"},
                     "annotations": {"node.alpha.kubernetes.io/ttl": "0",
                                     "volumes.kubernetes.io/controller-managed-attach-detach": "true"}},
        "spec": {"podCIDR": f"10.244.{i % 250}.0/24", "podCIDRs": [f"10.244.{i % 250}.0/24"],
                 "providerID": f"aws:///zone-{i % 3}/i-{i:017x}"},
        "status": {
            "capacity": {"cpu": "4", "memory": "16148412Ki", "pods": "110",
                         "ephemeral-storage": "101430960Ki"},
            "allocatable": {"cpu": "3920m", "memory": "15134588Ki", "pods": "110",
                            "ephemeral-storage": "93478772582"},
            "conditions": [{"type": kind, "status": "False", "reason": f"Kubelet{kind}",
                            "message": f"kubelet has no {kind}",
                            "lastHeartbeatTime": "2026-12-03T13:00:00Z",
                            "lastTransitionTime": "2026-12-01T09:00:00Z"}
                           for kind in ("MemoryPressure", "DiskPressure", "PIDPressure")]
            + [{"type": "Ready", "status": "True", "reason": "KubeletReady",
                "message": "kubelet is posting ready status",
                "lastHeartbeatTime": "2026-12-03T13:00:00Z",
                "lastTransitionTime": "2026-12-01T09:00:00Z"}],
            "addresses": [{"type": "InternalIP", "address": ip},
                          {"type": "InternalIP", "address": f"fd00:10::{i:x}"},
                          {"type": "Hostname", "address": f"node-{i}"}],
            "daemonEndpoints": {"kubeletEndpoint": {"Port": 10250}},
            "nodeInfo": {"machineID": f"{i:032x}", "systemUUID": f"{i:032x}",
                         "bootID": f"{i:032x}", "kernelVersion": "6.1.0-27-cloud-arm64",
                         "osImage": "Debian GNU/Linux 12 (bookworm)",
                         "containerRuntimeVersion": "containerd://1.6.20",
                         "kubeletVersion": "v1.37.2", "operatingSystem": "linux",
                         "architecture": "arm64" if i % 2 else "amd64"},
            "images": [{"names": [f"registry.example/team/app-{j}@sha256:{j:064x}",
                                  f"registry.example/team/app-{j}:1.{j}"],
                        "sizeBytes": 10_000_000 + j} for j in range(50)]}}


class _ListingApi:
    """The reads of cluster/ranges.py: Nodes in pages decoded from JSON, as the client decodes
    the apiserver's answer; the Service ranges and the API server's addresses."""

    class client:
        class configuration:
            host = "https://192.0.2.10:6443"

    def __init__(self, pages: list[bytes]):
        self.pages_json = pages
        self.sent = 0

    def request(self, method, path, **kw):
        if path.endswith("/servicecidrs"):
            return {"items": [{"spec": {"cidrs": ["10.96.0.0/12"]}}]}
        return {"endpoints": [{"addresses": ["192.0.2.11"]}]}

    def pages(self, path, page_size, **kw):
        for page in self.pages_json:
            self.sent += len(page)
            yield json.loads(page)


class _Cache:
    def __init__(self, facts: dict, synced: bool):
        self.items, self.synced, self.version = facts, synced, 1


def run(lab: Lab) -> list[Figure]:
    nodes = [_node(i) for i in range(NODES)]
    pages = [json.dumps({"kind": "NodeList", "items": nodes[i:i + PAGE]}).encode()
             for i in range(0, NODES, PAGE)]
    facts = {f.name: f for f in map(node_facts, nodes) if f is not None}
    listing_api, cached_api = _ListingApi(pages), _ListingApi(pages)
    listing = ClusterRanges(listing_api, ClusterAddresses([]), (), nodes=_Cache(facts, False))
    cached = ClusterRanges(cached_api, ClusterAddresses([]), (), nodes=_Cache(facts, True))
    per_round: dict[str, list[float]] = {"listed": [], "cached": []}
    for _ in range(rounds(5)):
        for name, keeper in (("listed", listing), ("cached", cached)):
            start = time.process_time()
            keeper.refresh()
            per_round[name].append(time.process_time() - start)
    assert listing.cluster.networks and set(listing.cluster.networks) == set(
        cached.cluster.networks), "the two refreshes refuse different addresses"
    assert cached_api.sent == 0, "the cached refresh listed Nodes"
    steady = ratios(per_round["cached"], per_round["listed"])
    listed, from_cache = min(per_round["listed"]), min(per_round["cached"])
    per_list = listing_api.sent / len(per_round["listed"])
    per_hour = per_list * WORKERS * 3600 / REFRESH_SECONDS
    return [Figure("27", f"refused cluster addresses at {NODES:,} Nodes: a refresh from the node "
                         f"cache vs listing them",
                   f"{steady.describe(unit='x')} ({from_cache * 1000:.0f} vs {listed * 1000:.0f} "
                   f"ms of CPU)", f"<= {TARGET_RATIO:g}x", steady.median <= TARGET_RATIO, [
        (f"in process, {len(steady.values)} rounds taking turns, CPU per refresh (best round): "
         f"listing = {NODES // PAGE} pages of {PAGE} Nodes decoded from JSON, as each webhook "
         f"worker did every {REFRESH_SECONDS // 60} minutes; from the cache = the Nodes' "
         f"networks from the worker's NodeFacts (the watch it keeps anyway); both refuse the "
         f"same {len(cached.cluster.networks):,} networks"),
        (f"what listing cost the apiserver: {per_list / 2**20:.0f} MB per refresh, "
         f"{per_hour / 2**30:.1f} GB an hour per replica of {WORKERS} workers; from the "
         f"cache: nothing"),
    ], rounds=steady)]
