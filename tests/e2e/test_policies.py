"""PlacementPolicies on the real control plane: the chart's CRDs (their schema and CEL rules
judged by the apiserver), `kubectl get`'s columns, the policy in force chosen by selectors and
priorities (the pod's archway.dev/policy annotation says which), a conflict and an invalid
policy failing no admission but getting a status condition and an Event from the leader, and an
edit applying to the next pod within a second (list + watch in every webhook worker)."""
import os
import subprocess
import time
import zlib

import pytest

from lab.kube import KubeError

from .workloads import create_pod, pod

GROUP = "/apis/archway.dev/v1alpha1"
POLICY = "archway.dev/policy"


def policies_path(namespace: str, name: str = "") -> str:
    return f"{GROUP}/namespaces/{namespace}/placementpolicies" + (f"/{name}" if name else "")


def placement_policy(name: str, **spec) -> dict:
    return {"apiVersion": "archway.dev/v1alpha1", "kind": "PlacementPolicy",
            "metadata": {"name": name}, "spec": spec}


def labelled(name: str, images, **labels) -> dict:
    body = pod(name, [images.ref("e2e/multi")])
    body["metadata"]["labels"].update(labels)
    return body


def shaped_by(created: dict) -> str:
    return (created["metadata"].get("annotations") or {}).get(POLICY, "")


def first_shaped_by(kube, namespace: str, images, source: str, **labels) -> dict:
    """The first pod archway admits under `source`: right after the chart's install the CRDs
    may have come after archway's first list, whose retry backs off."""
    made = []
    tag = f"{zlib.crc32(f'{source} {sorted(labels.items())}'.encode()):08x}"   # one per call

    def attempt():
        made.append(create_pod(kube, namespace, labelled(f"probe-{tag}-{len(made)}", images,
                                                         **labels)))
        return made[-1] if shaped_by(made[-1]) == source else None
    return kube.wait_for(attempt, timeout=60, what=f"a pod admitted under {source}")


def condition(kube, path: str, kind: str) -> dict | None:
    for c in (kube.get(path).get("status") or {}).get("conditions") or []:
        if c["type"] == kind:
            return c
    return None


def test_the_apiserver_refuses_a_policy_its_cel_rules_reject_with_their_message(
        archway, kube, namespace):
    with pytest.raises(KubeError) as both:
        kube.create(policies_path(namespace), placement_policy(
            "both", allowedArchitectures=["arm64"], excludedArchitectures=["arm64"]))
    assert both.value.status == 422
    assert "an architecture cannot be both allowed and excluded" in both.value.message
    with pytest.raises(KubeError) as heavy:
        kube.create(policies_path(namespace), placement_policy(
            "heavy", preferredArchitectures=[{"architecture": "arm64", "weight": 101}]))
    assert "a weight is 1..100" in heavy.value.message
    with pytest.raises(KubeError) as mode:
        kube.create(policies_path(namespace), placement_policy("loud", mode="shout"))
    assert "Unsupported value" in mode.value.message and "enforce" in mode.value.message


def test_a_namespace_editors_selector_is_bounded_by_the_schema_and_the_largest_legal_one_applies(
        archway, kube, namespace):
    """The attack of hardening round 6: 20,000 expressions in one policy. Now the apiserver
    refuses what is over the limits, saying which; the largest legal policy is accepted."""
    expression = {"key": "team", "operator": "In", "values": ["a"]}
    too_many = {"matchExpressions": [expression] * 17}
    too_wide = {"matchExpressions": [dict(expression, values=[f"v{i}" for i in range(17)])]}
    bad_value = {"matchLabels": {"team": "not a label value"}}
    for name, selector, words in (("many", too_many, "must have at most 16 items"),
                                  ("wide", too_wide, "must have at most 16 items"),
                                  ("value", bad_value, "should match")):
        with pytest.raises(KubeError) as refused:
            kube.create(policies_path(namespace), placement_policy(name, podSelector=selector))
        assert refused.value.status == 422 and words in refused.value.message, refused.value.message
    largest = {"matchLabels": {f"example.com/k{i}": "v" * 63 for i in range(16)},
               "matchExpressions": [{"key": f"example.com/e{i}", "operator": "NotIn",
                                     "values": [f"{i}-{j}".ljust(63, "x") for j in range(16)]}
                                    for i in range(16)]}
    kube.create(policies_path(namespace), placement_policy("largest", podSelector=largest))


