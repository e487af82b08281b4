"""The scheduler extender's filter and prioritize, with bodies shaped exactly as kube-scheduler
sends them (tests/fixtures/extender), a node cache fed by the stand-in API server's list + watch,
a real registry behind the resolver, and one real `archway serve` (gunicorn) over HTTP."""
import copy
import json
import os
import subprocess
import sys
import threading
import time

import kubernetes_validate
import pytest
import requests

from archway.cluster.nodes import NodeCache, node_arch
from archway.config import RegistrySettings, config_from_dict
from archway.extender.archfilter import (
    annotated_architectures,
    filter_by_arch,
    shared_architectures,
)
from archway.extender.routes import extender_routes
from archway.extender.service import Extender
from archway.podview import PodShapeError, PodView
from archway.registry.resolver import Resolver
from archway.server.routes import Routes, Site
from lab.procs import REPO, Server, free_port, wait_for_port, wait_until
from lab.servers.apiserver import FakeApiServer
from lab.servers.faults import BlackHole
from tests.infra.fixtures import LOOPBACK_HOSTS, plain_registry
from tests.infra.siteclient import SiteClient

# Starts real servers (registries, archway serve, helm...): outside the fast inner loop.
pytestmark = pytest.mark.slow

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures", "extender")
REPLY_KEYS = ["Nodes", "NodeNames", "FailedNodes", "FailedAndUnresolvableNodes", "Error"]
AMD64, ARM64, PPC64LE, S390X = (f"ip-10-0-1-1{i}.eu-west-1.compute.internal" for i in range(1, 5))


def raw(name: str) -> bytes:
    with open(os.path.join(FIXTURES, name), "rb") as f:
        return f.read()


def load(name: str) -> dict:
    return json.loads(raw(name))


def extender_client(extender: Extender) -> SiteClient:
    """The extender's two routes, called as archway's server calls them."""
    return SiteClient(Site(Routes(extender_routes(extender))))


def make_client(resolver=None, **sections) -> SiteClient:
    sections.setdefault("extender", {"node_cache": False})
    sections.setdefault("kubernetes", {"enabled": "off"})
    return extender_client(Extender(config_from_dict(sections), resolver))


@pytest.fixture(scope="module")
def client():
    return make_client()


def post(client, verb, body, status=200):
    data = body if isinstance(body, (bytes, str)) else json.dumps(body)
    r = client.post(f"/scheduler/{verb}", data=data, content_type="application/json")
    assert r.status_code == status, r.data
    assert r.mimetype == "application/json"
    return r


# --- the fixtures are what kube-scheduler really sends ---------------------------------------------

@pytest.mark.parametrize("version", ["1.30.0", "1.33.0"])
def test_fixture_objects_are_valid_pods_and_nodes(version):
    for name in ("filter-nodes.json", "filter-nodenames.json", "filter-unannotated-nodes.json"):
        args = load(name)
        assert set(args) == {"Pod", "Nodes", "NodeNames"}   # Go field names, no json tags
        kubernetes_validate.validate({"apiVersion": "v1", "kind": "Pod", **args["Pod"]}, version, strict=True)
        if args["Nodes"] is not None:
            assert args["NodeNames"] is None and set(args["Nodes"]) == {"metadata", "items"}
            for node in args["Nodes"]["items"]:
                kubernetes_validate.validate({"apiVersion": "v1", "kind": "Node", **node}, version,
                                             strict=True)
        else:
            assert all(isinstance(n, str) for n in args["NodeNames"])


# --- pure parts ----------------------------------------------------------------------------------

def test_node_arch_label_then_beta_label_then_node_info():
    nodes = {n["metadata"]["name"]: n for n in load("filter-nodes.json")["Nodes"]["items"]}
    assert [node_arch(nodes[n]) for n in (AMD64, ARM64, PPC64LE, S390X)] == [
        "amd64", "arm64", "ppc64le", "s390x"]
    assert "kubernetes.io/arch" not in nodes[PPC64LE]["metadata"]["labels"]
    assert not any("arch" in k for k in nodes[S390X]["metadata"]["labels"])
    assert node_arch({"metadata": {"labels": {"kubernetes.io/arch": "x86_64"}}}) == "amd64"
    assert node_arch({"metadata": {"labels": {"kubernetes.io/arch": 7}}, "status": "odd"}) is None


def test_annotation_parsing():
    def pod(value):
        return PodView.of({"metadata": {"annotations": {"archway.dev/architectures": value}}})
    assert annotated_architectures(pod("arm64, AMD64,x86_64")) == {"amd64", "arm64"}
    assert annotated_architectures(pod("")) is None
    assert annotated_architectures(PodView.of({"metadata": None})) is None
    with pytest.raises(PodShapeError, match=r"metadata.annotations\['archway.dev/architectures'\]"):
        pod(5)


