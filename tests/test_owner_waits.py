"""Any pod's author may name a controller that never comes (issue 38, finding 7). `archway
serve` under gunicorn as the chart runs it (2 workers x 8 threads), an API stand-in serving the
workloads (lab/servers/apiserver.py) and a real registry: 50 pods naming made-up ReplicaSets,
admitted beside 50 pods of a real one, must not slow those down."""
import json
import os
import re
import sys
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests
import yaml

from archway.cluster.workloadcache import WorkloadCache
from archway.config import config_from_dict
from archway.kubeclient import api_client_factory
from archway.podview import PodView
from lab.procs import REPO, Server, free_port, wait_until
from lab.servers.apiserver import FakeApiServer
from lab.servers.registry import RegistryServer

FIXTURE = os.path.join(REPO, "tests", "fixtures", "admission", "v1-pod-multiarch.json")
PODS = 50
REAL_RS, REAL_UID = "web-5d8", "0b5a1e52-real-replicaset"
DEADLINE = 3.0   # archway's default: the API's share (0.4) is the 1.2 s a missing owner was given


@pytest.fixture(scope="module")
def webhook(tmp_path_factory):
    work = tmp_path_factory.mktemp("owner-waits")
    api = FakeApiServer()
    registry = RegistryServer(str(work / "registry"))
    server = None
    try:
        registry.push_index("archway/multi", "1.0", ["linux/amd64", "linux/arm64"])
        api.put("/api/v1/namespaces/shop/serviceaccounts/default",
                {"kind": "ServiceAccount", "apiVersion": "v1",
                 "metadata": {"name": "default", "namespace": "shop"}})
        api.put(f"/apis/apps/v1/namespaces/shop/replicasets/{REAL_RS}", {
            "kind": "ReplicaSet", "apiVersion": "apps/v1",
            "metadata": {"name": REAL_RS, "namespace": "shop", "uid": REAL_UID},
            "spec": {"selector": {"matchLabels": {"app": "web"}},
                     "template": {"spec": {"containers": [
                         {"name": "web", "image": f"{registry.host}/archway/multi:1.0"}]}}}})
        config = {"server": {"state_dir": str(work / "state"), "workers": 2, "threads": 8,
                             "log_every_admission": True},
                  "admission": {"deadline_seconds": DEADLINE},
                  "registry": {"insecure_hosts": [registry.host]},
                  "kubernetes": {"kubeconfig": api.kubeconfig(str(work))}}
        (work / "archway.yaml").write_text(yaml.safe_dump(config))
        port = free_port()
        server = Server([sys.executable, "-m", "archway.main.cli", "--config",
                         str(work / "archway.yaml"), "serve", "--bind", f"127.0.0.1:{port}"],
                        port=port, log_path=str(work / "serve.log"), cwd=REPO,
                        env=dict(os.environ, PROMETHEUS_MULTIPROC_DIR=str(work / "metrics")),
                        ready_timeout=30)
        yield Webhook(server, port, str(work / "state" / "tls" / "ca.crt"), registry.host)
    finally:
        if server is not None:
            server.stop()
        registry.stop()
        api.stop()


