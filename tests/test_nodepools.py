"""Karpenter's NodePools as nodes that may join (cluster/nodepools.py): which architectures a
NodePool allows, and the unschedulable check counting them (pure, no I/O)."""
import pytest

from archway.cluster.nodepools import ANY_ARCH, nodepool_facts, pool_architectures
from archway.placement.policy import Policy
from tests.test_placement import Node, info, make_pod
from tests.test_placement import decide as decide_pod


def arch(operator, *values):
    return {"key": "kubernetes.io/arch", "operator": operator, "values": list(values)}


@pytest.mark.parametrize("requirements, archs", [
    (None, ANY_ARCH),
    ([], ANY_ARCH),
    ([{"key": "kubernetes.io/os", "operator": "In", "values": ["linux"]}], ANY_ARCH),
    ([arch("In", "amd64", "arm64")], {"amd64", "arm64"}),
    ([arch("In", "x86_64", "aarch64")], {"amd64", "arm64"}),      # the node label's names
    ([arch("NotIn", "amd64")], ANY_ARCH - {"amd64"}),
    ([arch("In", "amd64", "arm64"), arch("NotIn", "arm64")], {"amd64"}),
    ([arch("Exists")], ANY_ARCH),
    ([arch("DoesNotExist")], set()),
    ([arch("In", "riscv128")], {"riscv128"}),                       # whatever the pool says
])
def test_a_node_pool_allows_the_architectures_its_requirements_leave(requirements, archs):
    assert pool_architectures(requirements) == archs


def pool(name, requirements, taints=()):
    return {"apiVersion": "karpenter.sh/v1", "kind": "NodePool", "metadata": {"name": name},
            "spec": {"template": {"spec": {"requirements": requirements, "taints": list(taints),
                                           "nodeClassRef": {"name": "default"}}}}}


def test_a_node_pool_is_one_node_per_architecture_with_its_template_taints():
    facts = nodepool_facts(pool("graviton", [arch("In", "arm64", "amd64")], [
        {"key": "team", "value": "ml", "effect": "NoSchedule"}]))
    assert facts.name == "graviton"
    assert [(n.name, n.arch, n.taints) for n in facts.nodes] == [
        ("nodepool/graviton", "amd64", (("team", "ml", "NoSchedule"),)),
        ("nodepool/graviton", "arm64", (("team", "ml", "NoSchedule"),))]
    assert nodepool_facts({"metadata": {}}) is None
    assert nodepool_facts({"metadata": {"name": "odd"}, "spec": {"template": {"spec": "x"}}}).nodes == ()


def test_a_pod_whose_architecture_a_node_pool_may_launch_is_not_unschedulable():
    amd_only = {"reg/amd:1": info("reg/amd:1", "linux/amd64")}
    pod = make_pod("reg/amd:1")
    on_arm = [Node("arm64")]
    denied = decide_pod(pod, amd_only, Policy(deny_unschedulable=True), nodes=on_arm)
    assert not denied.allowed and denied.unschedulable == "images are amd64-only; nodes: arm64"
    both = nodepool_facts(pool("default", [arch("In", "amd64", "arm64")])).nodes
    placed = decide_pod(pod, amd_only, Policy(deny_unschedulable=True), nodes=[*on_arm, *both])
    assert placed.allowed and not placed.unschedulable and not placed.warnings
    # a pool of arm64 only launches nothing the pod can run on; a pool's taint counts as a node's
    arm_pool = nodepool_facts(pool("arm", [arch("In", "arm64")])).nodes
    assert decide_pod(pod, amd_only, Policy(), nodes=[*on_arm, *arm_pool]).unschedulable == (
        "images are amd64-only; nodes: arm64")
    tainted = nodepool_facts(pool("gpu", [arch("In", "amd64")],
                                  [{"key": "gpu", "effect": "NoSchedule"}])).nodes
    assert decide_pod(pod, amd_only, Policy(), nodes=[*on_arm, *tainted]).unschedulable == (
        "images are amd64-only; nodes: arm64")


@pytest.mark.parametrize("requirements, oses", [
    (None, {"linux"}),
    ([arch("In", "amd64")], {"linux"}),
    ([{"key": "kubernetes.io/os", "operator": "In", "values": ["windows"]}], {"windows"}),
    ([{"key": "kubernetes.io/os", "operator": "NotIn", "values": ["linux"]}], {"windows"}),
])
def test_a_node_pool_launches_the_oses_its_requirements_leave(requirements, oses):
    from archway.cluster.nodepools import pool_operating_systems
    assert pool_operating_systems(requirements) == oses


def test_a_windows_node_pool_does_not_run_a_linux_pod():
    amd_only = {"reg/amd:1": info("reg/amd:1", "linux/amd64")}
    windows = nodepool_facts(pool("win", [arch("In", "amd64"), {
        "key": "kubernetes.io/os", "operator": "In", "values": ["windows"]}])).nodes
    assert [(n.arch, n.os) for n in windows] == [("amd64", "windows")]
    assert decide_pod(make_pod("reg/amd:1"), amd_only, Policy(),
                      nodes=[Node("arm64"), *windows]).unschedulable == (
        "images are amd64-only; nodes: arm64")
