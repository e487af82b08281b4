"""Gating: the webhook's gate patch and the one release update a gated pod accepts (KEP-3838),
pure and checked against ValidatePodUpdate's rules (lab/servers/kubevalidation.py, fast enough
for hypothesis; tests/e2e proves the same releases against the real apiserver); the Lease
elector and observer, Events and release-all against a real apiserver of this module's own; the
stand-in for the faults it cannot be made to produce (a 503, a 410 relist, 1.26's validation)."""
import copy
import re

import jsonpatch
import kubernetes_validate
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from archway.cluster.events import event
from archway.config import KubernetesSettings, config_from_dict
from archway.errors import (
    DeadlineExceeded,
    HostRefused,
    InvalidReference,
    NotFound,
    RegistryError,
    TransportError,
)
from archway.gate import release as gate
from archway.gate.release import plan_release
from archway.kubeapi import KubeApi
from archway.kubeclient import build_api_client
from archway.lease import LeaderElector, LeaseObserver, lease_path
from archway.placement.decision import decide
from archway.placement.patches import NO_ARCHITECTURE, gate_patch
from archway.placement.policy import Policy
from archway.podview import PodView
from archway.registry.model import ImageInfo
from archway.registry.platforms import parse_platform
from archway.vocabulary import ARCH_LABEL, GATE, GATED_LABEL
from lab.clock import ManualClock
from lab.procs import wait_until
from lab.servers.apiserver import FakeApiServer
from lab.servers.kubevalidation import validate_event_create, validate_pod_update

# Starts real servers (registries, archway serve, helm...): outside the fast inner loop.
pytestmark = pytest.mark.slow

REQ = "requiredDuringSchedulingIgnoredDuringExecution"
SCHEMA_VERSIONS = ("1.30.0", "1.33.0")


def info(image, *platforms):
    return ImageInfo(image, frozenset(parse_platform(p) for p in platforms), None, "oci-index")


def pod(*images, gates=("other.example/quota", GATE), node_selector=None, affinity=None,
        labels=None, scheduler="default-scheduler"):
    spec = {"containers": [{"name": f"c{i}", "image": im} for i, im in enumerate(images)],
            "schedulerName": scheduler, "tolerations": [{"key": "a", "operator": "Exists"}]}
    if gates:
        spec["schedulingGates"] = [{"name": g} for g in gates]
    if node_selector is not None:
        spec["nodeSelector"] = node_selector
    if affinity is not None:
        spec["affinity"] = affinity
    meta = {"name": "p", "namespace": "team", "uid": "u1", "resourceVersion": "7",
            "creationTimestamp": "2026-01-01T00:00:00Z",
            "labels": dict(labels or {}, **{GATED_LABEL: "true"})}
    return {"apiVersion": "v1", "kind": "Pod", "metadata": meta, "spec": spec,
            "status": {"phase": "Pending"}}


def required(*terms):
    return {"nodeAffinity": {REQ: {"nodeSelectorTerms": list(terms)}}}


def arch_in(*values):
    return {"key": ARCH_LABEL, "operator": "In", "values": list(values)}


AMD = info("reg/amd:1", "linux/amd64")
MULTI = info("reg/multi:1", "linux/amd64", "linux/arm64")
ARM = info("reg/arm:1", "linux/arm64")
DOWN = TransportError("reg/down:1: connection refused")


def check_release(old, release):
    """The update the apiserver must accept, and a schema-valid pod."""
    assert validate_pod_update(old, release.pod) == []
    for version in SCHEMA_VERSIONS:
        kubernetes_validate.validate(release.pod, version, strict=True)
    assert GATE not in [g["name"] for g in release.pod["spec"].get("schedulingGates", [])]
    assert GATED_LABEL not in release.pod["metadata"].get("labels", {})


# --- the stand-in's validation is the real server's --------------------------------------------

def test_validation_rejects_what_the_real_server_rejects():
    old = pod("reg/amd:1", node_selector={"disk": "ssd"}, affinity=required({"matchExpressions": [
        {"key": "zone", "operator": "In", "values": ["a"]}]}))
    cases = {
        "spec.schedulingGates[2].name": lambda p: p["spec"]["schedulingGates"].append(
            {"name": "new.example/gate"}),
        "spec.nodeSelector": lambda p: p["spec"]["nodeSelector"].update(disk="hdd"),
        f"spec.affinity.nodeAffinity.{REQ}.nodeSelectorTerms": lambda p: p["spec"]["affinity"][
            "nodeAffinity"][REQ]["nodeSelectorTerms"].append({"matchExpressions": [arch_in("x")]}),
        f"spec.affinity.nodeAffinity.{REQ}.nodeSelectorTerms[0]": lambda p: p["spec"]["affinity"][
            "nodeAffinity"][REQ]["nodeSelectorTerms"][0]["matchExpressions"][0].update(values=["b"]),
        "spec": lambda p: p["spec"].update(schedulerName="other"),
        "spec.tolerations": lambda p: p["spec"].update(tolerations=[]),
        "metadata.uid": lambda p: p["metadata"].update(uid="u2"),
    }
    for field, change in cases.items():
        new = copy.deepcopy(old)
        change(new)
        assert field in [e.field for e in validate_pod_update(old, new)], field


