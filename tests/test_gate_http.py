"""Gate on a miss, end to end: a real `archway serve` (gunicorn workers + the gate controller
process), a real docker-registry behind a fault-injecting proxy, and the stand-in kube-apiserver
that validates every pod update as the real one does (KEP-3838) and serves the pod watch, the
Lease and Events. The test plays the apiserver's part in pod creation: it posts the
AdmissionReview, applies the webhook's patch and stores the pod."""
import base64
import json
import os
import re
import sys
import threading
import time
import uuid

import jsonpatch
import kubernetes_validate
import pytest
import requests
import yaml

from archway.webhook.gate import GATE, GATED_LABEL
from archway.webhook.lease import lease_path, parse_time
from tests.infra.apiserver import FakeApiServer
from tests.infra.procs import REPO, Server, free_port, wait_until
from tests.infra.proxy import DelayProxy
from tests.infra.registry import RegistryServer

pytestmark = pytest.mark.slow

NS = "team-a"
LEASE_NS = "archway"
DEADLINE = 1.0           # admission.deadline_seconds
GATE_MAX = 8.0           # admission.gate_max_seconds
LEASE = 3.0              # admission.gate_lease_seconds
SLOW = 2.5               # the proxy's delay per response chunk when the registry is "slow"
ARCH = "kubernetes.io/arch"
EVENTS = f"/apis/events.k8s.io/v1/namespaces/{NS}/events/"


class Archway:
    """One `archway serve` replica."""

    def __init__(self, config_path, workdir, name):
        self.port = free_port()
        self.log_path = str(workdir / f"{name}.log")
        env = dict(os.environ, PROMETHEUS_MULTIPROC_DIR=str(workdir / f"metrics-{name}"))
        self.server = Server([sys.executable, "-m", "archway.cli", "--config", str(config_path),
                              "serve", "--bind", f"127.0.0.1:{self.port}"], port=self.port,
                             log_path=self.log_path, cwd=REPO, env=env, ready_timeout=30)
        self.url = f"https://127.0.0.1:{self.port}"
        self.session = requests.Session()
        self.session.trust_env = False
        self.session.verify = str(workdir / "state" / "tls" / "ca.crt")

    def log(self) -> str:
        with open(self.log_path, encoding="utf-8", errors="replace") as f:
            return f.read()

    def metric(self, name: str, **labels) -> float:
        text = self.session.get(self.url + "/metrics", timeout=5).text
        wanted = ",".join(f'{k}="{v}"' for k, v in labels.items())
        pattern = re.escape(name) + (r"\{" + re.escape(wanted) + r"\}" if wanted else "") + r" (\S+)"
        found = re.search("^" + pattern + "$", text, re.MULTILINE)
        return float(found.group(1)) if found else 0.0

    def gates_now(self) -> bool:
        """Every worker sees a fresh Lease (several answers in a row from any worker)."""
        for _ in range(6):
            try:
                facts = self.session.get(self.url + "/readyz", timeout=5).json()
            except requests.RequestException:
                return False  # workers still booting on a busy machine
            if facts.get("gate_controller") != "leader alive":
                return False
        return True

    def stop(self):
        self.server.stop()


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    stack = []
    try:
        registry = RegistryServer(tmp_path_factory.mktemp("registry"))
        stack.append(registry)
        for tag in ("slow", "other-gate", "deleted", "replica-1", "replica-2", "bench"):
            registry.push_index("archway/multi", tag, ["linux/amd64", "linux/arm64"])
        registry.push_image("archway/arm64only", "1.0", "linux/arm64")
        registry.push_image("archway/amd64only", "1.0", "linux/amd64")
        slow = DelayProxy(registry.port)      # the registry as archway reaches it, slowed at will
        stack.append(slow)
        down = DelayProxy(registry.port, hang=True)   # a registry that never answers
        stack.append(down)
        api = FakeApiServer()
        stack.append(api)
        api.put(f"/api/v1/namespaces/{NS}/serviceaccounts/default", {
            "apiVersion": "v1", "kind": "ServiceAccount",
            "metadata": {"name": "default", "namespace": NS}})
        workdir = tmp_path_factory.mktemp("archway")
        config = {
            "server": {"state_dir": str(workdir / "state"), "workers": 2, "threads": 4,
                       "log_every_admission": True},
            "admission": {"deadline_seconds": DEADLINE, "unresolved": "gate",
                          "gate_max_seconds": GATE_MAX, "gate_lease_seconds": LEASE},
            "registry": {"insecure_hosts": [registry.host, slow.host, down.host],
                         "timeout_seconds": 1.5},
            "kubernetes": {"kubeconfig": api.kubeconfig(str(workdir)), "namespace": LEASE_NS},
        }
        config_path = workdir / "archway.yaml"
        config_path.write_text(yaml.safe_dump(config))
        first = Archway(config_path, workdir, "first")
        w = World(api=api, registry=registry, slow=slow, down=down, replicas=[first],
                  config_path=config_path, workdir=workdir)
        stack.append(Replicas(w))
        wait_until(first.gates_now, 30, "the gate controller to lead")
        yield w
        for replica in w.all:
            log = replica.log()
            assert "Traceback" not in log and "Error handling request" not in log, log[-6000:]
    finally:
        for item in reversed(stack):
            item.stop()


