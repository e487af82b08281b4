"""The closed loop's pure parts: reading exec format errors out of a pod's status, merging and
reading what a workload learned, when it stops holding, the placement decision with it as an
input, the owner chain, the utilisation ceiling, and report's stranded architectures."""
import base64
import json
import threading
import time

import jsonpatch
import pytest

from archway import metrics
from archway.cluster.workloadcache import WorkloadCache, top_workload, workload_facts, workload_path
from archway.cluster.workloads import workloads_in
from archway.config import config_from_dict
from archway.errors import ConfigError, DeadlineExceeded
from archway.extender.ceiling import utilisation_ceiling
from archway.extender.traffic import NodeLoad
from archway.gate.failingpods import failing_pod
from archway.gate.podstatus import exec_format_failures, image_digest
from archway.gate.release import plan_release
from archway.gate.tagwatch import tag_key
from archway.placement.decision import decide
from archway.placement.learning import (
    MAX_EVIDENCE,
    Evidence,
    Learned,
    learned_from,
    merged_annotations,
    reset_reason,
)
from archway.placement.policy import Policy
from archway.podview import PodView
from archway.registry.model import ImageInfo
from archway.registry.platforms import parse_platform
from archway.tools.report import assess, running_architectures
from archway.vocabulary import ANNOTATION_EVIDENCE, ANNOTATION_EXCLUDED, ANNOTATION_FAILED
from tests.test_service import Resolver, response, review, service

D1 = "sha256:" + "1" * 64
D2 = "sha256:" + "2" * 64
IMAGE = "reg.example/app:1"


def info(image, *archs, digest=D1):
    return ImageInfo(image, frozenset(parse_platform(f"linux/{a}") for a in archs), digest,
                     "oci-index")


def status(message, where=("lastState", "terminated"), image_id=f"reg.example/app@{D1}",
           key="containerStatuses", name="app"):
    state, phase = where
    return {key: [{"name": name, "image": "reg.example/app:1", "imageID": image_id,
                   "restartCount": 2, "ready": False, state: {phase: {"message": message}}}]}


def a_pod(status_=None, *, node="arm64-1", owner=("ReplicaSet", "web-5d8"), deleting=False,
          annotations=None, images=(IMAGE,)):
    meta = {"name": "web-5d8-x", "namespace": "shop", "uid": "u-1",
            "annotations": annotations if annotations is not None else {
                "archway.dev/architectures": "amd64,arm64",
                "archway.dev/images": json.dumps([{"image": IMAGE, "digest": D2}])}}
    if owner:
        meta["ownerReferences"] = [{"apiVersion": "apps/v1", "kind": owner[0], "name": owner[1],
                                    "uid": "o", "controller": True}]
    if deleting:
        meta["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    spec = {"containers": [{"name": "app" if i == 0 else f"c{i}", "image": image}
                           for i, image in enumerate(images)],
            "initContainers": [{"name": "setup", "image": "reg.example/setup:2"}]}
    if node:
        spec["nodeName"] = node
    return {"apiVersion": "v1", "kind": "Pod", "metadata": meta, "spec": spec,
            "status": status_ or {}}


# --- exec format errors in a pod's status -----------------------------------------------------

@pytest.mark.parametrize("where", [("state", "waiting"), ("state", "terminated"),
                                   ("lastState", "terminated")])
def test_each_place_a_status_may_carry_the_error_is_read(where):
    (failure,) = exec_format_failures(a_pod(status("exec /bin/app: exec format error", where)))
    assert (failure.container, failure.image, failure.digest) == ("app", IMAGE, D1)
    assert failure.message == "exec /bin/app: exec format error"


def test_init_containers_runtime_wording_and_case_are_read():
    pod = a_pod(status('OCI runtime create failed: exec: "/setup": Exec Format Error: unknown',
                       ("state", "terminated"), key="initContainerStatuses", name="setup",
                       image_id=""))
    (failure,) = exec_format_failures(pod)
    # The image as the pod spec names it; no digest from an empty image ID.
    assert (failure.container, failure.image, failure.digest) == ("setup", "reg.example/setup:2",
                                                                  None)