def test_validation_allows_what_kep_3838_allows_only_while_gated():
    old = pod("reg/amd:1", node_selector={"disk": "ssd"}, affinity=required(
        {"matchExpressions": [{"key": "zone", "operator": "In", "values": ["a"]}]}))
    new = copy.deepcopy(old)
    new["spec"]["nodeSelector"][ARCH_LABEL] = "amd64"
    new["spec"]["affinity"]["nodeAffinity"][REQ]["nodeSelectorTerms"][0][
        "matchExpressions"].append(arch_in("amd64"))
    new["spec"]["schedulingGates"] = [{"name": "other.example/quota"}]
    new["spec"]["containers"][0]["image"] = "reg/amd:2"
    new["metadata"]["annotations"] = {"x": "y"}
    assert validate_pod_update(old, new) == []
    ungated = copy.deepcopy(old)
    del ungated["spec"]["schedulingGates"]
    placed = copy.deepcopy(ungated)
    placed["spec"]["nodeSelector"][ARCH_LABEL] = "amd64"
    assert [e.field for e in validate_pod_update(ungated, placed)] == ["spec"]
    # absent, null and empty lists are the same to the real server's semantic equality
    blank = copy.deepcopy(ungated)
    blank["spec"]["schedulingGates"] = []
    blank["spec"]["volumes"] = None
    assert validate_pod_update(ungated, blank) == []
    # before KEP-3838 (1.26): removing gates is all a gated pod may change
    assert [e.field for e in validate_pod_update(old, new, mutable_scheduling_directives=False)
            ] == ["spec"]
    only_gate = copy.deepcopy(old)
    only_gate["spec"]["schedulingGates"] = [{"name": "other.example/quota"}]
    assert validate_pod_update(old, only_gate, mutable_scheduling_directives=False) == []


# --- the webhook's gate -----------------------------------------------------------------------

def unplaced(view, policy):
    """The patch of the admission's decision while no image is known: what gate_patch takes."""
    return decide(view, {}, policy).patch


def test_gate_patch_appends_the_gate_keeps_others_and_sets_the_scheduler_now():
    created = pod("reg/amd:1", gates=("other.example/quota",), scheduler="")
    del created["metadata"]["labels"]
    view = PodView.of(created)
    patch = gate_patch(view, unplaced(view, Policy(scheduler_name="archway-scheduler")))
    gated = jsonpatch.apply_patch(created, list(patch))
    assert gated["spec"]["schedulingGates"] == [{"name": "other.example/quota"}, {"name": GATE}]
    assert gated["metadata"]["labels"] == {GATED_LABEL: "true"}
    assert gated["spec"]["schedulerName"] == "archway-scheduler"
    assert "nodeSelector" not in gated["spec"] and "affinity" not in gated["spec"]
    for version in SCHEMA_VERSIONS:
        kubernetes_validate.validate(gated, version, strict=True)
    regated = PodView.of(gated)
    assert gate_patch(regated, unplaced(regated, Policy())) == ()   # a reinvocation adds nothing


def test_gate_patch_adds_to_existing_labels():
    created = pod("reg/amd:1", gates=(), labels={"app": "web"})
    del created["metadata"]["labels"][GATED_LABEL]
    view = PodView.of(created)
    gated = jsonpatch.apply_patch(created, list(gate_patch(view, unplaced(view, Policy()))))
    assert gated["metadata"]["labels"] == {"app": "web", GATED_LABEL: "true"}
    assert gated["spec"]["schedulingGates"] == [{"name": GATE}]


# --- the release ----------------------------------------------------------------------------------

def test_release_places_and_removes_only_archways_gate():
    old = pod("reg/amd:1", "reg/multi:1")
    release = plan_release(old, {"reg/amd:1": AMD, "reg/multi:1": MULTI}, Policy(),
                           expired=False, waited=3.2)
    check_release(old, release)
    assert release.outcome == "placed" and release.event_type == "Normal"
    assert release.pod["spec"]["nodeSelector"] == {ARCH_LABEL: "amd64"}
    assert release.pod["spec"]["schedulingGates"] == [{"name": "other.example/quota"}]
    assert "amd64" in release.note and "3.2 s" in release.note


def test_release_adds_the_arch_to_every_existing_term():
    old = pod("reg/multi:1", gates=(GATE,), affinity=required(
        {"matchExpressions": [{"key": "zone", "operator": "In", "values": ["a"]}]},
        {"matchFields": [{"key": "metadata.name", "operator": "In", "values": ["n1"]}]}))
    release = plan_release(old, {"reg/multi:1": MULTI}, Policy(), expired=False)
    check_release(old, release)
    terms = release.pod["spec"]["affinity"]["nodeAffinity"][REQ]["nodeSelectorTerms"]
    assert all(arch_in("amd64", "arm64") in t["matchExpressions"] for t in terms)
    assert "schedulingGates" not in release.pod["spec"]