class Replicas:
    """Stops every replica a test started (the first is stopped by its test, or here)."""

    def __init__(self, world):
        self.world = world

    def stop(self):
        for replica in self.world.replicas:
            replica.stop()


class World:
    def __init__(self, **parts):
        self.__dict__.update(parts)
        self.all = list(self.replicas)   # every replica ever started, for the log check

    @property
    def archway(self) -> Archway:
        return self.replicas[0]

    def create_pod(self, name, *images, gates=(), owner=False):
        """What the apiserver does on a pod CREATE: the webhook's patch, then the pod stored."""
        pod = {"apiVersion": "v1", "kind": "Pod",
               "metadata": {"name": name, "namespace": NS, "labels": {"app": name}},
               "spec": {"containers": [{"name": f"c{i}", "image": image}
                                       for i, image in enumerate(images)]}}
        if gates:
            pod["spec"]["schedulingGates"] = [{"name": g} for g in gates]
        if owner:
            pod["metadata"]["ownerReferences"] = [{
                "apiVersion": "apps/v1", "kind": "ReplicaSet", "name": f"{name}-rs",
                "uid": str(uuid.uuid4()), "controller": True}]
        review = {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": {
            "uid": str(uuid.uuid4()), "kind": {"group": "", "version": "v1", "kind": "Pod"},
            "resource": {"group": "", "version": "v1", "resource": "pods"},
            "operation": "CREATE", "namespace": NS, "name": name, "object": pod,
            "userInfo": {"username": "system:serviceaccount:kube-system:replicaset-controller"}}}
        answer = self.archway.session.post(self.archway.url + "/mutate", json=review, timeout=10)
        assert answer.status_code == 200, answer.text
        response = answer.json()["response"]
        assert response["allowed"]
        if "patch" in response:
            pod = jsonpatch.apply_patch(pod, json.loads(base64.b64decode(response["patch"])))
        for version in ("1.30.0", "1.33.0"):
            kubernetes_validate.validate(pod, version, strict=True)
        self.api.put(self.path(name), pod)
        return response

    def path(self, name):
        return f"/api/v1/namespaces/{NS}/pods/{name}"

    def pod(self, name):
        return self.api.get(self.path(name))

    def events(self, name):
        return [e for p, e in list(self.api.objects.items())
                if p.startswith(EVENTS) and e["regarding"].get("name") == name]


def gates(pod):
    return [g["name"] for g in pod["spec"].get("schedulingGates", [])]


def released(world, name):
    pod = world.pod(name)
    return pod if pod is not None and GATE not in gates(pod) else None


@pytest.fixture(autouse=True)
def nothing_rejected(world):
    yield
    assert world.api.rejections == [], world.api.rejections


def test_slow_registry_gates_then_the_pod_is_placed_and_released(world):
    world.slow.delay = SLOW
    try:
        response = world.create_pod("slow", f"{world.slow.host}/archway/multi:slow")
        assert any("waits (SchedulingGated)" in w for w in response["warnings"])
        pod = world.pod("slow")
        assert gates(pod) == [GATE] and pod["metadata"]["labels"][GATED_LABEL] == "true"
        assert ARCH not in json.dumps(pod["spec"])
        # While the registry stays slow the controller cannot resolve: the pod stays gated.
        wait_until(lambda: world.archway.metric("archway_gated_pods") == 1, 10, "the gauge")
        assert GATE in gates(world.pod("slow"))
    finally:
        world.slow.delay = 0.0
    pod = wait_until(lambda: released(world, "slow"), 10, "the release")
    assert pod["spec"]["affinity"]["nodeAffinity"][
        "requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"] == [
        {"matchExpressions": [{"key": ARCH, "operator": "In", "values": ["amd64", "arm64"]}]}]
    assert "schedulingGates" not in pod["spec"] and GATED_LABEL not in pod["metadata"]["labels"]
    assert pod["metadata"]["annotations"]["archway.dev/architectures"] == "amd64,arm64"
    events = wait_until(lambda: world.events("slow"), 5, "the Placed Event")
    assert [(e["type"], e["reason"]) for e in events] == [("Normal", "Placed")]
    assert "amd64, arm64" in events[0]["note"] and "waiting" in events[0]["note"]
    assert world.archway.metric("archway_gate_releases_total", outcome="placed") >= 1
    assert world.archway.metric("archway_gate_wait_seconds_count") >= 1


