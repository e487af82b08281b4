"""The closed loop's decisions, without I/O: which failed container's log is worth reading (and
which instance's), what a log tail says, the budget of reads, and whether a pod's controller
chain is real. The statuses are what a real kubelet writes (containerd 1.6.20 + runc 1.1.5,
measured: issue 27): an exec format error ends `terminated: {exitCode: 1, reason: Error}` with
no message; the words are only in the container's log."""
import json

import pytest

from archway.cluster.workloadcache import controlling_workload, selector_matches, workload_facts
from archway.gate.failingpods import explained_failures, failing_pod
from archway.gate.logreads import LogReadBudget
from archway.gate.podstatus import LogRead, log_reads, log_wording
from archway.placement.learning import Evidence, Learned
from archway.podview import OwnerReference

D1 = "sha256:" + "1" * 64
STARTED, FINISHED = "2026-11-27T10:00:00Z", "2026-11-27T10:00:01Z"


def terminated(exit_code=1, reason="Error", container_id="containerd://abc", **extra):
    return {"exitCode": exit_code, "reason": reason, "startedAt": STARTED,
            "finishedAt": FINISHED, **({"containerID": container_id} if container_id else {}),
            **extra}


def never_restarted(**record):
    """restartPolicy Never: the container's one instance terminated (measured)."""
    return {"name": "c", "ready": False, "restartCount": 0, "started": False,
            "image": "reg.example/app:1", "imageID": f"reg.example/app@{D1}",
            "state": {"terminated": terminated(**record)}}


def crash_looping(**record):
    """restartPolicy Always: back-off after a failed instance (measured)."""
    return {"name": "c", "ready": False, "restartCount": 4, "started": False,
            "image": "reg.example/app:1", "imageID": f"reg.example/app@{D1}",
            "state": {"waiting": {"reason": "CrashLoopBackOff",
                                  "message": "back-off 1m20s restarting failed container=c "
                                             "pod=web-1_shop(u)"}},
            "lastState": {"terminated": terminated(**record)}}


def pod_with(*statuses, init=(), labels=None, owner=True, node="arm64-1", restart_policy=None):
    meta = {"name": "web-1", "namespace": "shop", "uid": "u-1",
            "labels": labels if labels is not None else {"app": "web"}}
    if owner:
        meta["ownerReferences"] = [{"apiVersion": "apps/v1", "kind": "ReplicaSet",
                                    "name": "web-5d8", "uid": "rs-uid", "controller": True}]
    spec = {"containers": [{"name": "c", "image": "reg.example/app:1"}],
            "initContainers": [{"name": "setup", "image": "reg.example/setup:2"}]}
    if node:
        spec["nodeName"] = node
    if restart_policy:
        spec["restartPolicy"] = restart_policy
    return {"metadata": meta, "spec": spec,
            "status": {"containerStatuses": list(statuses), "initContainerStatuses": list(init)}}


def test_a_failed_instance_with_no_message_is_worth_its_current_log():
    (read,) = log_reads(pod_with(never_restarted(), restart_policy="Never"))
    assert read == LogRead("c", "reg.example/app:1", D1, previous=False,
                           episode="containerd://abc")


@pytest.mark.parametrize("restart_policy", [None, "Always", "OnFailure"])
def test_a_container_that_restarts_is_read_in_its_back_off_not_just_terminated(restart_policy):
    """Seen on the real node: the kubelet restarted the container at once, the "current" log
    read right after its first failure was the new, empty instance's, and nothing was learned."""
    assert log_reads(pod_with(never_restarted(), restart_policy=restart_policy)) == ()
    (read,) = log_reads(pod_with(crash_looping(), restart_policy=restart_policy))
    assert read.previous is True


def test_a_crash_loop_reads_the_previous_instance_and_the_same_instance_is_one_episode():
    (read,) = log_reads(pod_with(crash_looping()))
    assert read.previous is True
    # The instance seen terminated, then as lastState of the back-off: one episode, one read.
    assert read.episode == log_reads(pod_with(never_restarted(), restart_policy="Never"))[0].episode
    # Without a container ID (some statuses lack it) the instance is named by its times.
    (a,) = log_reads(pod_with(crash_looping(container_id="")))
    (b,) = log_reads(pod_with(crash_looping(container_id="", finishedAt="2026-11-27T10:05:00Z")))
    assert a.episode != b.episode


def test_init_containers_are_read_too():
    setup = dict(never_restarted(), name="setup")
    (read,) = log_reads(pod_with(init=[setup], restart_policy="Never"))
    assert (read.container, read.image) == ("setup", "reg.example/setup:2")