def test_unresolved_image_waits_until_expired_then_releases_unplaced_or_on_fallback():
    old = pod("reg/down:1", "reg/multi:1")
    results = {"reg/multi:1": MULTI, "reg/down:1": DOWN}
    assert plan_release(old, results, Policy(), expired=False) is None
    assert plan_release(old, {"reg/multi:1": MULTI}, Policy(), expired=False) is None  # no answer
    unplaced = plan_release(old, results, Policy(), expired=True, waited=120)
    check_release(old, unplaced)
    assert unplaced.outcome == "unplaced" and unplaced.event_type == "Warning"
    assert "reg/down:1: " in unplaced.note and "gate_max_seconds" in unplaced.note
    fallback = plan_release(old, results, Policy(), expired=True, fallback=("arm64",), waited=120)
    check_release(old, fallback)
    assert fallback.outcome == "fallback" and fallback.architectures == {"arm64"}
    assert fallback.pod["spec"]["nodeSelector"] == {ARCH_LABEL: "arm64"}
    # a fallback the known images exclude is not used
    other = plan_release(old, results, Policy(), expired=True, fallback=("s390x",))
    assert other.outcome == "unplaced"


def test_an_image_that_can_never_be_read_is_not_waited_for():
    """Issue 30, finding 6: an invalid reference or a host archway's policy refuses held its pod
    gated for the whole admission.gate_max_seconds; such a pod is released at once, saying why.
    A registry that may answer later keeps the gate as before."""
    old = pod("reg/multi:1", "169.254.169.254/app:1", "Reg/Bad:1")
    results = {"reg/multi:1": MULTI, "169.254.169.254/app:1": HostRefused("link-local: refused", rule="metadata"),
               "Reg/Bad:1": InvalidReference("malformed")}
    released = plan_release(old, results, Policy(), expired=False, waited=0.4)
    check_release(old, released)
    assert (released.outcome, released.reason) == ("unplaced", "ReleasedUnplaced")
    assert released.note.startswith("released at once (an image can never be read) placed on "
                                     "amd64, arm64 by the images it read; unresolved: ")
    assert ("169.254.169.254/app:1: refused by policy: metadata service"
            in released.note)
    assert released.note.endswith("; archway never contacts a cloud metadata service")
    assert "Reg/Bad:1: invalid image reference" in released.note
    assert "gate_max_seconds" not in released.note
    fallback = plan_release(old, results, Policy(), expired=False, fallback=("arm64",))
    assert fallback.outcome == "fallback" and fallback.architectures == {"arm64"}
    assert fallback.note.startswith("released at once (an image can never be read) placed on arm64")
    # One image that may still answer: the pod waits for it, as for any registry that is down.
    for transient in (DOWN, DeadlineExceeded("slow"), None, NotFound("not pushed yet", status=404),
                      RegistryError("bad gateway", status=502)):
        waiting = dict(results, **{"reg/multi:1": transient})
        assert plan_release(old, waiting, Policy(), expired=False) is None, transient
        assert "gate_max_seconds" in plan_release(old, waiting, Policy(), expired=True).note


def test_images_without_a_common_architecture_are_kept_off_every_node_at_once():
    old = pod("reg/amd:1", "reg/arm:1", "reg/down:1", affinity=required(
        {"matchExpressions": [{"key": "zone", "operator": "In", "values": ["a"]}]}))
    release = plan_release(old, {"reg/amd:1": AMD, "reg/arm:1": ARM,
                                 "reg/down:1": DeadlineExceeded("slow")}, Policy(), expired=False)
    check_release(old, release)
    assert release.outcome == "no_common_arch" and release.reason == "NoCommonArchitecture"
    assert "reg/amd:1 (amd64)" in release.note and "reg/arm:1 (arm64)" in release.note
    term = release.pod["spec"]["affinity"]["nodeAffinity"][REQ]["nodeSelectorTerms"][0]
    assert arch_in(NO_ARCHITECTURE) in term["matchExpressions"]
    bare = pod("reg/amd:1", "reg/arm:1")
    held = plan_release(bare, {"reg/amd:1": AMD, "reg/arm:1": ARM}, Policy(deny_on_empty=False),
                        expired=False)
    check_release(bare, held)
    assert held.outcome == "no_common_arch"


def test_a_pod_that_already_constrains_its_arch_keeps_its_selector():
    old = pod("reg/multi:1", node_selector={ARCH_LABEL: "arm64"})
    release = plan_release(old, {"reg/multi:1": MULTI}, Policy(), expired=False)
    check_release(old, release)
    assert release.pod["spec"]["nodeSelector"] == {ARCH_LABEL: "arm64"}


@settings(max_examples=60, deadline=None)
@given(st.lists(st.sampled_from(["reg/amd:1", "reg/arm:1", "reg/multi:1", "reg/down:1"]),
                min_size=1, max_size=3, unique=True),
       st.sampled_from([None, {}, {"disk": "ssd"}, {ARCH_LABEL: "amd64"}]),
       st.sampled_from([None, required({"matchExpressions": [
           {"key": "zone", "operator": "In", "values": ["a"]}]}, {}),
           {"podAntiAffinity": {}}]),
       st.booleans(), st.tuples() | st.just(("arm64",)))