def test_kubectl_get_placementpolicies_shows_mode_priority_and_selector(
        archway, control_plane, kube, namespace):
    kube.create(policies_path(namespace), placement_policy(
        "batch-arm64", mode="enforce", priority=10, podSelector={"matchLabels": {"kind": "batch"}}))
    env = {k: v for k, v in os.environ.items() if "proxy" not in k.lower()}
    done = subprocess.run([control_plane.binary("kubectl"), "--kubeconfig",
                           control_plane.admin_kubeconfig, "get", "placementpolicies", "-A"],
                          capture_output=True, text=True, timeout=60, env=env)
    assert done.returncode == 0, done.stderr
    header, *rows = done.stdout.splitlines()
    assert header.split()[:6] == ["NAMESPACE", "NAME", "MODE", "PRIORITY", "SELECTOR", "READY"]
    (row,) = [r for r in rows if r.startswith(namespace)]
    assert row.split()[1:4] == ["batch-arm64", "enforce", "10"] and "batch" in row


def test_selectors_and_priorities_choose_the_policy_and_the_pod_names_it(
        archway, kube, namespace, images):
    kube.create(policies_path(namespace), placement_policy(
        "everything", priority=1, allowedArchitectures=["amd64"]))
    kube.create(policies_path(namespace), placement_policy(
        "batch-arm64", priority=10, podSelector={"matchLabels": {"kind": "batch"}},
        allowedArchitectures=["arm64"]))
    kube.create(f"{GROUP}/clusterplacementpolicies", {
        "apiVersion": "archway.dev/v1alpha1", "kind": "ClusterPlacementPolicy",
        "metadata": {"name": f"{namespace}-edge"},
        "spec": {"priority": 100, "namespaceSelector": {"matchLabels": {
            "kubernetes.io/metadata.name": namespace}},
            "podSelector": {"matchLabels": {"tier": "edge"}}, "mode": "audit"}})
    try:
        first_shaped_by(kube, namespace, images, f"PlacementPolicy {namespace}/everything")
        batch = create_pod(kube, namespace, labelled("batch", images, kind="batch", tier="edge"))
        assert shaped_by(batch) == f"PlacementPolicy {namespace}/batch-arm64"
        assert batch["spec"]["nodeSelector"] == {"kubernetes.io/arch": "arm64"}
        web = create_pod(kube, namespace, labelled("web", images))
        assert shaped_by(web) == f"PlacementPolicy {namespace}/everything"
        assert web["spec"]["nodeSelector"] == {"kubernetes.io/arch": "amd64"}
        # Namespaced policies come before cluster ones: only where none selects does it apply.
        kube.delete(policies_path(namespace, "everything"))
        edge = first_shaped_by(kube, namespace, images, f"ClusterPlacementPolicy {namespace}-edge",
                               tier="edge")
        assert "nodeSelector" not in edge["spec"]   # audit: annotated only
        plain = create_pod(kube, namespace, labelled("plain", images))
        assert shaped_by(plain) == "config"
    finally:
        kube.delete(f"{GROUP}/clusterplacementpolicies/{namespace}-edge")


def test_a_conflict_and_an_invalid_policy_fail_no_admission_and_get_a_condition_and_an_event(
        archway, kube, namespace, images):
    kube.create(policies_path(namespace), placement_policy("amd", priority=5,
                                                           allowedArchitectures=["amd64"]))
    kube.create(policies_path(namespace), placement_policy("arm", priority=5,
                                                           allowedArchitectures=["arm64"]))
    kube.create(policies_path(namespace), placement_policy(
        "sparc", priority=50, allowedArchitectures=["sparc9"]))
    made = []

    def skipped() -> dict | None:   # once the policies are listed, both are skipped
        made.append(create_pod(kube, namespace, labelled(f"either-{len(made)}", images)))
        return made[-1] if "conflicting policies skipped" in kube.last_warnings else None
    created = kube.wait_for(skipped, timeout=60, what="the conflicting policies skipped")
    assert shaped_by(created) == "config"   # both skipped: the next rule applies
    assert set(created["spec"]["affinity"]["nodeAffinity"][
        "requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"][0][
        "matchExpressions"][0]["values"]) == {"amd64", "arm64"}
    assert "conflicting policies skipped (same priority 5" in kube.last_warnings

    def conflicting():
        c = condition(kube, policies_path(namespace, "amd"), "Conflicting")
        return c if c and c["status"] == "True" else None
    found = kube.wait_for(conflicting, timeout=20, what="the Conflicting condition")
    assert f"PlacementPolicy {namespace}/arm" in found["message"] and found["observedGeneration"] == 1
    assert condition(kube, policies_path(namespace, "amd"), "Ready")["status"] == "False"

    def invalid():
        c = condition(kube, policies_path(namespace, "sparc"), "Invalid")
        return c if c and c["status"] == "True" else None
    said = kube.wait_for(invalid, timeout=20, what="the Invalid condition")
    assert "'sparc9' is not an architecture archway knows" in said["message"]
    assert kube.get(policies_path(namespace, "sparc"))["status"]["observedGeneration"] == 1

    def events():
        reasons = {e["reason"] for name in ("amd", "sparc")
                   for e in kube.events_for(namespace, name, kind="PlacementPolicy")}
        return reasons if {"ConflictingPlacementPolicy", "InvalidPlacementPolicy"} <= reasons \
            else None
    kube.wait_for(events, timeout=20, what="an Event per problem")