@pytest.mark.parametrize("status", [
    {"name": "c", "state": {"running": {"startedAt": STARTED}}},                 # running
    {"name": "c", "state": {"running": {}}, "lastState": {"terminated": terminated()}},
    {"name": "c", "state": {"waiting": {"reason": "ContainerCreating"}}},         # starting
    never_restarted(exit_code=0, reason="Completed"),                             # a success
    crash_looping(exit_code=0, reason="Completed"),
    never_restarted(message="exec /app: exec format error"),   # the status says it: no read
    never_restarted(message="OOMKilled"),
    {"name": "c", "state": {"terminated": {"exitCode": "1"}}},                     # odd shapes
    {"name": "c", "state": "terminated"},
])
def test_nothing_is_read_for_a_container_that_is_not_failing_silently(status):
    assert log_reads(pod_with(status)) == ()


@pytest.mark.parametrize("tail, wording", [
    ("exec /hello: exec format error\n", "exec format error"),                   # runc
    ("bash: /hello: cannot execute binary file: Exec format error\n", "Exec format error"),
    ("sh: /hello: cannot execute binary file\n", "cannot execute binary file"),
    ("/hello: line 1: \x7fELF\x02\x01\x01: not found\n"                           # busybox sh
     "/hello: line 2: syntax error: unterminated quoted string\n", None),
    ("", None),
    ("panic: listen tcp :80: bind: address already in use\n", None),
])
def test_what_a_log_tail_says(tail, wording):
    assert log_wording(tail) == wording


def test_a_silently_failed_pod_is_kept_with_its_reads_and_a_healthy_one_is_not():
    failing = failing_pod(pod_with(crash_looping()))
    assert failing.failures == () and [r.previous for r in failing.log_reads] == [True]
    assert failing.labels == (("app", "web"),)
    assert failing_pod(pod_with({"name": "c", "state": {"running": {}}})) is None
    assert failing_pod(pod_with(crash_looping(), node=None)) is None
    # A status that says it is read there, and its log is not read as well.
    said = failing_pod(pod_with(crash_looping(message="exec /app: exec format error")))
    assert [f.source for f in said.failures] == ["status"] and said.log_reads == ()


def test_the_budget_caps_reads_per_workload_and_per_minute_in_all():
    now = [0.0]
    budget = LogReadBudget(per_workload=2, per_minute=3, clock=lambda: now[0])
    assert [budget.take("shop/web") for _ in range(2)] == [0.0, 0.0]
    assert budget.take("shop/web") == pytest.approx(60.0)      # web's two this minute
    assert budget.take("shop/api") == 0.0
    assert budget.take("shop/db") == pytest.approx(60.0)       # three in all this minute
    now[0] = 30.0
    assert budget.take("shop/db") == pytest.approx(30.0)
    now[0] = 60.0
    assert budget.take("shop/web") == 0.0 and budget.take("shop/db") == 0.0


# --- the controller chain ------------------------------------------------------------------

def objects():
    deployment = {"kind": "Deployment", "metadata": {"name": "web", "namespace": "shop",
                                                     "uid": "dep-uid"},
                  "spec": {"selector": {"matchLabels": {"app": "web"}},
                           "template": {"spec": {"containers": [{"name": "c", "image": "x"}]}}}}
    replica_set = {"kind": "ReplicaSet", "metadata": {
        "name": "web-5d8", "namespace": "shop", "uid": "rs-uid", "ownerReferences": [
            {"kind": "Deployment", "name": "web", "uid": "dep-uid", "controller": True}]},
        "spec": {"selector": {"matchLabels": {"app": "web"}, "matchExpressions": [
            {"key": "pod-template-hash", "operator": "In", "values": ["5d8"]}]},
                 "template": {"spec": {"containers": [{"name": "c", "image": "x"}]}}}}
    return {(o["kind"], o["metadata"]["name"]): workload_facts(o["kind"])(o)
            for o in (deployment, replica_set)}


def lookup_in(facts):
    return lambda kind, namespace, name: facts.get((kind, name))


def owner(kind="ReplicaSet", name="web-5d8", uid="rs-uid"):
    return OwnerReference("apps/v1", kind, name, uid, True)


LABELS = {"app": "web", "pod-template-hash": "5d8"}


def test_a_pod_its_replica_set_made_leads_to_the_deployment():
    top = controlling_workload("shop", owner(), LABELS, lookup_in(objects()))
    assert (top.kind, top.object_name) == ("Deployment", "web")


@pytest.mark.parametrize("claimed, labels", [
    (owner(kind="Deployment", name="web", uid="dep-uid"), LABELS),  # no pod is a Deployment's
    (owner(uid="another-uid"), LABELS),                 # a ReplicaSet of that name, not this one
    (owner(uid=""), LABELS),
    (owner(), {"app": "web"}),                          # labels its selector does not select
    (owner(), {}),
    (owner(name="gone"), LABELS),
    (None, LABELS),
])
def test_a_forged_controller_reference_leads_nowhere(claimed, labels):
    assert controlling_workload("shop", claimed, labels, lookup_in(objects())) is None