def test_every_release_is_an_update_the_apiserver_accepts(images, selector, affinity, expired,
                                                            fallback):
    old = pod(*images, node_selector=selector, affinity=copy.deepcopy(affinity))
    results = {"reg/amd:1": AMD, "reg/arm:1": ARM, "reg/multi:1": MULTI, "reg/down:1": DOWN}
    release = plan_release(old, results, Policy(), expired=expired, fallback=fallback)
    if release is None:
        assert "reg/down:1" in images and not expired
        return
    assert validate_pod_update(old, release.pod) == [], release
    assert validate_pod_update(old, gate.gate_only_release(old)) == []


# --- events ----------------------------------------------------------------------------------------

def test_event_notes_escape_control_characters_and_fit_in_1024_bytes():
    """Issue 30, finding 6: a note kept the raw CR/LF of an image reference, and `kubectl
    describe` showed a line of the pod author's choosing."""
    forged = "reg/app\r\nNormal  Placed  placed on amd64\x1b[2J\x85\u2028:1"
    body = event(regarding={"kind": "Pod", "name": "p", "namespace": "team"},
                 event_type="Warning", reason="ReleasedUnplaced", action="Release",
                 note=f"released; unresolved: {forged}: invalid image reference",
                 instance="archway-0_1_abc", now=1.7e9)
    assert body["note"] == ("released; unresolved: reg/app\\r\\nNormal  Placed  placed on "
                            "amd64\\x1b[2J\\x85\\u2028:1: invalid image reference")
    assert not re.search("[\x00-\x1f\x7f-\x9f\u2028\u2029]", body["note"])
    # The apiserver's 1 kB is bytes (Go's len): a note of wide characters is cut to fit.
    wide = event(regarding={"kind": "Pod", "name": "p", "namespace": "team"},
                 event_type="Warning", reason="R", action="Release", note="é" * 1000,
                 instance="i", now=1.7e9)
    assert len(wide["note"].encode()) <= 1024 and wide["note"].endswith("é...")
    assert validate_event_create(wide, "team") == []


def test_events_pass_the_strict_events_k8s_io_v1_validation():
    body = event(regarding={"apiVersion": "v1", "kind": "Pod", "namespace": "team", "name": "p",
                            "uid": "u1"}, event_type="Warning", reason="ReleasedUnplaced",
                 action="Release", note="x" * 5000, instance="archway-0_1_abc", now=1.7e9)
    assert validate_event_create(body, "team") == []
    assert len(body["note"]) == 1024
    wrong = dict(body, type="Info", reportingController="")
    assert {e.field for e in validate_event_create(wrong, "other")} == {
        "type", "reportingController", "involvedObject.namespace"}


# --- the Lease, on the stand-in ---------------------------------------------------------------------

class RealApi:
    """A real apiserver of this module's own: what the gate tests create and read there."""

    def __init__(self, plane):
        self.plane = plane
        self.kube = plane.kube
        self.namespace = "archway"    # the Lease's; pods go to "team"

    def get(self, path: str) -> dict:
        return self.kube.get(path)

    def create_pod(self, body: dict) -> dict:
        body = copy.deepcopy(body)
        for key in ("uid", "resourceVersion", "creationTimestamp"):
            body["metadata"].pop(key, None)
        body.pop("status", None)
        return self.kube.create(f"/api/v1/namespaces/{body['metadata']['namespace']}/pods", body)

    def events(self, namespace: str) -> list[dict]:
        return [e for e in self.kube.items(f"/apis/events.k8s.io/v1/namespaces/{namespace}/events")
                if e.get("reportingController") == "archway.dev/archway"]

    def clean(self) -> None:
        """No Lease, pods or Events left from the test before (pods force-deleted: no kubelet
        would confirm a graceful deletion)."""
        self.kube.delete(lease_path(self.namespace))
        for namespace in ("team", "shop"):
            base = f"/api/v1/namespaces/{namespace}"
            for item in self.kube.items(f"{base}/pods"):
                self.kube.delete(f"{base}/pods/{item['metadata']['name']}", gracePeriodSeconds=0)
            self.kube.request("DELETE", f"/apis/events.k8s.io/v1/namespaces/{namespace}/events")
            self.kube.wait_for(lambda base=base: not self.kube.items(f"{base}/pods"), timeout=30)


@pytest.fixture(scope="module")
def real_plane(tmp_path_factory):
    from lab.cluster.controlplane import ControlPlane
    with ControlPlane(str(tmp_path_factory.mktemp("gate-plane"))) as plane:
        for namespace in ("archway", "team", "shop"):
            plane.new_namespace(namespace)
        yield plane


@pytest.fixture
def api(real_plane):
    server = RealApi(real_plane)
    server.clean()
    client, _ = build_api_client(KubernetesSettings(kubeconfig=real_plane.admin_kubeconfig))
    yield server, KubeApi(client, timeout_seconds=5)


@pytest.fixture
def stand_in(tmp_path):
    """For faults a real apiserver cannot be made to produce on cue."""
    server = FakeApiServer()
    client, _ = build_api_client(KubernetesSettings(kubeconfig=server.kubeconfig(str(tmp_path))))
    yield server, KubeApi(client, timeout_seconds=5)
    server.stop()


