"""The pod view: every field archway reads, read once, with its shape checked in one place."""
import copy
import dataclasses

import pytest

from archway.podview import (
    Container,
    NodeSelectorTerm,
    OwnerReference,
    PodShapeError,
    PodView,
    PreferredTerm,
    Requirement,
)

POD = {
    "apiVersion": "v1", "kind": "Pod",
    "metadata": {
        "generateName": "web-7d9c5b8f6d-", "labels": {"app": "web"},
        "annotations": {"archway.dev/skip": "false"},
        "ownerReferences": [{"apiVersion": "apps/v1", "kind": "ReplicaSet",
                             "name": "web-7d9c5b8f6d", "uid": "u-1", "controller": True}]},
    "spec": {
        "initContainers": [{"name": "init", "image": "reg/init:1", "imagePullPolicy": "Always"}],
        "containers": [{"name": "app", "image": "reg/app:1"},
                       {"name": "side", "image": "reg/init:1", "imagePullPolicy": "IfNotPresent"},
                       {"name": "blank", "image": ""}],
        "ephemeralContainers": [{"name": "debug", "image": "reg/debug:1"}],
        "imagePullSecrets": [{"name": "regcred"}, {"name": ""}, {"name": "regcred"}, {}],
        "serviceAccountName": "builder",
        "schedulerName": "archway",
        "schedulingGates": [{"name": "archway.dev/arch"}],
        "nodeSelector": {"disktype": "ssd"},
        "tolerations": [{"key": "dedicated", "operator": "Equal", "value": "gpu",
                         "effect": "NoSchedule"}, {"operator": "Exists"}],
        "affinity": {"nodeAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
                {"matchExpressions": [{"key": "zone", "operator": "In", "values": ["a", "b"]}]},
                {"matchFields": [{"key": "metadata.name", "operator": "In", "values": ["n1"]}]},
                {}]},
            "preferredDuringSchedulingIgnoredDuringExecution": [
                {"weight": 10, "preference": {"matchExpressions": [
                    {"key": "kubernetes.io/arch", "operator": "In", "values": ["arm64"]}]}}]}},
        "volumes": [{"name": "data", "emptyDir": {}}],
    },
}


def test_every_field_is_read():
    pod = PodView.of(POD, namespace="shop")
    assert (pod.namespace, pod.name, pod.generate_name) == ("shop", "", "web-7d9c5b8f6d-")
    assert pod.display_name == "shop/web-7d9c5b8f6d-*"
    assert dict(pod.labels) == {"app": "web"}
    assert pod.owner_references == (OwnerReference("apps/v1", "ReplicaSet", "web-7d9c5b8f6d",
                                                   "u-1", True),)
    assert pod.containers == (Container("init", "reg/init:1", "Always", True),
                              Container("app", "reg/app:1", "", False),
                              Container("side", "reg/init:1", "IfNotPresent", False),
                              Container("blank", "", "", False))
    assert pod.images == ("reg/init:1", "reg/app:1")   # distinct, in order, no ephemeral ones
    assert pod.pull_secret_names == ("regcred",)
    assert pod.service_account == "builder" and pod.scheduler_name == "archway"
    assert pod.scheduling_gates == ("archway.dev/arch",) and pod.node_name == ""
    assert dict(pod.node_selector) == {"disktype": "ssd"}
    assert pod.required_terms == (
        NodeSelectorTerm((Requirement("zone", "In", ("a", "b")),), ()),
        NodeSelectorTerm((), (Requirement("metadata.name", "In", ("n1",)),)),
        NodeSelectorTerm((), ()))
    assert [t.matches_nothing for t in pod.required_terms] == [False, False, True]
    assert pod.preferred_terms == (PreferredTerm(10, NodeSelectorTerm(
        (Requirement("kubernetes.io/arch", "In", ("arm64",)),), ())),)


def test_metadata_wins_over_the_request_and_absent_parts_are_empty():
    pod = PodView.of({"metadata": {"name": "a", "namespace": "ns"}}, namespace="other", name="b")
    assert (pod.namespace, pod.name, pod.display_name) == ("ns", "a", "ns/a")
    bare = PodView.of({})
    assert bare.images == () and bare.required_terms is None and bare.display_name == "-/*"
    assert bare.service_account == "" and dict(bare.patchable) == {}
    assert PodView.of({"spec": {"serviceAccount": "legacy"}}).service_account == "legacy"


