"""The pure half of utilisation scoring and herd control, the pod watch's bookkeeping fed with
the objects the API server sends, and the poller election between processes (lock file)."""
import json
import os
import subprocess
import sys
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from archway.config import PrometheusSettings
from archway.extender.herd import (
    ANNOTATION_BANDWIDTH,
    Herd,
    Placement,
    PodWatch,
    added_traffic,
    parse_bandwidth,
    pod_key,
)
from archway.extender.prometheus import SharedSnapshot, TrafficPoller, combined_query, split_answer
from archway.extender.traffic import (
    MAX_SCORE,
    NodeLoad,
    TrafficScale,
    load_score,
    utilisation_score,
)
from lab.procs import wait_until
from lab.servers.prometheus import CannedPrometheusHttp
from tests.test_traffic import node_scores

# --- the curve --------------------------------------------------------------------------------------

@pytest.mark.parametrize("u, score", [(0, 10), (0.0001, 10), (0.01, 9), (0.04, 8), (0.09, 7),
                                      (0.25, 5), (0.49, 3), (0.64, 2), (0.81, 1), (1.0, 0),
                                      (3.0, 0), (-1.0, 10)])
def test_utilisation_curve_as_documented(u, score):
    assert utilisation_score(u) == score


@settings(max_examples=200, deadline=None)
@given(st.floats(min_value=0, max_value=10, allow_nan=False),
       st.floats(min_value=0, max_value=10, allow_nan=False))
def test_utilisation_curve_is_monotone(a, b):
    low, high = sorted((a, b))
    assert MAX_SCORE >= utilisation_score(low) >= utilisation_score(high) >= 0


def test_capacity_decides_over_bytes_and_no_capacity_falls_back_to_the_traffic_rank():
    traffic = {"slow": 2e6, "fast": 9e6, "bare-quiet": 1e4, "bare-busy": 5e7}
    capacity = {"slow": 25e6, "fast": 6.25e9}
    names = ["slow", "fast", "bare-quiet", "bare-busy", "absent"]
    assert node_scores(traffic, names, capacity=capacity) == [7, 10, 10, 0, 5]
    # Without any capacity, the same traffic is scored as before: by bytes.
    assert node_scores(traffic, names)[:2] == [TrafficScale.of(traffic.values()).score(2e6),
                                               TrafficScale.of(traffic.values()).score(9e6)]


def test_added_traffic_moves_a_score_down():
    scale = TrafficScale.of([1e3, 1e7])
    assert load_score(NodeLoad(2.5e6, 250e6), scale) == 9
    assert load_score(NodeLoad(2.5e6, 250e6), scale, added=20e6) == 7
    assert load_score(NodeLoad(1e3, None), scale, added=1e7) == 0


# --- one query for both -----------------------------------------------------------------------------

def test_combined_query_tags_both_halves_and_fills_in_the_window():
    settings = PrometheusSettings(window="90s")
    query = combined_query(settings)
    assert "[90s]" in query and "$window" not in query
    assert query.startswith('label_replace((sum by (nodename)') and ' or label_replace((' in query
    assert '"archway_series", "capacity"' in query
    assert combined_query(PrometheusSettings(capacity_query="")) == \
        PrometheusSettings().query.replace("$window", "2m")


def test_split_answer_separates_traffic_from_capacity_and_drops_zero_speeds():
    def series(node, kind, value):
        return {"metric": {"nodename": node, "archway_series": kind}, "value": [1, value]}
    payload = {"status": "success", "data": {"resultType": "vector", "result": [
        series("a", "traffic", "100"), series("a", "capacity", "2500"),
        series("b", "traffic", "7"), series("b", "capacity", "0"),
        {"metric": {"nodename": "c"}, "value": [1, "9"]}]}}
    assert split_answer(payload, "nodename") == ({"a": 100.0, "b": 7.0, "c": 9.0}, {"a": 2500.0})


def test_window_must_be_a_prometheus_duration():
    from archway.config import config_from_dict
    from archway.errors import ConfigError
    assert config_from_dict({"prometheus": {"window": "1m30s"}}).prometheus.window == "1m30s"
    with pytest.raises(ConfigError, match="config: prometheus.window must be a Prometheus duration"):
        config_from_dict({"prometheus": {"window": "2 minutes"}})


# --- estimates --------------------------------------------------------------------------------------

@pytest.mark.parametrize("value, expected", [
    ("2500000", 2.5e6), ("10M", 1e7), ("1.5Gi", 1.5 * 2 ** 30), ("800k", 8e5), ("64Ki", 65536.0),
    (" 3 M ", 3e6), ("", None), ("fast", None), ("-5M", None), ("10MB", None), (None, None), (5, None),
])
def test_parse_bandwidth(value, expected):
    assert parse_bandwidth(value) == expected