def test_one_leader_and_takeover_after_a_duration_without_renewal(api):
    server, kube = api
    clock = ManualClock()
    a = LeaderElector(kube, "archway", identity="a", duration_seconds=15, clock=clock)
    b = LeaderElector(kube, "archway", identity="b", duration_seconds=15, clock=clock)
    assert a.try_acquire_or_renew() and not b.try_acquire_or_renew()
    clock.now += 10
    assert a.try_acquire_or_renew() and not b.try_acquire_or_renew()  # b saw it renewed
    clock.now += 14.9
    assert not b.try_acquire_or_renew()
    clock.now += 0.2                                                   # a silent for 15 s
    assert b.try_acquire_or_renew() and not a.try_acquire_or_renew()
    lease = server.get(lease_path("archway"))
    assert lease["spec"]["holderIdentity"] == "b" and lease["spec"]["leaseTransitions"] == 1
    b.release()
    assert a.try_acquire_or_renew()                                   # released: at once


def test_a_stale_write_loses_with_409(api):
    server, kube = api
    a = LeaderElector(kube, "archway", identity="a", duration_seconds=1)
    assert a.try_acquire_or_renew()
    lease = server.get(lease_path("archway"))
    other = copy.deepcopy(lease)
    other["spec"]["holderIdentity"] = "someone else"
    server.kube.put(lease_path("archway"), other)   # someone else wrote meanwhile
    with pytest.raises(Exception) as failed:
        kube.request("PUT", lease_path("archway"), body=lease)
    assert failed.value.status == 409 and failed.value.reason == "Conflict"


def test_observer_sees_a_fresh_leader_and_its_absence(api):
    _, kube = api
    clock = ManualClock()
    observer = LeaseObserver(kube, "archway", duration_seconds=15, clock=clock)
    observer.refresh()
    assert not (observer._holder and clock() < observer._fresh_until)
    LeaderElector(kube, "archway", identity="a", duration_seconds=15).try_acquire_or_renew()
    observer.refresh()
    assert observer._holder == "a" and clock() < observer._fresh_until
    clock.now += 16                           # not renewed for a duration: not fresh
    observer.refresh()
    assert not clock() < observer._fresh_until


def test_an_observer_without_a_leader_reads_again_for_a_question_asked_after_the_lease_changed(api):
    """A worker that read the Lease before its controller took it answers an admission with a
    read made after the question (issue 21: the first misses after a start were admitted
    ungated for a third of a Lease duration)."""
    import time
    _, kube = api
    observer = LeaseObserver(kube, "archway", duration_seconds=15)
    observer.start()
    wait_until(lambda: observer.has_read, 5, "the observer's first read")
    assert not observer.leader_fresh() and observer.eager
    LeaderElector(kube, "archway", identity="a", duration_seconds=15).try_acquire_or_renew()
    assert observer.leader_fresh(time.monotonic() + 2)
    assert not observer.eager and observer.has_read


def test_an_observer_is_eager_for_one_duration_only_and_never_waits_past_the_deadline(api):
    import time
    _, kube = api
    clock = ManualClock()
    observer = LeaseObserver(kube, "archway", duration_seconds=15, clock=clock)
    assert observer.eager   # nothing read yet
    observer.refresh()
    assert observer.eager and observer.last_error is None
    clock.now += 15
    assert not observer.eager   # no leader for a duration: back to reading every third
    started = time.monotonic()
    assert not observer.leader_fresh(time.monotonic() + 5)   # not eager: no wait
    assert time.monotonic() - started < 0.5


def test_a_worker_not_ready_yet_reads_the_lease_again_for_a_miss_past_a_lease_duration(api):
    """Issue 30, finding 7: the pod is ready once ANY worker's /readyz is. A worker still waiting
    (not ready) for a controller slower to start than a Lease duration had stopped reading
    eagerly, so its misses right after another worker saw the controller take the Lease were
    admitted ungated: it must read the Lease again for them as long as it is not ready."""
    import time

    from archway.webhook.wiring import gate_readiness, startup_seconds
    _, kube = api
    config = config_from_dict({"admission": {"unresolved": "gate", "gate_lease_seconds": 6}})
    startup = startup_seconds(config)
    clock = ManualClock()
    observer = LeaseObserver(kube, "archway", duration_seconds=6, clock=clock,
                             eager_seconds=startup)
    ready = gate_readiness(observer, lambda: True, startup)  # this server's controller is up
    observer.start()
    wait_until(lambda: observer.has_read, 5, "the observer's first read")    # no leader yet
    clock.now += 7               # longer than a Lease duration, within the start-up allowance
    assert ready() == f"waiting for a gate controller to take the Lease (at most {startup:g} s)"
    LeaderElector(kube, "archway", identity="a", duration_seconds=6).try_acquire_or_renew()
    assert observer.leader_fresh(time.monotonic() + 5)       # so its next miss is gated
    assert ready() is None


