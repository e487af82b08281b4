"""The cluster's image records (docs/image-records.md) on the real control plane, with the chart's
CRDs and RBAC: two `archway serve` replicas against one apiserver and the real registry.

- a replica that starts after another read an image answers it from the record: no request
  reaches the registry for it, and the pod is not gated;
- a tag re-pushed (amd64 -> arm64) and seen by one replica is answered arm64 by the other within
  the watch's delay, not after the tag TTL;
- a record read with namespace A's pull secret is an ImageRecord in A, used by another replica
  for A's pods and never for namespace B's;
- the leader's round deletes records no pod or workload uses, once expired, and keeps the rest.
"""
import base64
import json
import time

import pytest

from archway.kubeapi import KubeApi
from archway.kubeclient import build_api_client
from archway.objects.imagerecords import ImageRecords
from archway.objects.records import record_object
from archway.registry.model import ImageInfo
from archway.registry.platforms import parse_platform
from archway.registry.records import CLUSTER, ImageRecord
from archway.registry.resolver import Resolver
from lab.servers.registry import RegistryServer

from .workloads import create_pod, describe, pod

API = "/apis/archway.dev/v1alpha1"
ANNOTATION_ARCHITECTURES = "archway.dev/architectures"
WATCH_BOUND = 5.0     # seconds: a record's change reaches every replica within this


def admission_review(namespace: str, body: dict) -> dict:
    return {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
            "request": {"uid": f"uid-{time.monotonic_ns()}", "kind": {"group": "", "version": "v1", "kind": "Pod"},
                        "resource": {"group": "", "version": "v1", "resource": "pods"},
                        "namespace": namespace, "operation": "CREATE", "object": body,
                        "userInfo": {"username": "e2e"}, "dryRun": False}}


def admit(replica, namespace: str, body: dict) -> dict:
    """What `replica` itself answers for `body` (the apiserver calls only the first replica):
    {"architectures": the annotation or None, "gated": bool}."""
    import requests
    answer = requests.post(replica.url + "/mutate", json=admission_review(namespace, body),
                           verify=replica.tls_ca, timeout=15).json()["response"]
    ops = json.loads(base64.b64decode(answer["patch"])) if answer.get("patch") else []
    annotations: dict = {}
    gated = False
    for op in ops:
        if op["path"] == "/metadata/annotations":
            annotations.update(op["value"])
        elif op["path"].startswith("/metadata/annotations/"):
            key = op["path"].rsplit("/", 1)[1].replace("~1", "/").replace("~0", "~")
            annotations[key] = op["value"]
        gated = gated or op["path"].startswith("/spec/schedulingGates")
    return {"architectures": annotations.get(ANNOTATION_ARCHITECTURES), "gated": gated}


def records_of(kube, reference_part: str, namespace: str | None = None) -> list[dict]:
    path = f"{API}/namespaces/{namespace}/imagerecords" if namespace else f"{API}/clusterimagerecords"
    return [r for r in kube.items(path) if reference_part in r["spec"]["reference"]]


def wait_record(kube, reference_part: str, namespace: str | None = None, digest: str | None = None):
    def found():
        records = records_of(kube, reference_part, namespace)
        return records and (digest is None or records[0]["spec"]["digest"] == digest) and records[0]
    return kube.wait_for(found, timeout=30, what=f"the record of {reference_part}")


def repo_requests(registry, mark: int, repo: str) -> list:
    return [r for r in registry.requests_since(mark) if f"/v2/{repo}/" in r.path]


@pytest.fixture(scope="module")
def replica(archway):
    """A second `archway serve` of the chart's config: started by the test that needs it."""
    from lab.cluster.controlplane import stop_process
    started = []

    def start(name="archway-records-replica", overrides=None):
        started.append(archway.start_replica(name, overrides))
        return started[-1]
    yield start
    for one in started:
        stop_process(one.process)
        archway.replicas.remove(one)


