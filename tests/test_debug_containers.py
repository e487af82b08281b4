"""Debug containers (`kubectl debug`, an UPDATE of pods/ephemeralcontainers): the pure decision
(placement/debugcontainers.py) and the service's answer (webhook/debugservice.py) over the
stand-ins of test_service.py. The HTTP and real-apiserver paths: test_debug_containers_http.py,
tests/e2e/test_debug_containers.py."""
import json

import pytest

from archway.cluster.nodes import NodeFacts, node_facts
from archway.errors import DeadlineExceeded, NotFound
from archway.placement.debugcontainers import NodePlatform, decide_debug, read_debug_request
from archway.placement.namespaces import NamespaceFacts
from archway.podview import PodShapeError
from archway.registry.model import ImageInfo
from tests.test_service import Cache, Events, Resolver, Secrets, info, response, service

ARM = "reg/tools:arm64"
MULTI = "reg/tools:multi"
WINDOWS = "reg/tools:windows"
AMD64_NODE = NodePlatform("amd64-1", "amd64")

RESULTS = {ARM: info(ARM, "linux/arm64"), MULTI: info(MULTI, "linux/amd64", "linux/arm64"),
           WINDOWS: info(WINDOWS, "windows/amd64"),
           "reg/sif:1": ImageInfo("reg/sif:1", frozenset(), None, "sif-oras", note="arch 00")}


# --- the pure decision ------------------------------------------------------------------------

def test_an_image_without_the_nodes_architecture_is_a_warning_by_default():
    decision = decide_debug((ARM,), RESULTS, AMD64_NODE, "warn")
    assert decision.allowed and decision.outcome == "warned" and decision.cannot_run == (ARM,)
    (warning,) = decision.warnings
    assert warning == ("debug image reg/tools:arm64 cannot run on node amd64-1 (linux/amd64): "
                       "it has linux/arm64")


def test_deny_refuses_with_the_node_and_the_setting_named():
    decision = decide_debug((MULTI, ARM), RESULTS, AMD64_NODE, "deny")
    assert not decision.allowed and decision.outcome == "denied"
    assert "reg/tools:arm64" in decision.message and "amd64-1 (linux/amd64)" in decision.message
    assert "admission.debug_containers is deny" in decision.message
    assert "multi" not in decision.message


@pytest.mark.parametrize("image", [MULTI, "reg/sif:1"])
def test_an_image_with_the_nodes_platform_or_no_platform_at_all_passes(image):
    decision = decide_debug((image,), RESULTS, AMD64_NODE, "deny")
    assert decision.allowed and decision.outcome == "unchanged" and not decision.warnings


def test_the_nodes_os_counts_not_only_its_architecture():
    """A Windows-only image has amd64, but not for the Linux node; on a Windows node it runs."""
    assert decide_debug((WINDOWS,), RESULTS, AMD64_NODE, "deny").outcome == "denied"
    windows = NodePlatform("win-1", "amd64", "windows")
    assert decide_debug((WINDOWS,), RESULTS, windows, "deny").outcome == "unchanged"
    assert decide_debug((MULTI,), RESULTS, windows, "deny").outcome == "denied"


@pytest.mark.parametrize("node, words", [
    (None, "its node is not known to archway"),
    (NodePlatform("odd-1", None), "node odd-1 has no kubernetes.io/arch"),
])
def test_an_unknown_node_is_a_warning_never_a_refusal(node, words):
    decision = decide_debug((ARM,), RESULTS, node, "deny")
    assert decision.allowed and decision.outcome == "fail_open"
    assert decision.warnings == (f"archway did not check the debug image: {words}",)


@pytest.mark.parametrize("result", [None, DeadlineExceeded("slow"), NotFound("gone")])
def test_an_unread_image_is_a_warning_never_a_refusal(result):
    results = {"reg/new:1": result} if result is not None else {}
    decision = decide_debug(("reg/new:1",), results, AMD64_NODE, "deny")
    assert decision.allowed and decision.outcome == "fail_open"
    (warning,) = decision.warnings
    assert warning.startswith("could not inspect debug image reg/new:1 (") and "not checked" in warning


def test_off_and_audit():
    assert decide_debug((ARM,), RESULTS, AMD64_NODE, "off").warnings == ()
    audited = decide_debug((ARM,), RESULTS, AMD64_NODE, "deny", audit=True)
    assert audited.allowed and audited.outcome == "audited"
    assert audited.warnings[0] == "audit mode: archway would have refused this debug container"


