"""PlacementPolicy objects, pure: what archway reads of one, which one is in force for a pod (the
precedence of docs/policies.md), the policy knobs in the decision, and the leader's status."""
import os
import subprocess
import sys
import textwrap
from dataclasses import replace

from archway.errors import TransportError as RegistryError
from archway.labelselector import compiled, selector_matches
from archway.objects.policies import CLUSTER_KIND, NAMESPACED_KIND, policy_object
from archway.objects.policystatus import status_body, up_to_date, wanted_conditions
from archway.placement.decision import decide
from archway.placement.namespaces import NamespaceFacts
from archway.placement.policies import conflicts_of, may_select_together, policy_in_force
from archway.placement.policy import Policy
from archway.podview import PodView
from archway.registry.model import ImageInfo, Platform

CONFIG = Policy(source="config")


def placement(name, namespace="ml", kind=NAMESPACED_KIND, **spec):
    meta = {"name": name, "generation": 2, "uid": f"uid-{name}"}
    if namespace:
        meta["namespace"] = namespace
    return policy_object({"metadata": meta, "spec": spec}, kind)


def cluster(name, **spec):
    return placement(name, namespace="", kind=CLUSTER_KIND, **spec)


def info(*archs):
    return ImageInfo("img", frozenset(Platform("linux", a) for a in archs), "sha256:0", "registry")


def pod(labels=None, **spec):
    return PodView.of({"metadata": {"name": "p", "namespace": "ml", "labels": labels or {}},
                       "spec": {"containers": [{"name": "c", "image": "reg/x:1"}], **spec}})


def test_a_namespaced_policy_beats_a_cluster_policy_which_beats_the_namespace_label():
    facts = NamespaceFacts("ml", mode="audit", labels=(("team", "ml"),))
    ns = placement("batch", podSelector={"matchLabels": {"kind": "batch"}}, mode="enforce",
                   preferredArchitectures=[{"architecture": "arm64", "weight": 80},
                                           {"architecture": "amd64", "weight": 20}])
    edge = cluster("edge", namespaceSelector={"matchLabels": {"team": "ml"}},
                   podSelector={"matchLabels": {"tier": "edge"}}, allowedArchitectures=["riscv64"])
    batch = policy_in_force(CONFIG, {"kind": "batch", "tier": "edge"}, "ml", facts, [ns], [edge])
    assert batch.source == "PlacementPolicy ml/batch" and batch.policy.mode == "enforce"
    assert batch.policy.preferred == (("arm64", 80), ("amd64", 20))
    at_edge = policy_in_force(CONFIG, {"tier": "edge"}, "ml", facts, [ns], [edge])
    assert at_edge.source == "ClusterPlacementPolicy edge"
    assert at_edge.policy.allowed == frozenset({"riscv64"}) and at_edge.policy.mode == "audit"
    plain = policy_in_force(CONFIG, {}, "ml", facts, [ns], [edge])
    assert plain.source == "namespace label" and plain.policy.mode == "audit"
    elsewhere = policy_in_force(CONFIG, {"tier": "edge"}, "shop", None, [ns], [edge])
    assert elsewhere.source == "config"


def test_the_highest_priority_wins_and_equals_that_differ_conflict_and_fall_through():
    low = placement("low", priority=1, mode="audit")
    high = placement("high", priority=5, mode="enforce")
    assert policy_in_force(CONFIG, {}, "ml", None, [low, high]).source == "PlacementPolicy ml/high"
    rival = placement("rival", priority=5, mode="off")
    fallback = cluster("all", mode="audit")
    chosen = policy_in_force(CONFIG, {}, "ml", None, [low, high, rival], [fallback])
    assert chosen.source == "ClusterPlacementPolicy all"
    assert chosen.conflicts == ((high, rival),)
    assert chosen.warnings == ("conflicting policies skipped (same priority 5, different "
                               "settings): PlacementPolicy ml/high, PlacementPolicy ml/rival",)
    same = placement("same", priority=5, mode="enforce")   # says what `high` says: agrees
    assert policy_in_force(CONFIG, {}, "ml", None, [high, same]).source == "PlacementPolicy ml/high"


