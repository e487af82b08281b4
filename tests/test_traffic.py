"""The pure half of extender/traffic.py and extender/prometheus.py: reading Prometheus answers,
matching series to nodes, scoring. No I/O here (the real Prometheus is in test_prometheus.py)."""
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from archway.config import PrometheusSettings
from archway.extender.prometheus import PrometheusError, TrafficPoller, parse_vector
from archway.extender.traffic import (
    MAX_SCORE,
    NEUTRAL_SCORE,
    TrafficScale,
    instance_host,
    match_by_address,
    match_by_name,
    node_loads,
    node_traffic,
    scores_of,
)
from archway.registry.http import Response
from lab.clock import ManualClock


def node_scores(traffic: dict[str, float], node_names, *, capacity: dict[str, float] | None = None,
                match: str = "name", node_addresses=None) -> list[int]:
    """scores_of for one sample, in the order of `node_names` (what the extender's ScoreBook
    keeps per snapshot, for the tests to compare with)."""
    names = list(node_names)
    loads = node_loads(traffic, capacity or {}, names, match=match, node_addresses=node_addresses)
    scores = scores_of(loads, TrafficScale.of(traffic.values()), names)
    return [scores[n] for n in names]


def vector(*series):
    return {"status": "success", "data": {"resultType": "vector", "result": [
        {"metric": labels, "value": [1736846000.123, value]} for labels, value in series]}}


# --- parse_vector -------------------------------------------------------------------------------

def test_parse_vector_reads_the_node_label_and_the_value_string():
    payload = vector(({"nodename": "worker-a"}, "1500.5"), ({"nodename": "Worker-B"}, "0"))
    assert parse_vector(payload, "nodename") == {"worker-a": 1500.5, "worker-b": 0.0}


def test_parse_vector_skips_nan_inf_negative_and_unlabelled_series():
    payload = vector(({"nodename": "a"}, "NaN"), ({"nodename": "b"}, "+Inf"),
                     ({"nodename": "c"}, "-Inf"), ({"nodename": "d"}, "-3"),
                     ({"instance": "10.0.0.1:9100"}, "7"), ({"nodename": "e"}, "not a number"),
                     ({"nodename": "f"}, "12"))
    assert parse_vector(payload, "nodename") == {"f": 12.0}


def test_parse_vector_adds_up_series_of_one_node():
    # A query left per device (no `sum by`) still gives one figure per node.
    payload = vector(({"nodename": "a", "device": "eth0"}, "10"), ({"nodename": "a", "device": "eth1"}, "5"))
    assert parse_vector(payload, "nodename") == {"a": 15.0}


@pytest.mark.parametrize("payload, words", [
    ({"status": "error", "errorType": "bad_data", "error": "parse error at char 5"}, "bad_data: parse error"),
    ({"status": "success", "data": {"resultType": "scalar", "result": [1, "2"]}}, "instant vector"),
    ({"status": "success", "data": {"resultType": "matrix", "result": []}}, "instant vector"),
    ({"status": "success"}, "instant vector"),
    (["not", "an", "object"], "JSON object"),
])
def test_parse_vector_errors_say_what_is_wrong(payload, words):
    with pytest.raises(PrometheusError, match=words):
        parse_vector(payload, "nodename")


# --- matching -------------------------------------------------------------------------------------

def test_name_match_exact_and_short_vs_fqdn_both_ways():
    series = ["ip-10-0-0-1", "ip-10-0-0-2.ec2.internal", "worker-9"]
    nodes = ["ip-10-0-0-1.ec2.internal", "ip-10-0-0-2", "worker-9", "absent"]
    assert match_by_name(series, nodes) == {
        "ip-10-0-0-1.ec2.internal": "ip-10-0-0-1",        # node FQDN, series short
        "ip-10-0-0-2": "ip-10-0-0-2.ec2.internal",        # node short, series FQDN
        "worker-9": "worker-9",
    }


def test_name_match_does_not_guess_ambiguous_short_names():
    # Two series share the short name: which one is node "db"? Not guessed.
    assert match_by_name(["db.zone-a.internal", "db.zone-b.internal"], ["db"]) == {}
    # Two nodes share the short name of one series: not guessed either.
    assert match_by_name(["db"], ["db.zone-a.internal", "db.zone-b.internal"]) == {}
    # An exact match is never ambiguous.
    assert match_by_name(["db", "db.zone-a.internal"], ["db.zone-a.internal"]) == {
        "db.zone-a.internal": "db.zone-a.internal"}


def test_name_match_never_pairs_two_different_fqdns():
    assert match_by_name(["web.zone-a.internal"], ["web.zone-b.internal"]) == {}