def test_the_view_is_immutable_and_does_not_follow_the_dict():
    source = {"metadata": {"annotations": {"a": "1"}}, "spec": {"nodeSelector": {"x": "y"}}}
    pod = PodView.of(source)
    source["metadata"]["annotations"]["a"] = "2"
    source["spec"]["nodeSelector"]["x"] = "z"
    assert pod.annotations["a"] == "1" and pod.node_selector["x"] == "y"
    with pytest.raises(TypeError):
        pod.annotations["b"] = "2"  # type: ignore[index]
    with pytest.raises(dataclasses.FrozenInstanceError):
        pod.name = "x"  # type: ignore[misc]


def test_tolerations_are_read_and_match_taints_as_the_scheduler_does():
    gpu, everything = PodView.of(POD).tolerations
    assert gpu.tolerates("dedicated", "gpu", "NoSchedule")
    assert not gpu.tolerates("dedicated", "gpu", "NoExecute")
    assert not gpu.tolerates("dedicated", "cpu", "NoSchedule")
    assert everything.tolerates("anything", "", "NoExecute")
    with pytest.raises(PodShapeError, match=r"spec.tolerations\[0\].key must be a string"):
        PodView.of({"spec": {"tolerations": [{"key": 3}]}})


def test_patchable_part_keeps_the_pods_own_paths_and_copies_are_independent():
    pod = PodView.of(POD)
    assert set(pod.patchable) == {"metadata", "spec"}
    assert pod.patchable["metadata"] == {"annotations": {"archway.dev/skip": "false"}}
    assert set(pod.patchable["spec"]) == {"affinity", "nodeSelector", "schedulerName",
                                          "schedulingGates", "tolerations"}
    copy = pod.patchable_copy()
    copy["spec"]["nodeSelector"]["kubernetes.io/arch"] = "arm64"
    assert "kubernetes.io/arch" not in pod.patchable["spec"]["nodeSelector"]
    assert PodView.of({"metadata": None, "spec": {}}).patchable == {"spec": {}}


@pytest.mark.parametrize("path, value, message", [
    (["metadata"], 7, "metadata must be a mapping"),
    (["metadata", "name"], 5, "metadata.name must be a string"),
    (["metadata", "annotations"], ["a"], "metadata.annotations must be a mapping"),
    (["metadata", "labels", "app"], 1, "metadata.labels['app'] must be a string"),
    (["metadata", "ownerReferences", 0, "controller"], "yes",
     "metadata.ownerReferences[0].controller must be true or false"),
    (["spec"], [], "spec must be a mapping"),
    (["spec", "containers"], {}, "spec.containers must be a list"),
    (["spec", "containers", 1], "nginx", "spec.containers[1] must be a mapping"),
    (["spec", "initContainers", 0, "image"], 7, "spec.initContainers[0].image must be a string"),
    (["spec", "containers", 0, "imagePullPolicy"], True,
     "spec.containers[0].imagePullPolicy must be a string"),
    (["spec", "imagePullSecrets"], "regcred", "spec.imagePullSecrets must be a list"),
    (["spec", "imagePullSecrets", 0, "name"], 1, "spec.imagePullSecrets[0].name must be a string"),
    (["spec", "serviceAccountName"], 1, "spec.serviceAccountName must be a string"),
    (["spec", "nodeName"], {}, "spec.nodeName must be a string"),
    (["spec", "schedulerName"], 5, "spec.schedulerName must be a string"),
    (["spec", "schedulingGates", 0], "gate", "spec.schedulingGates[0] must be a mapping"),
    (["spec", "nodeSelector"], ["a"], "spec.nodeSelector must be a mapping"),
    (["spec", "affinity"], "everywhere", "spec.affinity must be a mapping"),
    (["spec", "affinity", "nodeAffinity"], [], "spec.affinity.nodeAffinity must be a mapping"),
    (["spec", "affinity", "nodeAffinity", "requiredDuringSchedulingIgnoredDuringExecution",
      "nodeSelectorTerms"], {}, "nodeSelectorTerms must be a list"),
    (["spec", "affinity", "nodeAffinity", "requiredDuringSchedulingIgnoredDuringExecution",
      "nodeSelectorTerms", 0, "matchExpressions", 0, "values"], "a",
     "nodeSelectorTerms[0].matchExpressions[0].values must be a list"),
    (["spec", "affinity", "nodeAffinity", "preferredDuringSchedulingIgnoredDuringExecution", 0,
      "weight"], "10", "preferredDuringSchedulingIgnoredDuringExecution[0].weight must be an "
                       "integer"),
])
def test_shape_errors_name_the_field(path, value, message):
    pod = _replaced(POD, path, value)
    with pytest.raises(PodShapeError) as caught:
        PodView.of(pod)
    assert message in str(caught.value)


def _replaced(obj, path, value):
    obj = copy.deepcopy(obj)
    target = obj
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = value
    return obj
