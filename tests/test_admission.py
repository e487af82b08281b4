"""AdmissionReview parsing, skip rules and the reply envelope (pure; the HTTP path is in
test_admission_http.py)."""
import base64
import copy
import json
import os

import pytest

from archway.placement.decision import Decision
from archway.webhook.admission import (
    AdmissionError,
    BodyTooLarge,
    allow_unchanged,
    parse_review,
    review_response,
    skip_reason,
)
from lab.procs import REPO

FIXTURES = os.path.join(REPO, "tests", "fixtures", "admission")
LIMIT = 3 * 1024 * 1024


def fixture(name) -> dict:
    with open(os.path.join(FIXTURES, name + ".json")) as f:
        return json.load(f)


def body(review) -> bytes:
    return json.dumps(review).encode()


def test_every_fixture_parses():
    names = sorted(f[:-5] for f in os.listdir(FIXTURES) if f.endswith(".json"))
    assert len(names) >= 16
    for name in names:
        review = fixture(name)
        parsed = parse_review(body(review), LIMIT)
        assert parsed.uid == review["request"]["uid"]
        assert parsed.api_version == review["apiVersion"]


def test_controller_pod_without_name_or_namespace():
    parsed = parse_review(body(fixture("v1-pod-multiarch")), LIMIT)
    assert parsed.is_pod_create
    assert parsed.pod.namespace == "shop"          # from request.namespace
    assert parsed.display_name == "shop/web-7d9c5b8f6d-*"


@pytest.mark.parametrize("name, reason", [
    ("v1-configmap-create", "CREATE of configmaps"),
    ("v1-pod-update", "UPDATE of pods"),
    ("v1-pod-opted-out", "annotation archway.dev/skip=true"),
    ("v1-pod-bound-to-node", "spec.nodeName is already set"),
    ("v1-pod-multiarch", None),
])
def test_skip_reasons(name, reason):
    assert skip_reason(parse_review(body(fixture(name)), LIMIT), ("kube-system",)) == reason


def test_excluded_namespace_and_subresource():
    review = fixture("v1-pod-single-arch")
    review["request"]["namespace"] = review["request"]["object"]["metadata"]["namespace"] = "kube-system"
    assert skip_reason(parse_review(body(review), LIMIT), ("kube-system",)) == \
        "namespace kube-system is excluded"
    review = fixture("v1-pod-single-arch")
    review["request"]["subResource"] = "ephemeralcontainers"
    assert skip_reason(parse_review(body(review), LIMIT), ()) == \
        "CREATE of pods/ephemeralcontainers"
    review = fixture("v1-pod-opted-out")
    review["request"]["object"]["metadata"]["annotations"]["archway.dev/skip"] = "false"
    assert skip_reason(parse_review(body(review), LIMIT), ()) is None


def _mutated(path, value):
    review = fixture("v1-pod-single-arch")
    target = review
    *parents, last = path
    for key in parents:
        target = target[key]
    if value is KeyError:
        del target[last]
    else:
        target[last] = value
    return body(review)


MALFORMED = [
    (b"", "not JSON"),
    (b"{not json", "not JSON"),
    (b"\xff\xfe\x00", "not JSON"),
    (b"[1, 2]", "must be a JSON object"),
    (b'"AdmissionReview"', "must be a JSON object"),
    (_mutated(["apiVersion"], "admission.k8s.io/v2"), "apiVersion must be one of"),
    (_mutated(["apiVersion"], KeyError), "apiVersion must be one of"),
    (_mutated(["kind"], "Pod"), "kind must be AdmissionReview"),
    (_mutated(["request"], KeyError), "no request object"),
    (_mutated(["request"], []), "no request object"),
    (_mutated(["request", "uid"], KeyError), "request.uid must be a non-empty string"),
    (_mutated(["request", "uid"], ""), "request.uid must be a non-empty string"),
    (_mutated(["request", "uid"], 42), "request.uid must be a non-empty string"),
    (_mutated(["request", "operation"], "PATCH"), "request.operation must be one of"),
    (_mutated(["request", "namespace"], ["default"]), "request.namespace must be a string"),
    (_mutated(["request", "resource"], "pods"), "request.resource must be an object"),
    (_mutated(["request", "dryRun"], "no"), "request.dryRun must be true or false"),
    (_mutated(["request", "object"], "a pod"), "request.object must be an object"),
    (_mutated(["request", "object"], KeyError), "must hold the pod"),
    (_mutated(["request", "object", "metadata"], 7), "metadata must be a mapping"),
    (_mutated(["request", "object", "metadata", "annotations"], ["a"]), "annotations must be"),
    (_mutated(["request", "object", "spec"], []), "spec must be a mapping"),
    (_mutated(["request", "object", "spec", "containers"], {}), "spec.containers must be a list"),
    (_mutated(["request", "object", "spec", "containers", 0, "image"], 3),
     r"spec.containers\[0\].image must be a string"),
]