@pytest.mark.parametrize("pod", [
    a_pod(status("exec /bin/app: no such file or directory")),
    a_pod(status("back-off 40s restarting failed container", ("state", "waiting"))),
    a_pod({"containerStatuses": [{"name": "app", "state": {"running": {}}}]}),
    a_pod({"containerStatuses": "not a list"}),
    a_pod({"containerStatuses": [{"name": "app", "lastState": {"terminated": {"message": 7}}}]}),
    {"status": "nonsense"},
    {},
])
def test_other_failures_and_odd_statuses_are_no_exec_format_error(pod):
    assert exec_format_failures(pod) == ()


@pytest.mark.parametrize("image_id, digest", [
    (f"reg.example/app@{D1}", D1),
    (f"docker-pullable://reg.example/app@{D1}", D1),
    (D1, None),                      # a bare image ID: the config's digest on some runtimes
    (f"reg.example/app@sha256:{'1' * 10}", None),
    ("", None), (None, None), (7, None),
])
def test_the_digest_of_an_image_id(image_id, digest):
    assert image_digest(image_id) == digest


def test_failing_pod_keeps_a_few_facts_of_bound_pods_not_being_deleted():
    pod = a_pod(status("exec format error"))
    failing = failing_pod(pod)
    assert (failing.namespace, failing.name, failing.uid, failing.node) == (
        "shop", "web-5d8-x", "u-1", "arm64-1")
    assert (failing.owner.kind, failing.owner.name, failing.owner.uid) == ("ReplicaSet",
                                                                           "web-5d8", "o")
    assert failing.architectures == {"amd64", "arm64"}
    # The digest admission resolved first (what the next admissions compare to); the kubelet's
    # image ID only for a pod archway did not annotate.
    assert failing.evidence("arm64", failing.failures) == [Evidence(IMAGE, D2, "arm64")]
    no_id = failing_pod(a_pod(status("exec format error", image_id="")))
    assert no_id.evidence("arm64", no_id.failures) == [Evidence(IMAGE, D2, "arm64")]
    unannotated = failing_pod(a_pod(status("exec format error"), annotations={}))
    assert unannotated.evidence("arm64", unannotated.failures) == [Evidence(IMAGE, D1, "arm64")]
    assert failing_pod(a_pod(status("exec format error"), node=None)) is None
    assert failing_pod(a_pod(status("exec format error"), deleting=True)) is None
    assert failing_pod(a_pod(status("all fine"))) is None
    bare = failing_pod(a_pod(status("exec format error"), owner=None, annotations={}))
    assert bare.owner is None and bare.architectures is None


# --- what a workload learned --------------------------------------------------------------------

def test_merging_adds_the_architecture_and_the_evidence_once():
    first = merged_annotations({}, "arm64", [Evidence(IMAGE, D1, "arm64")])
    assert first[ANNOTATION_FAILED] == "arm64"
    assert json.loads(first[ANNOTATION_EVIDENCE]) == [
        {"image": IMAGE, "digest": D1, "architecture": "arm64"}]
    assert merged_annotations(first, "arm64", [Evidence(IMAGE, D1, "arm64")]) is None
    second = merged_annotations({**first, "team": "x"}, "ppc64le",
                                [Evidence(IMAGE, D1, "ppc64le")])
    assert second[ANNOTATION_FAILED] == "arm64,ppc64le"
    assert len(json.loads(second[ANNOTATION_EVIDENCE])) == 2
    # The same architecture from another image: new evidence, the same list of architectures.
    third = merged_annotations(second, "arm64", [Evidence("reg.example/side:3", None, "arm64")])
    assert third[ANNOTATION_FAILED] == "arm64,ppc64le"
    # Bounded: the newest evidence is kept.
    many = first
    for i in range(MAX_EVIDENCE + 5):
        many = merged_annotations(many, "arm64", [Evidence(f"reg.example/x{i}:1", None, "arm64")])
    kept = json.loads(many[ANNOTATION_EVIDENCE])
    assert len(kept) == MAX_EVIDENCE and kept[-1]["image"] == f"reg.example/x{MAX_EVIDENCE + 4}:1"


