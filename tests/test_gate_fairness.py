"""The gate controller is fair to registry hosts and namespaces (issue 30, finding 2), and lets go
at once of a pod whose images can never be read (finding 6).

fairqueue's order and caps, pure; then the controller's own process (`python -m
archway.gate.process`, as `archway serve` starts it) against a real control plane of this
module's own and a real registry, with a proxy in front of it that accepts connections and never
answers (a registry that hangs)."""
import pickle
import subprocess
import sys
import threading
import time
import uuid
from collections import Counter

import pytest
from hypothesis import given
from hypothesis import strategies as st

from archway.config import config_from_dict
from archway.errors import DeadlineExceeded, HostRefused, NotFound, TransportError
from archway.gate.fairqueue import Candidate, FairShare, Limits, choose, heard
from archway.registry.model import ImageInfo
from archway.registry.platforms import parse_platform
from archway.vocabulary import ARCH_LABEL, GATE, GATED_LABEL
from lab.kube import KubeError
from lab.procs import wait_until

LIMITS = Limits(per_host=4, per_failing_host=2)


def candidates(namespace: str, host: str, count: int, *, start: int = 0, **kwargs):
    return [Candidate(f"{namespace}-{host}-{i}", namespace, frozenset({host}), (0.0, start + i),
                      **kwargs) for i in range(count)]


def pick(waiting, slots=8, running_hosts=(), running_namespaces=(), failing=frozenset()):
    return choose(waiting, slots=slots, limits=LIMITS, running_hosts=Counter(running_hosts),
                  running_namespaces=Counter(running_namespaces), failing=failing)


# --- the order, pure ------------------------------------------------------------------------------

def test_a_host_that_hangs_holds_only_its_share_of_the_threads():
    stalled = candidates("a", "stalled", 100)
    healthy = candidates("b", "healthy", 10, start=1000)    # arrived after all of them
    first = pick(stalled + healthy)
    assert Counter(c.namespace for c in first) == {"a": 4, "b": 4}
    # Its lookups got no answer: from then on it holds at most two threads, behind B's pods.
    rest = [c for c in stalled + healthy if c not in first]
    later = pick(rest, running_hosts={"stalled": 1, "healthy": 2}, failing={"stalled"})
    assert [c.namespace for c in later] == ["b", "b", "a"]


def test_pods_of_answering_hosts_go_before_those_of_silent_ones():
    silent = candidates("a", "silent", 1)
    answering = candidates("a", "answering", 1, start=5)   # due later
    assert [c.key for c in pick(silent + answering, slots=1, failing={"silent"})] == [
        answering[0].key]
    assert [c.key for c in pick(silent + answering, slots=1)] == [silent[0].key]


def test_one_namespaces_backlog_does_not_sit_ahead_of_anothers_on_the_same_host():
    backlog = candidates("a", "shared", 100)
    late = candidates("b", "shared", 3, start=1000)
    chosen = pick(backlog + late, slots=4)
    assert [c.namespace for c in chosen] == ["a", "b", "a", "b"]
    # b already has two pods running: a's turn first, then the fewest-running namespace again.
    chosen = pick(backlog + late, slots=2, running_namespaces={"b": 2})
    assert [c.namespace for c in chosen] == ["a", "a"]


def test_an_expired_pod_goes_first_whatever_its_host_is_holding():
    stalled = candidates("a", "stalled", 3)
    expired = candidates("a", "stalled", 1, start=100, expired=True)
    chosen = pick(stalled + expired, slots=2, running_hosts={"stalled": 2}, failing={"stalled"})
    assert [c.key for c in chosen] == [expired[0].key]


@given(st.lists(st.tuples(st.sampled_from("abc"), st.sets(st.sampled_from("xyz"), max_size=2),
                          st.booleans(), st.booleans()), max_size=40),
       st.integers(0, 8), st.sets(st.sampled_from("xyz")))
def test_choose_keeps_its_caps_and_leaves_no_free_thread_idle_that_a_pod_could_use(
        pods, slots, failing):
    waiting = [Candidate(str(i), ns, frozenset(hosts), (float(late), i), expired)
               for i, (ns, hosts, expired, late) in enumerate(pods)]
    chosen = pick(waiting, slots=slots, failing=failing)
    assert len(chosen) <= slots and len({c.key for c in chosen}) == len(chosen)
    load = Counter(h for c in chosen if not c.expired for h in c.hosts)
    for host, count in load.items():
        assert count <= (LIMITS.per_failing_host if host in failing else LIMITS.per_host)
    if len(chosen) < slots:   # every pod left out would break a cap
        held = Counter(h for c in chosen for h in c.hosts)
        for c in waiting:
            if c not in chosen:
                assert not c.expired and any(held[h] >= (
                    LIMITS.per_failing_host if h in failing else LIMITS.per_host)
                    for h in c.hosts)
    # expired pods first, then pods of answering hosts before those of silent ones
    ranks = [(not c.expired, bool(c.hosts & failing)) for c in chosen]
    assert ranks == sorted(ranks)