def test_long_names_still_give_warnings_the_reply_can_hold():
    image = "registry.example.com/" + "a" * 150 + ":1"
    node = NodePlatform("n" * 200, "amd64")
    decision = decide_debug((image,), {image: info(image, "linux/arm64")}, node, "warn")
    (warning,) = decision.warnings
    assert len(warning) <= 120 and "cannot run on node nnn" in warning and "(linux/amd64)" in warning


# --- reading the request ----------------------------------------------------------------------

def pod(*ephemeral, node="amd64-1"):
    spec = {"containers": [{"name": "app", "image": "reg/app:1"}], "nodeName": node}
    if ephemeral:
        spec["ephemeralContainers"] = [
            {"name": name, "image": image, **({"imagePullPolicy": policy} if policy else {})}
            for name, image, policy in ephemeral]
    return {"apiVersion": "v1", "kind": "Pod", "spec": spec,
            "metadata": {"name": "x", "namespace": "shop", "uid": "u-1"}}


def test_only_the_added_containers_images_are_read():
    old = pod(("debugger-1", ARM, None))
    new = pod(("debugger-1", ARM, None), ("debugger-2", MULTI, "Always"), ("debugger-3", "", None))
    request = read_debug_request(new, old)
    assert request.images == (MULTI,) and request.always_pulled == frozenset({MULTI})
    assert request.pod.node_name == "amd64-1" and request.pod.uid == "u-1"


@pytest.mark.parametrize("new, old, words", [
    (pod(), "x", "oldObject must be a pod"),
    ({**pod(), "spec": {"ephemeralContainers": "sh"}}, pod(), "ephemeralContainers must be a list"),
    ({**pod(), "spec": {"ephemeralContainers": [{"name": "d", "image": 5}]}}, pod(),
     "not a string"),
    ({**pod(), "spec": {"containers": "nginx"}}, pod(), "object: spec.containers"),
])
def test_a_malformed_pod_names_the_field(new, old, words):
    with pytest.raises(PodShapeError, match=words):
        read_debug_request(new, old)


def test_the_node_cache_reads_the_nodes_os_label():
    node = {"metadata": {"name": "w", "labels": {"kubernetes.io/os": "windows",
                                                 "kubernetes.io/arch": "amd64"}}}
    assert node_facts(node).os == "windows"
    assert node_facts({"metadata": {"name": "l"}}).os == "linux"


# --- the service's answer ---------------------------------------------------------------------

def debug_review(image, *, node="amd64-1", namespace="shop", operation="UPDATE",
                 sub_resource="ephemeralcontainers", old=None, dry_run=False):
    new = pod(("debugger-abc", image, None), node=node)
    new["metadata"]["namespace"] = namespace
    return json.dumps({"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
                       "request": {"uid": "u", "operation": operation, "namespace": namespace,
                                   "name": "x", "subResource": sub_resource, "dryRun": dry_run,
                                   "kind": {"group": "", "version": "v1", "kind": "Pod"},
                                   "resource": {"group": "", "version": "v1", "resource": "pods"},
                                   "object": new, "oldObject": old or pod(node=node)}}).encode()


NODES = Cache({"amd64-1": NodeFacts("amd64-1", "amd64", ()),
               "win-1": NodeFacts("win-1", "amd64", (), os="windows")})


def test_the_service_warns_records_an_event_and_never_patches():
    events = Events()
    answer = service(Resolver(RESULTS), events=events, nodes=NODES).review(debug_review(ARM))
    reply = response(answer)
    assert reply["allowed"] and "patch" not in reply and "patchType" not in reply
    assert reply["warnings"][0].startswith("debug image reg/tools:arm64 cannot run on node amd64-1")
    assert reply["auditAnnotations"] == {"outcome": "warned"}
    ((regarding, kind, reason, note),) = events.sent
    assert (regarding, kind, reason) == ("shop/x", "Warning", "ArchwayDebugImageCannotRun")
    assert "reg/tools:arm64" in note


def test_the_service_refuses_with_deny_and_reads_the_pods_pull_secrets():
    secrets = Secrets(warnings=("pull secret regcred not found",))
    answer = service(Resolver(RESULTS), secrets, nodes=NODES, debug_containers="deny").review(
        debug_review(ARM))
    reply = response(answer)
    assert not reply["allowed"] and reply["status"]["code"] == 403
    assert "cannot run there" in reply["status"]["message"]
    assert reply["warnings"][0] == "pull secret regcred not found"
    assert secrets.calls and secrets.calls[0][0].name == "x"