def test_merging_into_annotations_a_person_wrote():
    merged = merged_annotations({ANNOTATION_FAILED: "aarch64", ANNOTATION_EVIDENCE: "{broken"},
                                "amd64", [Evidence(IMAGE, D1, "amd64")])
    assert merged[ANNOTATION_FAILED] == "amd64,arm64"      # aarch64 read as arm64
    assert json.loads(merged[ANNOTATION_EVIDENCE]) == [
        {"image": IMAGE, "digest": D1, "architecture": "amd64"}]


def test_learned_from_reads_both_annotations():
    assert learned_from({}, "Deployment web") is None
    assert learned_from({ANNOTATION_FAILED: " , "}, "Deployment web") is None
    merged = merged_annotations({}, "arm64", [Evidence(IMAGE, D1, "arm64")])
    learned = learned_from(merged, "Deployment web")
    assert learned == Learned(frozenset({"arm64"}), (Evidence(IMAGE, D1, "arm64"),),
                              "Deployment web")
    by_hand = learned_from({ANNOTATION_FAILED: "arm64", ANNOTATION_EVIDENCE: "[1]"}, "Job j")
    assert by_hand.evidence == () and "not archway's JSON" in by_hand.problem


def test_an_exclusion_holds_until_its_evidence_does_not():
    learned = Learned(frozenset({"arm64"}), (Evidence(IMAGE, D1, "arm64"),), "Deployment web")
    assert reset_reason(learned, [IMAGE], {IMAGE: info(IMAGE, "amd64", "arm64")}) == ""
    # An image archway could not read proves nothing.
    assert reset_reason(learned, [IMAGE], {IMAGE: DeadlineExceeded("slow")}) == ""
    assert reset_reason(learned, [IMAGE], {}) == ""
    moved = reset_reason(learned, [IMAGE], {IMAGE: info(IMAGE, "amd64", "arm64", digest=D2)})
    assert "now names sha256:222222222222, not sha256:111111111111" in moved
    assert "no longer among its images" in reset_reason(learned, ["reg.example/app:2"], {})
    # Evidence without a digest ends only with its image; no evidence at all: never.
    undated = Learned(frozenset({"arm64"}), (Evidence(IMAGE, None, "arm64"),), "Deployment web")
    assert reset_reason(undated, [IMAGE], {IMAGE: info(IMAGE, "arm64", digest=D2)}) == ""
    by_hand = Learned(frozenset({"arm64"}), (), "Deployment web")
    assert reset_reason(by_hand, ["anything:1"], {}) == ""


# --- the placement decision with it ------------------------------------------------------------

def pod_view(*images, **spec):
    return PodView.of({"metadata": {"name": "p", "namespace": "shop"},
                       "spec": {"containers": [{"name": f"c{i}", "image": image}
                                               for i, image in enumerate(images)], **spec}})


LEARNED = Learned(frozenset({"arm64"}), (Evidence(IMAGE, D1, "arm64"),), "Deployment web")


def apply(pod: PodView, decision) -> dict:
    return jsonpatch.apply_patch({"metadata": {"annotations": dict(pod.annotations)},
                                  "spec": {}}, list(decision.patch))