@pytest.mark.parametrize("raw, message", MALFORMED)
def test_malformed_bodies_are_typed_400s(raw, message):
    with pytest.raises(AdmissionError, match=message) as caught:
        parse_review(raw, LIMIT)
    assert caught.value.status == 400


def test_oversized_body_is_413():
    with pytest.raises(BodyTooLarge) as caught:
        parse_review(b" " * 101, 100)
    assert caught.value.status == 413


def test_reply_echoes_version_and_uid_and_encodes_the_patch():
    request = parse_review(body(fixture("v1beta1-pod-multiarch")), LIMIT)
    patch = ({"op": "add", "path": "/spec/nodeSelector", "value": {"kubernetes.io/arch": "arm64"}},)
    reply = review_response(request, Decision(allowed=True, patch=patch), warnings=("w",),
                            audit_annotations={"architectures": "arm64"})
    assert reply == {"apiVersion": "admission.k8s.io/v1beta1", "kind": "AdmissionReview",
                     "response": {"uid": "c4d5e6f7-0819-4a23-84c5-d6e7f8091a2d", "allowed": True,
                                  "patchType": "JSONPatch",
                                  "patch": base64.b64encode(json.dumps(list(patch)).encode()).decode(),
                                  "warnings": ["w"],
                                  "auditAnnotations": {"architectures": "arm64"}}}


def test_denial_has_status_and_never_a_patch():
    request = parse_review(body(fixture("v1-pod-conflicting-images")), LIMIT)
    reply = review_response(request, Decision(allowed=False, message="no common arch",
                                              patch=({"op": "add", "path": "/x", "value": 1},)))
    assert reply["response"] == {"uid": request.uid, "allowed": False,
                                 "status": {"code": 403, "reason": "Forbidden",
                                            "message": "no common arch"}}


def test_unchanged_reply_is_minimal():
    request = parse_review(body(fixture("v1-configmap-create")), LIMIT)
    assert allow_unchanged(request)["response"] == {"uid": request.uid, "allowed": True}


def test_parse_does_not_depend_on_key_order_or_extra_fields():
    review = fixture("v1-pod-single-arch")
    review["request"]["futureField"] = {"x": 1}
    shuffled = dict(reversed(list(copy.deepcopy(review).items())))
    assert parse_review(body(shuffled), LIMIT).uid == review["request"]["uid"]


@pytest.mark.parametrize("spec_key, value, message", [
    ("affinity", "everywhere", "spec.affinity must be a mapping"),
    ("affinity", {"nodeAffinity": []}, "spec.affinity.nodeAffinity must be a mapping"),
    ("nodeSelector", ["kubernetes.io/arch=arm64"], "spec.nodeSelector must be a mapping"),
    ("schedulerName", 5, "spec.schedulerName must be a string"),
])
def test_fields_the_decision_reads_are_type_checked(spec_key, value, message):
    review = fixture("v1-pod-single-arch")
    review["request"]["object"]["spec"][spec_key] = value
    with pytest.raises(AdmissionError, match=message):
        parse_review(body(review), LIMIT)
