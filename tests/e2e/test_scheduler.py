"""archway's second scheduler: the real kube-scheduler with the chart's KubeSchedulerConfiguration
calls the extender (running as the chart's scheduler ServiceAccount), which filters nodes by
architecture and scores them by link utilisation read from a real Prometheus."""
import re
import time

import pytest
import requests
import yaml

from lab.kube import pod_path
from lab.procs import wait_until
from lab.servers.prometheus import FakeNodeExporters, PrometheusServer

from .workloads import arches_of, create_pod, pod, wait_bound

QUIET, BUSY = 1e4, 1e9          # bytes/s
LINK = 1.25e9                   # 10 Gb/s links


@pytest.fixture(scope="module")
def traffic(archway, control_plane, tmp_path_factory):
    """Prometheus scraping one exporter per Node (nodename = the Node's name), and the extender
    restarted to read it with a short window; put back afterwards."""
    names = [name for name, _ in control_plane.nodes]
    exporters = FakeNodeExporters({name: QUIET for name in names}, {name: LINK for name in names})
    prometheus = PrometheusServer(tmp_path_factory.mktemp("prometheus"), exporters)
    try:
        prometheus.wait_for("count(node_uname_info)", at_least=1,
                            check=lambda r: float(r[0]["value"][1]) == len(names))
        archway.restart_extender({"prometheus": {
            "url": prometheus.url, "window": "3s", "refresh_seconds": 1,
            "stale_after_seconds": 30}})
        asks_scores(control_plane, True)
        yield exporters, prometheus
    finally:
        asks_scores(control_plane, False)
        archway.restart_extender()
        prometheus.stop()
        exporters.stop()


def asks_scores(plane, on: bool, name: str = "archway-scheduler") -> None:
    """The second scheduler restarted with the extender's prioritizeVerb (and weight), as the
    chart renders it with config.prometheus.url (test_chart), or without, as installed here."""
    path = plane.path(f"{name}.config.yaml")
    with open(path) as f:
        config = yaml.safe_load(f)
    [extender] = config["extenders"]
    extender.pop("prioritizeVerb", None), extender.pop("weight", None)
    if on:
        extender.update(prioritizeVerb="prioritize", weight=1)
    with open(path, "w") as f:
        yaml.safe_dump(config, f)
    plane.restart_scheduler(name)


def busy_only(exporters, prometheus, busy: str) -> None:
    """`busy` carries BUSY bytes/s, every other node QUIET; returns once Prometheus says so over
    the whole window and the extender had time to read it (it refreshes every second)."""
    for name in exporters.nodes:
        exporters.set_rate(name, BUSY if name == busy else QUIET)
    query = ('sum by (nodename) (rate(node_network_receive_bytes_total{device="eth0"}[3s]) '
             '* on(instance) group_left(nodename) node_uname_info)')

    def settled(result):
        rates = {r["metric"]["nodename"]: float(r["value"][1]) for r in result}
        return len(rates) == len(exporters.nodes) and all(
            (rate > BUSY / 4) if name == busy else (rate < BUSY / 100) for name, rate in rates.items())
    prometheus.wait_for(query, at_least=len(exporters.nodes), check=settled, timeout=20)


def extender_sees(archway, busy: str, since: float) -> None:
    """Wait until every worker of the extender scores with a sample taken after `since` (one
    worker queries Prometheus, the others read its snapshot within a second: the scheduler's
    call may reach any of them), and its prioritize ranks `busy` below every other amd64 node."""
    def every_worker_fresh():
        text = archway.extender.get("/metrics").text
        # One series per process that loaded the metrics: the master's too, which never scores.
        workers = set(re.findall(r'archway_prometheus_poller\{pid="(\d+)"\}', text)) \
            - {str(archway.extender.process.pid)}
        sampled = {pid: float(at) for pid, at in re.findall(
            r'archway_prometheus_snapshot_timestamp_seconds\{pid="(\d+)"\} (\S+)', text)}
        return bool(workers) and all(sampled.get(pid, 0.0) >= since for pid in workers)
    wait_until(every_worker_fresh, timeout=20, what="every extender worker to read a new sample")

    def ranked():
        args = {"Pod": {"metadata": {"name": "probe", "namespace": "default",
                                     "annotations": {"archway.dev/architectures": "amd64"}},
                        "spec": {"containers": [{"name": "c", "image": "x"}]}},
                "NodeNames": ["amd64-1", "amd64-2"]}
        scores = {s["Host"]: s["Score"] for s in requests.post(
            archway.extender.url + "/scheduler/prioritize", json=args, timeout=5).json()}
        return all(scores[busy] < score for host, score in scores.items() if host != busy)
    wait_until(ranked, timeout=20, what=f"the extender to rank {busy} lowest")