def test_a_learned_failure_keeps_the_pod_off_that_architecture_though_its_image_claims_it():
    pod = pod_view(IMAGE)
    results = {IMAGE: info(IMAGE, "amd64", "arm64", "ppc64le")}
    plain = decide(pod, results, Policy())
    assert apply(pod, plain)["spec"]["affinity"]["nodeAffinity"][
        "requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"][0][
        "matchExpressions"][0]["values"] == ["amd64", "arm64", "ppc64le"]
    decision = decide(pod, results, Policy(), learned=LEARNED)
    placed = apply(pod, decision)
    assert placed["spec"]["affinity"]["nodeAffinity"][
        "requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"][0][
        "matchExpressions"][0]["values"] == ["amd64", "ppc64le"]
    annotations = placed["metadata"]["annotations"]
    # The images' architectures stay what they claim; the exclusion is said apart.
    assert annotations["archway.dev/architectures"] == "amd64,arm64,ppc64le"
    assert annotations[ANNOTATION_EXCLUDED] == "arm64"
    assert decision.excluded == {"arm64"} and decision.architectures == {"amd64", "arm64",
                                                                         "ppc64le"}
    assert decision.warnings[0] == ("kept off arm64: pods of Deployment web failed there with "
                                    "exec format error")
    # Two architectures left: one of them only -> a nodeSelector.
    single = decide(pod, {IMAGE: info(IMAGE, "amd64", "arm64")}, Policy(), learned=LEARNED)
    assert apply(pod, single)["spec"]["nodeSelector"] == {"kubernetes.io/arch": "amd64"}


@pytest.mark.parametrize("results, learned, note", [
    # every architecture the images claim failed: nothing would be left, so nothing is excluded
    ({IMAGE: info(IMAGE, "arm64")}, LEARNED, "failed on every architecture"),
    # the evidence no longer holds
    ({IMAGE: info(IMAGE, "amd64", "arm64", digest=D2)}, LEARNED, "now names sha256:2222"),
    # a failure on an architecture the images do not claim changes nothing
    ({IMAGE: info(IMAGE, "amd64")}, LEARNED, ""),
    ({IMAGE: info(IMAGE, "amd64", "arm64")}, None, ""),
])
def test_when_a_learned_failure_excludes_nothing(results, learned, note):
    pod = pod_view(IMAGE)
    decision = decide(pod, results, Policy(), learned=learned)
    assert decision.patch == decide(pod, results, Policy()).patch and not decision.excluded
    assert ANNOTATION_EXCLUDED not in apply(pod, decision)["metadata"]["annotations"]
    if note:
        assert note in decision.learned and decision.warnings[0] == decision.learned
    else:
        assert decision.learned == "" and decision.warnings == ()


def test_unread_images_are_not_excluded_from_since_archway_places_by_what_it_read():
    pod = pod_view(IMAGE)
    decision = decide(pod, {IMAGE: DeadlineExceeded("slow")}, Policy(), learned=LEARNED)
    assert decision.outcome == "fail_open" and not decision.excluded


def test_audit_mode_keeps_the_placement_and_says_what_enforce_would_do():
    pod = pod_view(IMAGE)
    decision = decide(pod, {IMAGE: info(IMAGE, "amd64", "arm64")}, Policy(mode="audit"),
                      learned=LEARNED)
    placed = apply(pod, decision)
    assert "affinity" not in placed["spec"] and "nodeSelector" not in placed["spec"]
    assert ANNOTATION_EXCLUDED not in placed["metadata"]["annotations"]
    assert decision.excluded == {"arm64"} and decision.would == "mutated"


def test_a_pod_pinned_to_the_failed_architecture_keeps_its_pin_with_a_warning():
    pod = pod_view(IMAGE, nodeSelector={"kubernetes.io/arch": "arm64"})
    decision = decide(pod, {IMAGE: info(IMAGE, "amd64", "arm64")}, Policy(), learned=LEARNED)
    assert decision.allowed and decision.conflict.endswith("(amd64)")
    denied = decide(pod, {IMAGE: info(IMAGE, "amd64", "arm64")},
                    Policy(deny_on_conflict=True), learned=LEARNED)
    assert not denied.allowed