def test_a_replica_that_starts_answers_known_images_from_the_records_with_no_registry_request(
        archway, kube, namespace, images, replica):
    repo = "e2e/records-rollout"
    images.registry.push_index(repo, "v1", ["linux/amd64", "linux/arm64"])
    image = images.ref(repo, "v1")
    created = create_pod(kube, namespace, pod("known", [image]))   # the first replica reads it
    assert created["metadata"]["annotations"][ANNOTATION_ARCHITECTURES] == "amd64,arm64", \
        describe(kube, namespace, "known")
    record = wait_record(kube, f"/{repo}:v1")
    assert record["kind"] == "ClusterImageRecord" and record["spec"]["architectures"] == "amd64,arm64"
    # `kubectl get clusterimagerecords` shows the columns the CRD declares.
    table = kube.session.get(kube.server + f"{API}/clusterimagerecords/{record['metadata']['name']}",
                             headers={"Accept": "application/json;as=Table;v=v1;g=meta.k8s.io"},
                             timeout=10).json()
    names = [c["name"] for c in table["columnDefinitions"] if c.get("priority", 0) == 0]
    assert names == ["Name", "Image", "Architectures", "Digest", "Age"]

    mark = images.registry.mark()
    second = replica()                # pre-warms the pod's image, from the record
    answer = admit(second, namespace, pod("second", [image]))
    assert answer == {"architectures": "amd64,arm64", "gated": False}
    time.sleep(1.0)                   # anything the start set off has reached the registry
    assert repo_requests(images.registry, mark, repo) == []


def test_a_tag_one_replica_sees_moved_is_answered_from_its_new_digest_by_the_other_at_once(
        archway, kube, namespace, images, replica):
    repo = "e2e/records-move"
    images.registry.push_image(repo, "v1", "linux/amd64")
    image = images.ref(repo, "v1")
    assert admit(archway.webhook, namespace, pod("first", [image]))["architectures"] == "amd64"
    first_digest = wait_record(kube, f"/{repo}:v1")["spec"]["digest"]
    second = replica("archway-records-mover")
    assert admit(second, namespace, pod("before", [image]))["architectures"] == "amd64"

    images.registry.push_image(repo, "v1", "linux/arm64")
    # The first replica sees the move: a pod pulling Always has the tag checked first.
    seen = admit(archway.webhook, namespace, _pulling_always(pod("always", [image])))
    assert seen["architectures"] == "arm64"
    kube.wait_for(lambda: records_of(kube, f"/{repo}:v1")[0]["spec"]["digest"] != first_digest,
                  timeout=10, what="the record to name the new digest")
    began = time.monotonic()
    # The second replica held the amd64 answer, fresh for the tag TTL (300 s): the record's
    # watch replaces it.
    answer = kube.wait_for(lambda: (a := admit(second, namespace, pod("after", [image])))
                           ["architectures"] == "arm64" and a, timeout=WATCH_BOUND,
                           what="the second replica to answer the new digest")
    assert answer["architectures"] == "arm64" and time.monotonic() - began < WATCH_BOUND


def _pulling_always(body: dict) -> dict:
    for container in body["spec"]["containers"]:
        container["imagePullPolicy"] = "Always"
    return body


def test_a_record_read_with_a_namespaces_pull_secret_serves_that_namespace_only(
        archway, kube, control_plane, images, replica, tmp_path):
    private = RegistryServer(tmp_path / "private", auth="htpasswd",
                             users={"alice": "pw", "bob": "pw2"})
    try:
        _tenants_test(archway, kube, control_plane, images, private, replica)
    finally:
        private.stop()


