"""prioritize against a real Prometheus scraping fake nodes at known byte rates and this
machine's real node_exporter (lab/servers/prometheus.py; one Prometheus per session)."""
import json
import logging
import os
import re
import signal
import subprocess
import sys
import time
from contextlib import contextmanager

import pytest
import requests
from prometheus_client import REGISTRY

from archway.cluster.nodes import NodeCache
from archway.config import DEFAULT_PROMETHEUS_QUERY, config_from_dict
from archway.extender.prometheus import TrafficPoller
from archway.extender.routes import extender_routes
from archway.extender.service import Extender
from archway.extender.traffic import NEUTRAL_SCORE, node_traffic
from archway.kubeclient import build_api_client
from archway.server.routes import Routes, Site
from lab.cluster.controlplane import ControlPlane
from lab.procs import REPO, cmdline, free_port, poll, serve_extender, wait_for_port
from lab.servers.prometheus import FAKE_RATES, short_window
from tests.infra.fixtures import prometheus_stack
from tests.infra.siteclient import SiteClient
from tests.test_traffic import node_scores

pytestmark = pytest.mark.slow

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures", "extender")
FAST_QUERY = short_window(DEFAULT_PROMETHEUS_QUERY)
# Kubernetes names the fake nodes by FQDN while their exporters report short host names.
NODE_NAMES = [f"{name}.cluster.internal" for name in FAKE_RATES] + ["not-scraped.cluster.internal"]


def _pod():
    with open(os.path.join(FIXTURES, "filter-nodenames.json")) as f:
        return json.load(f)["Pod"]


@contextmanager
def extender_client(prometheus_url, kubeconfig=None, **prometheus):
    config = config_from_dict({
        "prometheus": {"url": prometheus_url, "refresh_seconds": 0.3, **prometheus},
        "extender": {"node_cache": kubeconfig is not None},
        "kubernetes": {"kubeconfig": kubeconfig} if kubeconfig else {"enabled": "off"}})
    extender = Extender(config, None, node_cache=NodeCache.for_config(config))
    try:
        yield SiteClient(Site(Routes(extender_routes(extender)))), extender
    finally:
        extender.stop()


def prioritize(client, names=NODE_NAMES, nodes=None):
    args = {"Pod": _pod(), "Nodes": nodes, "NodeNames": None if nodes else names}
    r = client.post("/scheduler/prioritize", data=json.dumps(args))
    assert r.status_code == 200, r.data
    reply = r.get_json()
    expected = [n["metadata"]["name"] for n in nodes["items"]] if nodes else names
    assert [entry["Host"] for entry in reply] == expected
    return {entry["Host"]: entry["Score"] for entry in reply}


def ordered(scores):
    a, b, c = (scores[f"worker-{x}.cluster.internal"] for x in "abc")
    return a > b > c


def rates_settled(prom):
    """Wait until Prometheus itself sees the fake nodes ordered as FAKE_RATES (an earlier test
    may have changed a rate within the last rate() window)."""
    def in_order(result):
        value = {r["metric"]["nodename"]: float(r["value"][1]) for r in result}
        return value.get("worker-a", 1e99) < value.get("worker-b", 0) < value.get("worker-c", 0)
    prom.prometheus.wait_for(FAST_QUERY, at_least=3, check=in_order, timeout=30)


@pytest.fixture(scope="module")
def prom(prometheus_stack):
    # All three fake nodes must have a rate before the tests compare them.
    prometheus_stack.prometheus.wait_for(FAST_QUERY, at_least=3, timeout=40)
    return prometheus_stack


def test_scores_are_ordered_as_the_rates(prom):
    with extender_client(prom.prometheus.url, query=FAST_QUERY) as (client, _):
        scores = poll(lambda: prioritize(client), ordered)
        assert ordered(scores), scores
        assert scores["not-scraped.cluster.internal"] == NEUTRAL_SCORE
        # 2e3 / 2e5 / 2e7 bytes/s: quietest 10, busiest 0, the middle one halfway on a log scale.
        assert scores["worker-a.cluster.internal"] == 10 and scores["worker-c.cluster.internal"] == 0
        assert 3 <= scores["worker-b.cluster.internal"] <= 7


def test_changing_a_rate_changes_the_scores_after_a_refresh(prom):
    with extender_client(prom.prometheus.url, query=FAST_QUERY) as (client, extender):
        poll(lambda: prioritize(client), ordered)
        before = extender.traffic.queries
        prom.fake.set_rate("worker-a", 2e9)   # the quietest node becomes the busiest
        try:
            scores = poll(lambda: prioritize(client),
                          lambda s: s["worker-a.cluster.internal"] == 0)
            assert scores["worker-a.cluster.internal"] == 0, scores
            assert scores["worker-b.cluster.internal"] > scores["worker-c.cluster.internal"] > 0
            assert extender.traffic.queries > before
        finally:
            prom.fake.set_rate("worker-a", FAKE_RATES["worker-a"])