def test_a_gated_pod_is_released_with_the_same_exclusion():
    obj = {"apiVersion": "v1", "kind": "Pod",
           "metadata": {"name": "p", "namespace": "shop", "labels": {"archway.dev/gated": "true"}},
           "spec": {"containers": [{"name": "c", "image": IMAGE}],
                    "schedulingGates": [{"name": "archway.dev/resolving"}]}}
    release = plan_release(obj, {IMAGE: info(IMAGE, "amd64", "arm64")}, Policy(), expired=False,
                           learned=LEARNED)
    assert release.pod["spec"]["nodeSelector"] == {"kubernetes.io/arch": "amd64"}
    assert "placed on amd64" in release.note
    assert release.pod["metadata"]["annotations"][ANNOTATION_EXCLUDED] == "arm64"


# --- the owner chain ---------------------------------------------------------------------------

def obj(kind, name, owner=None, annotations=None, template_images=()):
    meta = {"name": name, "namespace": "shop", "uid": f"uid-{name}",
            "annotations": annotations or {}}
    if owner:
        meta["ownerReferences"] = [{"kind": owner[0], "name": owner[1], "controller": True},
                                   {"kind": "Other", "name": "not-the-controller"}]
    template = {"spec": {"containers": [{"name": "c", "image": i} for i in template_images],
                         "serviceAccountName": "runner",
                         "imagePullSecrets": [{"name": "pull"}]}}
    spec = {"jobTemplate": {"spec": {"template": template}}} if kind == "CronJob" \
        else {"template": template}
    return {"kind": kind, "metadata": meta, "spec": spec}


def cache(*objects):
    facts = {(o["kind"], o["metadata"]["name"]): workload_facts(o["kind"])(o) for o in objects}
    return lambda kind, namespace, name: facts.get((kind, name))


def test_the_top_workload_of_a_pod():
    lookup = cache(obj("Deployment", "web", annotations={ANNOTATION_FAILED: "arm64", "x": "y"},
                       template_images=(IMAGE,)),
                   obj("ReplicaSet", "web-5d8", ("Deployment", "web")),
                   obj("CronJob", "nightly", template_images=("reg.example/job:1",)),
                   obj("Job", "nightly-28", ("CronJob", "nightly")),
                   obj("StatefulSet", "db"), obj("Job", "once"),
                   obj("ReplicaSet", "rollout-7", ("Rollout", "canary")),
                   obj("ReplicaSet", "orphan-1", ("Deployment", "deleted")))
    web = top_workload("shop", ("ReplicaSet", "web-5d8"), lookup)
    assert (web.kind, web.object_name) == ("Deployment", "web")
    assert web.annotations == ((ANNOTATION_FAILED, "arm64"),)   # archway's only
    assert web.learned.architectures == {"arm64"} and web.learned.workload == "Deployment web"
    assert web.images == (IMAGE,)
    view = web.template_view()
    assert (view.service_account, view.pull_secret_names, view.images) == ("runner", ("pull",),
                                                                          (IMAGE,))
    nightly = top_workload("shop", ("Job", "nightly-28"), lookup)
    assert (nightly.kind, nightly.images) == ("CronJob", ("reg.example/job:1",))
    assert top_workload("shop", ("StatefulSet", "db"), lookup).kind == "StatefulSet"
    assert top_workload("shop", ("Job", "once"), lookup).object_name == "once"
    # Controlled by a kind archway does not know: the ReplicaSet is the top it knows.
    assert top_workload("shop", ("ReplicaSet", "rollout-7"), lookup).object_name == "rollout-7"
    # A link not known (yet), no controller, a kind archway does not know: none.
    assert top_workload("shop", ("ReplicaSet", "orphan-1"), lookup) is None
    assert top_workload("shop", ("ReplicaSet", "unknown"), lookup) is None
    assert top_workload("shop", None, lookup) is None
    assert top_workload("shop", ("Node", "x"), lookup) is None


def _following(workloads):
    """The caches as if their first lists were in and their watches open."""
    for cache in workloads.caches.values():
        cache._current.set()
    return workloads