def _tenants_test(archway, kube, control_plane, images, private, replica):
    private.push_image("tenant/app", "v1", "linux/arm64")
    image = private.ref("tenant/app", "v1")
    account = archway.service_account("webhook")
    tenants = []
    for name, user, password in (("e2e-records-a", "alice", "pw"), ("e2e-records-b", "bob", "pw2")):
        tenant = f"{name}-{int(time.time() * 1000) % 10000}"
        control_plane.new_namespace(tenant)
        tenants.append(tenant)
        _allow_secret_reads(kube, tenant, account, archway.namespace)
        kube.create(f"/api/v1/namespaces/{tenant}/secrets", {
            "apiVersion": "v1", "kind": "Secret", "type": "kubernetes.io/dockerconfigjson",
            "metadata": {"name": "pull"},
            "data": {".dockerconfigjson": base64.b64encode(
                private.dockerconfigjson(user, password)).decode()}})
    a, b = tenants
    overrides = {"registry": {"insecure_hosts": [images.registry.host, private.host]},
                 "kubernetes": {"pull_secret_namespaces": tenants}}
    try:
        reader = replica("archway-records-tenant-1", overrides)
        with_secret = pod("private", [image], imagePullSecrets=[{"name": "pull"}])
        assert admit(reader, a, with_secret)["architectures"] == "arm64"
        record = wait_record(kube, "/tenant/app:v1", namespace=a)
        assert record["kind"] == "ImageRecord" and records_of(kube, "/tenant/app:v1") == []

        other = replica("archway-records-tenant-2", overrides)
        mark = private.mark()
        assert admit(other, a, with_secret)["architectures"] == "arm64"   # A's record, in A
        assert repo_requests(private, mark, "tenant/app") == []
        # B, without a secret: not answered (the registry refuses it, and A's record is A's).
        assert admit(other, b, pod("nosecret", [image]))["architectures"] is None
        # B, with a secret of its own (another account): read with it, at the registry, into
        # B's record. (A pod presenting A's very credentials would be answered as A's: the
        # same credentials have the same access, as the resolver's cache keys answers.)
        mark = private.mark()
        assert admit(other, b, with_secret)["architectures"] == "arm64"
        assert repo_requests(private, mark, "tenant/app") != []
        wait_record(kube, "/tenant/app:v1", namespace=b)
    finally:
        for tenant in tenants:
            kube.delete(f"/api/v1/namespaces/{tenant}")


def _allow_secret_reads(kube, namespace, account, account_namespace):
    """What rbac.pullSecretNamespaces grants for `namespace`: get of its Secrets."""
    kube.create(f"/apis/rbac.authorization.k8s.io/v1/namespaces/{namespace}/roles", {
        "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role",
        "metadata": {"name": "archway-secrets"},
        "rules": [{"apiGroups": [""], "resources": ["secrets"], "verbs": ["get"]}]})
    kube.create(f"/apis/rbac.authorization.k8s.io/v1/namespaces/{namespace}/rolebindings", {
        "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
        "metadata": {"name": "archway-secrets"},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "archway-secrets"},
        "subjects": [{"kind": "ServiceAccount", "name": account, "namespace": account_namespace}]})


def test_the_leaders_round_deletes_records_no_pod_uses_once_expired(
        archway, kube, namespace, control_plane):
    """The round of archway.gate.recordkeeper, as the leader runs it, on the real API."""
    from archway.cluster.reads import ClusterReader
    from archway.cluster.workloads import TEMPLATE_PATHS
    from archway.config import KubernetesSettings
    from archway.gate.recordkeeper import RecordKeeper
    client, _ = build_api_client(KubernetesSettings(kubeconfig=control_plane.admin_kubeconfig))
    hour_ago = time.time() - 3600
    used_image = f"registry.example/{namespace}/used:v1"
    made = {}
    for what, reference, read_at in (("old", f"registry.example/{namespace}/old:v1", hour_ago),
                                     ("recent", f"registry.example/{namespace}/recent:v1", time.time()),
                                     ("used", used_image, hour_ago)):
        info = ImageInfo(reference, frozenset({parse_platform("linux/arm64")}), "sha256:" + "c" * 64,
                         "oci-index")
        obj = record_object(ImageRecord(CLUSTER, reference, info, read_at, read_at))
        made[what] = kube.create(f"{API}/clusterimagerecords", obj)["metadata"]["name"]
    # A workload that names the image keeps its record (no pod need run).
    kube.create(f"/apis/apps/v1/namespaces/{namespace}/deployments", {
        "apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "keeps"},
        "spec": {"replicas": 0, "selector": {"matchLabels": {"app": "keeps"}},
                 "template": {"metadata": {"labels": {"app": "keeps"}},
                              "spec": {"containers": [{"name": "c", "image": used_image}]}}}})
    records = ImageRecords.build(lambda: client, refresh_seconds=150, max_pending=10).start(10)
    try:
        kube.wait_for(lambda: all(n in records.cluster.items for n in made.values()), timeout=10,
                      what="the records listed")
        keeper = RecordKeeper(api=KubeApi(client), records=records, resolver=Resolver(),
                              list_objects=lambda: (o for kind in TEMPLATE_PATHS
                                                    for o in ClusterReader(client).workloads(kind)),
                              expire_seconds=600, tag_ttl_seconds=10 ** 9)
        assert keeper.round()["deleted"] == 1
        path = f"{API}/clusterimagerecords/"
        assert not kube.exists(path + made["old"])
        assert kube.exists(path + made["recent"]) and kube.exists(path + made["used"])
    finally:
        records.stop()
        for name in made.values():
            if kube.exists(f"{API}/clusterimagerecords/{name}"):
                kube.delete(f"{API}/clusterimagerecords/{name}")