def test_filter_by_arch_decisions():
    names = ["a", "b", "c"]
    out = filter_by_arch(frozenset({"arm64"}), ["amd64", None, "arm64"], names)
    assert out.keep == [1, 2]
    assert out.unresolvable == {"a": "node arch amd64 not in the pod's images' architectures arm64"}
    assert filter_by_arch(None, [], names).keep == [0, 1, 2]          # unknown pod: all pass
    empty = filter_by_arch(frozenset(), ["amd64", None, "arm64"], names, why_none="x: amd64; y: arm64")
    assert empty.keep == [] and set(empty.unresolvable) == set(names)
    assert "no architecture in common (x: amd64; y: arm64)" in empty.unresolvable["b"]


def test_shared_architectures_ignores_failures_and_archless_images():
    from archway.errors import DeadlineExceeded
    from archway.registry.model import ImageInfo
    from archway.registry.platforms import normalize
    multi = ImageInfo("multi", frozenset({normalize("linux", "amd64"), normalize("linux", "arm64")}),
                      None, "oci-index")
    arm = ImageInfo("arm", frozenset({normalize("linux", "arm64")}), None, "oci-manifest")
    archless = ImageInfo("sif", frozenset(), None, "sif-https", note="arch 00")
    assert shared_architectures({"multi": multi, "arm": arm, "sif": archless,
                                 "slow": DeadlineExceeded("late")})[0] == {"arm64"}
    assert shared_architectures({"slow": DeadlineExceeded("late"), "sif": archless})[0] is None


# --- filter, full Nodes mode ----------------------------------------------------------------------

def test_full_mode_returns_the_passing_node_objects_exactly_as_sent(client):
    body = raw("filter-nodes.json")
    reply = post(client, "filter", body)
    result = reply.get_json()
    assert list(result) == REPLY_KEYS
    assert result["NodeNames"] is None and result["Error"] == "" and result["FailedNodes"] == {}
    sent = load("filter-nodes.json")["Nodes"]["items"]
    assert result["Nodes"]["items"] == [sent[0], sent[1]]          # amd64 and arm64 pass
    assert result["Nodes"]["metadata"] == {}
    for node in result["Nodes"]["items"]:                          # byte for byte, not rebuilt
        text = json.dumps(node, separators=(",", ":")).encode()
        assert text in body and text in reply.data
    assert result["FailedAndUnresolvableNodes"] == {
        PPC64LE: "node arch ppc64le not in the pod's images' architectures amd64, arm64",
        S390X: "node arch s390x not in the pod's images' architectures amd64, arm64"}


def test_any_case_whitespace_and_non_ascii_are_accepted(client):
    args = load("filter-nodes.json")
    args["Nodes"]["items"][0]["metadata"]["annotations"]["note"] = "café ✓ \u2028"
    nodes = args["Nodes"]
    nodes["Items"] = nodes.pop("items")
    shuffled = {"NODES": nodes, "nodeNames": None, "pod": args["Pod"]}
    reply = post(client, "filter", json.dumps(shuffled, indent=2, ensure_ascii=False).encode())
    result = reply.get_json()
    assert [n["metadata"]["name"] for n in result["Nodes"]["items"]] == [AMD64, ARM64]
    assert result["Nodes"]["items"][0]["metadata"]["annotations"]["note"] == "café ✓ \u2028"
    assert set(result["FailedAndUnresolvableNodes"]) == {PPC64LE, S390X}


def test_a_pod_of_unknown_architecture_passes_every_node():
    # Images on a port nothing listens on: the resolver fails fast, nothing is known, all pass.
    args = load("filter-nodes.json")
    del args["Pod"]["metadata"]["annotations"]
    args["Pod"]["spec"]["containers"][0]["image"] = "127.0.0.1:9/nothing/here:1"
    resolver = Resolver(RegistrySettings(allow_hosts=LOOPBACK_HOSTS, insecure_hosts=("127.0.0.1:9",)))
    client = make_client(resolver, extender={"node_cache": False, "deadline_seconds": 1.5})
    started = time.monotonic()
    result = post(client, "filter", args).get_json()
    assert time.monotonic() - started < 3
    assert len(result["Nodes"]["items"]) == 4 and result["FailedAndUnresolvableNodes"] == {}


def test_the_filters_deadline_counts_from_the_requests_arrival_not_from_a_thread_taking_it():
    """A call that waited 2.8 s for a thread (its Request.arrived) has 0.2 s of its 3 s
    left: an image on a registry that never answers is given up after that, not after 3 s."""
    hole = BlackHole()
    try:
        args = load("filter-nodes.json")
        del args["Pod"]["metadata"]["annotations"]
        args["Pod"]["spec"]["containers"][0]["image"] = f"{hole.host}/never/answers:1"
        resolver = Resolver(RegistrySettings(allow_hosts=LOOPBACK_HOSTS, insecure_hosts=(hole.host,), timeout_seconds=10))
        client = make_client(resolver, extender={"node_cache": False, "deadline_seconds": 3.0})
        started = time.monotonic()
        reply = client.post("/scheduler/filter", data=json.dumps(args),
                            content_type="application/json", arrived=started - 2.8)
        took = time.monotonic() - started
    finally:
        hole.stop()
    assert reply.status_code == 200 and len(reply.get_json()["Nodes"]["items"]) == 4
    assert took < 1.8, f"answered after {took:.2f} s: its deadline counted from the thread"


