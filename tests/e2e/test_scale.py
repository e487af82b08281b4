"""archway on a few hundred Nodes simulated by KWOK (lab/cluster/kwok.py) beside the real control
plane: its caches list in pages, a relist after its watches expired (410 Gone, forced by
restarting kube-apiserver: the new watch cache starts at the current revision, so every watch
resumed from an older one is expired) leaves admissions answered, and a new gate controller
leader takes over at that size. Pods become Running on KWOK Nodes of their image's architecture.
The large sizes (1,000-5,000 Nodes) stay in the bench."""
import itertools
import os
import re
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests

from lab.cluster.chart import ChartInstall
from lab.cluster.controlplane import ControlPlane, start_process, stop_process
from lab.cluster.kwok import LABEL, Kwok
from lab.kube import KubeError, pod_path

from .conftest import LEASE, archway_config
from .test_leader import holder
from .workloads import create_deployment, create_pod, deployment, describe, gated, pod, pods_of

KWOK_NODES = 300
# The module's control plane, KWOK Nodes and install count against its first test.
pytestmark = pytest.mark.timeout(900)
ON_KWOK = {"nodeSelector": {LABEL: "kwok"}}


@pytest.fixture(scope="module")
def scale(images, tmp_path_factory):
    """Its own control plane (the session's has 5 Nodes other tests count on), KWOK_NODES
    KWOK Nodes, archway installed by the chart."""
    plane = ControlPlane(str(tmp_path_factory.mktemp("scale-plane")))
    install = None
    started = time.monotonic()
    try:
        plane.start()
        kwok = Kwok(plane).start()
        archs = kwok.wait_ready(kwok.add_nodes(KWOK_NODES))
        install = ChartInstall(plane, archway_config=archway_config(images)).install()
        print(f"\nscale: {KWOK_NODES} KWOK Nodes and archway up in {time.monotonic() - started:.0f} s")
        yield plane, install, archs
    finally:
        if install is not None:
            install.stop_processes()
        plane.stop()


def running(kube, namespace: str, app: str, count: int, timeout: float = 120.0) -> list[dict]:
    def done():
        pods = pods_of(kube, namespace, app)
        return pods if len(pods) == count and all(
            p.get("status", {}).get("phase") == "Running" for p in pods) else None
    return kube.wait_for(done, timeout=timeout, what=f"{count} pods of {app} Running")


def archway_reads(plane, mark: int, collection: str) -> list[str]:
    """The list requests archway's ServiceAccounts made of `collection` since `mark`."""
    return [event["requestURI"] for event in plane.audit_events(mark)
            if event["verb"] == "list" and event["requestURI"].startswith(collection + "?")
            and event.get("user", {}).get("username", "").startswith(
                "system:serviceaccount:archway-system:")]


def test_pods_run_on_kwok_nodes_of_their_architecture_and_caches_list_in_pages(scale, images):
    plane, install, archs = scale
    kube = plane.kube
    assert {a for a in archs.values()} == {"amd64", "arm64", "ppc64le"}   # as each Node reports
    namespace = plane.new_namespace("scale-placement")
    wanted = {"arm64": 6, "amd64": 6, "ppc64le": 3}
    started = time.monotonic()
    for arch, replicas in wanted.items():
        create_deployment(kube, namespace, deployment(arch, [images.ref(f"e2e/{arch}")],
                                                      replicas=replicas, **ON_KWOK))
    # archway's own scheduler: its extender filters the 305 names from its node cache.
    create_deployment(kube, namespace, deployment(
        "second", [images.ref("e2e/arm64")], replicas=4, schedulerName=install.scheduler_name,
        **ON_KWOK))
    for arch, replicas in [*wanted.items(), ("arm64", 4)]:
        app = arch if replicas != 4 else "second"
        for p in running(kube, namespace, app, replicas):
            node = p["spec"]["nodeName"]
            assert node.startswith("kwok-") and archs[node] == arch, describe(kube, namespace,
                                                                              p["metadata"]["name"])
    print(f"scale: {sum(wanted.values()) + 4} pods Running in {time.monotonic() - started:.1f} s")
    # Every list archway made of Nodes (webhook and extender) and of Pods is paged.
    for collection in ("/api/v1/nodes", "/api/v1/pods"):
        lists = archway_reads(plane, 0, collection)
        assert lists and all("limit=500" in uri for uri in lists), (collection, lists)


def restart_apiserver(plane: ControlPlane) -> float:
    """kube-apiserver stopped and started again with the same command line; seconds down."""
    process = plane.processes["kube-apiserver"]
    with open(f"/proc/{process.pid}/cmdline", "rb") as f:
        args = [a.decode() for a in f.read().split(b"\0") if a]
    stopped = time.monotonic()
    stop_process(process)
    plane.processes["kube-apiserver"] = start_process("kube-apiserver", args, plane.state_dir)
    plane.save()
    end = time.monotonic() + 90
    while time.monotonic() < end:
        try:
            if requests.get(f"{plane.server}/readyz", verify=plane.ca_path, timeout=2,
                            headers={"Authorization": f"Bearer {plane.kube.token}"}).text == "ok":
                return time.monotonic() - stopped
        except requests.RequestException:
            pass
        time.sleep(0.2)
    raise AssertionError("kube-apiserver not ready 90 s after its restart")