def test_a_worker_is_ready_once_its_observer_stops_waiting_for_a_leader(api):
    """Without a leader for the start-up allowance, a worker is ready (a webhook without
    endpoints would hold up the cluster's pods) and its observer no longer reads eagerly."""
    from archway.webhook.wiring import gate_readiness
    _, kube = api
    clock = ManualClock()
    observer = LeaseObserver(kube, "archway", duration_seconds=3, clock=clock, eager_seconds=10)
    ready = gate_readiness(observer, lambda: True, 10)
    assert ready() == "reading the gate controller's Lease"
    observer.start()
    wait_until(lambda: observer.has_read, 5, "the observer's first read")
    assert ready() == "waiting for a gate controller to take the Lease (at most 10 s)"
    clock.now += 9.9
    assert ready() is not None and observer.eager
    clock.now += 0.1
    assert ready() is None and not observer.eager
    assert ready() is None       # settled: never again for this reason


def test_an_observer_says_why_the_lease_is_unreadable(stand_in):
    server, kube = stand_in
    observer = LeaseObserver(kube, "archway", duration_seconds=15, clock=ManualClock())
    server.faults["/apis/coordination.k8s.io"] = 503   # the read fails, and says why
    observer.refresh()
    assert "unreadable: 503" in observer.last_error


# --- the webhook's choice on a miss (the admission service, no HTTP) ---------------------------

class Leader:
    def __init__(self, fresh):
        self.fresh = fresh

    def leader_fresh(self, deadline=None):
        return self.fresh


def owned_review(image):
    import json as _json
    return _json.dumps({
        "apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
        "request": {"uid": "u-1", "operation": "CREATE", "namespace": "shop",
                    "kind": {"group": "", "version": "v1", "kind": "Pod"},
                    "resource": {"group": "", "version": "v1", "resource": "pods"},
                    "object": {"apiVersion": "v1", "kind": "Pod", "metadata": {
                        "generateName": "web-", "ownerReferences": [{
                            "apiVersion": "apps/v1", "kind": "ReplicaSet", "name": "web",
                            "uid": "rs-1", "controller": True}]},
                        "spec": {"containers": [{"name": "c", "image": image}]}}}}).encode()


def admission(unresolved, gating=None, events=None):
    from tests.test_service import Resolver, Secrets, service
    return service(Resolver({"reg/down:1": DOWN}), Secrets(), unresolved=unresolved,
                   gating=gating, events=events)


def decoded_patch(answer):
    import base64 as _b64
    import json as _json
    return _json.loads(_b64.b64decode(answer.body["response"]["patch"]))


def test_a_miss_is_gated_only_while_a_leader_is_fresh(api):
    server, kube = api
    from archway.cluster.events import EventSink
    sink = EventSink(kube, instance="webhook-0")
    gated = admission("gate", Leader(True), sink).review(owned_review("reg/down:1"))
    response = gated.body["response"]
    assert response["auditAnnotations"]["outcome"] == "gated"
    assert {"op": "add", "path": "/spec/schedulingGates", "value": [{"name": GATE}]} in \
        decoded_patch(gated)
    assert "SchedulingGated" in response["warnings"][0]
    # gated, the unread image will restrict placement: the warning says so, not the opposite
    assert response["warnings"][1:] == [
        "could not inspect reg/down:1 (registry unreachable); archway reads it again and "
        "places the pod before it is scheduled"]
    alone = admission("gate", Leader(False), sink).review(owned_review("reg/down:1"))
    response = alone.body["response"]
    assert response["auditAnnotations"]["outcome"] == "fail_open"
    assert "no archway gate controller is running" in response["warnings"][0]
    assert response["warnings"][1].endswith("; it does not restrict placement")
    sink.flush(5)
    events = server.events("shop")
    # only the unplaced pod told its ReplicaSet (a gated pod is not unplaced)
    assert [(e["type"], e["reason"], e["regarding"]["kind"], e["regarding"]["name"])
            for e in events] == [("Warning", "AdmittedUnplaced", "ReplicaSet", "web")]
    assert "reg/down:1" in events[0]["note"]


class EnforcingShop:
    """A namespace cache in which the namespace shop is labelled archway.dev/mode=enforce."""
    def __init__(self):
        from archway.placement.namespaces import NamespaceFacts
        self.items = {"shop": NamespaceFacts("shop", mode="enforce")}

    def wait_synced(self, timeout):
        return True


def test_a_gated_pod_gets_the_scheduler_its_namespaces_policy_asks_for():
    """The config says audit, the pod's namespace enforce: the pod is gated and gets archway's
    scheduler at creation, the only time it can (it was gated without one, for good)."""
    from tests.test_service import Resolver, Secrets, service
    answer = service(Resolver({"reg/down:1": DOWN}), Secrets(), unresolved="gate",
                     gating=Leader(True), namespaces=EnforcingShop(),
                     policy=Policy(scheduler_name="archway-scheduler", mode="audit"),
                     ).review(owned_review("reg/down:1"))
    assert answer.body["response"]["auditAnnotations"]["outcome"] == "gated"
    assert {"op": "add", "path": "/spec/schedulerName", "value": "archway-scheduler"} in \
        decoded_patch(answer)