def test_an_invalid_policy_is_skipped_and_says_why():
    bad = [placement("arch", allowedArchitectures=["sparc9"]),
           placement("sel", podSelector={"matchExpressions": [{"key": "a", "operator": "Near"}]}),
           placement("both", allowedArchitectures=["arm64"], excludedArchitectures=["aarch64"]),
           placement("weight", preferredArchitectures=[{"architecture": "arm64", "weight": 0}]),
           placement("sched", archwayScheduler=True)]
    assert [p.valid for p in bad] == [False, False, False, False, True]
    assert "sparc9" in bad[0].problems[0] and "Near" in bad[1].problems[0]
    assert "arm64 both allowed and excluded" in bad[2].problems
    in_force = policy_in_force(CONFIG, {}, "ml", None, bad)   # sched: no archway scheduler
    assert in_force.source == "config" and in_force.policy == CONFIG
    with_scheduler = policy_in_force(CONFIG, {}, "ml", None, bad, archway_scheduler="arch-s")
    assert with_scheduler.policy.scheduler_name == "arch-s"


def test_allowed_and_excluded_narrow_the_placement_and_forbid_what_is_left_out():
    policy = Policy(allowed=frozenset({"amd64"}), source="PlacementPolicy shop/payments")
    placed = decide(pod(), {"reg/x:1": info("amd64", "arm64")}, policy)
    assert {"op": "add", "path": "/spec/nodeSelector",
            "value": {"kubernetes.io/arch": "amd64"}} in placed.patch
    assert any(op["path"] == "/metadata/annotations" and op["value"]["archway.dev/policy"]
               == "PlacementPolicy shop/payments" for op in placed.patch)
    denied = decide(pod(), {"reg/x:1": info("arm64")}, policy)
    assert not denied.allowed and "shop/payments" in denied.message
    kept_off = decide(pod(), {"reg/x:1": info("arm64")}, Policy(excluded=frozenset({"arm64"}),
                                                                 deny_on_empty=False))
    assert kept_off.allowed and "no-common-architecture" in str(kept_off.patch)
    spread = decide(pod(), {"reg/x:1": info("amd64", "arm64", "riscv64")},
                    Policy(excluded=frozenset({"riscv64"})))
    assert "['amd64', 'arm64']" in str(spread.patch) and "riscv64" not in str(
        [op for op in spread.patch if "affinity" in op["path"]])


def test_fallback_architectures_place_a_pod_admitted_with_an_unread_image():
    results = {"reg/x:1": RegistryError("down")}
    unplaced = decide(pod(), results, Policy())
    assert unplaced.outcome == "fail_open" and "nodeSelector" not in str(unplaced.patch)
    placed = decide(pod(), results, Policy(fallback=("amd64",)))
    assert placed.outcome == "fail_open" and "'kubernetes.io/arch': 'amd64'" in str(placed.patch)
    assert any("fallback" in w for w in placed.warnings)


def test_selectors_that_cannot_select_the_same_pod_do_not_conflict():
    def together(a, b):
        return may_select_together(compiled(a), compiled(b))
    assert together({"matchLabels": {"a": "1"}}, {"matchLabels": {"b": "2"}})
    assert not together({"matchLabels": {"a": "1"}}, {"matchLabels": {"a": "2"}})
    assert not together({"matchExpressions": [{"key": "a", "operator": "Exists"}]},
                        {"matchExpressions": [{"key": "a", "operator": "DoesNotExist"}]})
    assert not together({"matchExpressions": [{"key": "a", "operator": "In", "values": ["1"]}]},
                        {"matchExpressions": [{"key": "a", "operator": "NotIn", "values": ["1"]}]})
    assert together({"matchExpressions": [{"key": "a", "operator": "In", "values": ["1", "2"]}]},
                    {"matchExpressions": [{"key": "a", "operator": "NotIn", "values": ["1"]}]})
    one = placement("one", priority=3, mode="audit", podSelector={"matchLabels": {"a": "1"}})
    two = placement("two", priority=3, mode="off", podSelector={"matchLabels": {"b": "1"}})
    apart = placement("apart", priority=3, mode="off", podSelector={"matchLabels": {"a": "2"}})
    assert conflicts_of([one, two, apart]) == {"ml/one": (two,), "ml/two": (one,)}


def test_the_leaders_conflict_check_compares_a_changed_policy_only_with_its_own_scope():
    same = [placement(f"p{i}", priority=1, mode="audit" if i % 2 else "off") for i in range(6)]
    elsewhere = [placement(f"q{i}", namespace="other", priority=1, mode="off") for i in range(50)]
    overlaps: dict = {}
    found = conflicts_of(same + elsewhere, None, overlaps)
    assert set(found) == {p.name for p in same}      # "other"'s policies all say the same
    assert len(overlaps) == 9                        # 3 audit x 3 off, nothing of "other"
    changed = placement("p0", priority=1, mode="enforce")
    changed = replace(changed, generation=3)
    conflicts_of([changed, *same[1:], *elsewhere], None, overlaps)
    assert len(overlaps) == 5 + 6     # p0 against all five; audit x off of the rest: 2 x 3
    never = placement("never", priority=1, mode="enforce", podSelector={"matchExpressions": [
        {"key": "a", "operator": "Exists"}, {"key": "a", "operator": "DoesNotExist"}]})
    assert "ml/never" not in conflicts_of([never, *same])    # it selects no pod at all