def test_a_windows_node_runs_a_windows_image():
    answer = service(Resolver(RESULTS), nodes=NODES, debug_containers="deny").review(
        debug_review(WINDOWS, node="win-1"))
    assert response(answer)["allowed"] and "warnings" not in response(answer)


@pytest.mark.parametrize("nodes, reads", [
    (Cache({}), False),                      # the node is not in the cache
    (Cache(NODES.items, synced=False), False),   # the first list is not in: no waiting
])
def test_a_node_archway_does_not_know_is_a_warning_at_once(nodes, reads):
    resolver = Resolver(RESULTS)
    answer = service(resolver, nodes=nodes, debug_containers="deny").review(debug_review(ARM))
    reply = response(answer)
    assert reply["allowed"] and reply["auditAnnotations"] == {"outcome": "fail_open"}
    assert "did not check" in reply["warnings"][0]
    assert bool(resolver.calls) == reads and all(t == 0 for t in nodes.waits)


def test_an_image_not_read_in_time_is_a_warning_not_a_gate_nor_a_refusal():
    resolver = Resolver({})   # nothing answered within the deadline
    answer = service(resolver, nodes=NODES, debug_containers="deny",
                     unresolved="deny").review(debug_review(ARM))
    reply = response(answer)
    assert reply["allowed"] and "patch" not in reply
    assert reply["warnings"][0].startswith("could not inspect debug image reg/tools:arm64")
    ((images, _, timeout),) = resolver.calls
    assert images == (ARM,) and 0 < timeout < 3.0


@pytest.mark.parametrize("kw, review_kw", [
    ({"debug_containers": "off"}, {}),
    ({}, {"namespace": "kube-system"}),
    ({}, {"node": ""}),
    ({"nodes": None}, {}),
])
def test_skipped_debug_requests_read_nothing(kw, review_kw):
    resolver = Resolver(RESULTS)
    settings = {"nodes": NODES, **kw}
    reply = response(service(resolver, **settings).review(debug_review(ARM, **review_kw)))
    assert reply["allowed"] and "warnings" not in reply and not resolver.calls


def test_namespace_mode_off_and_audit():
    namespaces = Cache({"quiet": NamespaceFacts("quiet", mode="off"),
                        "watched": NamespaceFacts("watched", mode="audit")})
    svc = service(Resolver(RESULTS), nodes=NODES, namespaces=namespaces, debug_containers="deny")
    assert "warnings" not in response(svc.review(debug_review(ARM, namespace="quiet")))
    audited = response(svc.review(debug_review(ARM, namespace="watched")))
    assert audited["allowed"] and audited["auditAnnotations"] == {"outcome": "audited"}


def test_a_dry_run_records_no_event():
    events = Events()
    service(Resolver(RESULTS), events=events, nodes=NODES).review(debug_review(ARM, dry_run=True))
    assert events.sent == []


def test_a_resolver_bug_is_a_warning_not_a_500_nor_a_refusal():
    answer = service(Resolver(error=RuntimeError("bug")), nodes=NODES,
                     debug_containers="deny").review(debug_review(ARM))
    reply = response(answer)
    assert reply["allowed"] and "internal error" in reply["warnings"][0]


@pytest.mark.parametrize("change", [
    {"oldObject": None}, {"object": None}, {"object": []}, {"oldObject": "pod"},
])
def test_malformed_ephemeralcontainers_requests_are_400s(change):
    review = json.loads(debug_review(ARM))
    review["request"].update(change)
    answer = service(Resolver(RESULTS), nodes=NODES).review(json.dumps(review).encode())
    assert answer.status == 400 and "request." in answer.body["error"]


@pytest.mark.parametrize("operation, sub_resource", [("UPDATE", ""), ("UPDATE", "status"),
                                                     ("CREATE", "ephemeralcontainers")])
def test_other_pod_updates_keep_their_answer(operation, sub_resource):
    resolver = Resolver(RESULTS)
    review = debug_review(ARM, operation=operation, sub_resource=sub_resource)
    reply = response(service(resolver, nodes=NODES, debug_containers="deny").review(review))
    assert reply == {"uid": "u", "allowed": True} and not resolver.calls
