"""Pre-warming against the real apiserver (tests/conftest.py's control plane) and real registries:
every workload kind and the pods, listed in pages, resolved with the pods' pull secrets, paced
per registry host."""
import base64
import time

import pytest

from archway.cluster import reads as cluster
from archway.cluster.pullsecrets import PullSecrets
from archway.cluster.reads import ClusterReader
from archway.cluster.workloads import wanted_images
from archway.config import CacheSettings, RegistrySettings
from archway.kubeclient import build_api_client
from archway.registry.model import ImageInfo
from archway.registry.pacing import paced
from archway.registry.resolver import Resolver
from archway.webhook.prewarm import Prewarmer
from lab.tls import session_ca
from tests.infra.fixtures import LOOPBACK_HOSTS, basic_auth_registry, plain_registry

RATE = 20.0   # lookups a second per host: the test's pace (the default is 5)


def template(*images, secrets=()):
    spec = {"containers": [{"name": f"c{i}", "image": image} for i, image in enumerate(images)]}
    if secrets:
        spec["imagePullSecrets"] = [{"name": name} for name in secrets]
    return {"metadata": {"labels": {"app": "x"}}, "spec": spec}


def seed(kube, shop, ops, plain, private, images):
    """One object of every kind archway reads, across namespaces; `private` needs a secret."""
    selector = {"matchLabels": {"app": "x"}}
    for i in range(len(images) - 1):   # 14 Deployments: more than a page of 5
        kube.create(f"/apis/apps/v1/namespaces/{shop}/deployments",
                    {"metadata": {"name": f"web-{i}"},
                     "spec": {"replicas": 0, "selector": selector, "template": template(images[i])}})
    job_template = template(private, secrets=["pull"])
    job_template["spec"]["restartPolicy"] = "Never"
    kube.create(f"/apis/batch/v1/namespaces/{ops}/cronjobs",
                {"metadata": {"name": "nightly"},
                 "spec": {"schedule": "@daily", "jobTemplate": {"spec": {"template": job_template}}}})
    kube.create(f"/apis/apps/v1/namespaces/{ops}/statefulsets",
                {"metadata": {"name": "db"}, "spec": {"replicas": 0, "selector": selector,
                                                      "serviceName": "db",
                                                      "template": template(images[-1])}})
    kube.create(f"/api/v1/namespaces/{ops}/pods",
                {"metadata": {"name": "debug", "annotations": {"archway.dev/skip": "true"}},
                 "spec": template(images[0])["spec"]})
    kube.create("/apis/apps/v1/namespaces/kube-system/daemonsets",
                {"metadata": {"name": "prewarm-test-agent"},
                 "spec": {"selector": selector, "template": template(plain.ref("never/seen", "v1"))}})


@pytest.fixture
def world(control_plane, plain_registry, basic_auth_registry, tmp_path, monkeypatch):
    monkeypatch.setattr(cluster, "LIST_PAGE_SIZE", 5)
    images = []
    for i in range(15):
        plain_registry.push_image(f"warm/app{i}", "v1", "linux/arm64")
        images.append(plain_registry.ref(f"warm/app{i}", "v1"))
    basic_auth_registry.push_image("warm/private", "v1", "linux/s390x")
    private = basic_auth_registry.ref("warm/private", "v1")
    kube = control_plane.kube
    suffix = str(int(time.time() * 1000) % 100000)
    shop, ops = (control_plane.new_namespace(f"{n}-{suffix}") for n in ("shop", "ops"))
    secret = base64.b64encode(basic_auth_registry.dockerconfigjson()).decode()
    kube.create(f"/api/v1/namespaces/{ops}/secrets",
                {"type": "kubernetes.io/dockerconfigjson", "metadata": {"name": "pull"},
                 "data": {".dockerconfigjson": secret}})
    seed(kube, shop, ops, plain_registry, private, images)
    api_client, _ = build_api_client(type("K", (), {
        "enabled": "auto", "kubeconfig": control_plane.admin_kubeconfig,
        "secret_cache_seconds": 60.0})())
    resolver = Resolver(RegistrySettings(allow_hosts=LOOPBACK_HOSTS, insecure_hosts=(plain_registry.host,),
                                         ca_file=basic_auth_registry.ca.cert_path,
                                         cache=CacheSettings()))
    # The cluster is shared: everything but the two namespaces seeded here is left out.
    others = tuple(n["metadata"]["name"] for n in kube.items("/api/v1/namespaces")
                   if n["metadata"]["name"] not in (shop, ops))
    yield api_client, resolver, images, private, others
    for namespace in (shop, ops):
        kube.delete(f"/api/v1/namespaces/{namespace}")
    kube.delete("/apis/apps/v1/namespaces/kube-system/daemonsets/prewarm-test-agent")


def test_prewarm_reads_every_kind_in_pages_with_pull_secrets_at_its_pace(
        world, plain_registry, basic_auth_registry, control_plane):
    api_client, resolver, images, private, others = world
    assert "kube-system" in others
    prewarmer = Prewarmer(lambda: ClusterReader(api_client), resolver,
                          PullSecrets(api_client), per_second=RATE, exclude_namespaces=others)
    mark, audit = plain_registry.mark(), control_plane.audit_mark()
    started = time.monotonic()
    outcome = prewarmer.run_once()
    # 14 Deployments, the CronJob's private image, the StatefulSet's, and the pod's (the same
    # image as web-0, in another namespace).
    assert outcome == {"images": 17, "resolved": 17, "failed": 0}
    # Paged: the cluster's Deployments (ours, 14, and the chart's and other tests' few) in pages
    # of 5: at least 3 list calls, each after the first continuing the one before.
    pages = [uri for verb, uri in control_plane.requests_since(audit)
             if verb == "list" and uri.startswith("/apis/apps/v1/deployments?")]
    assert len(pages) >= 3 and all("continue=" in uri for uri in pages[1:]), pages
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
    schedule = [(at, item.image) for at, item in paced(items, 10.0,
                                                                 lambda i: i.image.split("/")[0])]
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