def test_whether_two_equal_policies_conflict_does_not_depend_on_the_hash_seed():
    """Two policies saying the same in another order agree in every process."""
    program = textwrap.dedent("""
        from archway.objects.policies import NAMESPACED_KIND, policy_object
        from archway.placement.policies import conflicts_of
        def p(name, archs, tolerations):
            return policy_object({"metadata": {"name": name, "namespace": "ml", "uid": name},
                                  "spec": {"priority": 5, "allowedArchitectures": archs,
                                           "excludedArchitectures": ["s390x", "ppc64le"],
                                           "tolerations": tolerations}}, NAMESPACED_KIND)
        t1 = {"architecture": "arm64", "tolerations": [{"key": "a", "operator": "Exists"},
                                                       {"key": "b", "operator": "Exists"}]}
        t2 = {"architecture": "amd64", "tolerations": [{"key": "c", "operator": "Exists"}]}
        print(conflicts_of([p("one", ["amd64", "arm64", "riscv64"], [t1, t2]),
                            p("two", ["riscv64", "arm64", "amd64"], [t2, dict(t1, tolerations=t1["tolerations"][::-1])])]))
    """)
    for seed in ("0", "1", "7", "42", "12345", "random"):
        done = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True,
                              env={**os.environ, "PYTHONHASHSEED": seed}, timeout=60, check=True)
        assert done.stdout.strip() == "{}", (seed, done.stdout, done.stderr)


def test_a_selector_the_apiserver_would_refuse_or_over_the_limits_makes_the_policy_invalid():
    cases = {
        "matchLabels: 'bad key!' is not a label key": {"matchLabels": {"bad key!": "x"}},
        "is not a label value": {"matchLabels": {"team": "-starts-with-dash"}},
        "matchExpressions: 'Upper.Case/x' is not a label key": {"matchExpressions": [
            {"key": "Upper.Case/x", "operator": "Exists"}]},
        "has 17 values (at most 16)": {"matchExpressions": [
            {"key": "a", "operator": "In", "values": [f"v{i}" for i in range(17)]}]},
        "more than 16 matchLabels": {"matchLabels": {f"k{i}": "v" for i in range(17)}},
    }
    for words, selector in cases.items():
        policy = placement("bad", podSelector=selector)
        assert not policy.valid and words in policy.problems[0], (words, policy.problems)
        assert not selector_matches(policy.pod_selector, {"team": "x", "a": "v1"})
    fine = placement("fine", podSelector={"matchLabels": {"example.com/team": "a.b_c-9"},
                                          "matchExpressions": [{"key": "tier", "operator": "NotIn",
                                                                "values": ["", "db"]}]})
    assert fine.valid
    assert selector_matches(fine.pod_selector, {"example.com/team": "a.b_c-9", "tier": "web"})
    assert not selector_matches(fine.pod_selector, {"example.com/team": "a.b_c-9", "tier": "db"})


def test_a_compiled_selector_matches_as_its_document_does():
    documents = [
        {}, {"matchLabels": {"a": "1"}},
        {"matchExpressions": [{"key": "a", "operator": "In", "values": ["1", "2"]}]},
        {"matchExpressions": [{"key": "a", "operator": "NotIn", "values": ["1"]}]},
        {"matchExpressions": [{"key": "a", "operator": "Exists"}]},
        {"matchExpressions": [{"key": "b", "operator": "DoesNotExist"}],
         "matchLabels": {"a": "2"}},
        {"matchExpressions": [{"key": "a", "operator": "Sometimes", "values": ["1"]}]},
    ]
    label_sets = [{}, {"a": "1"}, {"a": "2"}, {"a": "3", "b": ""}, {"b": "1"}, {"a": "1\x002"}]
    for document in documents:
        for labels in label_sets:
            assert selector_matches(compiled(document), labels) == selector_matches(document, labels), \
                (document, labels)