def test_added_traffic_annotation_then_node_average_then_default():
    placements = [Placement("p1", "n1", 1.0, 4e6, True),     # annotated
                  Placement("p2", "n1", 1.0, None, False),   # n1: 9e6 over 3 pods = 3e6
                  Placement("p3", "n2", 1.0, None, True),    # n2: no running pods: default
                  Placement("p4", "n3", 1.0, None, True)]    # n3: no traffic data: default
    added = added_traffic(placements, {"n1": 9e6, "n2": 5e6}, {"n1": 3, "n3": 2}, default=1e6)
    assert added == {"n1": 7e6, "n2": 1e6, "n3": 1e6}


def test_herd_guess_bound_since_and_exclude():
    now = [100.0]
    herd = Herd(wall=lambda: now[0])
    herd.guess("p1", "n1", None)
    herd.bound("p1", "n2", 5.0)            # the watch corrects the guess
    herd.guess("p1", "n3", None)           # ... and a later guess does not undo it
    assert herd.placement("p1") == Placement("p1", "n2", 100.0, 5.0, True)
    now[0] = 101.0
    herd.guess("p2", "n1", None)
    assert [p.pod for p in herd.since(99.0)] == ["p1", "p2"]
    assert [p.pod for p in herd.since(99.0, exclude="p2")] == ["p1"]   # a pod scored again
    assert [p.pod for p in herd.since(100.5)] == ["p2"]               # the sample includes p1
    assert herd.placement("p1") is None
    herd.forget("p2")
    assert herd.since(0) == []


def _pod(name, node=None, phase="Pending", bandwidth=None):
    pod = {"metadata": {"name": name, "namespace": "ns", "uid": f"uid-{name}"},
           "spec": {"containers": [{"name": "c", "image": "x"}]}, "status": {"phase": phase}}
    if node:
        pod["spec"]["nodeName"] = node
    if bandwidth:
        pod["metadata"]["annotations"] = {ANNOTATION_BANDWIDTH: bandwidth}
    return pod


def test_pod_watch_counts_running_pods_and_reports_binds():
    herd = Herd()
    watch = PodWatch(lambda: None, herd)
    watch._on_list([_pod("old", "n1", "Running"), _pod("done", "n1", "Succeeded"), _pod("new")])
    watch._synced.set()
    assert herd.running == {"n1": 1} and herd.since(0) == []       # the first list places nothing
    watch._on_event("MODIFIED", _pod("new", "n2", bandwidth="10M"))  # the scheduler's bind
    assert herd.placement("uid-new") == Placement("uid-new", "n2", herd.placement("uid-new").at,
                                                  1e7, True)
    assert herd.running == {"n1": 1, "n2": 1}
    watch._on_event("MODIFIED", _pod("new", "n2", "Running"))      # a status update: no new bind
    assert len(herd.since(0)) == 1
    watch._on_event("MODIFIED", _pod("old", "n1", "Succeeded"))
    assert herd.running == {"n2": 1}
    watch._on_event("DELETED", _pod("new", "n2", "Running"))
    assert herd.running == {} and herd.since(0) == []
    # A re-list after 410 Gone: a pod bound meanwhile is a placement.
    watch._on_list([_pod("gap", "n3", "Pending")])
    assert [p.node for p in herd.since(0)] == ["n3"] and herd.running == {"n3": 1}


def test_pod_key_uid_else_namespace_name():
    assert pod_key({"metadata": {"uid": "u", "name": "a"}}) == "u"
    assert pod_key({"metadata": {"name": "a", "namespace": "ns"}}) == "ns/a"
    assert pod_key({"metadata": {}}) is None and pod_key({}) is None


# --- one poller per server ----------------------------------------------------------------------------

_HOLD = """
import fcntl, os, sys, time
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o600)
fcntl.flock(fd, fcntl.LOCK_EX)
print("held", flush=True)
time.sleep(60)
"""


def test_the_poller_lock_passes_on_when_its_holder_dies(tmp_path):
    shared = SharedSnapshot(str(tmp_path))
    holder = subprocess.Popen([sys.executable, "-c", _HOLD, os.path.join(str(tmp_path), "poller.lock")],
                              stdout=subprocess.PIPE)
    try:
        assert holder.stdout.readline() == b"held\n"
        assert not shared.lead()
        holder.kill()   # dies without a word: the kernel drops its lock
        holder.wait(10)
        assert shared.lead() and shared.lead()
    finally:
        if holder.poll() is None:
            holder.kill()
            holder.wait(10)
        holder.stdout.close()
        shared.release()


def test_snapshot_file_round_trip_and_foreign_files_are_ignored(tmp_path):
    writer, reader = SharedSnapshot(str(tmp_path)), SharedSnapshot(str(tmp_path))
    assert reader.read_if_new() is None
    writer.write({"a": 1.0}, {"a": 2.0}, 1234.5)
    assert reader.read_if_new() == {"traffic": {"a": 1.0}, "capacity": {"a": 2.0}, "sampled_at": 1234.5}
    assert reader.read_if_new() is None                       # unchanged: not read again
    with open(writer.path, "w") as f:
        json.dump({"traffic": []}, f)
    assert reader.read_if_new() is None
    assert [n for n in os.listdir(str(tmp_path)) if n.startswith(".snapshot-")] == []