def test_admissions_are_answered_while_archway_relists_after_its_watches_expired(scale, images):
    plane, install, _ = scale
    kube = plane.kube
    namespace = plane.new_namespace("scale-relist")
    marks = {a.name: len(a.log(100000)) for a in (install.webhook, install.extender)}
    mark = plane.audit_mark()
    # Admissions from before the restart until every cache of both archway processes has found
    # its watch expired and listed again (and a few after): the first answered ones meet
    # archway's reconnecting watches. While the apiserver is down a create is refused.
    image = images.ref("e2e/arm64")
    relisted: dict = {}

    def expired_and_relisted() -> bool:
        for archway in (install.webhook, install.extender):
            text = archway.log(100000)[marks[archway.name]:]
            relisted[archway.name] = re.findall(r"(\w[\w ]*): watch expired \(410 Gone\)", text)
        return bool(all(relisted.values()) and archway_reads(plane, mark, "/api/v1/nodes"))

    times: list[float] = []
    done, ready = threading.Event(), threading.Event()
    starting: list[float] = []   # sent before the apiserver said ready: its start's, not archway's

    created_names: list[str] = []

    def admit() -> None:
        during = 0
        for attempt in itertools.count():
            if done.is_set() or (during and len(times) >= during + 3):
                break
            started, was_ready = time.monotonic(), ready.is_set()
            # A fresh name per attempt: a create stored before its answer was lost must not collide.
            name = f"during-{attempt}"
            try:
                created = create_pod(kube, namespace, pod(name, [image], **ON_KWOK))
            except (requests.ConnectionError, KubeError) as refused:
                # While it stops or starts, the apiserver itself refuses ("apiserver is shutting
                # down", 503; 429 with Retry-After); archway is not asked. Once ready, all must pass.
                if was_ready or (isinstance(refused, KubeError) and refused.status not in (429, 503)):
                    raise
                time.sleep(0.1)
                continue
            created_names.append(name)
            (times if was_ready else starting).append(time.monotonic() - started)
            annotations = created["metadata"].get("annotations") or {}
            assert any(k.startswith("archway.dev/") for k in annotations) or gated(created)
            if not during and expired_and_relisted():
                during = len(times)
        relisted["admissions until relisted"] = during

    with ThreadPoolExecutor(1) as pool:
        admissions = pool.submit(admit)
        try:
            down = restart_apiserver(plane)
            ready.set()
            admissions.result(timeout=90)
        finally:
            done.set()
    during = relisted.pop("admissions until relisted")
    # Each was answered by archway (annotated or gated, above), within the webhook's timeout.
    assert max(times) < 10.0, times
    assert "node cache" in relisted["archway-extender"] and "pod watch" in relisted["archway-extender"]
    assert "node cache" in relisted["archway-webhook"], relisted
    for name in created_names:
        kube.wait_for(lambda name=name: kube.get(pod_path(namespace, name))["status"].get(
            "phase") == "Running", timeout=120, what=f"{name} Running")
    print(f"scale: apiserver down {down:.1f} s; {during} admissions until every cache had "
          f"relisted after its 410, {len(times)} in all, slowest {max(times) * 1000:.0f} ms "
          f"(sent while the apiserver started: {[round(t, 1) for t in starting]} s); "
          f"relisted: {sorted(set(relisted['archway-webhook'] + relisted['archway-extender']))}")


def test_a_new_gate_controller_leader_takes_over_at_scale(scale, images):
    plane, install, archs = scale
    kube = plane.kube
    namespace = plane.new_namespace("scale-leader")
    # The cluster's pods for the new leader to list: one per KWOK Node.
    create_deployment(kube, namespace, deployment("filler", [images.ref("e2e/everywhere")],
                                                  replicas=KWOK_NODES, **ON_KWOK))
    running(kube, namespace, "filler", KWOK_NODES, timeout=300)
    first = holder(kube, install)
    replica = install.start_replica("archway-replica")
    stop_process(install.webhook.process)      # gives the Lease up: the replica leads
    kube.wait_for(lambda: (h := holder(kube, install)) and h != first and h,
                  timeout=60, what="the replica to lead")
    install.restart_webhook()
    slow = images.slow
    slow.delay = 3.0
    try:
        tag = images.fresh("e2e/arm64")
        created = create_pod(kube, namespace, pod("gated", [images.ref("e2e/arm64", tag, via="slow")],
                                                  **ON_KWOK))
        assert gated(created), describe(kube, namespace, "gated")
        killed = time.monotonic()
        os.killpg(replica.process.pid, signal.SIGKILL)   # the leader dies without a word
        slow.delay = 0.0
        kube.wait_for(lambda: kube.get(pod_path(namespace, "gated"))["status"].get("phase")
                      == "Running", timeout=120, what="the gated pod released and Running")
    finally:
        slow.delay = 0.0
    took = time.monotonic() - killed
    node = kube.get(pod_path(namespace, "gated"))["spec"]["nodeName"]
    assert archs[node] == "arm64"
    print(f"scale: leader killed -> gated pod released and Running in {took:.1f} s "
          f"(Lease {LEASE:g} s, {KWOK_NODES} pods running)")
