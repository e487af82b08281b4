"""The image records with archway installed by its chart on the real node (two webhook replicas,
lab/cluster/incluster.py): `kubectl rollout restart` of archway under steady pod creation asks
the registry nothing for the images the cluster already runs, and gates no pod."""
import pytest

from lab.kube import pod_path

from .test_incluster import ARCH_ANNOTATION, SteadyCreation, fresh_namespace, restart_deployments

RECORDS = "/apis/archway.dev/v1alpha1/clusterimagerecords"
REPOS = [f"node/records-{i}" for i in range(5)]


def arm64_pod(name: str, image: str) -> dict:
    """A pod for the API-only arm64 Nodes: admitted and bound, never started."""
    return {"metadata": {"name": name}, "spec": {"nodeSelector": {"kubernetes.io/arch": "arm64"},
                                                 "containers": [{"name": "c", "image": image}]}}


@pytest.mark.timeout(900)
def test_an_archway_rollout_reads_no_known_image_from_the_registry_and_gates_no_pod(
        in_cluster, node_registry):
    kube = in_cluster.plane.kube
    for repo in REPOS:
        node_registry.push_index(repo, "v1", ["linux/amd64", "linux/arm64"])
    images = [f"{node_registry.host}/{repo}:v1" for repo in REPOS]
    namespace = fresh_namespace(in_cluster.plane, "records")
    for i, image in enumerate(images):            # the cluster runs them: archway reads them
        kube.create(pod_path(namespace), arm64_pod(f"known{i}", image))
    kube.wait_for(lambda: all(any(r["spec"]["reference"].endswith(f"/{repo}:v1")
                                  for r in kube.items(RECORDS)) for repo in REPOS) or None,
                  timeout=60, what="a record of every image")
    mark = node_registry.mark()
    with SteadyCreation(kube, namespace,
                        lambda i: arm64_pod(f"p{i}", images[i % len(images)])) as creation:
        restart_deployments(in_cluster)
        creation.wait_for_more(6, what="creations after the rollout")
    created, failures = creation.created, creation.failures
    assert failures == []
    # What the apiserver stored is what admission made of each pod: none gated, all placed.
    gated = [p["metadata"]["name"] for p in created if p["spec"].get("schedulingGates")]
    unannotated = [p["metadata"]["name"] for p in created
                   if ARCH_ANNOTATION not in (p["metadata"].get("annotations") or {})]
    assert gated == [] and unannotated == [] and len(created) >= 8
    asked = [r for r in node_registry.requests_since(mark)
             if any(f"/v2/{repo}/" in r.path for repo in REPOS)]
    assert asked == []
