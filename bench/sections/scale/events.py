"""What the scale section measures at the largest size only (issue 28, item 2):

relist    a forced watch expiry: kube-apiserver restarted (its new watch cache starts at the
          current revision, so every watch archway resumes from an older one gets 410 Gone, as
          tests/e2e/test_scale.py shows); pods created one after another throughout, each timed;
          relist time per archway process from the audit log (its first list request after the
          restart to the last page's answer), and the admissions answered meanwhile.
failover  the gate controller's leader killed (SIGKILL, it gives nothing up) while a pod it
          gated waits: until the Lease has a new holder, until that leader has released the
          pod, until the pod is Running, and until the new leader has learned (its caches of
          Nodes, Namespaces, workloads and failing pods synced, as its log says).
schedule  pods bound per second by archway's second scheduler + extender vs the default
          kube-scheduler, client limits lifted (bench/sections/kube.py, figure 19b's method),
          and in the same rounds that second scheduler pointed at the Go pass-all extender
          (figure 19c's arm, bench/common/passall.py).
"""
import os
import re
import signal
import threading
import time

import requests

from bench.common.passall import PassAllExtender
from bench.common.stats import percentile
from bench.sections.kube import UNTHROTTLED, algorithm_means, race_details, race_rounds, rates
from lab.cluster.chart import ChartInstall
from lab.cluster.controlplane import ControlPlane, start_process, stop_process
from lab.kube import KubeError, pod_path
from lab.servers.proxy import DelayProxy

from .load import ACCOUNTS, pod

LEASE_PATH = "/apis/coordination.k8s.io/v1/namespaces/{}/leases/archway-gate-controller"
SYNCED = re.compile(r"(\w[\w ]*) synced: \d+ items")


def restart_apiserver(plane: ControlPlane) -> tuple[float, float]:
    """kube-apiserver stopped and started again with its command line: (when it was stopped,
    when it answered ready), time.monotonic()."""
    process = plane.processes["kube-apiserver"]
    with open(f"/proc/{process.pid}/cmdline", "rb") as f:
        args = [a.decode() for a in f.read().split(b"\0") if a]
    stopped = time.monotonic()
    stop_process(process, timeout=60)
    plane.processes["kube-apiserver"] = start_process("kube-apiserver", args, plane.state_dir)
    plane.save()
    assert plane.kube is not None
    end = time.monotonic() + 300
    while time.monotonic() < end:
        try:
            if requests.get(f"{plane.server}/readyz", verify=plane.ca_path, timeout=2,
                            headers={"Authorization": f"Bearer {plane.kube.token}"}).text == "ok":
                return stopped, time.monotonic()
        except requests.RequestException:
            pass
        time.sleep(0.2)
    raise RuntimeError("kube-apiserver not ready 300 s after its restart")


def _lists_after(plane: ControlPlane, mark: int) -> dict[str, tuple[str, str, int]]:
    """account -> (first list received, last list answered, pages) among archway's list
    requests after `mark` (RFC 3339 strings, as the audit log writes them)."""
    found: dict[str, tuple[str, str, int]] = {}
    for event in plane.audit_events(mark):
        user = event.get("user", {}).get("username", "")
        if not user.startswith(ACCOUNTS) or event["verb"] != "list" or \
                event.get("stage") != "ResponseComplete":
            continue
        account = user[len(ACCOUNTS):]
        first, last, pages = found.get(account, (event["requestReceivedTimestamp"], "", 0))
        found[account] = (min(first, event["requestReceivedTimestamp"]),
                          max(last, event["stageTimestamp"]), pages + 1)
    return found


def _seconds(start: str, end: str) -> float:
    import datetime
    parse = datetime.datetime.fromisoformat
    return (parse(end.replace("Z", "+00:00")) - parse(start.replace("Z", "+00:00"))).total_seconds()