def _owned_by(kind, name, uid="u"):
    return PodView.of({"metadata": {"namespace": "shop", "name": "p", "ownerReferences": [
        {"kind": kind, "name": name, "uid": uid, "controller": True}]}, "spec": {}})


def _owner_waits():
    return {result: metrics.OWNER_WAITS.labels(result)._value.get()
            for result in ("found", "missed", "busy", "not_watching", "missed_before")}


def test_a_controller_the_watch_has_not_brought_yet_is_waited_for_within_the_time_given():
    """A Deployment's new ReplicaSet, a CronJob's Job: its first pods may be admitted before the
    webhook's watch has it. Admission gives the watch the time it may spend on the API."""
    workloads = _following(WorkloadCache(lambda: None))
    deployment = obj("Deployment", "web", annotations={ANNOTATION_FAILED: "arm64"})
    workloads.caches["Deployment"]._upsert(workload_facts("Deployment")(deployment))

    arrives = threading.Timer(0.2, lambda: workloads.caches["ReplicaSet"]._upsert(
        workload_facts("ReplicaSet")(obj("ReplicaSet", "web-5d8", ("Deployment", "web")))))
    started = time.monotonic()
    arrives.start()
    try:
        top = workloads.top_of(_owned_by("ReplicaSet", "web-5d8"), timeout=10)
    finally:
        arrives.cancel()
    assert top is not None and top.learned.architectures == {"arm64"}
    assert 0.15 < time.monotonic() - started < 5
    # A link that never comes costs the time given, and no more; none given, none spent.
    started = time.monotonic()
    assert workloads.top_of(_owned_by("Job", "gone"), timeout=0.3) is None
    assert 0.3 <= time.monotonic() - started < 2
    started = time.monotonic()
    assert workloads.top_of(_owned_by("Job", "gone")) is None
    # A kind archway does not watch is never waited for.
    assert workloads.top_of(_owned_by("Rollout", "canary"), timeout=10) is None
    assert time.monotonic() - started < 1


def test_a_missing_controller_is_waited_for_by_a_few_pods_at_once_only_while_the_watch_follows():
    """Any pod's author may name a controller that never comes: the wait holds a handler thread,
    so only `waits_at_once` admissions wait at once (the others are answered at once, as with no
    controller), none while the watch is not following the API (a list brings nothing sooner),
    and none again for a controller a whole wait missed."""
    workloads = WorkloadCache(lambda: None, waits_at_once=1)
    before = _owner_waits()
    started = time.monotonic()
    assert workloads.top_of(_owned_by("ReplicaSet", "made-up"), timeout=10) is None
    assert time.monotonic() - started < 1, "waited while no watch follows the API"

    _following(workloads)
    waiting = threading.Thread(target=workloads.top_of,
                               args=(_owned_by("ReplicaSet", "made-up", "u1"), 1.0))
    waiting.start()
    time.sleep(0.2)
    started = time.monotonic()
    assert workloads.top_of(_owned_by("ReplicaSet", "made-up-too", "u2"), timeout=10) is None
    assert time.monotonic() - started < 0.5, "a second admission waited beside the first"
    waiting.join()
    # The controller the first wait missed is not waited for again...
    started = time.monotonic()
    assert workloads.top_of(_owned_by("ReplicaSet", "made-up", "u1"), timeout=10) is None
    assert time.monotonic() - started < 0.5
    # ...but another one is, and one that arrives is found.
    arrives = threading.Timer(0.2, lambda: workloads.caches["ReplicaSet"]._upsert(
        workload_facts("ReplicaSet")(obj("ReplicaSet", "web-5d8"))))
    arrives.start()
    assert workloads.top_of(_owned_by("ReplicaSet", "web-5d8"), timeout=10) is not None
    after = _owner_waits()
    assert {k: after[k] - before[k] for k in after} == {
        "found": 1, "missed": 1, "busy": 1, "not_watching": 1, "missed_before": 1}