def test_admit_mode_tells_the_owner_and_deny_mode_denies(api):
    server, kube = api
    from archway.cluster.events import EventSink
    sink = EventSink(kube, instance="webhook-0")
    admitted = admission("admit", None, sink).review(owned_review("reg/down:1"))
    assert admitted.body["response"]["allowed"]
    sink.flush(5)
    assert [e["reason"] for e in server.events("shop")] == ["AdmittedUnplaced"]
    from tests.test_service import Resolver, Secrets, service
    denied = service(Resolver({"reg/down:1": DOWN}), Secrets(),
                     policy=Policy(fail_closed=True)).review(owned_review("reg/down:1"))
    assert not denied.body["response"]["allowed"]
    assert "unresolved is deny" in denied.body["response"]["status"]["message"]


def test_an_event_about_a_pod_in_admission_names_the_uid_it_is_stored_with(api):
    """`kubectl describe pod` selects Events by the pod's uid, which the apiserver gives only
    when it stores the pod, after admission: the sink waits for the pod (off the admission's
    path) and names its uid; a pod whose creation failed after admission gets its Event
    without one."""
    server, kube = api
    from archway.cluster.events import EventSink
    sink = EventSink(kube, instance="webhook-0", uid_wait_seconds=3.0)
    for name in ("stored", "never"):
        sink.record({"apiVersion": "v1", "kind": "Pod", "namespace": "shop", "name": name},
                    "Warning", "ArchwayUnschedulable", "Admit", f"about {name}",
                    being_created=True)
    body = pod("reg/amd:1", gates=())
    body["metadata"].update(name="stored", namespace="shop")
    stored = server.create_pod(body)      # once admitted, as the apiserver stores it
    sink.flush(20)
    regarding = {e["regarding"]["name"]: e["regarding"] for e in server.events("shop")}
    assert regarding["stored"]["uid"] == stored["metadata"]["uid"]
    assert "uid" not in regarding["never"]


def test_an_older_pod_of_the_same_name_is_not_the_one_an_event_is_about():
    from archway.cluster.events import uid_of_stored
    pod_obj = {"metadata": {"uid": "u", "creationTimestamp": "2026-01-01T00:00:00Z"}}
    created = 1767225600.0     # 2026-01-01T00:00:00Z
    assert uid_of_stored(pod_obj, created + 1) == "u"
    assert uid_of_stored(pod_obj, created - 30) == "u"       # clocks apart: still this pod
    assert uid_of_stored(pod_obj, created + 3600) is None    # its creation failed: AlreadyExists


# --- archway gate release-all (the uninstall hook) ------------------------------------------------

def test_release_all_removes_only_archways_gate_from_every_pod(api):
    from archway.gate.cli import release_all
    server, kube = api
    base = "/api/v1/namespaces/team/pods"
    both = pod("reg/amd:1")
    mine = pod("reg/amd:1", gates=(GATE,))
    mine["metadata"].update(name="mine")
    del mine["metadata"]["labels"][GATED_LABEL]       # a gate without the label is found too
    theirs = pod("reg/amd:1", gates=("other.example/quota",))
    theirs["metadata"].update(name="theirs")
    for item in (both, mine, theirs):
        server.create_pod(item)
    mark = server.plane.audit_mark()
    assert release_all(kube) == (2, 0)
    assert server.get(f"{base}/p")["spec"]["schedulingGates"] == [{"name": "other.example/quota"}]
    assert GATED_LABEL not in server.get(f"{base}/p")["metadata"].get("labels", {})
    assert "schedulingGates" not in server.get(f"{base}/mine")["spec"]
    assert server.get(f"{base}/theirs")["spec"]["schedulingGates"] == [
        {"name": "other.example/quota"}]
    updates = [uri for verb, uri in server.plane.requests_since(mark, user="admin")
               if verb == "update"]
    assert sorted(updates) == [f"{base}/mine", f"{base}/p"]


# --- the controller in process, on the stand-in (no registry: the resolver is a stand-in) -----------

class FlakyResolver:
    """Answers from `results`; an image missing there fails (a registry that is down)."""

    def __init__(self):
        self.results = {}

    def resolve_many(self, images, *, keyring=None, timeout, scope=None):
        return {image: self.results.get(image, DOWN) for image in images}


class NoSecrets:
    def credentials_for(self, pod, deadline):
        from archway.cluster.pullsecrets import PullCredentials
        from archway.registry.credentials import Keyring
        return PullCredentials(Keyring.empty())