def test_name_match_ignores_case():
    assert match_by_name(["node-1"], ["Node-1.Example.COM"]) == {"Node-1.Example.COM": "node-1"}


@pytest.mark.parametrize("instance, host", [
    ("10.0.0.1:9100", "10.0.0.1"), ("[fd00::1]:9100", "fd00::1"), ("fd00::1", "fd00::1"),
    ("10.0.0.1", "10.0.0.1"), ("Node-1.Example:9100", "node-1.example"), ("[fd00::2]", "fd00::2"),
])
def test_instance_host(instance, host):
    assert instance_host(instance) == host


def test_address_match_uses_node_addresses_and_refuses_shared_addresses():
    addresses = {"n1": ("10.0.0.1", "n1.internal"), "n2": ("10.0.0.2", "fd00::2"),
                 "n3": ("10.0.0.9",), "n4": ("10.0.0.9",)}
    series = ["10.0.0.1:9100", "[fd00::2]:9100", "10.0.0.9:9100", "10.0.0.7:9100"]
    assert match_by_address(series, addresses) == {"n1": ["10.0.0.1:9100"], "n2": ["[fd00::2]:9100"]}


def test_address_match_takes_the_largest_of_several_exporters_for_one_node():
    traffic = {"10.0.0.1:9100": 100.0, "192.168.0.1:9100": 300.0}
    per_node = node_traffic(traffic, ["n1"], match="address",
                            node_addresses={"n1": ("10.0.0.1", "192.168.0.1")})
    assert per_node == {"n1": 300.0}


# --- scoring --------------------------------------------------------------------------------------

def test_scores_follow_the_rates_inversely_and_span_0_to_10():
    traffic = {"a": 2e3, "b": 2e5, "c": 2e7}
    assert node_scores(traffic, ["c", "a", "b"]) == [0, 10, 5]


def test_nodes_without_data_are_neutral_and_keep_input_order():
    traffic = {"a": 1e3, "b": 1e6}
    assert node_scores(traffic, ["x", "b", "y", "a"]) == [NEUTRAL_SCORE, 0, NEUTRAL_SCORE, 10]


def test_no_data_at_all_or_equal_traffic_is_neutral():
    assert node_scores({}, ["a", "b"]) == [NEUTRAL_SCORE, NEUTRAL_SCORE]
    assert node_scores({"a": 5.0, "b": 5.0}, ["a", "b"]) == [NEUTRAL_SCORE, NEUTRAL_SCORE]


def test_a_score_does_not_depend_on_the_other_candidates():
    # The scale is the whole query's: asking about one node gives the same as asking about all.
    traffic = {"a": 1e3, "b": 1e5, "c": 1e7}
    assert node_scores(traffic, ["b"]) == [node_scores(traffic, ["a", "b", "c"])[1]]


def test_one_huge_node_does_not_flatten_the_others():
    # A linear scale would give a and b both 10; the log scale still tells them apart.
    traffic = {"a": 1e3, "b": 1e6, "huge": 1e12}
    a, b, huge = node_scores(traffic, ["a", "b", "huge"])
    assert a > b > huge == 0


@settings(max_examples=200, deadline=None)
@given(st.dictionaries(st.text("abcdefgh", min_size=1, max_size=4),
                       st.floats(min_value=0, max_value=1e12, allow_nan=False), max_size=12))
def test_scores_are_in_range_and_monotonic(traffic):
    names = sorted(traffic)
    scores = node_scores(traffic, names)
    assert all(0 <= s <= MAX_SCORE for s in scores)
    by_rate = sorted(zip(names, scores), key=lambda pair: traffic[pair[0]])
    assert [s for _, s in by_rate] == sorted((s for _, s in by_rate), reverse=True)


def test_series_that_overflow_when_added_score_the_busiest_not_inf_over_inf():
    """Two series of 1e308 for one node add up to inf: every prioritize answered 500, and with
    a capacity of inf too, inf/inf scored the node 10 (issue 21, item 7)."""
    huge = vector(({"nodename": "a", "device": "eth0"}, "1e308"),
                  ({"nodename": "a", "device": "eth1"}, "1e308"), ({"nodename": "b"}, "1000"))
    traffic = parse_vector(huge, "nodename")
    assert all(math.isfinite(v) for v in traffic.values()) and traffic["a"] > traffic["b"]
    assert node_scores(traffic, ["a", "b", "c"]) == [0, MAX_SCORE, NEUTRAL_SCORE]
    links = dict(traffic)   # a capacity that overflowed the same way
    assert node_scores(traffic, ["a", "b"], capacity=links) == [0, 0]
    assert node_scores({"a": 5.0}, ["a"], capacity={"a": 1e-320}) == [0]


