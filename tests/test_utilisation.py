"""Scoring by link utilisation, herd control and the one poller per server, against a real
Prometheus scraping test nodes with known byte rates and link speeds (job "links" of
lab/servers/prometheus.py), the API server stand-in, and a real `archway serve` under gunicorn."""
import copy
import json
import os
import signal
import subprocess
import sys
import time
from contextlib import contextmanager

import pytest
import requests

from archway.cluster.nodes import NodeCache
from archway.config import (
    DEFAULT_CAPACITY_QUERY,
    DEFAULT_PROMETHEUS_QUERY,
    config_from_dict,
)
from archway.extender.herd import ANNOTATION_BANDWIDTH
from archway.extender.prometheus import combined_query
from archway.extender.routes import extender_routes
from archway.extender.service import Extender
from archway.extender.traffic import TrafficScale, utilisation_score
from archway.kubeclient import build_api_client
from archway.server.routes import Routes, Site
from lab.cluster.controlplane import ControlPlane
from lab.kube import KubeError
from lab.procs import REPO, free_port, poll, wait_for_port
from lab.servers.prometheus import LINK_RATES, LINK_SPEEDS, PrometheusServer, short_window
from tests.infra.fixtures import prometheus_stack
from tests.infra.siteclient import SiteClient
from tests.test_traffic import node_scores

pytestmark = pytest.mark.slow

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures", "extender")
JOB = PrometheusServer.LINKS_JOB
# The default queries restricted to the links job, their window left to prometheus.window.
LINKS = {"query": short_window(DEFAULT_PROMETHEUS_QUERY, "$window", job=JOB),
         "capacity_query": short_window(DEFAULT_CAPACITY_QUERY, job=JOB), "window": "4s"}
EQUAL = ["equal-1", "equal-2", "equal-3"]


def _fixture(name):
    with open(os.path.join(FIXTURES, name)) as f:
        return json.load(f)


@pytest.fixture(scope="module")
def prom(prometheus_stack):
    # Every links node's rate must have settled (rate() over a window the series only partly
    # covers yet reads low) before the tests compare scores.
    def settled(result):
        seen = {r["metric"]["nodename"]: float(r["value"][1]) for r in result}
        return all(abs(seen.get(n, 0) / rate - 1) < 0.05 for n, rate in LINK_RATES.items())
    prometheus_stack.prometheus.wait_for(LINKS["query"].replace("$window", "4s"),
                                         at_least=len(LINK_RATES), check=settled, timeout=60)
    return prometheus_stack


@contextmanager
def extender_client(prometheus_url, kubeconfig=None, extender=None, **prometheus):
    config = config_from_dict({
        "prometheus": {"url": prometheus_url, "refresh_seconds": 0.3, **LINKS, **prometheus},
        "extender": {"node_cache": kubeconfig is not None, **(extender or {})},
        "kubernetes": {"kubeconfig": kubeconfig} if kubeconfig else {"enabled": "off"}})
    ext = Extender(config, None, node_cache=NodeCache.for_config(config))
    try:
        yield SiteClient(Site(Routes(extender_routes(ext)))), ext
    finally:
        ext.stop()


def prioritize(client, names, pod=None):
    args = {"Pod": pod or _fixture("filter-nodenames.json")["Pod"], "Nodes": None,
            "NodeNames": names}
    r = client.post("/scheduler/prioritize", data=json.dumps(args))
    assert r.status_code == 200, r.data
    return {entry["Host"]: entry["Score"] for entry in r.get_json()}


def test_a_busy_slow_link_scores_below_a_lightly_loaded_fast_link(prom):
    names = ["slow-busy", "fast-light"]
    with extender_client(prom.prometheus.url) as (client, extender):
        scores = poll(lambda: prioritize(client, names),
                      lambda s: s["fast-light"] > s["slow-busy"])
        snapshot = extender.traffic.fresh_snapshot()
        # More bytes on the fast link: by bytes alone it would score lower.
        assert snapshot.traffic["fast-light"] > snapshot.traffic["slow-busy"]
        # 2 MB/s of 2 x 100 Mb/s is 8 %: 7; 9 MB/s of 2 x 25 Gb/s is 0.14 %: 10.
        assert snapshot.capacity["slow-busy"] == 2 * LINK_SPEEDS["slow-busy"]
        assert scores == {"slow-busy": 7, "fast-light": 10}, (snapshot.traffic, snapshot.capacity)
        assert scores["slow-busy"] == utilisation_score(2e6 / 25e6)
        # The veth's huge speed is left out like its traffic, as the traffic query does.
        assert snapshot.capacity["fast-light"] == 2 * LINK_SPEEDS["fast-light"]


