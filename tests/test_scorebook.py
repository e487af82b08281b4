"""Figure 7 (issue 28): a new traffic sample reaches a serving worker ready to swap in. The poller
works out each series key's score where it parses the answer and writes them with the snapshot;
a worker keeps its nodes' match to the series keys while both stay the same, so adopting a sample
is copies and joins at C speed. The answers must stay exactly the pure functions'. No I/O but
the snapshot file in a temporary directory."""
import json
import marshal
import time

from hypothesis import given, settings
from hypothesis import strategies as st

import archway.extender.traffic as traffic_module
from archway.cluster.nodes import NodeFacts
from archway.config import PrometheusSettings, config_from_dict
from archway.extender.prometheus import SharedSnapshot, TrafficPoller, TrafficSnapshot, prepared_of
from archway.extender.traffic import key_scores
from archway.extender.trafficscore import MatchedNodes, ScoreBook, TrafficScore
from lab.servers.prometheus import CannedPrometheusHttp

NAMES = ["worker-a.cluster.internal", "worker-b", "WORKER-C.cluster.internal", "dup.one.internal",
         "dup.two.internal", "lonely.cluster.internal", "zero.cluster.internal"]
TRAFFIC = {"worker-a": 1e3, "worker-b.cluster.internal": 2e6, "worker-c": 4e7, "dup": 5e5,
           "zero": 7e4, "not-a-node": 9e9}
CAPACITY = {"worker-a": 1.25e8, "worker-c": 1.25e9, "zero": 0.0}


def snapshot(traffic=TRAFFIC, capacity=CAPACITY, version=1, prepared=True) -> TrafficSnapshot:
    return TrafficSnapshot(traffic, time.monotonic(), version, capacity, time.time() - 1,
                           key_scores(traffic, capacity) if prepared else None)


def same_book(new: ScoreBook, old: ScoreBook) -> None:
    assert list(new.table.scores.items()) == list(old.table.scores.items())
    assert list(new.table.entries.items()) == list(old.table.entries.items())
    assert dict(new.loads) == old.loads and new.scale == old.scale
    for name in NAMES:
        assert (name in new.loads) == (name in old.loads)


def test_the_matched_book_is_the_book_of_the_pure_functions():
    for prepared in (True, False):
        sample = snapshot(prepared=prepared)
        old = ScoreBook(sample, NAMES, {}, "name")
        new = ScoreBook.matched(sample, MatchedNodes(dict.fromkeys(NAMES), sample.traffic.keys()))
        same_book(new, old)
    assert old.table.scores["lonely.cluster.internal"] == 5          # no series: neutral
    assert "dup.one.internal" not in old.loads                      # an ambiguous short name


@settings(max_examples=60, deadline=None)
@given(st.dictionaries(st.sampled_from(["a", "b", "b.x", "c.y", "d", "E"]),
                       st.floats(min_value=0, max_value=1e12), min_size=1),
       st.dictionaries(st.sampled_from(["a", "b", "c.y", "E"]), st.floats(min_value=0, max_value=1e10)),
       st.lists(st.sampled_from(["a", "a.x", "b", "b.x", "c", "c.y", "d.z", "e", "f"]), unique=True))
def test_any_sample_gives_the_same_book_either_way(traffic, capacity, names):
    sample = snapshot(traffic, capacity)
    same_book(ScoreBook.matched(sample, MatchedNodes(dict.fromkeys(names), traffic.keys())),
              ScoreBook(sample, names, {}, "name"))


class Nodes:
    def __init__(self, names):
        self.nodes = {name: NodeFacts(name, "amd64", ()) for name in names}

    def ensure_started(self):
        pass


class Poller:
    listeners: list = []


def test_a_sample_of_the_same_series_is_adopted_without_matching_a_node_again(monkeypatch):
    calls = []
    real = traffic_module.short_name
    monkeypatch.setattr(traffic_module, "short_name", lambda name: calls.append(name) or real(name))
    config = config_from_dict({"kubernetes": {"enabled": "off"}})
    score = TrafficScore(config, Poller(), Nodes(NAMES), None)
    first = score.book(snapshot())
    matched = len(calls)
    assert matched > 0
    busier = {**TRAFFIC, "worker-a": 1e8}                  # the same keys, another value
    book = score.book(snapshot(busier, version=2))
    assert len(calls) == matched                           # no name looked at again
    same_book(book, ScoreBook(snapshot(busier), NAMES, {}, "name"))
    assert book.table.scores != first.table.scores
    joined = {**TRAFFIC, "lonely": 1.0}                    # a new series: matched again
    book = score.book(snapshot(joined, version=3))
    assert len(calls) > matched and book.table.scores["lonely.cluster.internal"] == 10
    same_book(book, ScoreBook(snapshot(joined), NAMES, {}, "name"))


def test_the_snapshot_file_carries_the_key_scores_and_a_bad_set_is_not_used(tmp_path):
    writer, reader = SharedSnapshot(str(tmp_path)), SharedSnapshot(str(tmp_path))
    prepared = key_scores(TRAFFIC, CAPACITY)
    writer.write(TRAFFIC, CAPACITY, 1234.5, prepared)
    assert prepared_of(reader.read_if_new()) == prepared
    for scale, scores in (([0, 1], {"worker-a": 3}),                        # a key left out
                          ([0, 1], {k: 11 for k in TRAFFIC}),               # not a score
                          ("0..1", prepared[1])):
        with open(writer.path, "wb") as f:
            marshal.dump({"traffic": TRAFFIC, "capacity": CAPACITY, "sampled_at": 1.0,
                          "scale": scale, "scores": scores}, f)
        assert prepared_of(reader.read_if_new()) is None


def test_a_worker_beside_a_poller_process_only_follows_its_snapshot(tmp_path):
    settings = PrometheusSettings(url="http://127.0.0.1:9", refresh_seconds=15)
    process_http, worker_http = CannedPrometheusHttp(), CannedPrometheusHttp()
    worker = TrafficPoller(settings, http=worker_http, shared_dir=str(tmp_path), follow_only=True)
    process = TrafficPoller(settings, http=process_http, shared_dir=str(tmp_path))
    try:
        worker.tick()                                  # the lock is free: still no query
        assert worker_http.calls == 0 and worker.fresh_snapshot() is None
        process.tick()
        worker.tick()
        assert (process_http.calls, worker_http.calls) == (1, 0)
        adopted = worker.fresh_snapshot()
        assert adopted.traffic == {"a": 42.0}
        assert adopted.prepared == process.fresh_snapshot().prepared == key_scores({"a": 42.0}, {})
    finally:
        process.stop()
        worker.stop()