def test_workload_facts_skip_what_is_not_a_workload():
    assert workload_facts("Deployment")({"metadata": {"name": "x"}}) is None
    assert workload_facts("Deployment")("junk") is None
    odd = workload_facts("Deployment")({"metadata": {"name": "x", "namespace": "n"},
                                        "spec": {"template": {"spec": {"containers": "no"}}}})
    assert odd.images == () and odd.owner is None


def test_paths_and_tag_keys():
    assert workload_path("CronJob", "ops", "nightly") == "/apis/batch/v1/namespaces/ops/cronjobs/nightly"
    assert workload_path("Deployment", "shop", "web") == "/apis/apps/v1/namespaces/shop/deployments/web"
    assert tag_key("nginx:1") == "docker.io/library/nginx:1"
    assert tag_key(f"reg.example/app@{D1}") is None             # a digest cannot move
    assert tag_key("https://files.example/tools/x.sif") is None  # no tag to HEAD
    assert tag_key("::not an image::") is None


# --- the ceiling and report ----------------------------------------------------------------------

def test_the_utilisation_ceiling_turns_away_busy_links_unless_every_one_is_busy():
    loads = {"busy": NodeLoad(90.0, 100.0), "calm": NodeLoad(10.0, 100.0),
             "no-speed": NodeLoad(1e9, None), "edge": NodeLoad(80.0, 100.0)}
    busy, everyone = utilisation_ceiling(loads, ["busy", "calm", "no-speed", "edge", "unknown"], 0.8)
    assert busy == {"busy": "link utilisation 90% is above extender.max_utilisation (80%)"}
    assert not everyone
    assert utilisation_ceiling(loads, ["busy"], 0.8) == ({}, True)
    # A node whose load is unknown is never above: one of them keeps the ceiling on.
    assert utilisation_ceiling(loads, ["busy", "no-speed"], 0.8) == (
        {"busy": "link utilisation 90% is above extender.max_utilisation (80%)"}, False)
    assert utilisation_ceiling(loads, [], 0.8) == ({}, False)


def test_the_ceiling_is_a_fraction_off_by_default():
    assert config_from_dict({}).extender.max_utilisation is None
    assert config_from_dict({"extender": {"max_utilisation": 0.8}}).extender.max_utilisation == 0.8
    assert config_from_dict({"extender": {"max_utilisation": 1}}).extender.max_utilisation == 1.0
    for bad in (0, 1.5, -0.1, "80%", True):
        with pytest.raises(ConfigError, match="extender.max_utilisation must be a fraction"):
            config_from_dict({"extender": {"max_utilisation": bad}})
    remediation = config_from_dict({}).remediation
    assert (remediation.learn_failed_architectures, remediation.evict,
            remediation.watch_tags) == (True, True, True)     # evict: on by default


