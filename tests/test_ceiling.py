"""extender.max_utilisation against a real Prometheus scraping test nodes with known byte rates
and link speeds (job "links" of lab/servers/prometheus.py): /scheduler/filter turns away the
nodes whose link is busier than the ceiling (FailedNodes: load passes), lets every candidate
through when all are above it, and forgets the ceiling while its traffic sample is stale."""
import copy
import json
import logging
import time

import pytest

from lab.procs import poll
from tests.infra.fixtures import prometheus_stack
from tests.test_utilisation import _fixture, extender_client, prom

pytestmark = pytest.mark.slow

# Utilisation of the links nodes (traffic / 2 x link speed): slow-busy 8 %, equal-* 1 %,
# fast-light 0.14 %; the nospeed-* nodes report no link speed.
CEILING = {"max_utilisation": 0.05}
# Prometheus measures 2 MB/s within a few per mille: 7.9 % to 8.1 % is "8%".
SLOW_BUSY = "link utilisation 8% is above extender.max_utilisation (5%)"


def filtered(client, names=None, nodes=None) -> dict:
    args = {"Pod": _fixture("filter-nodenames.json")["Pod"], "Nodes": None, "NodeNames": names}
    if nodes is not None:
        args.update(Nodes={"items": nodes}, NodeNames=None)
    answer = client.post("/scheduler/filter", data=json.dumps(args))
    assert answer.status_code == 200, answer.data
    return answer.get_json()


def node(name: str) -> dict:
    item = copy.deepcopy(_fixture("filter-nodes.json")["Nodes"]["items"][0])
    item["metadata"]["name"] = name
    item["metadata"]["labels"]["kubernetes.io/arch"] = "amd64"
    return item


def test_nodes_above_the_ceiling_fail_for_now_the_others_pass(prom):
    names = ["slow-busy", "fast-light", "equal-1", "nospeed-busy"]
    with extender_client(prom.prometheus.url, extender=CEILING) as (client, _):
        answer = poll(lambda: filtered(client, names), lambda a: a["FailedNodes"])
        assert answer["FailedNodes"] == {"slow-busy": SLOW_BUSY}
        # Load is transient: not unresolvable, so preemption still weighs those nodes. A node
        # without link speed has no known utilisation and is never turned away.
        assert answer["FailedAndUnresolvableNodes"] == {}
        assert answer["NodeNames"] == ["fast-light", "equal-1", "nospeed-busy"]
        # Full Node objects: the same.
        full = filtered(client, nodes=[node(n) for n in ("slow-busy", "equal-2")])
        assert [n["metadata"]["name"] for n in full["Nodes"]["items"]] == ["equal-2"]
        assert full["FailedNodes"] == {"slow-busy": SLOW_BUSY}
    with extender_client(prom.prometheus.url) as (client, extender):     # off by default
        poll(lambda: extender.traffic.fresh_snapshot(), lambda s: s is not None)
        assert filtered(client, names)["NodeNames"] == names


def test_when_every_candidate_is_above_the_ceiling_all_pass_and_the_log_says_so(prom, caplog):
    caplog.set_level(logging.INFO, logger="archway.extender")
    with extender_client(prom.prometheus.url, extender={"max_utilisation": 0.005}) as (client, _):
        poll(lambda: filtered(client, ["slow-busy", "fast-light"]), lambda a: a["FailedNodes"])
        answer = filtered(client, ["slow-busy", "equal-1", "equal-2"])   # 8 %, 1 %, 1 %
        assert answer["NodeNames"] == ["slow-busy", "equal-1", "equal-2"]
        assert answer["FailedNodes"] == {}
    (lifted,) = [r.getMessage() for r in caplog.records if "all pass" in r.getMessage()]
    assert "3/3 nodes pass; every candidate's link is above extender.max_utilisation (0.5%): " \
           "all pass" in lifted


def test_a_stale_sample_lifts_the_ceiling_until_a_fresh_one_comes(prom, caplog):
    caplog.set_level(logging.INFO, logger="archway.extender")
    names = ["slow-busy", "fast-light"]
    with extender_client(prom.prometheus.url, extender=CEILING, refresh_seconds=3600,
                         stale_after_seconds=1.5) as (client, extender):
        # Before the first answer the ceiling is not applied either (said once).
        answer = poll(lambda: filtered(client, names), lambda a: a["FailedNodes"])
        assert answer["FailedNodes"] == {"slow-busy": SLOW_BUSY}
        answered = extender.traffic.fresh_snapshot().fetched_at
        caplog.clear()
        # The one query is answered once (refresh_seconds 3600): past 1.5 s it is stale.
        answer = poll(lambda: filtered(client, names), lambda a: not a["FailedNodes"], timeout=5)
        assert answer["NodeNames"] == names and time.monotonic() - answered >= 1.5
        filtered(client, names)
        blind = [r.getMessage() for r in caplog.records if "not applied" in r.getMessage()]
        assert len(blind) == 1 and "prometheus.stale_after_seconds (1.5s)" in blind[0]
        extender.traffic.refresh_once()            # a fresh sample: applied again, said once
        assert filtered(client, names)["FailedNodes"] == {"slow-busy": SLOW_BUSY}
        assert [r.getMessage() for r in caplog.records if "applied again" in r.getMessage()]