def test_what_the_controller_hears_from_a_try():
    arm = ImageInfo("x", frozenset({parse_platform("linux/arm64")}), None, "oci")
    answered, silent = heard({
        "up.example/a:1": arm, "gone.example/b:1": NotFound("404", status=404),
        "hung.example/c:1": DeadlineExceeded("no answer"), "down.example/d:1": TransportError("refused"),
        "up.example/e:1": DeadlineExceeded("slow"), "none.example/f:1": None,
        "169.254.169.254/g:1": HostRefused("link-local")})
    assert answered == {"up.example", "gone.example"}
    assert silent == {"hung.example", "down.example", "none.example"}


def test_fair_share_counts_threads_and_says_which_hosts_are_back():
    share = FairShare(threads=8)
    assert share.limits == Limits(per_host=4, per_failing_host=2)
    started = share.start(candidates("a", "reg.example", 10))
    assert len(started) == 4 and share.running == 4 and share.hosts == {"reg.example": 4}
    for c in started:
        share.finish(c.hosts, c.namespace)
    assert share.running == 0 and not share.hosts and not share.namespaces
    assert share.heard({"reg.example/x:1": DeadlineExceeded("no answer")}, set) == frozenset()
    assert share.silent == {"reg.example"}
    arm = ImageInfo("x", frozenset({parse_platform("linux/arm64")}), None, "oci")
    assert share.heard({"reg.example/x:1": arm}, set) == {"reg.example"}
    assert share.silent == set()
    for n in range(100):   # hosts nobody waits on any more are forgotten
        share.heard({f"h{n}.example/x:1": DeadlineExceeded("no answer")}, lambda: {"h99.example"})
    assert len(share.silent) <= 65 and "h99.example" in share.silent


# --- the controller's process on a real control plane ------------------------------------------

GATE_MAX = 120.0


@pytest.fixture(scope="module")
def plane(tmp_path_factory):
    from lab.cluster.controlplane import ControlPlane
    with ControlPlane(str(tmp_path_factory.mktemp("fair-plane"))) as plane:
        for namespace in ("archway", "tenant-a", "tenant-b"):
            plane.new_namespace(namespace)
        yield plane


@pytest.fixture(scope="module")
def registries(tmp_path_factory):
    """A real registry, and a proxy in front of it that takes connections and never answers."""
    from lab.servers.proxy import DelayProxy
    from lab.servers.registry import RegistryServer
    registry = RegistryServer(tmp_path_factory.mktemp("fair-registry"))
    stalled = DelayProxy(registry.port, hang=True)
    yield registry, stalled
    stalled.stop()
    registry.stop()


@pytest.fixture(scope="module")
def controller(plane, registries, tmp_path_factory):
    """The gate controller's process as `archway serve` starts it (archway.server.supervisor):
    8 threads, registry.timeout_seconds 5 s (the defaults), gate_max_seconds 120 s."""
    registry, stalled = registries
    config = config_from_dict({
        "admission": {"unresolved": "gate", "gate_max_seconds": GATE_MAX,
                      "gate_lease_seconds": 3},
        "registry": {"insecure_hosts": [registry.host, stalled.host]},
        "kubernetes": {"kubeconfig": plane.admin_kubeconfig, "namespace": "archway"}})
    log_path = str(tmp_path_factory.mktemp("fair-controller") / "controller.log")
    with open(log_path, "wb") as log:
        process = subprocess.Popen([sys.executable, "-P", "-m", "archway.gate.process"],
                                   stdin=subprocess.PIPE, stderr=log)
    process.stdin.write(pickle.dumps(config))
    process.stdin.close()
    wait_until(lambda: "leading" in open(log_path).read(), 30, "the controller to lead")
    yield log_path
    process.terminate()
    try:
        process.wait(15)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait(5)


def gated_pod(name: str, namespace: str, *images: str) -> dict:
    """A pod as the webhook admits it on a miss: archway's gate and label."""
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": namespace, "labels": {GATED_LABEL: "true"}},
            "spec": {"schedulingGates": [{"name": GATE}],
                     "containers": [{"name": f"c{i}", "image": image}
                                    for i, image in enumerate(images)]}}


def create(plane, pod: dict) -> dict:
    return plane.kube.create(f"/api/v1/namespaces/{pod['metadata']['namespace']}/pods", pod)


def still_gated(plane, namespace: str) -> set[str]:
    return {p["metadata"]["name"] for p in plane.kube.items(
        f"/api/v1/namespaces/{namespace}/pods", labelSelector=GATED_LABEL)}


def archway_events(plane, namespace: str, name: str) -> list[dict]:
    return [e for e in plane.kube.items(f"/apis/events.k8s.io/v1/namespaces/{namespace}/events")
            if e["regarding"].get("name") == name
            and e.get("reportingController") == "archway.dev/archway"]


