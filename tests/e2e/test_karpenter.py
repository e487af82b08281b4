"""archway with Karpenter (issue 29): a control plane with no Node until Karpenter's KWOK provider
launches one (lab/cluster/karpenter.py), NodePool `default` allowing amd64 and arm64 with arm64
20 % cheaper, archway installed by its chart in front. What Karpenter reads is what archway wrote:
the required node affinity on kubernetes.io/arch, the preferred weights, the scheduling gate.

Each test starts with no NodeClaim (the `fresh` fixture deletes what the last one left) and
counts the NodeClaims it caused. KWOK runs no binary: an amd64 image bound to an arm64 Node
"runs" there; the exec format error a real node would give is the failure archway prevents, and
the contrast test shows Karpenter making it when archway does not see the pod.
"""
import json
import os
import re
import time

import pytest

from lab.cluster.chart import ChartInstall, deep_merge
from lab.cluster.controlplane import ControlPlane
from lab.cluster.karpenter import (
    ARM64_PRICE,
    NODEPOOL,
    NODEPOOL_LABEL,
    arm64_priced,
    build_karpenter,
    plane_options,
    start_with_kwok,
)
from lab.kube import KubeError, pod_path

from .conftest import archway_config
from .workloads import create_deployment, create_pod, deployment, describe, gated, pod, pods_of

ARCH = "kubernetes.io/arch"
# amd64 preferred although arm64 is cheaper: the preference, not the price, must decide.
PREFERRED = {"amd64": 80, "arm64": 20}
SKIP = {"archway.dev/skip": "true"}        # the chart's objectSelector: archway never sees the pod
# The module's control plane, archway, KWOK and Karpenter count against its first test, and
# consolidation alone may take minutes.
pytestmark = pytest.mark.timeout(900)


@pytest.fixture(scope="module")
def autoscaled(images, tmp_path_factory):
    """Its own control plane without Nodes, archway (the e2e configuration, amd64 preferred,
    NodePools read), KWOK and Karpenter."""
    plane = ControlPlane(str(tmp_path_factory.mktemp("karpenter-plane")), **plane_options(True))
    install = None
    started = time.monotonic()
    try:
        plane.start()
        # The chart's values (not only archway's file): they grant the NodePools' list/watch.
        install = ChartInstall(plane, archway_config=deep_merge(
            archway_config(images), {"placement": {"preferred_architectures": PREFERRED},
                                     # gated pods stay gated while Karpenter launches others
                                     "admission": {"gate_max_seconds": 300}}),
            values={"config": {"kubernetes": {"karpenter_node_pools": True}}}).install()
        karpenter = start_with_kwok(plane, install.namespace)
        print(f"\nkarpenter: control plane, archway, KWOK and Karpenter up in "
              f"{time.monotonic() - started:.0f} s")
        yield plane, install, karpenter
    finally:
        if install is not None:
            install.stop_processes()
        plane.stop()


@pytest.fixture
def fresh(autoscaled, request):
    """A namespace of the test's own on a cluster with no NodeClaim; (karpenter, namespace).
    After the test its namespace goes first: a NodeClaim deleted while pods are still on its
    Node makes Karpenter launch a Node for them."""
    plane, _, karpenter = autoscaled
    karpenter.poll(lambda: not karpenter.nodeclaims() and not karpenter.nodes(), timeout=120,
                   what="no NodeClaim left by the last test")
    name = re.sub(r"[^a-z0-9-]", "-", f"k-{request.node.name.lower()}")[:45].strip("-")
    namespace = plane.new_namespace(f"{name}-{int(time.time() * 1000) % 10000}")
    yield karpenter, namespace
    plane.kube.delete(f"/api/v1/namespaces/{namespace}")
    karpenter.poll(lambda: not plane.kube.items(pod_path(namespace)), timeout=120,
                   what=f"the pods of {namespace} deleted")
    for claim in karpenter.nodeclaims():
        plane.kube.delete(f"/apis/karpenter.sh/v1/nodeclaims/{claim['metadata']['name']}")
    karpenter.poll(lambda: not karpenter.nodeclaims() and not karpenter.nodes(), timeout=120,
                   what="the test's NodeClaims and Nodes gone")