class Webhook:
    def __init__(self, server, port, cacert, registry_host):
        self.server, self.url, self.cacert = server, f"https://127.0.0.1:{port}", cacert
        with open(FIXTURE) as f:
            self.template = f.read().replace("REGISTRY", registry_host)
        self.wait_ready()

    def session(self) -> requests.Session:
        session = requests.Session()
        session.trust_env = False
        session.verify = self.cacert
        return session

    def wait_ready(self, timeout=30.0):
        end = time.monotonic() + timeout
        with self.session() as s:
            while time.monotonic() < end:
                try:
                    if s.get(self.url + "/readyz", timeout=2).status_code == 200:
                        return
                except requests.RequestException:
                    pass
                time.sleep(0.05)
        raise RuntimeError("archway serve never became ready:\n" + self.server.log())

    def review(self, owner: str, owner_uid: str) -> dict:
        review = json.loads(self.template)
        review["request"]["uid"] = str(uuid.uuid4())
        [reference] = review["request"]["object"]["metadata"]["ownerReferences"]
        reference.update(name=owner, uid=owner_uid)
        return review

    def admit(self, session: requests.Session, review: dict) -> None:
        answer = session.post(self.url + "/mutate", json=review, timeout=15)
        assert answer.status_code == 200, answer.text
        assert answer.json()["response"]["allowed"] is True

    def server_ms(self) -> dict[str, float]:
        """uid -> the admission's time in archway (from arrival, waiting for a thread included)."""
        with open(self.server.log_path, encoding="utf-8", errors="replace") as f:
            return {m.group(1): float(m.group(2)) for m in re.finditer(
                r"uid=(\S+) .*? ([0-9.]+) ms", f.read())}

    def metric(self, name: str, labels: str) -> float:
        with self.session() as s:
            text = s.get(self.url + "/metrics", timeout=5).text
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith(f"{name}{{{labels}}}"))


def _burst(webhook: Webhook, reviews: list[dict]) -> None:
    """All of `reviews` in flight at once, each on a keep-alive connection opened beforehand."""
    sessions = [webhook.session() for _ in reviews]
    try:
        with ThreadPoolExecutor(len(reviews)) as pool:
            list(pool.map(lambda s: s.get(webhook.url + "/readyz", timeout=10), sessions))
            list(pool.map(webhook.admit, sessions, reviews))
    finally:
        for session in sessions:
            session.close()