def test_controller_lists_again_after_410_and_releases_what_it_finds(stand_in):
    import threading
    import time

    from archway.cluster.events import EventSink
    from archway.gate.controller import GateController
    server, kube = stand_in
    resolver = FlakyResolver()
    controller = GateController(api=kube, resolver=resolver, pull_secrets=NoSecrets(),
                                policy=Policy(), max_seconds=600, events=EventSink(kube, instance="t"),
                                watch_seconds=1)
    first = pod("reg/multi:1")
    first["metadata"]["creationTimestamp"] = None
    server.put("/api/v1/namespaces/team/pods/p", first)
    stop = threading.Event()
    leader = threading.Thread(target=controller.lead, args=(stop,), daemon=True)
    leader.start()
    try:
        wait_until(lambda: "u1" in controller.pending)
        # A pod whose watch event was compacted away: it is in the store, in no event, and the
        # history is gone, so the next watch from the controller's version gets 410 Gone.
        second = pod("reg/amd:1")
        second["metadata"].update(name="q", uid="u2", creationTimestamp=time.strftime(
            "%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
        with server._lock:
            server._rv += 1
            second["metadata"]["resourceVersion"] = str(server._rv)
            server.objects["/api/v1/namespaces/team/pods/q"] = second
        server.expire_history()
        wait_until(lambda: controller.sweeps >= 2 and "u2" in controller.pending)
        resolver.results = {"reg/multi:1": MULTI, "reg/amd:1": AMD}
        wait_until(lambda: not controller.pending)
    finally:
        stop.set()
        leader.join(5)
    assert server.get("/api/v1/namespaces/team/pods/q")["spec"]["nodeSelector"] == {
        ARCH_LABEL: "amd64"}
    assert GATE not in str(server.get("/api/v1/namespaces/team/pods/p")["spec"])
    assert server.rejections == []


def test_the_gate_pages_kubectl_line_releases_gated_pods_and_keeps_other_gates(api):
    """docs/gate.md's one-liner (the README's until issue 47), run as an operator runs it: bash,
    the real kubectl, the real apiserver's strategic merge patch."""
    import os
    import subprocess

    from lab.procs import REPO
    with open(os.path.join(REPO, "docs", "gate.md"), encoding="utf-8") as f:
        line = next(line for line in f if line.startswith("kubectl get pods -A -l " + GATED_LABEL))
    assert "--type strategic" in line
    server, _ = api
    server.create_pod(pod("reg/amd:1"))
    kubectl = server.plane.binary("kubectl")
    done = subprocess.run(["bash", "-c", line], capture_output=True, text=True, timeout=60,
                          env=dict(os.environ, KUBECONFIG=server.plane.admin_kubeconfig,
                                   PATH=f"{os.path.dirname(kubectl)}:{os.environ['PATH']}"))
    assert done.returncode == 0, done.stderr
    assert "pod/p patched" in done.stdout
    released = server.get("/api/v1/namespaces/team/pods/p")
    assert released["spec"]["schedulingGates"] == [{"name": "other.example/quota"}]
    assert GATED_LABEL not in released["metadata"].get("labels", {})


def test_the_release_all_command_as_the_uninstall_hook_runs_it(api, tmp_path):
    import subprocess
    import sys
    server, _ = api
    server.create_pod(pod("reg/amd:1"))
    config = tmp_path / "archway.yaml"
    config.write_text(f"kubernetes: {{kubeconfig: {server.plane.admin_kubeconfig}}}\n")
    done = subprocess.run([sys.executable, "-m", "archway.main.cli", "--config", str(config), "gate",
                           "release-all"], capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    assert "released 1 gated pod(s)" in done.stdout
    assert server.get("/api/v1/namespaces/team/pods/p")["spec"]["schedulingGates"] == [
        {"name": "other.example/quota"}]


def test_an_apiserver_without_kep_3838_gets_the_gate_removed_and_a_warning(stand_in):
    """Before 1.27 a gated pod's nodeSelector is as fixed as any pod's: the placement update is
    a 422, so the controller removes only its gate (the pod must not wait for ever) and says
    why on the pod."""
    import threading
    import time

    from archway.cluster.events import EventSink
    from archway.gate.controller import GateController
    server, kube = stand_in
    server.mutable_scheduling_directives = False
    resolver = FlakyResolver()
    resolver.results = {"reg/amd:1": AMD}
    controller = GateController(api=kube, resolver=resolver, pull_secrets=NoSecrets(),
                                policy=Policy(), max_seconds=600, events=EventSink(kube, instance="t"),
                                watch_seconds=1)
    path = "/api/v1/namespaces/team/pods/p"
    fresh = pod("reg/amd:1")
    fresh["metadata"]["creationTimestamp"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    server.put(path, fresh)
    stop = threading.Event()
    leader = threading.Thread(target=controller.lead, args=(stop,), daemon=True)
    leader.start()
    try:
        wait_until(lambda: GATE not in str(server.get(path)["spec"]))
        events_path = "/apis/events.k8s.io/v1/namespaces/team/events/"
        wait_until(lambda: any(p.startswith(events_path) for p in server.objects))
    finally:
        stop.set()
        leader.join(5)
    released = server.get(path)
    assert released["spec"]["schedulingGates"] == [{"name": "other.example/quota"}]
    assert "nodeSelector" not in released["spec"]
    assert [(code, method) for method, _, code, _ in server.rejections] == [(422, "PUT")]
    [note] = [o for p, o in server.objects.items() if p.startswith(events_path)]
    assert (note["type"], note["reason"]) == ("Warning", "ReleasedUnplaced")
    assert "refused archway's placement" in note["note"] and "Forbidden" in note["note"]