def running(karpenter, namespace: str, app: str, count: int, timeout: float = 120.0) -> list[dict]:
    """The `count` pods of `app` once each is Running (KWOK plays them on Karpenter's Nodes)."""
    def done():
        karpenter.check_alive()
        pods = pods_of(karpenter.kube, namespace, app)
        return pods if len(pods) == count and all(
            p.get("status", {}).get("phase") == "Running" for p in pods) else None
    return karpenter.poll(done, timeout=timeout, what=f"{count} pods of {app} Running")


def node_of(karpenter, pod_obj: dict) -> dict:
    return karpenter.kube.get(f"/api/v1/nodes/{pod_obj['spec']['nodeName']}")


def arch_of(karpenter, pod_obj: dict) -> str:
    node = node_of(karpenter, pod_obj)
    assert NODEPOOL_LABEL in node["metadata"]["labels"], "a Node Karpenter did not launch"
    assert node["status"]["nodeInfo"]["architecture"] == node["metadata"]["labels"][ARCH]
    return node["metadata"]["labels"][ARCH]


def claim_arch(claim: dict) -> str:
    """A NodeClaim's architecture: its label, which Karpenter sets once it is launched; until
    then what its requirements allow ("amd64|arm64" when more than one)."""
    label = (claim["metadata"].get("labels") or {}).get(ARCH)
    if label:
        return label
    allowed = sorted(v for r in claim["spec"].get("requirements", [])
                     if r.get("key") == ARCH and r.get("operator") == "In" for v in r["values"])
    return "|".join(allowed) or "any"


def claim_archs(karpenter) -> list[str]:
    return sorted(claim_arch(c) for c in karpenter.nodeclaims())


def unseen(body: dict) -> dict:
    """The Deployment with its pods labelled archway.dev/skip: archway never sees them."""
    body["spec"]["template"]["metadata"]["labels"].update(SKIP)
    return body


def test_each_arm64_offering_costs_less_than_the_same_amd64_one():
    """The instance types Karpenter is given: the provider's linux ones, arm64 at 0.8x."""
    with open(os.path.join(build_karpenter(), "instance_types.json")) as f:
        types = json.load(f)
    priced = {t["name"]: t for t in arm64_priced(types)}
    assert priced and all(t["operatingSystems"] == ["linux"] for t in priced.values())
    original = {t["name"]: t for t in types}
    for name, kind in priced.items():
        if kind["architecture"] == "arm64":
            twin = original[name.replace("-arm64-", "-amd64-")]
            pairs = list(zip(kind["offerings"], twin["offerings"]))
            assert pairs and all(a["Requirements"] == b["Requirements"] for a, b in pairs)
            assert all(abs(a["Price"] - ARM64_PRICE * b["Price"]) < 1e-8 for a, b in pairs)
        else:
            assert kind["offerings"] == original[name]["offerings"]
    # the provider's own file, as given: both architectures priced alike
    assert original["c-2x-arm64-linux"]["offerings"] == original["c-2x-amd64-linux"]["offerings"]


def test_single_architecture_workloads_get_nodes_of_their_architecture(fresh, images):
    karpenter, namespace = fresh
    kube = karpenter.kube
    took = {}
    # arm64 first, then amd64 beside a Node of the cheaper arm64: each gets a Node of its own.
    for arch in ("arm64", "amd64"):
        created = time.monotonic()
        create_deployment(kube, namespace, deployment(arch, [images.ref(f"e2e/{arch}")], replicas=2))
        pods = running(karpenter, namespace, arch, 2)
        took[arch] = time.monotonic() - created
        assert {arch_of(karpenter, p) for p in pods} == {arch}, describe(
            kube, namespace, pods[0]["metadata"]["name"])
        assert pods[0]["metadata"]["annotations"]["archway.dev/architectures"] == arch
    assert claim_archs(karpenter) == ["amd64", "arm64"]
    # Admitted while the only Node was arm64, the amd64 pods are not announced Pending "until
    # such a node joins": archway reads the NodePool, which launches amd64 (karpenter_node_pools).
    (owner,) = [r["metadata"]["name"] for r in kube.items(
        f"/apis/apps/v1/namespaces/{namespace}/replicasets") if r["metadata"]["name"].startswith("amd64-")]
    assert not [e for e in kube.events_for(namespace, owner, "ReplicaSet")
                if e.get("reason") == "ArchwayUnschedulable"]
    print(f"\nkarpenter: created -> Running on a new Node (polled every 0.5 s): "
          f"arm64 {took['arm64']:.1f} s, amd64 {took['amd64']:.1f} s; NodeClaims: "
          f"{claim_archs(karpenter)}")