def test_scale_clamps_values_outside_the_observed_range():
    scale = TrafficScale.of([10.0, 1000.0])
    assert scale.score(0.0) == MAX_SCORE and scale.score(1e9) == 0
    assert not math.isnan(TrafficScale.of([]).score(1.0))


# --- the poller's error handling, Prometheus answers injected -----------------------------------

class _CannedHttp:
    """Fault injection only: hands out prepared answers instead of a network."""

    def __init__(self, *answers):
        self.answers = list(answers)
        self.urls = []

    def get(self, url, **kwargs):
        self.urls.append(url)
        answer = self.answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        status, body = answer
        return Response(status, {}, body, url)


def test_poller_keeps_the_last_answer_until_stale_then_none(caplog):
    from archway.errors import TransportError
    clock = ManualClock()
    http = _CannedHttp(
        (200, b'{"status":"success","data":{"resultType":"vector","result":'
              b'[{"metric":{"nodename":"a"},"value":[1,"42"]}]}}'),
        TransportError("cannot reach 127.0.0.1:9: connection refused"),
        TransportError("cannot reach 127.0.0.1:9: connection refused"),
        (503, b"<html>Service Unavailable</html>"),
        (400, b'{"status":"error","errorType":"bad_data","error":"1:5: parse error"}'),
    )
    poller = TrafficPoller(PrometheusSettings(url="http://127.0.0.1:9", stale_after_seconds=60),
                           http=http, clock=clock)
    poller.refresh_once()
    assert poller.fresh_snapshot().traffic == {"a": 42.0}
    # One query asks for traffic and capacity, the rate window substituted.
    assert "query=label_replace%28%28sum+by+%28nodename%29" in http.urls[0] and "timeout=5s" in http.urls[0]
    assert "%5B2m%5D" in http.urls[0] and "window" not in http.urls[0]
    caplog.clear()
    clock.now += 30
    poller.refresh_once()
    poller.refresh_once()
    assert poller.fresh_snapshot().traffic == {"a": 42.0}   # an outage does not erase data at once
    clock.now += 31
    assert poller.fresh_snapshot() is None                   # ... but stale data is no data
    failures = [r for r in caplog.records if "Prometheus traffic query failed" in r.getMessage()]
    assert len(failures) == 1                                # one line per outage
    poller.refresh_once()
    assert "not JSON" in poller.last_error
    poller.refresh_once()
    assert "bad_data: 1:5: parse error" in poller.last_error


def test_poller_without_url_never_starts():
    poller = TrafficPoller(PrometheusSettings(url=None))
    assert poller.fresh_snapshot() is None and poller._runner.thread is None


# --- network faults from a real socket (fault injection) -----------------------------------------

class _FaultServer:
    """Accepts connections and misbehaves: `silent` never answers, `flood` streams an endless
    body without Content-Length, `nested` answers JSON nested far too deep."""

    def __init__(self, mode):
        import socket
        import threading
        self.mode = mode
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(8)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.closing = threading.Event()
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self):
        import threading
        while not self.closing.is_set():
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._handle, args=(conn,), daemon=True).start()

    def _handle(self, conn):
        try:
            conn.recv(65536)
            if self.mode == "silent":
                self.closing.wait(10)
            elif self.mode == "flood":
                conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                             b"Connection: close\r\n\r\n")
                chunk = b" " * 65536
                while not self.closing.is_set():
                    conn.sendall(chunk)
            elif self.mode == "nested":
                body = b"[" * 200000 + b"]" * 200000
                conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: "
                             + str(len(body)).encode() + b"\r\nConnection: close\r\n\r\n" + body)
        except OSError:
            pass
        finally:
            conn.close()

    def stop(self):
        self.closing.set()
        self.sock.close()


@pytest.mark.parametrize("mode, words, timeout", [
    ("silent", "deadline passed waiting for 127.0.0.1", 1.0),
    # The cap is made small so a busy machine reaches it long before the deadline: which of the
    # two bounds fires must not depend on how fast this machine copies bytes.
    ("flood", "more than the 1048576 bytes", 20.0),
    ("nested", "recursion", 1.0),
])
def test_poller_survives_a_prometheus_that_misbehaves(mode, words, timeout, monkeypatch):
    import time

    from archway.extender import prometheus
    monkeypatch.setattr(prometheus, "MAX_RESPONSE_BYTES", 1024 * 1024)
    server = _FaultServer(mode)
    try:
        poller = TrafficPoller(PrometheusSettings(url=server.url, timeout_seconds=timeout))
        started = time.monotonic()
        poller.refresh_once()
        assert time.monotonic() - started < timeout + 2
        assert words in poller.last_error and poller.fresh_snapshot() is None
    finally:
        server.stop()
