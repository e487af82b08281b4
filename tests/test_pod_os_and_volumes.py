"""Every image a pod pulls, on its own OS (issue 36, findings 1 and 3), as pure decisions: the
pod's OS, its image volumes, OCI artifacts, Windows and mixed-OS images, and the nodes that
count. The same images through the real registry: tests/test_oci.py and
tests/test_os_registry.py; on the real control plane: tests/e2e/test_os_placement.py."""
import json

import pytest

from archway.cluster.nodes import NodeFacts, node_facts
from archway.cluster.workloadcache import workload_facts
from archway.cluster.workloads import workloads_in
from archway.extender.archfilter import filter_by_arch, shared_architectures
from archway.gate.tagwatch import dropped_architectures
from archway.placement.decision import decide
from archway.placement.policy import Policy
from archway.podview import ImageVolume, PodShapeError, PodView
from archway.registry.model import ARTIFACT_SOURCE, ImageInfo
from archway.registry.platforms import parse_platform
from archway.tools.explanation import explain_workload, to_json, to_text
from archway.vocabulary import ANNOTATION_ARCHITECTURES, ANNOTATION_IMAGES, ARCH_LABEL, OS_LABEL

DIGEST = "sha256:" + "1" * 64


def info(image, *platforms, source="oci-index", note=""):
    return ImageInfo(image, frozenset(parse_platform(p) for p in platforms), DIGEST, source, note)


MIXED = info("reg/mixed:1", "linux/arm64", "windows/amd64")
WINDOWS_ONLY = info("reg/win:1", "windows/amd64")
MULTI = info("reg/app:1", "linux/amd64", "linux/arm64")
AMD_ONLY = info("reg/amd-model:1", "linux/amd64")
ARTIFACT = info("reg/model:1", source=ARTIFACT_SOURCE,
                note="an OCI artifact (application/vnd.example.model.v1): no platform")
RESULTS = {i.image: i for i in (MIXED, WINDOWS_ONLY, MULTI, AMD_ONLY, ARTIFACT)}


def pod(*images, os=None, node_selector=None, affinity=None, volumes=()):
    spec: dict = {"containers": [{"name": f"c{i}", "image": im} for i, im in enumerate(images)]}
    if os is not None:
        spec["os"] = {"name": os}
    if node_selector is not None:
        spec["nodeSelector"] = node_selector
    if affinity is not None:
        spec["affinity"] = affinity
    if volumes:
        spec["volumes"] = [{"name": name, "image": {"reference": ref, **extra}}
                           for name, ref, extra in volumes]
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": "p", "namespace": "default"}, "spec": spec}


def os_terms(*values_per_term):
    return {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
        "nodeSelectorTerms": [{"matchExpressions": [
            {"key": OS_LABEL, "operator": "In", "values": list(values)}]}
            for values in values_per_term]}}}


def view(obj) -> PodView:
    return PodView.of(obj)


# --- the pod's OS ------------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs, expected", [
    ({}, "linux"),
    ({"os": "windows"}, "windows"),
    ({"node_selector": {OS_LABEL: "windows"}}, "windows"),
    ({"os": "linux", "node_selector": {OS_LABEL: "windows"}}, "linux"),     # spec.os first
    ({"node_selector": {OS_LABEL: "windows"}, "affinity": os_terms(["linux"])}, "windows"),
    ({"affinity": os_terms(["windows"])}, "windows"),
    ({"affinity": os_terms(["windows"], ["windows"])}, "windows"),          # every term agrees
    ({"affinity": os_terms(["windows"], ["linux"])}, "linux"),              # terms disagree
    ({"affinity": os_terms(["windows", "linux"])}, "linux"),                # not pinned
    ({"node_selector": {"disktype": "ssd"}}, "linux"),
])
def test_the_pods_os_is_spec_os_then_its_node_selector_then_its_required_affinity(kwargs, expected):
    assert view(pod("reg/app:1", **kwargs)).os == expected


def test_a_term_that_does_not_pin_the_os_leaves_the_pod_linux():
    affinity = os_terms(["windows"])
    affinity["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][
        "nodeSelectorTerms"].append({"matchExpressions": [{"key": "zone", "operator": "In",
                                                          "values": ["a"]}]})
    assert view(pod("reg/app:1", affinity=affinity)).os == "linux"


def test_a_malformed_spec_os_is_a_shape_error():
    obj = pod("reg/app:1")
    obj["spec"]["os"] = ["windows"]
    with pytest.raises(PodShapeError, match="spec.os"):
        view(obj)