def test_a_node_without_speed_data_is_ranked_by_its_traffic(prom):
    names = ["nospeed-quiet", "nospeed-busy", "slow-busy"]
    with extender_client(prom.prometheus.url) as (client, extender):
        scores = poll(lambda: prioritize(client, names),
                      lambda s: s["nospeed-quiet"] == 10 and s["nospeed-busy"] == 0)
        snapshot = extender.traffic.fresh_snapshot()
        assert "nospeed-quiet" not in snapshot.capacity and "nospeed-busy" not in snapshot.capacity
        # The quietest of the whole answer scores 10, the busiest 0, on the log scale.
        assert scores["nospeed-quiet"] == 10 and scores["nospeed-busy"] == 0, scores
        scale = TrafficScale.of(snapshot.traffic.values())
        assert scale.score(snapshot.traffic["nospeed-quiet"]) == 10
        assert scores == dict(zip(names, node_scores(snapshot.traffic, names,
                                                     capacity=snapshot.capacity)))


# --- herd control -----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def api(tmp_path_factory):
    """A control plane of this module's own, Nodes EQUAL. The test plays the scheduler: its pods
    name a scheduler nobody runs, and it binds them itself (pods/binding)."""
    with ControlPlane(str(tmp_path_factory.mktemp("herd-plane")),
                      nodes=tuple((name, "amd64") for name in EQUAL)) as plane:
        yield plane


def _new_pod(api, ns, i):
    pod = copy.deepcopy(_fixture("filter-nodenames.json")["Pod"])
    meta = pod["metadata"]
    for key in ("uid", "resourceVersion", "creationTimestamp", "generateName", "ownerReferences"):
        meta.pop(key, None)
    meta["name"], meta["namespace"] = f"burst-{i}", ns
    # Most pods say what they will move; every 4th does not (node average or default).
    meta.setdefault("annotations", {})
    if i % 4 != 3:
        meta["annotations"][ANNOTATION_BANDWIDTH] = "10M"
    pod["spec"].pop("nodeName", None)
    pod["spec"]["schedulerName"] = "nobody"
    pod.pop("status", None)
    return api.kube.create(f"/api/v1/namespaces/{ns}/pods", pod)


def _bind(api, ns: str, name: str, node: str) -> dict:
    return api.kube.create(f"/api/v1/namespaces/{ns}/pods/{name}/binding", {
        "apiVersion": "v1", "kind": "Binding", "metadata": {"name": name},
        "target": {"apiVersion": "v1", "kind": "Node", "name": node}})


def _schedule_burst(client, extender, api, ns, rounds, *, watch):
    """The scheduler's part: prioritize, take the best node (the first on a tie: the worst case
    for herding), bind it through the API. Returns the nodes chosen."""
    chosen = []
    for i in range(rounds):
        pod = _new_pod(api, ns, i)
        scores = prioritize(client, EQUAL, pod)
        best = max(EQUAL, key=lambda n: (scores[n], -EQUAL.index(n)))
        assert _bind(api, ns, pod["metadata"]["name"], best)["status"] == "Success"
        chosen.append(best)
        if watch:  # the next pod is scheduled once the pod watch has reported this bind
            uid = pod["metadata"]["uid"]
            placement = poll(lambda uid=uid: extender.herd.placement(uid),
                             lambda p: p is not None and p.confirmed, timeout=10, interval=0.02)
            assert placement is not None and placement.confirmed and placement.node == best
    return chosen


@pytest.fixture
def burst_namespace(api, request):
    """A namespace of the test's own (bound pods never finish terminating without a kubelet:
    a namespace is not reused)."""
    return api.new_namespace("burst-" + request.node.name[5:30].replace("_", "-").strip("-"))


def test_a_burst_inside_one_refresh_spreads_over_equal_nodes(prom, api, burst_namespace):
    mark = api.audit_mark()
    with extender_client(prom.prometheus.url, api.admin_kubeconfig,
                         refresh_seconds=3600) as (client, extender):
        poll(lambda: prioritize(client, EQUAL), lambda s: set(s.values()) == {9})
        assert extender.pod_watch.wait_synced(10) and extender.node_cache.wait_synced(10)
        chosen = _schedule_burst(client, extender, api, burst_namespace, 20, watch=True)
        assert extender.traffic.queries == 1          # all inside one refresh
    pods = api.kube.items(f"/api/v1/namespaces/{burst_namespace}/pods")
    placed = {name: sum(1 for p in pods if p["spec"].get("nodeName") == name) for name in EQUAL}
    assert sum(placed.values()) == 20 and [placed[n] for n in EQUAL] == [
        chosen.count(n) for n in EQUAL]
    assert max(placed.values()) <= 10, placed      # no node above 50 %
    assert min(placed.values()) >= 4, placed
    binds = [uri for verb, uri in api.requests_since(mark) if verb == "create"
             and uri.startswith(f"/api/v1/namespaces/{burst_namespace}/pods/burst-")
             and "/binding" in uri]
    assert len(binds) == 20
    # A second bind of a bound pod is refused by the apiserver.
    with pytest.raises(KubeError) as refused:
        _bind(api, burst_namespace, "burst-0", "equal-2")
    assert refused.value.status == 409 and refused.value.body["reason"] == "Conflict"