def test_unannotated_pod_resolved_through_a_real_registry(plain_registry):
    plain_registry.push_image("archway-test/arm64-only", "1.0", "linux/arm64")
    plain_registry.push_index("archway-test/multi", "1.0", ["linux/amd64", "linux/arm64", "linux/s390x"])
    plain_registry.push_image("archway-test/amd64-only", "1.0", "linux/amd64")
    resolver = Resolver(RegistrySettings(allow_hosts=LOOPBACK_HOSTS, insecure_hosts=(plain_registry.host,)))
    client = make_client(resolver)
    body = raw("filter-unannotated-nodes.json").replace(b"REGISTRY", plain_registry.host.encode())
    result = post(client, "filter", body).get_json()
    assert [n["metadata"]["name"] for n in result["Nodes"]["items"]] == [ARM64]
    assert set(result["FailedAndUnresolvableNodes"]) == {AMD64, PPC64LE, S390X}
    assert "architectures arm64" in result["FailedAndUnresolvableNodes"][AMD64]

    # Images with no architecture in common: no node can run the pod, and the reason says why.
    args = json.loads(body)
    args["Pod"]["spec"]["containers"][1]["image"] = plain_registry.ref("archway-test/amd64-only", "1.0")
    result = post(client, "filter", args).get_json()
    assert result["Nodes"]["items"] == []
    reason = result["FailedAndUnresolvableNodes"][ARM64]
    assert "no architecture in common" in reason and "amd64-only:1.0: amd64" in reason


# --- filter, NodeNames mode without a cluster ----------------------------------------------------

def test_nodenames_mode_without_a_node_cache_lets_every_node_pass(client):
    result = post(client, "filter", raw("filter-nodenames.json")).get_json()
    assert list(result) == REPLY_KEYS
    assert result["Nodes"] is None and result["NodeNames"] == [AMD64, ARM64, PPC64LE, S390X]


# --- malformed bodies -----------------------------------------------------------------------------

@pytest.mark.parametrize("body, words", [
    (b"", "expected '{'"),
    (b"not json", "expected '{'"),
    (b"[]", "expected '{'"),
    (b'{"Pod": {}, "NodeNames": ["a"]', "expected ',' or '}'"),
    (b'{"Pod": {}, "NodeNames": ["a"]} trailing', "unexpected data"),
    (b'{"Pod": {}, "NodeNames": ["a",]}', "not valid JSON"),
    (b'{"Pod": 3, "NodeNames": ["a"]}', "Pod is missing or not an object"),
    (b'{"NodeNames": ["a"]}', "Pod is missing"),
    (b'{"Pod": {}, "Nodes": null, "NodeNames": null}', "neither Nodes nor NodeNames"),
    (b'{"Pod": {}, "NodeNames": "a"}', "list of node names"),
    (b'{"Pod": {}, "NodeNames": [1]}', "list of node names"),
    (b'{"Pod": {}, "NodeNames": ["a", ""]}', "list of node names"),
    (b'{"Pod": {}, "NodeNames": ["a", null]}', "list of node names"),
    (b'{"Pod": {}, "Nodes": []}', "expected '{' to open ExtenderArgs.Nodes"),
    (b'{"Pod": {}, "Nodes": {"items": {}}}', "expected '[' to open Nodes.items"),
    (b'{"Pod": {}, "Nodes": {"items": [7]}}', "items[0] is not an object"),
    (b'{"Pod": {}, "Nodes": {"items": [{"metadata": {}}]}}', "items[0] has no metadata.name"),
    (b'{"Pod": {}, "Nodes": {"items": [{"metadata": {"name": "a"}} {}]}}', "expected ',' or ']'"),
    (b'\xff\xfe{}', "not UTF-8"),
    (b'{"Pod": {"spec": {"containers": 5}}, "NodeNames": ["a"]}', "spec.containers must be a list"),
    (b"[" * 100000, "expected '{'"),
    (b'{"Pod": ' + b"[" * 100000 + b"]" * 100000 + b', "NodeNames": ["a"]}', "nests too deeply"),
])
@pytest.mark.parametrize("verb", ["filter", "prioritize"])
def test_malformed_bodies_get_400_with_a_message(client, verb, body, words):
    if words.startswith("spec.") and verb == "prioritize":
        words = None  # prioritize never reads the pod's images
    r = client.post(f"/scheduler/{verb}", data=body, content_type="application/json")
    if words is None:
        assert r.status_code == 200
        return
    assert r.status_code == 400, r.data
    assert words in r.get_json()["error"], r.get_json()