def test_an_edit_applies_to_the_next_pod_within_a_second(archway, kube, namespace, images):
    kube.create(policies_path(namespace), placement_policy("pin", allowedArchitectures=["amd64"]))
    first_shaped_by(kube, namespace, images, f"PlacementPolicy {namespace}/pin")
    probes = iter(range(1000))
    # Every worker's watch has it: eight pods in a row (spread over the workers) placed by it.
    kube.wait_for(lambda: all(shaped_by(create_pod(kube, namespace, labelled(
        f"probe-pin-{next(probes)}", images))) == f"PlacementPolicy {namespace}/pin"
        for _ in range(8)), timeout=30, what="every worker placing by the policy")
    before = create_pod(kube, namespace, labelled("before", images))
    assert before["spec"]["nodeSelector"] == {"kubernetes.io/arch": "amd64"}
    kube.patch(policies_path(namespace, "pin"), {"spec": {"allowedArchitectures": ["arm64"]}})
    edited = time.monotonic()
    n = 0
    while True:
        n += 1
        made = create_pod(kube, namespace, labelled(f"after-{n}", images))
        if made["spec"]["nodeSelector"] == {"kubernetes.io/arch": "arm64"}:
            break
        assert time.monotonic() - edited < 1.0, "the edit did not apply within a second"
    took = time.monotonic() - edited
    # Every worker has it now: the pods that follow are all placed by the edited policy.
    for i in range(6):
        later = create_pod(kube, namespace, labelled(f"later-{i}", images))
        assert later["spec"]["nodeSelector"] == {"kubernetes.io/arch": "arm64"}, took


def test_a_gated_pod_is_released_under_the_policy_it_was_admitted_under(
        archway, kube, namespace, images, slow_registry):
    kube.create(policies_path(namespace), placement_policy("amd-only",
                                                           allowedArchitectures=["amd64"]))
    first_shaped_by(kube, namespace, images, f"PlacementPolicy {namespace}/amd-only")
    tag = images.fresh("e2e/multi")
    created = create_pod(kube, namespace, pod("slow", [images.ref("e2e/multi", tag, via="slow")]))
    assert created["spec"].get("schedulingGates"), "the pod should wait for its image"
    assert shaped_by(created) == f"PlacementPolicy {namespace}/amd-only"
    slow_registry.delay = 0.0

    def released():
        obj = kube.get(f"/api/v1/namespaces/{namespace}/pods/slow")
        return None if obj["spec"].get("schedulingGates") else obj
    placed = kube.wait_for(released, timeout=60, what="the gated pod released")
    # The config alone would have allowed both architectures the image has.
    assert placed["spec"]["nodeSelector"] == {"kubernetes.io/arch": "amd64"}
    assert "affinity" not in placed["spec"]


def may(client, verb: str, resource: str, namespace: str | None = None,
        subresource: str = "") -> bool:
    attrs = {"verb": verb, "resource": resource, "group": "archway.dev",
             "subresource": subresource}
    if namespace:
        attrs["namespace"] = namespace
    review = client.create("/apis/authorization.k8s.io/v1/selfsubjectaccessreviews", {
        "apiVersion": "authorization.k8s.io/v1", "kind": "SelfSubjectAccessReview",
        "spec": {"resourceAttributes": attrs}})
    return bool(review.get("status", {}).get("allowed"))