# --- image volumes in the view ----------------------------------------------------------------

def test_image_volumes_are_images_of_the_pod_after_its_containers():
    obj = pod("reg/app:1", volumes=[("models", "reg/model:1", {"pullPolicy": "Always"}),
                                    ("tools", "reg/app:1", {}), ("blank", "", {})])
    obj["spec"]["volumes"].append({"name": "data", "emptyDir": {}})
    v = view(obj)
    assert v.image_volumes == (ImageVolume("models", "reg/model:1", "Always"),
                               ImageVolume("tools", "reg/app:1", ""), ImageVolume("blank", "", ""))
    assert v.images == ("reg/app:1", "reg/model:1")
    assert v.always_pulled == {"reg/model:1"}       # pullPolicy Always: revalidated
    assert (v.volume_name("reg/model:1"), v.volume_name("reg/app:1")) == ("models", "")


def test_a_malformed_image_volume_is_a_shape_error():
    obj = pod("reg/app:1")
    obj["spec"]["volumes"] = [{"name": "m", "image": {"reference": 7}}]
    with pytest.raises(PodShapeError, match=r"spec.volumes\[0\].image.reference"):
        view(obj)


def test_a_workloads_images_include_its_image_volumes():
    deployment = {"apiVersion": "apps/v1", "kind": "Deployment",
                  "metadata": {"name": "d", "namespace": "ns", "uid": "u"},
                  "spec": {"template": pod("reg/app:1", volumes=[("models", "reg/model:1", {})])}}
    facts = workload_facts("Deployment")(deployment)
    assert facts is not None and facts.images == ("reg/app:1", "reg/model:1")


# --- the decision ------------------------------------------------------------------------------

def placed_archs(decision) -> str:
    patched = {op["path"]: op["value"] for op in decision.patch}
    return patched.get("/spec/nodeSelector", {}).get(ARCH_LABEL) \
        or patched.get(f"/spec/nodeSelector/{ARCH_LABEL.replace('/', '~1')}")


def annotation(decision, key):
    for op in decision.patch:
        if op["path"] == "/metadata/annotations":
            return op["value"].get(key)
        if op["path"] == "/metadata/annotations/" + key.replace("/", "~1"):
            return op["value"]
    return None


def test_a_windows_pod_with_a_mixed_os_index_gets_the_windows_architecture():
    for how in ({"os": "windows"}, {"node_selector": {OS_LABEL: "windows"}},
                {"affinity": os_terms(["windows"])}):
        d = decide(view(pod("reg/mixed:1", **how)), RESULTS, Policy())
        assert d.allowed and d.architectures == {"amd64"}, how
        assert annotation(d, ANNOTATION_ARCHITECTURES) == "amd64"
    d = decide(view(pod("reg/mixed:1", os="windows", node_selector={OS_LABEL: "windows"})),
               RESULTS, Policy())
    assert placed_archs(d) == "amd64"
    linux = decide(view(pod("reg/mixed:1")), RESULTS, Policy())
    assert linux.architectures == {"arm64"} and placed_archs(linux) == "arm64"


def test_a_windows_pod_pinned_only_by_spec_os_is_kept_on_windows_nodes_and_warned_without_one():
    """spec.os does not steer the scheduler: a Windows pod bound to a Linux node fails there
    (PodOSNotSupported). archway pins the OS with the architecture, and says when no node of
    the pod's OS is in the cluster."""
    d = decide(view(pod("reg/mixed:1", os="windows")), RESULTS, Policy())
    patched = {op["path"]: op["value"] for op in d.patch}
    assert patched["/spec/nodeSelector"] == {OS_LABEL: "windows", ARCH_LABEL: "amd64"}
    pinned = decide(view(pod("reg/mixed:1", os="windows", node_selector={OS_LABEL: "windows"})),
                    RESULTS, Policy())
    assert placed_archs(pinned) == "amd64"
    linux_only = [NodeFacts("lin-amd", "amd64", (), (), "linux")]
    for how in ({"os": "windows"}, {"node_selector": {OS_LABEL: "windows"}}):
        d = decide(view(pod("reg/mixed:1", **how)), RESULTS, Policy(), nodes=linux_only)
        assert d.unschedulable == "no windows node is in the cluster (the pod runs on windows)", how
        assert d.warnings[0].startswith("no windows node is in the cluster")
    linux = decide(view(pod("reg/mixed:1")), RESULTS, Policy(), nodes=linux_only)
    assert {op["path"]: op["value"] for op in linux.patch}["/spec/nodeSelector"] == {ARCH_LABEL: "arm64"}