def test_only_post_is_routed(client):
    assert client.get("/scheduler/filter").status_code == 405


@pytest.mark.parametrize("verb", ["filter", "prioritize"])
def test_a_call_that_waits_for_nothing_is_answered_on_the_servers_loop(verb):
    """kube-scheduler waits for every call: an annotated pod's filter (and every prioritize) is
    answered on the loop, without a thread hand-off; a pod whose images must be looked up is
    not (its lookup would hold every connection of the worker)."""
    client = make_client()
    assert post(client, verb, raw("filter-nodenames.json")).on_loop
    unannotated = make_client(Resolver(RegistrySettings(), sif=None))
    if verb == "filter":
        assert not post(unannotated, verb, raw("filter-unannotated-nodes.json")).on_loop


# --- prioritize without Prometheus ----------------------------------------------------------------

@pytest.mark.parametrize("fixture", ["filter-nodes.json", "filter-nodenames.json"])
def test_prioritize_without_prometheus_is_neutral_in_input_order(client, fixture):
    reply = post(client, "prioritize", raw(fixture)).get_json()
    assert reply == [{"Host": n, "Score": 5} for n in (AMD64, ARM64, PPC64LE, S390X)]


# --- the node cache: list + watch from a real apiserver --------------------------------------------

def as_created(node: dict) -> dict:
    """A Node of the fixture as one creates it (the apiserver sets uid, version, time)."""
    node = copy.deepcopy(node)
    for key in ("uid", "resourceVersion", "creationTimestamp"):
        node["metadata"].pop(key, None)
    return node


@pytest.fixture(scope="module")
def apiserver(tmp_path_factory):
    """A control plane of this module's own whose Nodes are the fixture's (real EKS nodes)."""
    from lab.cluster.controlplane import ControlPlane
    with ControlPlane(str(tmp_path_factory.mktemp("extender-plane")), nodes=()) as plane:
        for node in load("filter-nodes.json")["Nodes"]["items"]:
            plane.kube.create("/api/v1/nodes", as_created(node))
        yield plane


def node_cache_of(kubeconfig: str, **kwargs) -> NodeCache:
    config = config_from_dict({"kubernetes": {"kubeconfig": kubeconfig}})
    from archway.kubeclient import build_api_client
    return NodeCache(lambda: build_api_client(config.kubernetes)[0], **kwargs)


@pytest.fixture(scope="module")
def cached(apiserver):
    """A bare app whose extender keeps a node cache of the apiserver's nodes (fast re-watch)."""
    mark = apiserver.audit_mark()
    config = config_from_dict({"kubernetes": {"kubeconfig": apiserver.admin_kubeconfig}})
    cache = node_cache_of(apiserver.admin_kubeconfig, watch_timeout_seconds=1,
                          max_backoff_seconds=0.5)
    extender = Extender(config, None, node_cache=cache)
    yield extender_client(extender), cache, mark
    extender.stop()


def names_filter(client, names):
    args = load("filter-nodenames.json")
    args["NodeNames"] = names
    return post(client, "filter", args).get_json()


def node_reads(apiserver, mark) -> tuple[list, list]:
    """(lists, gets) of Nodes by the admin since `mark`: what the cache asked for."""
    asked = apiserver.requests_since(mark, user="admin")
    return ([uri for verb, uri in asked if verb == "list" and uri.startswith("/api/v1/nodes?")],
            [uri for verb, uri in asked if verb == "get" and uri.startswith("/api/v1/nodes/")])


def test_nodenames_filter_reads_arch_from_the_node_cache(cached, apiserver):
    client, cache, mark = cached
    assert cache.wait_synced(10)
    result = names_filter(client, [AMD64, ARM64, PPC64LE, S390X, "joined-a-moment-ago"])
    assert list(result) == REPLY_KEYS and result["Nodes"] is None
    # A name the cache does not hold yet passes (see Extender._cached_facts for why).
    assert result["NodeNames"] == [AMD64, ARM64, "joined-a-moment-ago"]
    assert set(result["FailedAndUnresolvableNodes"]) == {PPC64LE, S390X}
    for _ in range(20):
        names_filter(client, [AMD64, ARM64])
    # One list, then watches (which re-start every second here): never a GET per node or call.
    lists, gets = node_reads(apiserver, mark)
    assert len(lists) == 1 and gets == [], (lists, gets)
    assert "limit=500" in lists[0]   # in pages, not one answer of every Node