def test_report_flags_the_architectures_a_workloads_pods_run_on_that_its_images_lack():
    owners = {("ReplicaSet", "shop", "web-5d8"): ("Deployment", "web"),
              ("Job", "ops", "nightly-28"): ("CronJob", "nightly"),
              ("ReplicaSet", "shop", "lone"): None}
    pods = [("shop", "web-5d8-a", ("ReplicaSet", "web-5d8"), "arm64-1"),
            ("shop", "web-5d8-b", ("ReplicaSet", "web-5d8"), "amd64-1"),
            ("ops", "nightly-28-x", ("Job", "nightly-28"), "amd64-2"),
            ("shop", "lone-x", ("ReplicaSet", "lone"), "ppc64le-1"),
            ("ops", "debug", None, "arm64-2"),
            ("ops", "ghost", None, "gone-node")]
    nodes = {"arm64-1": "arm64", "arm64-2": "arm64", "amd64-1": "amd64", "amd64-2": "amd64",
             "ppc64le-1": "ppc64le"}
    assert running_architectures(pods, owners, nodes) == {
        ("Deployment", "shop", "web"): {"amd64", "arm64"},
        ("CronJob", "ops", "nightly"): {"amd64"},
        ("ReplicaSet", "shop", "lone"): {"ppc64le"},
        ("Pod", "ops", "debug"): {"arm64"}}
    (workload,) = workloads_in([{"kind": "Deployment", "metadata": {"name": "web",
                                                                     "namespace": "shop"},
                                 "spec": {"template": {"spec": {"containers": [
                                     {"name": "c", "image": IMAGE}]}}}}])
    pod = PodView.of(workload.pod)
    row = assess(workload, pod, {IMAGE: info(IMAGE, "amd64")}, None, frozenset({"amd64", "arm64"}))
    assert row.not_offered == ("arm64",)
    assert assess(workload, pod, {IMAGE: info(IMAGE, "amd64", "arm64")}, None,
                  frozenset({"amd64", "arm64"})).not_offered == ()
    # Images archway could not read say nothing about what they offer.
    assert assess(workload, pod, {IMAGE: DeadlineExceeded("slow")}, None,
                  frozenset({"arm64"})).not_offered == ()


# --- admission: the workload found in memory ---------------------------------------------------

class Workloads:
    """The workload caches as admission sees them: counted, never a request."""

    def __init__(self, tops, synced=True):
        self.tops, self.synced = tops, synced
        self.waits, self.asked, self.timeouts = [], [], []

    def wait_synced(self, timeout):
        self.waits.append(timeout)
        return self.synced

    def top_of(self, pod, timeout=0.0):
        self.asked.append(pod.owner_references[0].name)
        self.timeouts.append(timeout)
        return self.tops.get(pod.owner_references[0].name)


def test_admission_applies_what_the_pods_workload_learned_from_its_cache():
    web = workload_facts("Deployment")(obj("Deployment", "web", annotations=merged_annotations(
        {}, "arm64", [Evidence(IMAGE, D1, "arm64")])))
    cache = Workloads({"web-5d8": web})
    svc = service(Resolver({IMAGE: info(IMAGE, "amd64", "arm64")}), workloads=cache)
    owned = json.loads(review(IMAGE))
    owned["request"]["object"]["metadata"]["ownerReferences"] = [
        {"apiVersion": "apps/v1", "kind": "ReplicaSet", "name": "web-5d8", "uid": "u",
         "controller": True}]
    answer = response(svc.review(json.dumps(owned).encode()))
    patch = json.loads(base64.b64decode(answer["patch"]))
    placed = jsonpatch.apply_patch({"metadata": {}, "spec": {}}, patch)
    assert placed["spec"]["nodeSelector"] == {"kubernetes.io/arch": "amd64"}
    assert placed["metadata"]["annotations"][ANNOTATION_EXCLUDED] == "arm64"
    assert answer["warnings"][0].startswith("kept off arm64: pods of Deployment web failed")
    assert cache.asked == ["web-5d8"]
    # A controller not yet in the cache may be waited for within the API's share of the deadline.
    assert 0 < cache.timeouts[0] <= 3.0 * 0.4 + 1e-9
    # A pod no controller owns costs no look at all.
    response(svc.review(review(IMAGE)))
    assert cache.asked == ["web-5d8"] and len(cache.waits) == 1
    # Caches not listed yet: wait at most the API's share of the deadline, then decide without.
    unsynced = Workloads({"web-5d8": web}, synced=False)
    svc = service(Resolver({IMAGE: info(IMAGE, "amd64", "arm64")}), workloads=unsynced)
    answer = response(svc.review(json.dumps(owned).encode()))
    placed = jsonpatch.apply_patch({"metadata": {}, "spec": {}}, json.loads(
        base64.b64decode(answer["patch"])))
    assert "nodeSelector" not in placed["spec"] and unsynced.asked == []
    assert unsynced.waits == [pytest.approx(3.0 * 0.4)]