def test_without_a_cluster_its_own_answers_spread_the_burst(prom, api, burst_namespace):
    # No API access for archway: it assumes each pod went where it scored highest (an estimate).
    with extender_client(prom.prometheus.url, refresh_seconds=3600) as (client, extender):
        assert extender.pod_watch is None
        poll(lambda: prioritize(client, EQUAL), lambda s: set(s.values()) == {9})
        chosen = _schedule_burst(client, extender, api, burst_namespace, 20, watch=False)
        assert extender.traffic.queries == 1
    counts = [chosen.count(n) for n in EQUAL]
    assert sum(counts) == 20 and max(counts) <= 10 and min(counts) >= 4, counts


def test_without_herd_control_the_same_burst_lands_on_one_node(prom, api, burst_namespace):
    # The control for the test above: frozen scores send every pod to the same node.
    with extender_client(prom.prometheus.url, refresh_seconds=3600,
                         extender={"herd_control": False}) as (client, extender):
        poll(lambda: prioritize(client, EQUAL), lambda s: set(s.values()) == {9})
        chosen = _schedule_burst(client, extender, api, burst_namespace, 20, watch=False)
    assert chosen == ["equal-1"] * 20


# --- one poller per server ------------------------------------------------------------------------

def _gauge(text, name):
    """{pid: value} of a multiprocess gauge in a /metrics body (a process that never set it
    shows 0)."""
    values = {}
    for line in text.splitlines():
        if line.startswith(name + "{"):
            labels, value = line[len(name) + 1:].split("} ")
            pid = dict(part.split("=") for part in labels.split(","))['pid'].strip('"')
            values[pid] = float(value)
    return values


def _scoring(text):
    """{pid: sample time} of the workers that score with a traffic sample."""
    return {pid: t for pid, t in _gauge(text, "archway_prometheus_snapshot_timestamp_seconds").items()
            if t > 0}


def test_two_workers_make_one_query_per_refresh(prom, tmp_path):
    directory = str(tmp_path)
    port = free_port()
    settings = {"url": prom.prometheus.url, "refresh_seconds": 3600, **LINKS,
                "window": "7s"}   # a window no other test uses: its queries are this server's
    config_path = os.path.join(directory, "archway.yaml")
    with open(config_path, "w") as f:
        json.dump({"server": {"tls": False, "workers": 2, "threads": 2, "state_dir": directory},
                   "kubernetes": {"enabled": "off"}, "extender": {"node_cache": False},
                   "prometheus": settings}, f)
    query = combined_query(config_from_dict({"prometheus": settings}).prometheus)
    env = {**os.environ, "PYTHONPATH": REPO}
    env.pop("PROMETHEUS_MULTIPROC_DIR", None)
    with open(os.path.join(directory, "serve.log"), "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "archway.main.cli", "--config", config_path, "serve",
             "--product", "extender", "--bind", f"127.0.0.1:{port}"], cwd=REPO, stdout=log,
            stderr=subprocess.STDOUT, env=env, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    body = json.dumps({"Pod": _fixture("filter-nodenames.json")["Pod"], "NodeNames": EQUAL})

    def both_workers_scored():
        # A new connection each time, so both workers get calls.
        requests.post(f"{url}/scheduler/prioritize", data=body, timeout=5,
                      headers={"Connection": "close"}).raise_for_status()
        return requests.get(f"{url}/metrics", timeout=5).text

    try:
        wait_for_port(port, timeout=30, proc=proc)
        # Both workers and the server's traffic poller process (extender/pollerprocess.py).
        text = poll(both_workers_scored,
                    lambda t: len(_scoring(t)) == 3, timeout=30, interval=0.1)
        snapshots = _scoring(text)
        assert len(snapshots) == 3, text
        assert len(set(snapshots.values())) == 1         # all score with the same sample
        pollers = _gauge(text, "archway_prometheus_poller")
        assert sorted(pollers[pid] for pid in snapshots) == [0.0, 0.0, 1.0], pollers
        assert sum(pollers.values()) == 1
        assert prom.prometheus.logged_queries().count(query) == 1
        # The poller dies: the master starts another, and the snapshot being fresh, no query.
        leader = next(pid for pid, v in pollers.items() if v == 1)
        os.kill(int(leader), signal.SIGKILL)

        def scrape():
            # Each worker listens on its own socket (archway.server.worker): a connection the kernel
            # had queued for the killed one is reset. The next goes to a live worker.
            try:
                return requests.get(f"{url}/metrics", timeout=5).text
            except requests.ConnectionError:
                return ""

        text = poll(scrape,
                    lambda t: any(v == 1 and pid != leader
                                  for pid, v in _gauge(t, "archway_prometheus_poller").items()),
                    timeout=20)
        after = _gauge(text, "archway_prometheus_poller")
        assert leader not in after and sum(after.values()) == 1, after
        assert prom.prometheus.logged_queries().count(query) == 1
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(15)