def test_the_node_cache_lists_in_pages_and_keeps_every_node(apiserver):
    """limit/continue through the real apiserver: each page is cut down to the nodes' facts
    before the next is read (5,000 full Nodes are ~60 MB in one answer, near its 64 MiB cap)."""
    mark = apiserver.audit_mark()
    cache = node_cache_of(apiserver.admin_kubeconfig)
    cache.page_size = 2
    try:
        assert cache.wait_synced(10)
        every = {n["metadata"]["name"] for n in apiserver.kube.items("/api/v1/nodes")}
        assert len(every) >= 4 and set(cache.nodes) >= every
        lists, _ = node_reads(apiserver, mark)
        assert len(lists) == (len(every) + 1) // 2, lists
        assert all("limit=2" in uri for uri in lists)
        assert sum("continue=" in uri for uri in lists) == len(lists) - 1
        assert cache.nodes[ARM64].arch == "arm64"
    finally:
        cache.stop()


def test_watch_events_update_the_cache(cached, apiserver):
    client, cache, _ = cached
    cache.wait_synced(5)
    kube = apiserver.kube
    kube.patch(f"/api/v1/nodes/{PPC64LE}", {"metadata": {"labels": {"kubernetes.io/arch": "arm64"}}})
    wait_until(lambda: cache.nodes[PPC64LE].arch == "arm64")
    assert PPC64LE in names_filter(client, [PPC64LE])["NodeNames"]

    new = as_created(load("filter-nodes.json")["Nodes"]["items"][2])
    new["metadata"]["name"] = "ip-10-0-1-99.eu-west-1.compute.internal"
    new["metadata"]["labels"]["kubernetes.io/arch"] = "riscv64"
    kube.create("/api/v1/nodes", new)
    wait_until(lambda: "ip-10-0-1-99.eu-west-1.compute.internal" in cache.nodes)
    assert names_filter(client, [new["metadata"]["name"]])["NodeNames"] == []

    kube.delete(f"/api/v1/nodes/{new['metadata']['name']}")
    wait_until(lambda: new["metadata"]["name"] not in cache.nodes)
    # A heartbeat that changes nothing archway uses does not bump the version.
    version = cache.version
    status = kube.get(f"/api/v1/nodes/{PPC64LE}")["status"]
    for condition in status["conditions"]:
        condition["lastHeartbeatTime"] = "2026-01-14T09:13:41Z"
    kube.patch(f"/api/v1/nodes/{PPC64LE}/status", {"status": {"conditions": status["conditions"]}})
    # Events arrive in order: once the change after the heartbeat is seen, the heartbeat was
    # handled too, and only the change moved the version.
    kube.patch(f"/api/v1/nodes/{PPC64LE}", {"metadata": {"labels": {"kubernetes.io/arch": "ppc64le"}}})
    wait_until(lambda: cache.nodes[PPC64LE].arch == "ppc64le")
    assert cache.version == version + 1


def test_410_gone_makes_the_cache_list_again(tmp_path):
    """The watch drops, cannot come back, and its resourceVersion has gone meanwhile: the
    stand-in's faults (a real apiserver would need an etcd compaction at the right moment)."""
    server = FakeApiServer()
    node = load("filter-nodes.json")["Nodes"]["items"][0]
    server.put(f"/api/v1/nodes/{AMD64}", node)
    cache = node_cache_of(server.kubeconfig(str(tmp_path)), watch_timeout_seconds=1,
                          max_backoff_seconds=0.5)
    try:
        assert cache.wait_synced(5)
        lists = cache.lists
        server.faults["/api/v1/nodes"] = 500           # the watch drops and cannot come back...
        asked = len(server.requests)
        try:
            # its watch timed out (1 s) and the next attempt was refused: the cache is away
            wait_until(lambda: any(m == "GET" and p.startswith("/api/v1/nodes")
                                   for m, p in server.requests[asked:]), 15, "a refused watch")
            missed = copy.deepcopy(node)
            missed["metadata"]["name"] = "missed-while-away"
            server.put("/api/v1/nodes/missed-while-away", missed)
            server.expire_history()                    # ...and its resourceVersion is gone
        finally:
            del server.faults["/api/v1/nodes"]
        wait_until(lambda: "missed-while-away" in cache.nodes, timeout=10)
        assert cache.lists == lists + 1
        server.emit("/api/v1/nodes", "DELETED", missed)
        wait_until(lambda: "missed-while-away" not in cache.nodes)
    finally:
        cache.stop()
        server.stop()


def test_a_refused_first_list_does_not_make_filter_calls_wait(apiserver):
    """An identity whose RBAC lacks list on nodes (the real authorizer's 403), then granted it."""
    rbac = "/apis/rbac.authorization.k8s.io/v1"
    apiserver.kube.create("/api/v1/namespaces", {"metadata": {"name": "no-list"}})
    kubeconfig = apiserver.identity("no-list", "extender", cluster_rules=[
        {"apiGroups": [""], "resources": ["pods"], "verbs": ["list"]}])
    cache = node_cache_of(kubeconfig, max_backoff_seconds=0.3)
    try:
        started = time.monotonic()
        assert cache.wait_synced(5) is False
        assert time.monotonic() - started < 3 and cache.nodes == {}
        apiserver.kube.patch(f"{rbac}/clusterroles/no-list-extender", {"rules": [
            {"apiGroups": [""], "resources": ["nodes"], "verbs": ["list", "watch"]}]})
        wait_until(lambda: cache.synced and AMD64 in cache.nodes, timeout=15)   # caught up
    finally:
        cache.stop()