def test_nodenames_prioritize_with_a_node_cache_gives_the_pure_functions_scores(prom, tmp_path):
    rates_settled(prom)
    nodes = tuple((name, "amd64") for name in NODE_NAMES[:3])
    with ControlPlane(str(tmp_path / "plane"), nodes=nodes) as plane, \
            extender_client(prom.prometheus.url, kubeconfig=plane.admin_kubeconfig,
                            query=FAST_QUERY, refresh_seconds=3600) as (client, extender):
        assert extender.node_cache.wait_synced(10)
        scores = poll(lambda: prioritize(client), ordered)
        assert ordered(scores), scores
        snapshot = extender.traffic.fresh_snapshot()
        assert scores == dict(zip(NODE_NAMES, node_scores(snapshot.traffic, NODE_NAMES)))
        # The cached nodes were answered from the precomputed book, the unknown one per call.
        (version, nodes), book = extender.traffic_score._book
        assert version == snapshot.version and set(book.table.entries) == set(NODE_NAMES[:3])


def test_address_matching_of_instance_against_node_addresses(prom):
    query = FAST_QUERY.replace("sum by (nodename)", "sum by (instance)")
    with open(os.path.join(FIXTURES, "filter-nodes.json")) as f:
        template = json.load(f)["Nodes"]["items"][0]
    items = []
    for name in ["c-node", "a-node", "b-node", "unscraped"]:
        node = json.loads(json.dumps(template))
        node["metadata"]["name"] = name
        ip = {"a-node": "10.0.0.1", "b-node": "10.0.0.2", "c-node": "10.0.0.3"}.get(name, "10.9.9.9")
        node["status"]["addresses"][0]["address"] = ip
        items.append(node)
    nodes = {"metadata": {}, "items": items}
    with extender_client(prom.prometheus.url, query=query, node_label="instance",
                         match="address") as (client, _):
        scores = poll(lambda: prioritize(client, nodes=nodes),
                      lambda s: s["a-node"] > s["b-node"] > s["c-node"])
        assert scores["a-node"] > scores["b-node"] > scores["c-node"], scores
        assert scores["unscraped"] == NEUTRAL_SCORE


def test_default_query_maps_this_machines_traffic_to_its_node(prom):
    poller = TrafficPoller(config_from_dict({"prometheus": {"url": prom.prometheus.url}}).prometheus)
    host = os.uname().nodename.lower()

    def answer():
        poller.refresh_once()
        snapshot = poller.fresh_snapshot()
        return snapshot.traffic if snapshot else {}

    traffic = poll(answer, lambda t: host in t and all(n in t for n in FAKE_RATES), timeout=40,
                   interval=0.5)
    assert host in traffic, (traffic, poller.last_error)
    assert traffic[host] >= 0 and traffic[host] < 1e9
    # lo and veth carry 5e9 bytes/s each on every fake node: the default query leaves them
    # out. (rate() over [2m] divides by the whole window, so in Prometheus' first two minutes it
    # shows only a fraction of the true rate: compare magnitudes, with worker-b left untouched.)
    assert 0 < traffic["worker-b"] < 1e8 and traffic["worker-b"] < traffic["worker-c"], traffic
    # The node is named after this machine (or its FQDN): both find the series.
    for node in (host, f"{host}.cluster.internal"):
        assert node_traffic(traffic, [node, "some-other-node"]) == {node: traffic[host]}


def test_stale_data_expires(prom):
    rates_settled(prom)
    with extender_client(prom.prometheus.url, query=FAST_QUERY, refresh_seconds=3600,
                         stale_after_seconds=1.5) as (client, extender):
        scores = poll(lambda: prioritize(client), ordered)   # the one and only query answered
        assert ordered(scores)
        assert extender.traffic.queries == 1
        answered = extender.traffic.fresh_snapshot().fetched_at
        scores = poll(lambda: prioritize(client),
                      lambda s: set(s.values()) == {NEUTRAL_SCORE}, timeout=5)
        assert set(scores.values()) == {NEUTRAL_SCORE}
        assert time.monotonic() - answered >= 1.5


def _series(node: str, device: str, value: str) -> str:
    return (f'label_replace(label_replace(vector({value}), "nodename", "{node}", "", ""), '
            f'"device", "{device}", "", "")')