def test_two_pollers_sharing_a_directory_query_once_per_refresh(tmp_path):
    now = [1000.0]
    settings = PrometheusSettings(url="http://127.0.0.1:9", refresh_seconds=15)
    a_http, b_http = CannedPrometheusHttp(), CannedPrometheusHttp()
    a = TrafficPoller(settings, http=a_http, clock=lambda: now[0], shared_dir=str(tmp_path))
    b = TrafficPoller(settings, http=b_http, clock=lambda: now[0], shared_dir=str(tmp_path))
    try:
        a.tick()
        b.tick()
        now[0] += 5
        a.tick()
        b.tick()
        assert (a_http.calls, b_http.calls) == (1, 0)
        assert b.fresh_snapshot().traffic == {"a": 42.0}
        a.stop()                        # the poller goes: b takes over, but the data is fresh
        b.tick()
        assert b_http.calls == 0
        now[0] += 11
        b.tick()
        assert b_http.calls == 1
    finally:
        a.stop()
        b.stop()
    assert time.time() - b.fresh_snapshot().sampled_at < 60


def test_placements_stay_bounded_while_no_sample_prunes_them(monkeypatch):
    import archway.extender.herd as herd_module
    monkeypatch.setattr(herd_module, "MAX_PLACEMENTS", 3)
    now = [0.0]
    herd = Herd(wall=lambda: now[0])
    for i in range(5):
        now[0] += 1
        herd.bound(f"p{i}", "n1", None)
    herd.guess("p2", "n2", None)                      # confirmed: not moved by a guess
    assert [p.pod for p in herd.since(0)] == ["p2", "p3", "p4"]   # the oldest went first


@pytest.mark.slow
def test_pod_watch_lists_in_pages_and_keeps_only_what_it_uses(tmp_path):
    """Against a real apiserver of its own (Nodes n0 and n1): the test writes what a kubelet
    would (the pods' phase, through pods/status) and reads the list pages in its audit log."""
    from archway.config import config_from_dict
    from archway.kubeclient import build_api_client
    from lab.cluster.controlplane import ControlPlane
    with ControlPlane(str(tmp_path / "plane"), nodes=(("n0", "amd64"), ("n1", "arm64"))) as api:
        api.new_namespace("ns")
        for i in range(7):
            pod = _pod(f"p{i}", f"n{i % 2}", bandwidth="1M" if i == 3 else None)
            del pod["metadata"]["uid"], pod["status"]
            pod["metadata"].setdefault("annotations", {})["big"] = "x" * 1000
            api.kube.create("/api/v1/namespaces/ns/pods", pod)
            api.kube.patch(f"/api/v1/namespaces/ns/pods/p{i}/status", {"status": {"phase": "Running"}})
        config = config_from_dict({"kubernetes": {"kubeconfig": api.admin_kubeconfig}})
        herd = Herd()
        watch = PodWatch(lambda: build_api_client(config.kubernetes)[0], herd,
                         watch_timeout_seconds=1)
        watch.page_size = 3
        seen = []
        original = watch._on_list
        watch._on_list = lambda items: (seen.extend(items), original(items))
        mark = api.audit_mark()
        try:
            assert watch.wait_synced(10)
            assert herd.running == {"n0": 4, "n1": 3}
            pages = [uri for verb, uri in api.requests_since(mark, user="admin")
                     if verb == "list" and uri.startswith("/api/v1/pods?")]
            assert len(pages) == 3 and "limit=3" in pages[0], pages
            assert all("continue=" in uri for uri in pages[1:]), pages
            assert len(seen) == 7 and all("labels" not in p["metadata"] for p in seen)
            assert seen[3]["metadata"]["annotations"] == {ANNOTATION_BANDWIDTH: "1M"}
            assert all("big" not in p["metadata"].get("annotations", {}) for p in seen)
            # A pod bound after the list comes through the watch.
            late = api.kube.create("/api/v1/namespaces/ns/pods", {
                "metadata": {"name": "late"},
                "spec": {"nodeName": "n1", "containers": [{"name": "c", "image": "x"}]}})
            uid = late["metadata"]["uid"]
            wait_until(lambda: herd.placement(uid) is not None and herd.running.get("n1") == 4,
                       30, "the late pod through the watch")
            assert herd.placement(uid).node == "n1"
        finally:
            watch.stop()


def test_closing_a_watch_whose_socket_its_reader_closed_meanwhile_raises_nothing():
    """stop() from another thread races the reading thread's own end of the stream: urllib3's
    shutdown() then finds the socket gone (EBADF; the fault the fast tier once hit in a
    teardown). A watch being stopped is stopped."""
    from archway.kubeapi import WatchStream

    class Gone:
        def shutdown(self):
            raise OSError(9, "Bad file descriptor")
    WatchStream(Gone()).close()