def test_a_link_whose_owner_is_another_object_under_that_name_leads_nowhere():
    facts = objects()
    deployment = facts[("Deployment", "web")]
    import dataclasses
    facts[("Deployment", "web")] = dataclasses.replace(deployment, uid="recreated")
    assert controlling_workload("shop", owner(), LABELS, lookup_in(facts)) is None


@pytest.mark.parametrize("selector, labels, selects", [
    ({"matchLabels": {"a": "1"}}, {"a": "1", "b": "2"}, True),
    ({"matchLabels": {"a": "1"}}, {"a": "2"}, False),
    ({"matchExpressions": [{"key": "a", "operator": "NotIn", "values": ["1"]}]}, {}, True),
    ({"matchExpressions": [{"key": "a", "operator": "Exists"}]}, {}, False),
    ({"matchExpressions": [{"key": "a", "operator": "DoesNotExist"}]}, {"a": "x"}, False),
    ({"matchExpressions": [{"key": "a", "operator": "Gt", "values": ["1"]}]}, {"a": "2"}, False),
    (None, {"a": "1"}, False),                                    # no selector selects nothing
])
def test_label_selectors(selector, labels, selects):
    facts = workload_facts("ReplicaSet")({"metadata": {"name": "x", "namespace": "n"},
                                          "spec": {"selector": selector}})
    assert selector_matches(facts.selector, labels) is selects


# --- what the workload learned explains ---------------------------------------------------

def test_a_silent_failure_of_the_image_and_digest_its_workload_failed_with_needs_no_log_read():
    """Another replica's log taught the workload that this image at this digest fails on arm64:
    this pod's silent failure there is the same one (its binaries cannot run there), so it is
    acted on without reading its log; anything else is still read."""
    pod = failing_pod(pod_with(crash_looping()))
    reads = list(pod.log_reads)
    learned = Learned(frozenset({"arm64"}), (Evidence("reg.example/app:1", D1, "arm64"),),
                      "Deployment web")
    (failure,) = explained_failures(pod, reads, learned, "arm64")
    assert (failure.container, failure.image, failure.digest, failure.source) == \
        ("c", "reg.example/app:1", D1, "evidence")
    assert "its log is not read again" in failure.where
    other_digest = Learned(frozenset({"arm64"}), (Evidence("reg.example/app:1", "sha256:" + "2" * 64,
                                                           "arm64"),), "Deployment web")
    other_image = Learned(frozenset({"arm64"}), (Evidence("reg.example/other:1", D1, "arm64"),),
                          "Deployment web")
    by_hand = Learned(frozenset({"arm64"}), (), "Deployment web")   # no evidence: proves nothing
    for what in (other_digest, other_image, by_hand, None):
        assert explained_failures(pod, reads, what, "arm64") == ()
    assert explained_failures(pod, reads, learned, "amd64") == ()   # learned of another arch


def test_the_evidence_names_the_digest_the_pod_was_admitted_with_not_the_runtimes_other_names():
    """containerd merges every reference to the same image content, and a container status'
    imageID names the first of them: after another repository (or an older index of the tag)
    pulled the same binary, it names that one. Evidence with that digest would never match an
    admission again and the exclusion would reset at once: a scale-up back on the failing
    architecture. The digest archway admitted the pod with is what admission compares to."""
    admitted = "sha256:" + "a" * 64
    obj = pod_with(crash_looping(message="exec /app: exec format error"))
    obj["status"]["containerStatuses"][0]["imageID"] = f"reg.example/aaa-other-repo@{D1}"
    obj["metadata"]["annotations"] = {"archway.dev/images": json.dumps(
        [{"image": "reg.example/app:1", "digest": admitted}])}
    pod = failing_pod(obj)
    (failure,) = pod.failures
    assert failure.digest == D1                          # what the status says...
    assert pod.evidence("arm64", pod.failures) == [      # ... and what is learned
        Evidence("reg.example/app:1", admitted, "arm64")]
    learned = Learned(frozenset({"arm64"}), tuple(pod.evidence("arm64", pod.failures)), "web")
    silent = failing_pod({**pod_with(crash_looping()), "metadata": obj["metadata"]})
    assert [f.digest for f in explained_failures(silent, list(silent.log_reads), learned,
                                                 "arm64")] == [admitted]
    # A pod archway did not annotate: the status' digest is all there is.
    del obj["metadata"]["annotations"]
    bare = failing_pod(obj)
    assert bare.evidence("arm64", bare.failures)[0].digest == D1