def test_stop_ends_a_watch_waiting_for_its_next_event(apiserver):
    """A watch waits up to its timeout (4 min) for the next event; stop() must not (a thread
    left in that read when the interpreter exits aborts it)."""
    mark = apiserver.audit_mark()
    cache = node_cache_of(apiserver.admin_kubeconfig, watch_timeout_seconds=240)
    assert cache.wait_synced(5)
    wait_until(lambda: cache._stream is not None)
    started = time.monotonic()
    cache.stop()
    assert time.monotonic() - started < 1 and not cache._runner.thread.is_alive()
    assert any(verb == "watch" and uri.startswith("/api/v1/nodes?")
               for verb, uri in apiserver.requests_since(mark, user="admin"))


def test_a_watch_event_over_its_size_cap_is_refused_and_the_cache_lists_again(tmp_path):
    """A 4 MiB watch event: more than a real apiserver stores in one object, so the stand-in."""
    from archway import kubeapi
    server = FakeApiServer()
    node = load("filter-nodes.json")["Nodes"]["items"][0]
    server.put(f"/api/v1/nodes/{AMD64}", node)
    cache = node_cache_of(server.kubeconfig(str(tmp_path)), max_backoff_seconds=0.3)
    try:
        assert cache.wait_synced(5)
        lists = cache.lists
        huge = copy.deepcopy(node)
        huge["metadata"]["name"] = "huge"
        huge["metadata"]["annotations"] = {"filler": "x" * (kubeapi.MAX_WATCH_LINE_BYTES + 1)}
        server.put("/api/v1/nodes/huge", huge)
        # The watch refuses the event, the loop lists again, and the list (whose cap is
        # 64 MiB) brings the node in.
        wait_until(lambda: "huge" in cache.nodes, timeout=10)
        assert cache.lists == lists + 1
    finally:
        cache.stop()
        server.stop()


def test_no_cluster_means_an_empty_cache_that_settles_at_once():
    cache = NodeCache(lambda: None)
    started = time.monotonic()
    assert cache.wait_synced(5) is False
    assert time.monotonic() - started < 1 and cache.available is False and cache.nodes == {}


# --- a real `archway serve` (gunicorn) over HTTP ----------------------------------------------------

@pytest.fixture(scope="module")
def served(apiserver, tmp_path_factory):
    directory = tmp_path_factory.mktemp("serve")
    port, metrics_port = free_port(), free_port()
    config_path = os.path.join(str(directory), "archway.yaml")
    with open(config_path, "w") as f:
        json.dump({"server": {"tls": False, "workers": 1, "threads": 4,
                              "state_dir": str(directory),
                              "metrics_bind": f"127.0.0.1:{metrics_port}"},
                   "kubernetes": {"kubeconfig": apiserver.admin_kubeconfig},
                   "extender": {"node_cache": True}}, f)
    log_path = os.path.join(str(directory), "serve.log")
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "archway.main.cli", "--config", config_path, "serve",
             "--product", "extender", "--bind", f"127.0.0.1:{port}"], cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONPATH": REPO}, start_new_session=True)
    try:
        wait_for_port(port, timeout=30, proc=proc)
        session = requests.Session()
        session.trust_env = False
        yield session, f"http://127.0.0.1:{port}", log_path, f"http://127.0.0.1:{metrics_port}"
    finally:
        proc.terminate()
        proc.wait(15)


def test_served_filter_in_both_modes_and_prioritize(served, apiserver):
    session, url, log_path, metrics_url = served
    r = session.post(f"{url}/scheduler/filter", data=raw("filter-nodenames.json"), timeout=10)
    assert r.status_code == 200 and r.headers["Content-Type"] == "application/json"
    assert r.json()["NodeNames"] == [AMD64, ARM64] and list(r.json()) == REPLY_KEYS
    r = session.post(f"{url}/scheduler/filter", data=raw("filter-nodes.json"), timeout=10)
    assert [n["metadata"]["name"] for n in r.json()["Nodes"]["items"]] == [AMD64, ARM64]
    r = session.post(f"{url}/scheduler/prioritize", data=raw("filter-nodenames.json"), timeout=10)
    assert r.status_code == 200 and {e["Score"] for e in r.json()} == {5}
    r = session.post(f"{url}/scheduler/filter", data=b'{"Pod": {}}', timeout=10)
    assert r.status_code == 400 and "neither Nodes nor NodeNames" in r.json()["error"]
    # gunicorn's workers write multiprocess metrics; /metrics adds them up (on the metrics
    # address only: the product's port answers 404 there).
    assert session.get(f"{url}/metrics", timeout=10).status_code == 404
    text = session.get(f"{metrics_url}/metrics", timeout=10).text
    assert 'archway_extender_requests_total{outcome="ok",verb="filter"} 2.0' in text
    assert 'archway_extender_requests_total{outcome="bad_request",verb="filter"} 1.0' in text
    assert 'archway_extender_duration_seconds_count{verb="prioritize"} 1.0' in text