def test_a_linux_pod_with_a_windows_only_image_is_denied_and_told_why():
    d = decide(view(pod("reg/app:1", "reg/win:1")), RESULTS, Policy(deny_on_empty=True))
    assert not d.allowed and d.outcome == "denied" and d.architectures == frozenset()
    assert d.message == "reg/win:1 has no linux platform: windows/amd64 only"


def test_a_linux_pod_with_a_windows_only_image_is_warned_when_empty_is_admitted():
    d = decide(view(pod("reg/win:1")), RESULTS, Policy(deny_on_empty=False))
    assert d.allowed and d.architectures == frozenset()
    assert d.warnings[0] == ("reg/win:1 has no linux platform: windows/amd64 only; "
                             "admitted without an arch constraint")
    entries = json.loads(annotation(d, ANNOTATION_IMAGES))
    assert entries == [{"image": "reg/win:1", "digest": DIGEST, "architectures": [],
                        "source": "oci-index", "note": "no linux platform"}]


def test_audit_mode_says_enforce_would_deny_the_windows_only_image():
    d = decide(view(pod("reg/win:1")), RESULTS, Policy(deny_on_empty=True, mode="audit"))
    assert d.allowed and d.outcome == "audited" and d.would == "denied"
    assert d.warnings[0] == ("audit mode: archway would have denied this pod: "
                             "reg/win:1 has no linux platform: windows/amd64 only")


def test_a_windows_pod_with_a_linux_only_image_cannot_run():
    d = decide(view(pod("reg/app:1", os="windows")), RESULTS, Policy(deny_on_empty=True))
    assert not d.allowed
    assert d.message == "reg/app:1 has no windows platform: linux/amd64, linux/arm64 only"


def test_an_image_volume_with_platforms_places_the_pod():
    d = decide(view(pod("reg/app:1", volumes=[("models", "reg/amd-model:1", {})])),
               RESULTS, Policy())
    assert d.allowed and d.architectures == {"amd64"} and placed_archs(d) == "amd64"
    entries = json.loads(annotation(d, ANNOTATION_IMAGES))
    assert [e.get("volume") for e in entries] == [None, "models"]
    assert entries[1]["architectures"] == ["amd64"]


def test_an_image_volume_sharing_no_architecture_is_denied_and_the_message_names_the_volume():
    arm_only = info("reg/arm:1", "linux/arm64")
    d = decide(view(pod("reg/arm:1", volumes=[("models", "reg/amd-model:1", {})])),
               {**RESULTS, arm_only.image: arm_only}, Policy())
    assert not d.allowed and d.outcome == "denied"
    assert d.message == ("the pod's images share no CPU architecture: reg/arm:1 (arm64); "
                         "reg/amd-model:1 (image volume 'models') (amd64)")
    windows = decide(view(pod("reg/app:1", volumes=[("tools", "reg/win:1", {})])), RESULTS, Policy())
    assert windows.message == ("reg/win:1 (image volume 'tools') has no linux platform: "
                               "windows/amd64 only")


def test_an_artifact_volume_constrains_nothing_and_says_why():
    d = decide(view(pod("reg/app:1", volumes=[("models", "reg/model:1", {})])), RESULTS,
               Policy(fail_closed=True))
    assert d.allowed and d.architectures == {"amd64", "arm64"}
    assert d.warnings == ("reg/model:1 (image volume 'models') is an OCI artifact, no image; "
                          "it does not restrict placement",)
    entries = json.loads(annotation(d, ANNOTATION_IMAGES))
    assert entries[1] == {"image": "reg/model:1", "volume": "models", "digest": DIGEST,
                          "architectures": [], "source": ARTIFACT_SOURCE,
                          "note": ARTIFACT.note}


def test_an_unreadable_image_volume_fails_closed_like_a_container_image():
    from archway.errors import NotFound
    results = {**RESULTS, "reg/gone:1": NotFound("gone")}
    d = decide(view(pod("reg/app:1", volumes=[("models", "reg/gone:1", {})])), results,
               Policy(fail_closed=True))
    assert not d.allowed and "reg/gone:1" in d.message