def test_a_pod_a_nodepool_may_place_is_admitted_even_when_unschedulable_pods_are_denied(
        autoscaled, fresh, images):
    """admission.deny_unschedulable with Karpenter: a NodePool that launches the pod's
    architecture counts as a node that may join; once the NodePool allows only arm64 the
    amd64-only pod is denied, naming what the cluster offers."""
    _, install, _ = autoscaled
    karpenter, namespace = fresh
    kube = karpenter.kube
    install.restart_webhook({"admission": {"deny_unschedulable": True}})
    requirements = kube.get(f"/apis/karpenter.sh/v1/nodepools/{NODEPOOL}")[
        "spec"]["template"]["spec"]["requirements"]
    try:
        create_deployment(kube, namespace, deployment("arm", [images.ref("e2e/arm64")], replicas=1))
        running(karpenter, namespace, "arm", 1)
        created = create_pod(kube, namespace, pod("x86", [images.ref("e2e/amd64")]))
        assert created["metadata"]["annotations"]["archway.dev/architectures"] == "amd64"
        only_arm64 = [dict(r, values=["arm64"]) if r["key"] == ARCH else r for r in requirements]
        kube.patch(f"/apis/karpenter.sh/v1/nodepools/{NODEPOOL}",
                   {"spec": {"template": {"spec": {"requirements": only_arm64}}}})

        def denied():   # the webhook's NodePool watch sees the change
            try:
                create_pod(kube, namespace, pod(f"x86-{time.monotonic_ns()}", [images.ref("e2e/amd64")]))
            except KubeError as e:
                return str(e)
            return None
        message = karpenter.poll(denied, timeout=30, what="the amd64-only pod denied")
        assert "images are amd64-only; nodes: arm64" in message, message
    finally:
        kube.patch(f"/apis/karpenter.sh/v1/nodepools/{NODEPOOL}",
                   {"spec": {"template": {"spec": {"requirements": requirements}}}})
        install.restart_webhook()


def test_preferred_architectures_choose_the_node_over_the_price(fresh, images):
    karpenter, namespace = fresh
    create_deployment(karpenter.kube, namespace, deployment(
        "preferred", [images.ref("e2e/multi")], replicas=2))
    (placed, _) = running(karpenter, namespace, "preferred", 2)
    terms = placed["spec"]["affinity"]["nodeAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"]
    assert [(t["weight"], t["preference"]["matchExpressions"][0]["values"]) for t in terms] == [
        (80, ["amd64"]), (20, ["arm64"])]
    assert arch_of(karpenter, placed) == "amd64"
    assert claim_archs(karpenter) == ["amd64"]
    # The same multi-arch image unseen by archway, kept off that Node: Karpenter's cost choice.
    away = {"podAntiAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": [{
        "labelSelector": {"matchLabels": {"app": "preferred"}},
        "topologyKey": "kubernetes.io/hostname"}]}}
    create_deployment(karpenter.kube, namespace, unseen(deployment(
        "priced", [images.ref("e2e/multi")], replicas=1, affinity=away)))
    (priced,) = running(karpenter, namespace, "priced", 1)
    assert "nodeAffinity" not in priced["spec"]["affinity"]
    assert arch_of(karpenter, priced) == "arm64"