def test_archway_explain_reads_what_the_cluster_knows_from_the_records_not_the_registry(
        archway, control_plane, kube, namespace, images, tmp_path):
    from .test_tools import run_archway
    repo = "e2e/records-explain"
    images.registry.push_index(repo, "v1", ["linux/arm64", "linux/ppc64le"])
    image = images.ref(repo, "v1")
    create_pod(kube, namespace, pod("explained", [image]))   # the webhook reads and records it
    wait_record(kube, f"/{repo}:v1")
    mark = images.registry.mark()
    done = run_archway(control_plane, tmp_path, images, "explain", "pod/explained", "-n", namespace,
                       "--json")
    assert done.returncode == 0, done.stderr
    (explained,) = json.loads(done.stdout)
    assert explained["architectures"] == ["arm64", "ppc64le"]
    assert repo_requests(images.registry, mark, repo) == []


def test_a_new_image_two_processes_offer_is_written_once(archway, kube, control_plane):
    """The second process's offer was queued before the first process's record reached its
    watch: when its writer runs, the record already says as much, and it sends nothing."""
    from archway import metrics
    from archway.config import KubernetesSettings

    def writes() -> dict:
        return {s.labels["result"]: s.value for f in metrics.IMAGE_RECORD_WRITES.collect()
                for s in f.samples if s.name.endswith("_total")}
    client, _ = build_api_client(KubernetesSettings(kubeconfig=control_plane.admin_kubeconfig))
    reference = f"registry.example/once/app{time.time_ns()}:v1"
    info = ImageInfo(reference, frozenset({parse_platform("linux/arm64")}), "sha256:" + "d" * 64,
                     "oci-index")
    record = ImageRecord(CLUSTER, reference, info, time.time(), time.time())
    first, second = (ImageRecords.build(lambda: client, refresh_seconds=150, max_pending=10)
                     for _ in range(2))
    try:
        for watch in (second.cluster, second.namespaced):
            watch.ensure_started()
            watch.wait_synced(10)
        second.offer(record)                 # queued: its writer is not running yet
        before = writes()
        first.start(10).offer(record)
        kube.wait_for(lambda: record.name in second.cluster.items, timeout=10,
                      what="the first process's record in the second's watch")
        second.writer.start()
        kube.wait_for(lambda: second.writer.pending == 0 and first.writer.pending == 0,
                      timeout=10, what="the writers to finish")
        time.sleep(0.5)
        after = writes()
        made = {k: after.get(k, 0) - before.get(k, 0) for k in after}
        assert made.get("created") == 1 and not made.get("updated") and not made.get("exists"), made
    finally:
        first.stop()
        second.stop()
        kube.delete(f"{API}/clusterimagerecords/{record.name}")


def test_the_webhooks_service_account_may_do_with_records_what_archway_does_and_no_more(
        archway, kube):
    from .test_rbac import identity_of
    client, _ = identity_of(archway, kube, "webhook")
    for resource in ("clusterimagerecords", "imagerecords"):
        for verb in ("get", "list", "watch", "create", "update", "delete"):
            assert client.can_i(verb, resource, group="archway.dev"), (verb, resource)
        for verb in ("patch", "deletecollection"):
            assert not client.can_i(verb, resource, group="archway.dev"), (verb, resource)
    # The records' kinds only: nothing else of the group.
    assert not client.can_i("create", "placementpolicies", group="archway.dev", namespace="default")