class Releases:
    """Notes when each pod of `namespace` is first seen without archway's label, while the test
    creates them (reads every 50 ms)."""

    def __init__(self, plane, namespace: str, seen: dict):
        self.plane, self.namespace, self.seen = plane, namespace, seen
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._watch, daemon=True)

    def _watch(self) -> None:
        while not self.stop.wait(0.05):
            try:
                pods = self.plane.kube.items(f"/api/v1/namespaces/{self.namespace}/pods")
            except (KubeError, OSError):   # a busy apiserver: read again
                continue
            for pod in pods:
                name = pod["metadata"]["name"]
                if name not in self.seen and GATED_LABEL not in pod["metadata"].get("labels", {}):
                    self.seen[name] = time.monotonic()

    def __enter__(self) -> "Releases":
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join(10)


def tail(path: str) -> str:
    with open(path, encoding="utf-8", errors="replace") as f:
        return "".join(f.readlines()[-40:])


def delete_pods(plane, namespace: str) -> None:
    for item in plane.kube.items(f"/api/v1/namespaces/{namespace}/pods"):
        plane.kube.delete(f"/api/v1/namespaces/{namespace}/pods/{item['metadata']['name']}",
                          gracePeriodSeconds=0)


@pytest.mark.slow
def test_pods_of_a_healthy_registry_are_released_while_another_tenants_registry_hangs(
        plane, registries, controller):
    """Issue 30, finding 2: 100 gated pods of namespace A on a registry that hangs held every
    one of the controller's threads (8, each waiting up to registry.timeout_seconds): B's pods,
    on a registry that answers at once, were released after 48 s instead of 0.4 s."""
    registry, stalled = registries
    run = uuid.uuid4().hex[:6]
    try:
        for i in range(100):
            create(plane, gated_pod(f"a-{i}", "tenant-a", f"{stalled.host}/a/app:{run}-{i}"))
        # The controller is on them: its lookups hang on the stalled registry.
        wait_until(lambda: stalled.connections >= 4, 30, "lookups on the stalled registry")
        tags = [f"{run}-{i}" for i in range(10)]
        for tag in tags:    # tags nobody read yet: each is a lookup at the registry
            registry.push_image("b/app", tag, "linux/arm64")
        created, released = {}, {}
        with Releases(plane, "tenant-b", released):
            for tag in tags:
                create(plane, gated_pod(f"b-{tag}", "tenant-b", f"{registry.host}/b/app:{tag}"))
                created[f"b-{tag}"] = time.monotonic()
            wait_until(lambda: released.keys() >= created.keys(), 60, "B's pods released")
        after = {name: round(released[name] - created[name], 1) for name in created}
        # The target is 2 s (0.4-0.8 s measured on a quiet machine); a loaded one takes longer
        # for every release, backlog or not. Without fairness it took 48 s.
        assert max(after.values()) <= 5.0, (after, tail(controller))
        for pod in plane.kube.items("/api/v1/namespaces/tenant-b/pods"):
            assert pod["spec"]["nodeSelector"] == {ARCH_LABEL: "arm64"}
        assert len(still_gated(plane, "tenant-a")) == 100   # still waiting for theirs
    finally:
        delete_pods(plane, "tenant-a")
        delete_pods(plane, "tenant-b")


@pytest.mark.slow
def test_a_pod_whose_images_can_never_be_read_is_released_at_once_with_the_reason(
        plane, registries, controller):
    """Issue 30, finding 6: a reference that can never resolve (a metadata address, an invalid
    reference) held its pod gated for the whole gate_max_seconds; the Event's note kept the
    reference's raw CR/LF. A registry that hangs still keeps its pod gated."""
    registry, stalled = registries
    registry.push_image("b/app", "multi", "linux/arm64")
    forged = f"{registry.host}/b/app\r\nNormal Placed placed on amd64:1"
    pods = {"metadata-address": "169.254.169.254/app:1", "metadata-name":
            "metadata.google.internal/app:1", "forged": forged}
    try:
        start = time.monotonic()
        for name, image in pods.items():
            create(plane, gated_pod(name, "tenant-a", f"{registry.host}/b/app:multi", image))
        create(plane, gated_pod("hung", "tenant-a", f"{stalled.host}/b/app:1"))
        wait_until(lambda: still_gated(plane, "tenant-a") == {"hung"}, 30,
                   "the pods that can never be read to be released")
        assert time.monotonic() - start < 20 < GATE_MAX
        for name in pods:
            pod = plane.kube.get(f"/api/v1/namespaces/tenant-a/pods/{name}")
            assert pod["spec"]["nodeSelector"] == {ARCH_LABEL: "arm64"}
            (event,) = wait_until(lambda name=name: archway_events(plane, "tenant-a", name), 15,
                                  f"the Event on {name}")
            assert (event["type"], event["reason"]) == ("Warning", "ReleasedUnplaced")
            assert event["note"].startswith("released at once (an image can never be read)")
            assert "\r" not in event["note"] and "\n" not in event["note"]
        notes = {name: archway_events(plane, "tenant-a", name)[0]["note"] for name in pods}
        assert ("169.254.169.254/app:1: refused by policy: metadata service"
                in notes["metadata-address"])
        assert (f"{registry.host}/b/app\\r\\nNormal Placed placed on amd64:1: invalid image "
                "reference") in notes["forged"]
    finally:
        delete_pods(plane, "tenant-a")