def test_the_extender_product_serves_no_admission(served):
    session, url, _, _ = served
    r = session.post(f"{url}/mutate", json={}, timeout=10)
    assert r.status_code == 404
    served_routes = r.json()["error"].split("archway serves ")[1]
    assert "POST /scheduler/filter" in served_routes and "/mutate" not in served_routes
    assert session.get(f"{url}/healthz", timeout=10).json() == {"status": "ok"}
    ready = session.get(f"{url}/readyz", timeout=10).json()
    assert ready["ready"] is True and "kubernetes_api" not in ready   # no pull secrets read here


def test_the_metrics_address_serves_only_metrics_and_probes(served):
    """The chart's exposeMetrics: scrapers reach /metrics on the pod network while the extender
    routes stay on localhost."""
    session, url, _, metrics_url = served
    r = session.get(f"{metrics_url}/metrics", timeout=10)
    assert r.status_code == 200 and "archway_build_info" in r.text
    assert session.get(f"{metrics_url}/healthz", timeout=10).json() == {"status": "ok"}
    assert session.get(f"{metrics_url}/readyz", timeout=10).json()["ready"] is True
    for path in ("/scheduler/filter", "/scheduler/prioritize"):
        r = session.post(f"{metrics_url}{path}", data=raw("filter-nodenames.json"), timeout=10)
        assert r.status_code == 404 and "only /metrics" in r.json()["error"], path
    r = session.post(f"{url}/scheduler/filter", data=raw("filter-nodenames.json"), timeout=10)
    assert r.status_code == 200


def test_served_filter_takes_a_body_far_above_the_admission_limit(served):
    session, url, _, _ = served
    args = load("filter-nodes.json")
    template = args["Nodes"]["items"]
    items = []
    for i in range(1500):                       # ~6 MB: twice the 3 MiB admission body limit
        node = copy.deepcopy(template[i % 4])
        node["metadata"]["name"] = f"node-{i:04d}"
        items.append(node)
    args["Nodes"]["items"] = items
    body = json.dumps(args, separators=(",", ":")).encode()
    assert len(body) > 2 * 3 * 1024 * 1024 * 0.9
    r = session.post(f"{url}/scheduler/filter", data=body, timeout=30)
    assert r.status_code == 200, r.text[:300]
    result = r.json()
    assert len(result["Nodes"]["items"]) == 750 and len(result["FailedAndUnresolvableNodes"]) == 750


def test_node_facts_keep_taints_and_a_cordon():
    from archway.cluster.nodes import CORDON_TAINT, node_facts
    node = {"metadata": {"name": "n1", "labels": {"kubernetes.io/arch": "arm64"}},
            "spec": {"unschedulable": True, "taints": [
                {"key": "kubernetes.io/arch", "value": "arm64", "effect": "NoSchedule"},
                {"key": "spot", "effect": "PreferNoSchedule"}, "junk"]}}
    facts = node_facts(node)
    assert facts.taints == (("kubernetes.io/arch", "arm64", "NoSchedule"),
                            ("spot", "", "PreferNoSchedule"), CORDON_TAINT)
    node["spec"]["taints"].append({"key": CORDON_TAINT[0], "effect": "NoSchedule"})
    assert node_facts(node).taints.count(CORDON_TAINT) == 1   # the controller's own, once
    assert node_facts({"metadata": {"name": "bare"}}).taints == ()


def _peak_rss(pid: int) -> int:
    """VmHWM: the most resident memory the process ever had."""
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))


def _body(pod, **shape) -> bytes:
    return json.dumps({"Pod": pod, **shape}, separators=(",", ":")).encode()