def relist(plane: ControlPlane, install: ChartInstall, image: str) -> dict:
    kube = plane.kube
    assert kube is not None
    namespace = plane.new_namespace("relist")
    marks = {a.name: len(a.log(1000000)) for a in (install.webhook, install.extender) if a}
    audit_mark = plane.audit_mark()
    times: list[tuple[float, float]] = []     # (sent, seconds) of answered creates
    problems: list[str] = []
    done, ready = threading.Event(), threading.Event()

    def admit() -> None:
        i = 0
        while not done.is_set():
            sent, i = time.monotonic(), i + 1
            try:
                created = kube.create(pod_path(namespace), pod(f"during-{i}", image))
            except requests.ConnectionError:
                time.sleep(0.1)
                continue
            except KubeError as e:
                if ready.is_set():
                    problems.append(f"during-{i}: {e.status} {e}"[:200])
                continue
            if ready.is_set():
                times.append((sent, time.monotonic() - sent))
                annotations = created["metadata"].get("annotations") or {}
                if not any(k.startswith("archway.dev/") for k in annotations) and \
                        not created["spec"].get("schedulingGates"):
                    problems.append(f"during-{i} not placed by archway")

    def relisted() -> bool:
        return all("watch expired (410 Gone)" in a.log(1000000)[marks[a.name]:]
                   for a in (install.webhook, install.extender) if a)

    admissions = threading.Thread(target=admit, daemon=True)
    admissions.start()
    try:
        stopped, up = restart_apiserver(plane)
        ready.set()
        kube.wait_for(relisted, timeout=300, what="archway's watches expired and relisting")
        time.sleep(15)    # the relists' pages, and admissions after them
    finally:
        done.set()
        admissions.join(60)
    lists = _lists_after(plane, audit_mark)
    relists = {account: _seconds(first, last) for account, (first, last, _) in lists.items()}
    return {"down_s": up - stopped, "relist_s": relists,
            "pages": {a: p for a, (_, _, p) in lists.items()},
            "answered": len(times), "p99_ms": 1000 * percentile([t for _, t in times], 99),
            "max_ms": 1000 * max(t for _, t in times), "problems": problems}


def _holder(plane: ControlPlane, install: ChartInstall) -> str:
    assert plane.kube is not None
    return plane.kube.get(LEASE_PATH.format(install.namespace))["spec"].get("holderIdentity") or ""


def failover(plane: ControlPlane, install: ChartInstall, slow: DelayProxy, image_slow: str) -> dict:
    """As tests/e2e/test_scale.py: the replica made leader (the webhook the apiserver calls
    gives the Lease up and comes back), then killed with a gated pod waiting."""
    kube = plane.kube
    assert kube is not None and install.webhook is not None
    namespace = plane.new_namespace("failover")
    first = _holder(plane, install)
    replica = install.start_replica("archway-replica")
    stop_process(install.webhook.process)
    kube.wait_for(lambda: (h := _holder(plane, install)) and h != first, timeout=120,
                  what="the replica to lead")
    leader = _holder(plane, install)
    install.restart_webhook()
    mark = len(install.webhook.log(1000000))
    slow.delay = 5.0
    try:
        created = kube.create(pod_path(namespace), pod("gated", image_slow))
        if not created["spec"].get("schedulingGates"):
            raise RuntimeError("the pod was not gated")
        # The replica has learned what it learns before it is killed.
        learned = set(SYNCED.findall(replica.log(1000000).split(": leading", 1)[-1]))
        killed = time.monotonic()
        os.killpg(replica.process.pid, signal.SIGKILL)
        slow.delay = 0.0
        when: dict[str, float] = {}
        end = killed + 300
        while len(when) < 4 and time.monotonic() < end:
            now = time.monotonic() - killed
            if "lease" not in when and _holder(plane, install) not in ("", leader):
                when["lease"] = now
            got = kube.get(pod_path(namespace, "gated"))
            if "released" not in when and not got["spec"].get("schedulingGates"):
                when["released"] = now
            if "running" not in when and got["status"].get("phase") == "Running":
                when["running"] = now
            log = install.webhook.log(1000000)[mark:]
            if "learned" not in when and ": leading" in log and \
                    learned <= set(SYNCED.findall(log.split(": leading", 1)[1])):
                when["learned"] = now
            time.sleep(0.1)
    finally:
        slow.delay = 0.0
    return {"lease_s": install_lease(install), "when": when, "learned": sorted(learned)}


def install_lease(install: ChartInstall) -> float:
    return float((install.archway_config.get("admission") or {}).get("gate_lease_seconds", 15.0))


def schedule(plane: ControlPlane, install: ChartInstall, image: str) -> dict:
    go = PassAllExtender(plane.path("passall-extender"))
    try:
        races = race_rounds(plane, install, image, UNTHROTTLED, go=go)
    finally:
        go.stop()
    return {"rates": {name: rates(rs) for name, rs in races.items()},
            "polled": {name: [r.polled for r in rs] for name, rs in races.items()},
            "algorithm_ms": algorithm_means(races), "details": race_details(races)}