def test_pods_naming_made_up_controllers_do_not_slow_the_admission_of_others(webhook):
    # Warm: the image in every worker's cache, the workload caches synced.
    _burst(webhook, [webhook.review(REAL_RS, REAL_UID) for _ in range(16)])
    alone = [webhook.review(REAL_RS, REAL_UID) for _ in range(PODS)]
    _burst(webhook, alone)

    made_up = [webhook.review(f"web-{uuid.uuid4().hex[:10]}", str(uuid.uuid4()))
               for _ in range(PODS)]
    normal = [webhook.review(REAL_RS, REAL_UID) for _ in range(PODS)]
    mixed = [review for pair in zip(made_up, normal) for review in pair]
    started = time.monotonic()
    _burst(webhook, mixed)
    elapsed = time.monotonic() - started

    took = webhook.server_ms()
    uid = lambda review: review["request"]["uid"]  # noqa: E731
    alone_ms = sorted(took[uid(r)] for r in alone)
    normal_ms = sorted(took[uid(r)] for r in normal)
    made_up_ms = sorted(took[uid(r)] for r in made_up)
    report = (f"normal alone max {alone_ms[-1]:.0f} ms; beside made-up owners: normal p50 "
              f"{normal_ms[PODS // 2]:.1f} / max {normal_ms[-1]:.0f} ms, made-up p50 "
              f"{made_up_ms[PODS // 2]:.1f} / max {made_up_ms[-1]:.0f} ms; burst {elapsed:.1f} s")
    print(report)
    # A made-up owner was given 1.2 s: 50 of them in 16 threads held the others for seconds.
    assert normal_ms[-1] < 800 + alone_ms[-1], report
    assert normal_ms[PODS // 2] < 400 + alone_ms[PODS // 2], report
    # A few waited (at most 2 a worker at once), most were answered at once.
    assert made_up_ms[PODS // 2] < 800, report
    assert webhook.metric("archway_admission_owner_waits_total", 'result="busy"') > 0, report


def _wait(condition, what: str, timeout: float = 15.0) -> None:
    end = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < end, what
        time.sleep(0.02)


def _seconds_to_miss(workloads: WorkloadCache, name: str, timeout: float) -> float:
    pod = PodView.of({"metadata": {"namespace": "shop", "name": "p", "ownerReferences": [
        {"kind": "ReplicaSet", "name": name, "uid": str(uuid.uuid4()), "controller": True}]}})
    started = time.monotonic()
    assert workloads.top_of(pod, timeout=timeout) is None
    return time.monotonic() - started


def test_no_admission_waits_for_a_controller_while_the_workload_watch_is_not_following(tmp_path):
    """While a watch fails and retries (or lists again) nothing it would bring arrives sooner:
    an admission does not wait for it then."""
    api = FakeApiServer()
    settings = config_from_dict({"kubernetes": {"kubeconfig": api.kubeconfig(str(tmp_path))}})
    workloads = WorkloadCache(api_client_factory(settings.kubernetes), kinds=("ReplicaSet",),
                              watch_timeout_seconds=1, max_backoff_seconds=1)
    try:
        workloads.ensure_started()
        _wait(lambda: workloads.current, "the ReplicaSet watch never followed the API")
        assert _seconds_to_miss(workloads, "made-up-1", 0.4) >= 0.4
        api.faults["/apis/apps/v1/replicasets"] = 500   # the next watch (within 1 s) fails
        _wait(lambda: not workloads.current, "the failing watch was still taken as following")
        assert _seconds_to_miss(workloads, "made-up-2", 5.0) < 0.3
        del api.faults["/apis/apps/v1/replicasets"]
        _wait(lambda: workloads.current, "the watch never followed the API again")
        assert _seconds_to_miss(workloads, "made-up-3", 0.4) >= 0.4
    finally:
        workloads.stop()
        api.stop()


def test_ghost_owners_cannot_take_the_waits_kept_for_a_rollouts_new_replicaset(tmp_path):
    """Finding 7 of hardening round 6: while pods naming ghost ReplicaSets hold every wait, a
    rollout's pods (their ReplicaSet named after a Deployment the cache holds) still wait for
    it, and find it when the watch brings it."""
    api = FakeApiServer()
    try:
        apps = "/apis/apps/v1/namespaces/shop"
        deployment = api.put(f"{apps}/deployments/web", {
            "apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "web"},
            "spec": {"selector": {"matchLabels": {"app": "web"}}}})
        config = config_from_dict({"kubernetes": {"kubeconfig": api.kubeconfig(str(tmp_path))}})
        cache = WorkloadCache(api_client_factory(config.kubernetes), waits_at_once=1)
        cache.ensure_started()
        assert cache.wait_synced(30)

        def pod(owner: str, uid: str) -> PodView:
            return PodView.of({"metadata": {"name": "p", "namespace": "shop", "labels": {"app": "web"},
                                            "ownerReferences": [{"apiVersion": "apps/v1",
                                                                 "kind": "ReplicaSet", "name": owner,
                                                                 "uid": uid, "controller": True}]},
                               "spec": {"containers": [{"name": "c", "image": "x"}]}})
        busy_before = _owner_waits("busy")
        with ThreadPoolExecutor(4) as pool:
            ghosts = [pool.submit(cache.top_of, pod(f"ghost-{i}", f"g{i}"), 8.0) for i in range(3)]
            # One ghost holds the one wait, the other two were refused it.
            wait_until(lambda: _owner_waits("busy") - busy_before >= 2, timeout=10,
                       what="the ghosts' waits taken")
            rollout = pool.submit(cache.top_of, pod("web-7d9f8c", "rs-uid"), 5.0)
            api.put(f"{apps}/replicasets/web-7d9f8c", {
                "apiVersion": "apps/v1", "kind": "ReplicaSet", "metadata": {
                    "name": "web-7d9f8c", "uid": "rs-uid", "ownerReferences": [{
                        "apiVersion": "apps/v1", "kind": "Deployment", "name": "web",
                        "uid": deployment["metadata"]["uid"], "controller": True}]},
                "spec": {"selector": {"matchLabels": {"app": "web"}}}})
            top = rollout.result(timeout=10)
            assert top is not None and top.name == "shop/web"
            assert [g.result(timeout=10) for g in ghosts] == [None, None, None]
        cache.stop()
    finally:
        api.stop()


def _owner_waits(result: str) -> float:
    from prometheus_client import REGISTRY
    return REGISTRY.get_sample_value("archway_admission_owner_waits_total", {"result": result}) or 0.0