def test_the_second_scheduler_binds_to_the_quieter_node_of_the_right_architecture(
        archway, kube, namespace, images, traffic):
    exporters, prometheus = traffic
    image = images.ref("e2e/amd64")
    chosen = []
    for round_, busy in enumerate(("amd64-1", "amd64-2", "amd64-1")):
        busy_only(exporters, prometheus, busy)
        extender_sees(archway, busy, since=time.time())
        name = f"round-{round_}"

        def placed(name=name):
            create_pod(kube, namespace, pod(name, [image], schedulerName=archway.scheduler_name))
            return wait_bound(kube, namespace, name, 1)[0]
        bound = placed()
        chosen.append(bound["spec"]["nodeName"])
        assert arches_of(kube, [bound]) == {"amd64"}
        assert bound["spec"]["nodeName"] != busy, (busy, bound["spec"]["nodeName"])
    assert chosen == ["amd64-2", "amd64-1", "amd64-2"]
    calls = re.findall(r'archway_extender_requests_total\{outcome="ok",verb="(\w+)"\} (\d+)',
                       archway.extender.get("/metrics").text)
    assert {verb for verb, count in calls if int(count) >= 3} >= {"filter", "prioritize"}, calls


def test_the_second_scheduler_never_binds_to_a_node_of_another_architecture(
        archway, kube, namespace, images, traffic):
    exporters, prometheus = traffic
    # Every amd64 node busy, the other nodes idle: traffic must not pull the pod off its arch.
    for name in exporters.nodes:
        exporters.set_rate(name, BUSY if name.startswith("amd64") else QUIET)
    for i in range(4):
        create_pod(kube, namespace, pod(f"p{i}", [images.ref("e2e/amd64")],
                                        schedulerName=archway.scheduler_name))
    for i in range(4):
        bound = wait_bound(kube, namespace, f"p{i}", 1)[0]
        assert arches_of(kube, [bound]) == {"amd64"}
        assert bound["spec"]["schedulerName"] == archway.scheduler_name
    # The default scheduler never touched them: the Scheduled events come from archway's. A
    # scheduler writes its Events in the background after the bind: waited for, one per pod.
    def scheduled():
        found = kube.items(f"/api/v1/namespaces/{namespace}/events",
                           fieldSelector="reason=Scheduled")
        named = {e.get("involvedObject", {}).get("name") for e in found}
        return found if named >= {f"p{i}" for i in range(4)} else None
    events = kube.wait_for(scheduled, timeout=30, what="a Scheduled Event for each pod")
    assert {e.get("reportingComponent") or e["source"].get("component")
            for e in events} == {archway.scheduler_name}
    assert kube.get(pod_path(namespace, "p0"))["metadata"]["annotations"][
        "archway.dev/architectures"] == "amd64"


def test_only_pods_whose_node_archway_could_still_change_go_to_its_scheduler(
        archway, kube, namespace, images):
    """placement.scheduler_name with placement.scheduler_for: needed (the default), no
    Prometheus: a pod archway pins to its image's architecture keeps default-scheduler, which
    binds it to a node of that architecture without any extender call; a pod whose image archway
    cannot read goes to archway's scheduler. scheduler_for: all sends every pod there."""
    second = archway.scheduler_name
    try:
        archway.restart_webhook({"placement": {"scheduler_name": second}})
        archway.wait_until_webhook_acts()
        create_pod(kube, namespace, pod("pinned", [images.ref("e2e/arm64")]))
        create_pod(kube, namespace, pod("unread", [images.ref("e2e/never-pushed")]))
        pinned = wait_bound(kube, namespace, "pinned", 1)[0]
        assert pinned["spec"]["schedulerName"] == "default-scheduler"
        assert pinned["spec"]["nodeSelector"] == {"kubernetes.io/arch": "arm64"}
        assert arches_of(kube, [pinned]) == {"arm64"}
        assert kube.get(pod_path(namespace, "unread"))["spec"]["schedulerName"] == second

        def scheduled_by():
            found = {e.get("involvedObject", {}).get("name"):
                     e.get("reportingComponent") or e["source"].get("component")
                     for e in kube.items(f"/api/v1/namespaces/{namespace}/events",
                                         fieldSelector="reason=Scheduled")}
            return found if "pinned" in found else None
        by = kube.wait_for(scheduled_by, timeout=30, what="the pinned pod's Scheduled Event")
        assert by["pinned"] == "default-scheduler"
        assert f"{namespace}/pinned" not in archway.extender.log(5000)

        archway.restart_webhook({"placement": {"scheduler_name": second, "scheduler_for": "all"}})
        archway.wait_until_webhook_acts()
        create_pod(kube, namespace, pod("pinned-all", [images.ref("e2e/arm64")]))
        assert kube.get(pod_path(namespace, "pinned-all"))["spec"]["schedulerName"] == second
    finally:
        archway.restart_webhook()