def test_namespace_editors_own_its_placement_policies_and_cluster_ones_are_for_admins(
        archway, kube, namespace):
    from .test_rbac import identity_of
    clients = {}
    for account, role in (("editor", "edit"), ("viewer", "view")):
        kube.create(f"/api/v1/namespaces/{namespace}/serviceaccounts",
                    {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": account}})
        kube.create(f"/apis/rbac.authorization.k8s.io/v1/namespaces/{namespace}/rolebindings", {
            "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
            "metadata": {"name": account},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole",
                        "name": role},
            "subjects": [{"kind": "ServiceAccount", "name": account, "namespace": namespace}]})
        clients[account] = kube.as_user(kube.service_account_token(namespace, account))
    editor, viewer = clients["editor"], clients["viewer"]
    # The controller-manager aggregates the chart's rules into edit and view.
    kube.wait_for(lambda: may(editor, "create", "placementpolicies", namespace), timeout=30,
                  what="PlacementPolicies aggregated into edit")
    editor.create(policies_path(namespace), placement_policy("mine", mode="audit"))
    assert not may(editor, "create", "placementpolicies", "default")   # its namespace only
    assert not may(editor, "create", "clusterplacementpolicies")
    assert not may(editor, "update", "placementpolicies", namespace, "status")
    kube.wait_for(lambda: may(viewer, "list", "placementpolicies", namespace), timeout=30,
                  what="PlacementPolicies aggregated into view")
    assert [p["metadata"]["name"] for p in viewer.items(policies_path(namespace))] == ["mine"]
    with pytest.raises(KubeError) as refused:
        viewer.create(policies_path(namespace), placement_policy("theirs"))
    assert refused.value.status == 403
    # archway itself: reads both, writes their status, never a spec.
    webhook, _user = identity_of(archway, kube, "webhook")
    for resource in ("placementpolicies", "clusterplacementpolicies"):
        assert may(webhook, "watch", resource) and may(webhook, "update", resource, "", "status")
        assert not may(webhook, "update", resource) and not may(webhook, "create", resource)


def test_archway_explain_says_which_policy_applied_to_a_file_and_a_live_pod(
        archway, control_plane, kube, namespace, images, tmp_path):
    import json

    import yaml

    from .test_tools import run_archway
    kube.create(policies_path(namespace), placement_policy(
        "batch", priority=3, podSelector={"matchLabels": {"kind": "batch"}},
        allowedArchitectures=["arm64"]))
    live = first_shaped_by(kube, namespace, images, f"PlacementPolicy {namespace}/batch",
                           kind="batch")
    done = run_archway(control_plane, tmp_path, images, "explain",
                       f"pod/{live['metadata']['name']}", "-n", namespace, "--json")
    assert done.returncode == 0, done.stderr
    (explained,) = json.loads(done.stdout)
    assert explained["policy"]["source"] == f"PlacementPolicy {namespace}/batch"
    assert explained["annotations"][POLICY] == f"PlacementPolicy {namespace}/batch"
    # A file: the cluster's policies, and one given beside the workload that outranks them.
    manifests = tmp_path / "batch.yaml"
    workload = labelled("job", images, kind="batch")
    workload["metadata"]["namespace"] = namespace
    manifests.write_text(yaml.safe_dump(workload))
    done = run_archway(control_plane, tmp_path, images, "explain", "-f", str(manifests))
    assert f"  policy: PlacementPolicy {namespace}/batch (priority 3, selects it)" in done.stdout
    given = dict(placement_policy("urgent", priority=9, allowedArchitectures=["amd64"]))
    given["metadata"]["namespace"] = namespace
    manifests.write_text(yaml.safe_dump_all([workload, given]))
    done = run_archway(control_plane, tmp_path, images, "explain", "-f", str(manifests))
    assert f"  policy: PlacementPolicy {namespace}/urgent (priority 9, selects it)" in done.stdout


def test_a_namespace_editors_largest_legal_policies_leave_other_namespaces_placed_as_before(
        archway, kube, namespace, images, control_plane):
    """Hardening round 6, finding 1: a tenant's worst legal policies (each at every limit of the
    schema) are read, judged by the leader and leave a pod of another namespace admitted exactly
    as before."""
    other = control_plane.new_namespace(f"{namespace[:40]}-other")
    before = create_pod(kube, other, labelled("before", images))
    value = lambda *parts: "-".join(map(str, parts)).ljust(63, "x")   # noqa: E731
    count = 40
    for n in range(count):
        kube.create(policies_path(namespace), placement_policy(
            f"big-{n}", priority=1, mode="audit" if n % 2 else "enforce", podSelector={
                "matchLabels": {f"example.com/l{i}": value(n, i) for i in range(16)},
                "matchExpressions": [{"key": f"example.com/e{i}", "operator": "NotIn",
                                      "values": [value(n, i, j) for j in range(16)]}
                                     for i in range(16)]}))
    # The leader judged them all: Applied (their matchLabels differ: no pod could have two).
    kube.wait_for(lambda: all((condition(kube, policies_path(namespace, f"big-{n}"), "Ready")
                               or {}).get("status") == "True" for n in range(count)),
                  timeout=90, what="every policy's status written by the leader")
    after = create_pod(kube, other, labelled("after", images))
    assert shaped_by(after) == shaped_by(before)
    assert after["spec"].get("affinity") == before["spec"].get("affinity")
    assert after["spec"].get("nodeSelector") == before["spec"].get("nodeSelector")
    kube.delete(f"/api/v1/namespaces/{other}")
