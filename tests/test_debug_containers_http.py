"""kubectl debug's AdmissionReview (an UPDATE of pods/ephemeralcontainers) posted over real TLS to
a real `archway serve` (test_admission_http.py's world: real registries, the real apiserver for
Nodes, Secrets and Events): the reply warns, never patches, and malformed requests are 400s."""
import json
import uuid

import pytest

from tests.test_admission_http import NS, world

pytestmark = pytest.mark.slow

WINDOWS_NODE = "win-debug-1"


@pytest.fixture(scope="module")
def windows_node(world, control_plane):
    """An API-only Windows node, and an image that exists only for windows/amd64."""
    if not control_plane.kube.exists(f"/api/v1/nodes/{WINDOWS_NODE}"):
        control_plane.add_node(WINDOWS_NODE, "amd64", address="10.244.9.1",
                               labels={"kubernetes.io/os": "windows"})
    world.registry.push_image("archway/windowsonly", "1.0", "windows/amd64")
    return WINDOWS_NODE


def pod(node: str, *ephemeral: tuple[str, str]) -> dict:
    spec = {"containers": [{"name": "app", "image": "busybox"}], "nodeName": node}
    if ephemeral:
        spec["ephemeralContainers"] = [{"name": name, "image": image, "stdin": True, "tty": True,
                                        "terminationMessagePolicy": "File"}
                                       for name, image in ephemeral]
    return {"apiVersion": "v1", "kind": "Pod", "spec": spec,
            "metadata": {"name": "x", "namespace": NS, "uid": str(uuid.uuid4())}}


def debug_review(world, image: str, node: str = "amd64-1", before=()) -> dict:
    image = world.substitute(image)
    old = pod(node, *before)
    new = pod(node, *before, (f"debugger-{uuid.uuid4().hex[:5]}", image))
    new["metadata"]["uid"] = old["metadata"]["uid"]
    return {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
            "request": {"uid": str(uuid.uuid4()), "operation": "UPDATE", "namespace": NS,
                        "name": "x", "subResource": "ephemeralcontainers",
                        "kind": {"group": "", "version": "v1", "kind": "Pod"},
                        "resource": {"group": "", "version": "v1", "resource": "pods"},
                        "requestKind": {"group": "", "version": "v1", "kind": "Pod"},
                        "requestResource": {"group": "", "version": "v1", "resource": "pods"},
                        "requestSubResource": "ephemeralcontainers",
                        "userInfo": {"username": "dev"}, "object": new, "oldObject": old,
                        "dryRun": True,   # no Event about a pod that does not exist
                        "options": {"apiVersion": "meta.k8s.io/v1", "kind": "UpdateOptions"}}}


def wait_for_nodes(world, review):
    """The node cache lists the apiserver's Nodes once, right after start: ask until it has."""
    for _ in range(50):
        response = world.admit(review)
        if "not known to archway" not in " ".join(response.get("warnings", [])):
            return response
        review["request"]["uid"] = str(uuid.uuid4())
    raise AssertionError("the node cache never listed the Nodes")


def test_a_debug_image_without_the_nodes_architecture_is_warned(world):
    review = debug_review(world, "REGISTRY/archway/arm64only:1.0")
    response = wait_for_nodes(world, review)
    assert response["allowed"] and "patch" not in response and "patchType" not in response
    assert response["warnings"] == [
        f"debug image {world.registry.host}/archway/arm64only:1.0 cannot run on node amd64-1 "
        "(linux/amd64): it has linux/arm64"]
    assert response["auditAnnotations"] == {"outcome": "warned"}
    line = [ln for ln in world.full_log().splitlines() if f"uid={review['request']['uid']} " in ln]
    assert line and "debug images=1 node=amd64-1 outcome=warned" in line[-1]


def test_a_debug_image_for_the_nodes_platform_passes(world):
    # The container already there is not looked at again: only the one the update adds.
    review = debug_review(world, "REGISTRY/archway/multi:1.0",
                          before=[("old", world.substitute("REGISTRY/archway/arm64only:1.0"))])
    response = wait_for_nodes(world, review)
    assert response == {"uid": review["request"]["uid"], "allowed": True,
                        "auditAnnotations": {"outcome": "unchanged"}}


def test_the_nodes_os_counts(world, windows_node):
    windows_only = "REGISTRY/archway/windowsonly:1.0"
    on_linux = wait_for_nodes(world, debug_review(world, windows_only))
    assert "cannot run on node amd64-1 (linux/amd64): it has windows/amd64" in on_linux["warnings"][0]
    review = debug_review(world, windows_only, node=windows_node)
    for _ in range(50):   # the node cache's watch brings the new node in
        on_windows = world.admit(review)
        if not on_windows.get("warnings"):
            break
        review["request"]["uid"] = str(uuid.uuid4())
    assert on_windows["allowed"] and "warnings" not in on_windows
    linux_only = wait_for_nodes(world, debug_review(world, "REGISTRY/archway/amd64only:1.0",
                                                    node=windows_node))
    assert "(windows/amd64): it has linux/amd64" in linux_only["warnings"][0]


def test_an_unreadable_debug_image_is_a_warning_within_the_deadline(world):
    review = debug_review(world, f"{world.hang.host}/archway/arm64only:1.0")
    response = wait_for_nodes(world, review)
    assert response["allowed"] and response["auditAnnotations"] == {"outcome": "fail_open"}
    assert response["warnings"][0].startswith("could not inspect debug image")
    assert world.server_ms(review["request"]["uid"]) < 1500 + 300   # the deadline, not the hang


def _malformed(world, change) -> bytes:
    review = debug_review(world, "REGISTRY/archway/arm64only:1.0")
    target = review["request"]
    *path, last = change[0]
    for key in path:
        target = target[key]
    if change[1] is KeyError:
        del target[last]
    else:
        target[last] = change[1]
    return json.dumps(review).encode()


MALFORMED = {
    "no-old-object": (["oldObject"], KeyError),
    "old-object-is-a-list": (["oldObject"], []),
    "object-is-a-string": (["object"], "pod"),
    "ephemeral-is-a-map": (["object", "spec", "ephemeralContainers"], {"a": 1}),
    "ephemeral-entry-is-a-string": (["object", "spec", "ephemeralContainers"], ["sh"]),
    "image-is-a-number": (["object", "spec", "ephemeralContainers", 0, "image"], 7),
    "containers-is-a-string": (["object", "spec", "containers"], "nginx"),
    "node-name-is-a-list": (["object", "spec", "nodeName"], ["amd64-1"]),
}


@pytest.mark.parametrize("change", MALFORMED.values(), ids=MALFORMED.keys())
def test_malformed_ephemeralcontainers_requests_are_json_400s(world, change):
    r = world.post(_malformed(world, change))
    assert r.status_code == 400, r.text
    assert r.json()["error"].startswith("request.")


def test_other_subresources_keep_their_answer(world):
    review = debug_review(world, "REGISTRY/archway/arm64only:1.0")
    review["request"]["subResource"] = "status"
    response = world.admit(review)   # checked as the apiserver checks a reply
    assert response == {"uid": review["request"]["uid"], "allowed": True}