def test_registry_down_for_good_releases_after_gate_max_seconds_with_a_warning(world):
    world.create_pod("down", f"{world.down.host}/archway/multi:1.0", owner=True)
    start = time.monotonic()
    assert GATE in gates(world.pod("down"))
    pod = wait_until(lambda: released(world, "down"), GATE_MAX + 10, "the release at gate_max")
    assert time.monotonic() - start >= GATE_MAX - 1.0   # creationTimestamp has 1 s granularity
    assert ARCH not in json.dumps(pod["spec"])
    events = wait_until(lambda: world.events("down"), 5, "the Warning Event")
    assert [(e["type"], e["reason"]) for e in events] == [("Warning", "ReleasedUnplaced")]
    assert f"{world.down.host}/archway/multi:1.0" in events[0]["note"]
    assert world.archway.metric("archway_gate_releases_total", outcome="unplaced") == 1


def test_a_gated_pod_deleted_before_release_is_forgotten(world):
    world.slow.delay = SLOW
    try:
        world.create_pod("deleted", f"{world.slow.host}/archway/multi:deleted")
        assert GATE in gates(world.pod("deleted"))
        world.api.requests.clear()
        world.api.delete(world.path("deleted"))
        wait_until(lambda: world.archway.metric("archway_gate_releases_total", outcome="deleted"),
                 10, "the deletion to be seen")
    finally:
        world.slow.delay = 0.0
    assert world.api.count("PUT", world.path("deleted")) == 0
    assert world.events("deleted") == []


def test_another_controllers_gate_is_kept(world):
    world.slow.delay = SLOW
    try:
        world.create_pod("other-gate", f"{world.slow.host}/archway/multi:other-gate",
                         gates=("example.com/quota",))
        assert gates(world.pod("other-gate")) == ["example.com/quota", GATE]
    finally:
        world.slow.delay = 0.0
    pod = wait_until(lambda: released(world, "other-gate"), 10, "the release")
    assert gates(pod) == ["example.com/quota"]


def test_no_common_architecture_keeps_the_pod_off_every_node(world):
    world.slow.delay = SLOW
    try:
        world.create_pod("never", f"{world.slow.host}/archway/amd64only:1.0",
                         f"{world.slow.host}/archway/arm64only:1.0")
    finally:
        world.slow.delay = 0.0
    pod = wait_until(lambda: released(world, "never"), 10, "the release")
    assert pod["spec"]["affinity"]["nodeAffinity"][
        "requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"] == [
        {"matchExpressions": [{"key": ARCH, "operator": "In",
                               "values": ["no-common-architecture"]}]}]
    events = wait_until(lambda: world.events("never"), 5, "the Warning Event")
    assert [(e["type"], e["reason"]) for e in events] == [("Warning", "NoCommonArchitecture")]
    assert "amd64only:1.0 (amd64)" in events[0]["note"]
    assert "arm64only:1.0 (arm64)" in events[0]["note"]


def test_two_replicas_one_leader_and_takeover_when_it_stops(world):
    first = world.archway
    second = Archway(world.config_path, world.workdir, "second")
    world.replicas.append(second)
    world.all.append(second)
    wait_until(second.gates_now, 30, "the second replica to see the leader")
    holder = world.api.get(lease_path(LEASE_NS))["spec"]["holderIdentity"]
    assert first.log().count("gate controller") and ": leading" in first.log()
    assert ": leading" not in second.log()
    world.slow.delay = SLOW
    try:
        world.create_pod("replica-1", f"{world.slow.host}/archway/multi:replica-1")
    finally:
        world.slow.delay = 0.0
    wait_until(lambda: released(world, "replica-1"), 10, "the release by the first")
    assert f"{NS}/replica-1" in first.log() and f"{NS}/replica-1" not in second.log()

    seen = []   # (holder, renewTime, acquireTime) as the Lease changes, read every 50 ms
    watching = threading.Event()

    def watch_lease():
        while not watching.is_set():
            spec = world.api.get(lease_path(LEASE_NS))["spec"]
            seen.append((spec["holderIdentity"], spec["renewTime"], spec["acquireTime"]))
            time.sleep(0.05)

    watcher = threading.Thread(target=watch_lease, daemon=True)
    watcher.start()
    first.stop()
    world.replicas.remove(first)
    try:
        wait_until(lambda: seen[-1][0] not in ("", holder), LEASE + 5, "the takeover")
    finally:
        watching.set()
        watcher.join()
    last_renewal = max(parse_time(renewed) for who, renewed, _ in seen if who == holder)
    taken = parse_time(seen[-1][2])
    assert taken - last_renewal <= LEASE, seen   # within one Lease duration
    assert ": leading" in second.log()
    wait_until(second.gates_now, 10, "the second replica's workers to see the new leader")
    world.slow.delay = SLOW
    try:
        world.create_pod("replica-2", f"{world.slow.host}/archway/multi:replica-2")
        assert GATE in gates(world.pod("replica-2"))
    finally:
        world.slow.delay = 0.0
    wait_until(lambda: released(world, "replica-2"), 10, "the release by the second")
    assert f"{NS}/replica-2" in second.log()