def test_a_gated_pod_provisions_nothing_until_released_then_gets_its_architecture(
        fresh, images, slow_registry):
    karpenter, namespace = fresh
    kube = karpenter.kube
    tag = images.fresh("e2e/amd64")
    held = create_pod(kube, namespace, pod("held", [images.ref("e2e/amd64", tag, via="slow")]))
    assert gated(held), describe(kube, namespace, "held")
    # A pod Karpenter must provision for, created after the gated one: once it runs, Karpenter
    # has batched and simulated with the gated pod pending, and launched nothing for it.
    create_deployment(kube, namespace, deployment("beside", [images.ref("e2e/arm64")], replicas=1))
    running(karpenter, namespace, "beside", 1)
    watched_until = time.monotonic() + 5      # a few batch windows (BATCH_IDLE_DURATION 1 s)
    while time.monotonic() < watched_until:
        still = kube.get(pod_path(namespace, "held"))
        assert gated(still) and not still["spec"].get("nodeName")
        assert claim_archs(karpenter) == ["arm64"], "a NodeClaim for a gated pod"
        time.sleep(0.5)

    slow_registry.delay = 0.0
    released_at = time.monotonic()
    (placed,) = running(karpenter, namespace, "held", 1)
    took = time.monotonic() - released_at
    assert not gated(placed) and arch_of(karpenter, placed) == "amd64"
    assert claim_archs(karpenter) == ["amd64", "arm64"]
    print(f"\nkarpenter: gated pod released -> Running on a new amd64 Node in {took:.1f} s; "
          f"NodeClaims: {claim_archs(karpenter)}; archway's Events: "
          f"{[(e.get('reason'), e.get('note')) for e in kube.events_for(namespace, 'held')]}")


def test_a_gated_deployment_released_together_gets_one_node(fresh, images, slow_registry):
    """Four pods gated on the same image, released as archway reads it, get one Node, not one
    each: Karpenter batches the pods that turn unschedulable within its window
    (BATCH_IDLE_DURATION 1 s) and counts the room of the NodeClaims it has in flight."""
    karpenter, namespace = fresh
    kube = karpenter.kube
    tag = images.fresh("e2e/amd64")
    create_deployment(kube, namespace, deployment(
        "herd", [images.ref("e2e/amd64", tag, via="slow")], replicas=4))
    karpenter.poll(lambda: len(pods_of(kube, namespace, "herd")) == 4
                   and all(gated(p) for p in pods_of(kube, namespace, "herd")),
                   timeout=30, what="4 gated pods")
    slow_registry.delay = 0.0
    released_at = time.monotonic()
    pods = running(karpenter, namespace, "herd", 4)
    took = time.monotonic() - released_at
    assert {arch_of(karpenter, p) for p in pods} == {"amd64"}
    print(f"\nkarpenter: 4 gated pods released -> Running in {took:.1f} s on "
          f"{len({p['spec']['nodeName'] for p in pods})} Node(s); NodeClaims: {claim_archs(karpenter)}")
    assert claim_archs(karpenter) == ["amd64"]


def test_images_that_share_no_architecture_provision_nothing_and_say_why(fresh, images):
    karpenter, namespace = fresh
    kube = karpenter.kube
    create_deployment(kube, namespace, deployment(
        "nowhere", [images.ref("e2e/amd64"), images.ref("e2e/arm64")], replicas=2))

    def failed_create():
        sets = kube.items(f"/apis/apps/v1/namespaces/{namespace}/replicasets")
        events = [e for s in sets for e in kube.items(
            f"/api/v1/namespaces/{namespace}/events",
            fieldSelector=f"involvedObject.name={s['metadata']['name']}")]
        return [e for e in events if e.get("reason") == "FailedCreate"]
    (event, *_) = karpenter.poll(failed_create, timeout=60, what="a FailedCreate Event")
    assert "share no CPU architecture" in event["message"], event["message"]
    assert "amd64" in event["message"] and "arm64" in event["message"]
    assert pods_of(kube, namespace, "nowhere") == []
    assert karpenter.nodeclaims() == []
    # A bare pod is refused with the same words.
    with pytest.raises(KubeError) as refused:
        create_pod(kube, namespace, pod("bare", [images.ref("e2e/amd64"), images.ref("e2e/arm64")]))
    assert refused.value.status == 403 and "share no CPU architecture" in refused.value.message