def test_the_leader_writes_a_status_only_when_it_differs():
    invalid = placement("arch", allowedArchitectures=["sparc9"])
    wanted = wanted_conditions(invalid, (), None)
    assert wanted[1][:2] == ("Invalid", "True") and wanted[0][:3] == ("Ready", "False", "Invalid")
    body = status_body(invalid, wanted, "2026-01-01T00:00:00Z")
    assert body["status"]["observedGeneration"] == 2
    assert body["metadata"] == {"name": "arch", "namespace": "ml", "resourceVersion": ""}
    stored = policy_object({"metadata": {"name": "arch", "namespace": "ml", "generation": 2},
                            "spec": {"allowedArchitectures": ["sparc9"]},
                            "status": body["status"]}, NAMESPACED_KIND)
    assert not up_to_date(invalid, wanted) and up_to_date(stored, wanted)


def test_explain_judges_manifests_under_the_policies_and_namespaces_they_hold():
    import yaml

    from archway.cluster.workloads import workloads_in
    from archway.tools.explainpolicy import KnownPolicies
    from archway.tools.explanation import explain_workload, to_json, to_text
    docs = list(yaml.safe_load_all("""
apiVersion: v1
kind: Namespace
metadata: {name: shop, labels: {archway.dev/mode: audit}}
---
apiVersion: archway.dev/v1alpha1
kind: PlacementPolicy
metadata: {name: payments-amd64, namespace: shop}
spec: {podSelector: {matchLabels: {app: payments}}, allowedArchitectures: [amd64], mode: enforce}
---
apiVersion: apps/v1
kind: Deployment
metadata: {name: payments, namespace: shop}
spec:
  template:
    metadata: {labels: {app: payments}}
    spec: {containers: [{name: c, image: reg/x:1}]}
---
apiVersion: v1
kind: Pod
metadata: {name: web, namespace: shop}
spec: {containers: [{name: c, image: reg/x:1}]}
"""))
    known = KnownPolicies()
    known.add(docs, "all.yaml")
    payments, web = workloads_in(docs, "all.yaml")
    results = {"reg/x:1": info("amd64", "arm64")}
    placed = explain_workload(payments, results, CONFIG, known=known)
    assert "  policy: PlacementPolicy shop/payments-amd64 (priority 0, selects it)" \
        in to_text(placed)
    assert "'kubernetes.io/arch': 'amd64'" in str(placed.decision.patch)
    audited = explain_workload(web, results, CONFIG, known=known)
    assert to_json(audited)["policy"]["source"] == "namespace label"
    assert audited.decision.outcome == "audited"


def test_a_gated_pod_is_released_on_its_policys_fallback():
    from archway.gate.release import plan_release
    obj = {"metadata": {"name": "p", "namespace": "ml"},
           "spec": {"containers": [{"name": "c", "image": "reg/x:1"}],
                    "schedulingGates": [{"name": "archway.dev/resolving"}]}}
    release = plan_release(obj, {"reg/x:1": RegistryError("down")},
                           Policy(fallback=("arm64",)), expired=True)
    assert release.outcome == "fallback" and release.architectures == frozenset({"arm64"})


def test_the_cluster_policy_cache_remembers_namespaces_until_a_policy_changes():
    from archway.objects.policies import PolicyCache
    cache = PolicyCache(lambda: None, CLUSTER_KIND)
    cache._on_event("ADDED", {"metadata": {"name": "ml-only"},
                              "spec": {"namespaceSelector": {"matchLabels": {"team": "ml"}}}})
    ml = {"team": "ml", "kubernetes.io/metadata.name": "ml"}
    assert [p.name for p in cache.selecting_namespace(ml)] == ["ml-only"]
    assert cache.selecting_namespace({"team": "shop"}) == ()
    cache._on_event("ADDED", {"metadata": {"name": "all"}, "spec": {"mode": "audit"}})
    assert [p.name for p in cache.selecting_namespace({"team": "shop"})] == ["all"]
    cache._on_event("DELETED", {"metadata": {"name": "ml-only"}})
    assert [p.name for p in cache.selecting_namespace(ml)] == ["all"]
    namespaced = PolicyCache(lambda: None, NAMESPACED_KIND)
    namespaced._on_event("ADDED", {"metadata": {"name": "a", "namespace": "ml"}, "spec": {}})
    assert [p.name for p in namespaced.in_namespace("ml")] == ["ml/a"]
    namespaced._on_event("DELETED", {"metadata": {"name": "a", "namespace": "ml"}})
    assert namespaced.in_namespace("ml") == ()