def test_a_worker_stays_under_512_mb_with_bodies_at_the_cap_in_both_shapes(tmp_path):
    """64 MiB of short NodeNames took a worker to 0.9 GB, of tiny Nodes to 1.2 GB (issue 21,
    item 7): past MAX_CANDIDATE_NODES they are a 413 at once; up to it, in both shapes, and
    for 60 MB of full Nodes whose reply echoes them all, the worker stays under 512 MB."""
    from archway.extender.wire import MAX_CANDIDATE_NODES
    longest_name = 253   # a Node's name is a DNS subdomain
    port = free_port()
    config = tmp_path / "archway.json"
    config.write_text(json.dumps({"server": {"tls": False, "workers": 1, "threads": 4,
                                             "state_dir": str(tmp_path)},
                                  "kubernetes": {"enabled": "off"}}))
    with open(tmp_path / "serve.log", "wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "archway.main.cli", "--config", str(config),
                                 "serve", "--product", "extender", "--bind", f"127.0.0.1:{port}"],
                                cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
    try:
        wait_for_port(port, timeout=30, proc=proc)
        url = f"http://127.0.0.1:{port}/scheduler"
        pod = load("filter-nodenames.json")["Pod"]
        cap = 64 * 1024 * 1024
        session = requests.Session()
        session.trust_env = False
        short = _body(pod, Nodes=None, NodeNames=[f"n{i:08d}" for i in range(cap // 12 - 1000)])
        tiny = _body(pod, NodeNames=None, Nodes={"items": [
            {"metadata": {"name": f"n{i:08d}"}} for i in range(cap // 34 - 1000)]})
        assert cap * 0.95 < len(short) <= cap and cap * 0.95 < len(tiny) <= cap
        for verb, body in (("filter", short), ("prioritize", short), ("filter", tiny)):
            r = session.post(f"{url}/{verb}", data=body, timeout=60)
            assert r.status_code == 413, (verb, r.status_code, r.text[:200])
            assert f"lists more than {MAX_CANDIDATE_NODES} nodes" in r.json()["error"]
        del short, tiny
        longest = _body(pod, Nodes=None, NodeNames=[
            f"n{i:08d}".ljust(longest_name, "x") for i in range(MAX_CANDIDATE_NODES)])
        for verb in ("filter", "prioritize"):
            r = session.post(f"{url}/{verb}", data=longest, timeout=60)
            assert r.status_code == 200 and len(r.content) > len(longest) * 0.9, verb
        del longest, r
        padded = _body(pod, NodeNames=None, Nodes={"items": [
            {"metadata": {"name": f"n{i:08d}", "annotations": {"a": "y" * 880}}}
            for i in range(MAX_CANDIDATE_NODES)]})
        assert len(padded) > 60e6
        r = session.post(f"{url}/filter", data=padded, timeout=60)
        assert r.status_code == 200 and len(r.json()["Nodes"]["items"]) == MAX_CANDIDATE_NODES
        del padded, r
        worker = int(open(f"/proc/{proc.pid}/task/{proc.pid}/children").read().split()[0])
        assert _peak_rss(worker) < 512 * 1024 * 1024, _peak_rss(worker) / 1e6
    finally:
        os.killpg(proc.pid, 15)
        proc.wait(15)


def test_one_pods_slow_lookup_holds_up_no_other_pods_call(tmp_path):
    """kube-scheduler waits for every extender call. With the worker's only thread held by an
    unannotated pod whose image is on a registry that never answers, the call for a pod archway
    annotated at admission is answered at once in the worker's main loop (archway.server.inline),
    not after that lookup's deadline."""
    hole = BlackHole()
    config_path = str(tmp_path / "archway.yaml")
    with open(config_path, "w") as f:
        json.dump({"server": {"tls": False, "workers": 1, "threads": 1,
                              "state_dir": str(tmp_path)},
                   "kubernetes": {"enabled": "off"},
                   "registry": {"allow_hosts": list(LOOPBACK_HOSTS), "insecure_hosts": [hole.host],
                                "timeout_seconds": 30},
                   "extender": {"deadline_seconds": 6.0}}, f)
    port = free_port()
    stuck = load("filter-nodes.json")
    del stuck["Pod"]["metadata"]["annotations"]
    stuck["Pod"]["spec"]["containers"][0]["image"] = f"{hole.host}/never/answers:1"
    answers: dict = {}
    try:
        with Server([sys.executable, "-m", "archway.main.cli", "--config", config_path, "serve",
                     "--product", "extender", "--bind", f"127.0.0.1:{port}"],
                    port=port, log_path=str(tmp_path / "serve.log"), cwd=REPO, ready_timeout=30):
            url = f"http://127.0.0.1:{port}/scheduler/filter"

            def call(name, body):
                started = time.monotonic()
                answers[name] = requests.post(url, data=body, timeout=30), time.monotonic() - started

            held = threading.Thread(target=call, args=("stuck", json.dumps(stuck)))
            held.start()
            wait_until(lambda: hole.accepted > 0, timeout=10)   # the thread is looking
            call("annotated", raw("filter-nodes.json"))
            held.join(30)
    finally:
        hole.stop()
    reply, took = answers["annotated"]
    assert reply.status_code == 200
    assert [n["metadata"]["name"] for n in reply.json()["Nodes"]["items"]] == [AMD64, ARM64]
    assert took < 3.0, f"answered after {took:.1f} s: it waited for the held thread"
    reply, took = answers["stuck"]   # given up at its deadline: archway has no objection
    assert reply.status_code == 200 and len(reply.json()["Nodes"]["items"]) == 4 and took >= 5