def test_only_nodes_of_the_pods_os_count_when_judging_it_unschedulable():
    nodes = [NodeFacts("lin-arm", "arm64", (), (), "linux"),
             NodeFacts("win-amd", "amd64", (), (), "windows")]
    amd_pod = view(pod("reg/amd-model:1"))
    d = decide(amd_pod, RESULTS, Policy(), nodes=nodes)
    assert d.unschedulable == "images are amd64-only; nodes: arm64"    # windows/amd64 is no help
    win = decide(view(pod("reg/mixed:1", os="windows")), RESULTS, Policy(), nodes=nodes)
    assert win.allowed and win.unschedulable == ""
    only_arm_windows = [NodeFacts("win-arm", "arm64", (), (), "windows")]
    win = decide(view(pod("reg/mixed:1", os="windows")), RESULTS, Policy(),
                 nodes=only_arm_windows)
    assert win.unschedulable == "images are amd64-only; windows nodes: arm64"


def test_a_nodes_os_is_its_label_else_what_the_kubelet_reported_else_linux():
    def node(labels=None, os_reported=None):
        status = {"nodeInfo": {"operatingSystem": os_reported}} if os_reported else {}
        return {"metadata": {"name": "n", "labels": labels or {}}, "status": status}
    assert node_facts(node({OS_LABEL: "windows"})).os == "windows"
    assert node_facts(node(os_reported="windows")).os == "windows"
    assert node_facts(node()).os == "linux"


# --- the extender and the alarm ----------------------------------------------------------------

def test_the_extender_reads_the_pods_os_and_refuses_nodes_of_another_os():
    archs, _ = shared_architectures({"reg/mixed:1": MIXED}, "windows")
    assert archs == {"amd64"}
    archs, detail = shared_architectures({"reg/win:1": WINDOWS_ONLY}, "linux")
    assert archs == frozenset() and "no linux platform" in detail
    outcome = filter_by_arch(frozenset({"amd64"}), ["amd64", "amd64"], ["win", "lin"],
                             node_oses=["windows", "linux"], pod_os="windows")
    assert outcome.keep == [0]
    assert outcome.unresolvable == {"lin": "node OS linux is not the pod's OS windows"}


def test_a_tag_that_drops_its_windows_platform_raises_the_alarm():
    assert dropped_architectures(MIXED, info("reg/mixed:1", "linux/arm64")) == {"windows/amd64"}
    assert dropped_architectures(MIXED, info("reg/mixed:1", "linux/arm64", "linux/amd64",
                                             "windows/amd64")) == frozenset()
    assert dropped_architectures(MULTI, info("reg/app:1", "linux/amd64")) == {"arm64"}


# --- explain -----------------------------------------------------------------------------------

def test_explain_follows_the_pods_os_and_names_image_volumes():
    (workload,) = workloads_in([pod("reg/mixed:1", os="windows",
                                    volumes=[("models", "reg/model:1", {})])])
    e = explain_workload(workload, RESULTS, Policy())
    assert e.can_run and e.os == "windows"
    text = to_text(e)
    assert "runs on: amd64 (windows)" in text
    assert "image reg/model:1  ->  docker.io/reg/model:1  (image volume 'models')" in text
    assert "platforms: linux/arm64 windows/amd64" in text
    data = to_json(e)
    assert data["os"] == "windows" and data["images"][0]["architectures"] == ["amd64"]
    assert data["images"][1]["volume"] == "models" and data["images"][1]["note"] == ARTIFACT.note


def test_explain_says_a_linux_workload_with_a_windows_only_image_cannot_run():
    (workload,) = workloads_in([pod("reg/win:1")])
    e = explain_workload(workload, RESULTS, Policy(deny_on_empty=False))
    assert not e.can_run
    assert e.cannot_run == "reg/win:1 has no linux platform: windows/amd64 only"
    assert "architectures: none for linux" in to_text(e)


# --- pre-warming and the report ----------------------------------------------------------------

def test_pre_warming_reads_image_volumes_too():
    from archway.cluster.workloads import wanted_images
    deployment = {"kind": "Deployment", "metadata": {"namespace": "a"},
                  "spec": {"template": pod("reg/app:1", volumes=[("models", "reg/model:1", {})])}}
    assert [w.image for w in wanted_images([deployment])] == ["reg/app:1", "reg/model:1"]


def test_the_report_counts_image_volumes_and_the_pods_os():
    from archway.tools.report import assess
    (workload,) = workloads_in([pod("reg/app:1", volumes=[("tools", "reg/amd-model:1", {})])])
    row = assess(workload, PodView.of(workload.pod), RESULTS, "arm64")
    assert row.architectures == {"amd64"} and row.movable == "no"
    assert row.lacking == ("reg/amd-model:1",)
    (windows,) = workloads_in([pod("reg/mixed:1", os="windows")])
    row = assess(windows, PodView.of(windows.pod), RESULTS, "arm64")
    assert row.architectures == {"amd64"} and row.movable == "no"