def test_series_adding_up_to_inf_neither_fail_prioritize_nor_score_inf_over_inf(prom):
    """Prometheus answers two series of 1e308 for one node (issue 21, item 7): their sum is inf,
    and every prioritize answered 500 with a traceback."""
    huge = " or ".join([_series("worker-a", "eth0", "1e308"), _series("worker-a", "eth1", "1e308"),
                        _series("worker-b", "eth0", "1000")])
    assert len(prom.prometheus.query(huge)) == 3
    names = ["worker-a", "worker-b", "worker-c"]
    with extender_client(prom.prometheus.url, query=huge, capacity_query="") as (client, _):
        scores = poll(lambda: prioritize(client, names), lambda s: s["worker-a"] != NEUTRAL_SCORE)
        assert scores == {"worker-a": 0, "worker-b": 10, "worker-c": NEUTRAL_SCORE}
    # The same sum as the link capacity: utilisation max/max, the busiest score, not inf/inf = 10
    with extender_client(prom.prometheus.url, query=huge, capacity_query=huge) as (client, _):
        scores = poll(lambda: prioritize(client, names), lambda s: s["worker-b"] != NEUTRAL_SCORE)
        assert scores == {"worker-a": 0, "worker-b": 0, "worker-c": NEUTRAL_SCORE}


def _metric(name):
    return REGISTRY.get_sample_value(name) or 0.0


def test_prometheus_down_gives_neutral_scores_200s_a_metric_and_one_log_line(prom, caplog):
    caplog.set_level(logging.INFO, logger="archway.traffic")
    with extender_client(prom.prometheus.url, query=FAST_QUERY, refresh_seconds=0.2,
                         stale_after_seconds=1.5, timeout_seconds=1) as (client, extender):
        poll(lambda: prioritize(client), ordered)
        assert _metric("archway_prometheus_up") == 1
        assert time.time() - _metric("archway_prometheus_last_success_timestamp_seconds") < 5
        errors_before = _metric("archway_prometheus_query_errors_total")
        prom.prometheus.stop()
        try:
            stopped = time.monotonic()
            scores = poll(lambda: prioritize(client),   # every call a 200 (checked in prioritize)
                          lambda s: set(s.values()) == {NEUTRAL_SCORE}, timeout=10)
            assert set(scores.values()) == {NEUTRAL_SCORE}
            assert time.monotonic() - stopped >= 1.0     # the last answer served until stale
            assert _metric("archway_prometheus_up") == 0
            # a failed query each refresh (0.2 s), counted by the poller's thread
            assert poll(lambda: _metric("archway_prometheus_query_errors_total"),
                        lambda errors: errors >= errors_before + 2, timeout=10) >= errors_before + 2
            failures = [r for r in caplog.records if "query failed" in r.getMessage()]
            assert len(failures) == 1, [r.getMessage() for r in failures]
            assert "cannot reach" in extender.traffic.last_error
        finally:
            prom.prometheus.start()
        # Back up: the next answer is used again, and said so once.
        scores = poll(lambda: prioritize(client), ordered, timeout=40)
        assert ordered(scores), scores
        assert _metric("archway_prometheus_up") == 1


def test_archway_serve_queries_prometheus_from_a_process_that_answers_no_call(prom, tmp_path):
    """Figure 7 (issue 28): a refresh parses ~2 MB at 5,000 nodes with the GIL held, so it must
    not run in a worker. The one poller is a process of its own; both workers score with its
    sample; killed, it is started again."""
    serve = serve_extender(tmp_path, workers=2, prometheus={
        "url": prom.prometheus.url, "query": FAST_QUERY, "refresh_seconds": 0.3})
    session = requests.Session()
    session.trust_env = False
    url = f"http://127.0.0.1:{serve.port}"

    def pollers() -> dict[str, float]:
        text = session.get(f"{url}/metrics", timeout=10).text
        return {pid: float(v) for pid, v in
                re.findall(r'archway_prometheus_poller\{pid="(\d+)"\} (\S+)', text)}

    def one_poller_process(found: dict[str, float]) -> bool:
        leading = [pid for pid, v in found.items() if v == 1]
        return len(leading) == 1 and "archway.extender.pollerprocess" in cmdline(leading[0])

    def scores() -> dict[str, int]:
        args = {"Pod": _pod(), "Nodes": None, "NodeNames": NODE_NAMES}
        r = session.post(f"{url}/scheduler/prioritize", data=json.dumps(args), timeout=10)
        assert r.status_code == 200, r.text
        return {e["Host"]: e["Score"] for e in r.json()}

    try:
        found = poll(pollers, one_poller_process, timeout=30)
        assert one_poller_process(found), {pid: cmdline(pid) for pid in found}
        first = next(pid for pid, v in found.items() if v == 1)
        workers = [pid for pid, v in found.items() if v == 0 and "archway" in cmdline(pid)]
        assert len(workers) >= 2, found   # the workers follow (the master never scores)
        # Each call may reach either worker: every one of them scores with the sample.
        for _ in range(6):
            assert ordered(poll(scores, ordered, timeout=30))
        os.kill(int(first), signal.SIGKILL)
        found = poll(pollers, lambda f: one_poller_process(f) and f.get(first) != 1, timeout=30)
        assert one_poller_process(found) and found.get(first) != 1, found
    finally:
        serve.stop()
