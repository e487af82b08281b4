"""Pre-warming against the API stand-in and real registries: every workload kind and the pods,
listed in pages, resolved with the pods' pull secrets, paced per registry host."""
import base64
import time

import pytest

from archway.config import CacheSettings, RegistrySettings
from archway.kubeclient import build_api_client
from archway.registry.model import ImageInfo
from archway.registry.resolver import Resolver
from archway.webhook import cluster
from archway.webhook.cluster import ClusterReader
from archway.webhook.prewarm import Prewarmer, paced, wanted_images
from archway.webhook.pullsecrets import PullSecrets
from tests.infra.apiserver import FakeApiServer
from tests.infra.registry import basic_auth_registry, plain_registry, session_ca

RATE = 20.0   # lookups a second per host: the test's pace (the default is 5)


def template(*images, secrets=()):
    spec = {"containers": [{"name": f"c{i}", "image": image} for i, image in enumerate(images)]}
    if secrets:
        spec["imagePullSecrets"] = [{"name": name} for name in secrets]
    return {"metadata": {"labels": {"app": "x"}}, "spec": spec}


def seed(api, plain, private, images):
    """One object of every kind archway reads, across namespaces; `private` needs a secret."""
    for i in range(len(images) - 1):   # 14 Deployments: more than a page of 5
        api.put(f"/apis/apps/v1/namespaces/shop/deployments/web-{i}",
                {"apiVersion": "apps/v1", "kind": "Deployment",
                 "metadata": {"name": f"web-{i}", "namespace": "shop"},
                 "spec": {"selector": {}, "template": template(images[i])}})
    api.put("/apis/batch/v1/namespaces/ops/cronjobs/nightly",
            {"apiVersion": "batch/v1", "kind": "CronJob",
             "metadata": {"name": "nightly", "namespace": "ops"},
             "spec": {"schedule": "@daily", "jobTemplate": {"spec": {
                 "template": template(private, secrets=["pull"])}}}})
    api.put("/apis/apps/v1/namespaces/ops/statefulsets/db",
            {"apiVersion": "apps/v1", "kind": "StatefulSet",
             "metadata": {"name": "db", "namespace": "ops"},
             "spec": {"selector": {}, "serviceName": "db", "template": template(images[-1])}})
    api.put("/api/v1/namespaces/ops/pods/debug",
            {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "debug", "namespace": "ops"},
             "spec": template(images[0])["spec"]})
    api.put("/apis/apps/v1/namespaces/kube-system/daemonsets/agent",
            {"apiVersion": "apps/v1", "kind": "DaemonSet",
             "metadata": {"name": "agent", "namespace": "kube-system"},
             "spec": {"selector": {}, "template": template(plain.ref("never/seen", "v1"))}})
    api.put("/api/v1/namespaces/ops/serviceaccounts/default",
            {"apiVersion": "v1", "kind": "ServiceAccount",
             "metadata": {"name": "default", "namespace": "ops"}})
    api.put("/api/v1/namespaces/shop/serviceaccounts/default",
            {"apiVersion": "v1", "kind": "ServiceAccount",
             "metadata": {"name": "default", "namespace": "shop"}})


@pytest.fixture
def world(plain_registry, basic_auth_registry, tmp_path, monkeypatch):
    monkeypatch.setattr(cluster, "PAGE_SIZE", 5)
    images = []
    for i in range(15):
        plain_registry.push_image(f"warm/app{i}", "v1", "linux/arm64")
        images.append(plain_registry.ref(f"warm/app{i}", "v1"))
    basic_auth_registry.push_image("warm/private", "v1", "linux/s390x")
    private = basic_auth_registry.ref("warm/private", "v1")
    api = FakeApiServer()
    secret = base64.b64encode(basic_auth_registry.dockerconfigjson()).decode()
    api.put("/api/v1/namespaces/ops/secrets/pull",
            {"apiVersion": "v1", "kind": "Secret", "type": "kubernetes.io/dockerconfigjson",
             "metadata": {"name": "pull", "namespace": "ops"},
             "data": {".dockerconfigjson": secret}})
    seed(api, plain_registry, private, images)
    settings = type("K", (), {"enabled": "auto", "kubeconfig": api.kubeconfig(str(tmp_path)),
                              "secret_cache_seconds": 60.0})()
    api_client, _ = build_api_client(settings)
    resolver = Resolver(RegistrySettings(insecure_hosts=(plain_registry.host,),
                                         ca_file=basic_auth_registry.ca.cert_path,
                                         cache=CacheSettings()))
    yield api, api_client, resolver, images, private
    api.stop()


def test_prewarm_reads_every_kind_in_pages_with_pull_secrets_at_its_pace(world, plain_registry,
                                                                          basic_auth_registry):
    api, api_client, resolver, images, private = world
    prewarmer = Prewarmer(lambda: ClusterReader(api_client), resolver,
                          PullSecrets(api_client), per_second=RATE,
                          exclude_namespaces=("kube-system",))
    mark = plain_registry.mark()
    started = time.monotonic()
    outcome = prewarmer.run_once()
    assert outcome == {"images": 17, "resolved": 17, "failed": 0}   # debug: same image, other namespace
    # Paged: 14 Deployments in pages of 5 are 3 list calls.
    assert api.count("GET", "/apis/apps/v1/deployments?") == 3
    # Paced: 15 images on one host at 20 a second take at least 14 steps of 50 ms.
    served = [e for e in plain_registry.manifest_gets(mark) if e.path.startswith("/v2/warm/")]
    assert len(served) == 15
    assert time.monotonic() - started >= 14 / RATE
    # Everything is in the cache now: admissions cost the registries nothing, the private image
    # included (it was read with the CronJob's pull secret), and kube-system was skipped.
    mark = plain_registry.mark()
    answers = resolver.resolve_many(images, timeout=0)
    assert all(isinstance(a, ImageInfo) for a in answers.values())
    assert plain_registry.requests_since(mark) == []
    assert plain_registry.manifest_gets(mark, "never/seen") == []


def test_paced_interleaves_hosts_and_spaces_each_host():
    items = [type("W", (), {"image": f"{host}/app:{i}"})() for host in ("a", "b") for i in range(3)]
    schedule = [(at, item.image) for at, item in paced(items, 10.0, lambda i: i.split("/")[0])]
    assert schedule == [(0.0, "a/app:0"), (0.0, "b/app:0"), (0.1, "a/app:1"), (0.1, "b/app:1"),
                        (pytest.approx(0.2), "a/app:2"), (pytest.approx(0.2), "b/app:2")]


def test_wanted_images_skips_excluded_namespaces_and_malformed_objects():
    objects = [
        {"kind": "Deployment", "metadata": {"namespace": "a"},
         "spec": {"template": template("x:1", "y:1")}},
        {"kind": "Deployment", "metadata": {"namespace": "kube-system"},
         "spec": {"template": template("z:1")}},
        {"kind": "Job", "metadata": {"namespace": "a"}, "spec": {"template": "not a template"}},
        {"kind": "Pod", "metadata": {"namespace": "a"}, "spec": {"containers": "nope"}},
    ]
    assert [w.image for w in wanted_images(objects, ("kube-system",))] == ["x:1", "y:1"]