def test_consolidation_replaces_a_node_only_with_one_of_the_pods_architecture(fresh, images):
    """An underused amd64 Node replaced by a cheaper one: arm64 would be cheapest, the pod's
    archway affinity allows only amd64."""
    karpenter, namespace = fresh
    kube = karpenter.kube
    # On-demand: Karpenter replaces a spot Node with a spot one only with SpotToSpotConsolidation.
    body = deployment("wide", [images.ref("e2e/amd64")], replicas=3,
                      nodeSelector={"karpenter.sh/capacity-type": "on-demand"})
    body["spec"]["template"]["spec"]["containers"][0]["resources"] = {"requests": {"cpu": "800m"}}
    create_deployment(kube, namespace, body)
    running(karpenter, namespace, "wide", 3)
    first = {c["metadata"]["name"]: claim_arch(c) for c in karpenter.nodeclaims()}
    assert list(first.values()) == ["amd64"], first    # one Node for the three: 2.4 CPUs

    kube.patch(f"/apis/apps/v1/namespaces/{namespace}/deployments/wide/scale",
               {"spec": {"replicas": 1}})
    seen = dict(first)
    karpenter.set_consolidate_after("5s")
    started = time.monotonic()
    try:
        def replaced():
            claims = karpenter.nodeclaims()
            seen.update({c["metadata"]["name"]: claim_arch(c) for c in claims})
            pods = pods_of(kube, namespace, "wide")
            return (claims and not {c["metadata"]["name"] for c in claims} & first.keys()
                    and len(pods) == 1 and pods[0]["status"].get("phase") == "Running"
                    and pods[0])
        moved = karpenter.poll(replaced, timeout=300, what="the underused Node replaced")
    finally:
        karpenter.set_consolidate_after("30s")
    assert arch_of(karpenter, moved) == "amd64"
    assert set(seen.values()) == {"amd64"}, seen
    print(f"\nkarpenter: consolidation replaced {sorted(first)} by "
          f"{sorted(seen.keys() - first.keys())} in {time.monotonic() - started:.0f} s; "
          f"NodeClaims seen: {seen}")


def test_an_amd64_only_pod_archway_never_sees_is_given_an_arm64_node(fresh, images):
    """The contrast: what archway prevents. Without its affinity Karpenter launches the cheapest
    Node, arm64, and the scheduler binds the amd64-only pod there. On a real node its container
    would exit with `exec format error`; KWOK runs nothing, so here it is 'Running'."""
    karpenter, namespace = fresh
    create_deployment(karpenter.kube, namespace, unseen(deployment(
        "unseen", [images.ref("e2e/amd64")], replicas=1)))
    (placed,) = running(karpenter, namespace, "unseen", 1)
    assert "archway.dev/architectures" not in (placed["metadata"].get("annotations") or {})
    assert "affinity" not in placed["spec"]
    assert arch_of(karpenter, placed) == "arm64"
    assert claim_archs(karpenter) == ["arm64"]


def test_a_nodepool_of_one_architecture_launches_nothing_for_the_other_and_says_why(
        fresh, images):
    """A NodePool of arm64 only: an amd64-only workload gets no Node (never an arm64 one);
    Karpenter's Event on the pod names the architecture it cannot offer."""
    karpenter, namespace = fresh
    kube = karpenter.kube
    requirements = kube.get(f"/apis/karpenter.sh/v1/nodepools/{NODEPOOL}")[
        "spec"]["template"]["spec"]["requirements"]
    only_arm64 = [dict(r, values=["arm64"]) if r["key"] == ARCH else r for r in requirements]
    kube.patch(f"/apis/karpenter.sh/v1/nodepools/{NODEPOOL}",
               {"spec": {"template": {"spec": {"requirements": only_arm64}}}})
    try:
        create_deployment(kube, namespace, deployment("x86", [images.ref("e2e/amd64")], replicas=1))
        (name,) = karpenter.poll(lambda: [p["metadata"]["name"] for p in pods_of(kube, namespace, "x86")],
                                 timeout=30, what="the pod created")

        def refused():
            return [e for e in kube.events_for(namespace, name)
                    if e.get("reportingController") == "karpenter"
                    and e.get("reason") == "FailedScheduling"]
        (event, *_) = karpenter.poll(refused, timeout=60, what="Karpenter's FailedScheduling Event")
        assert "kubernetes.io/arch In [amd64] not in kubernetes.io/arch In [arm64]" in event["note"]
        assert karpenter.nodeclaims() == []
        assert not kube.get(pod_path(namespace, name))["spec"].get("nodeName")
    finally:
        kube.patch(f"/apis/karpenter.sh/v1/nodepools/{NODEPOOL}",
                   {"spec": {"template": {"spec": {"requirements": requirements}}}})
