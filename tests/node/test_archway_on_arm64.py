"""archway's own arm64 image on the arm64 node (tests/node/twoarch.py): installed by its chart as
a release installs it, both images (archway's and the second kube-scheduler's) an index of amd64
and arm64 in a registry both nodes pull from. One webhook replica runs on each node, the second
scheduler and its extender sidecar on the arm64 node: archway's arm64 build (its aarch64 wheels:
cryptography, the kubernetes client) starts, serves and decides as the amd64 one does.
"""
import base64
import json
import time

import pytest
import requests
import urllib3

from lab.cluster.incluster import InClusterInstall
from lab.cluster.realnode import node_address
from lab.cluster.vmimage import MACHINES
from lab.cluster.vmnode import vm_address
from tests.e2e.workloads import create_pod, describe, pod
from tests.node.twoarch import FOREIGN, HOST, two_real_nodes, wait_running, whoami
from webhook.admissionreview import admission_review

pytestmark = [pytest.mark.slow, pytest.mark.realnode, pytest.mark.vmnode, pytest.mark.timeout(1800)]


class ArchwayOnTwo:
    def __init__(self, plane, node, vm, install, registry, mark):
        self.plane, self.node, self.vm, self.install, self.registry = plane, node, vm, install, registry
        self.kube = plane.kube
        self.mark = mark        # the registry's access log before the install pulled anything

    def pods(self, component: str) -> list[dict]:
        return self.kube.items(f"/api/v1/namespaces/{self.install.namespace}/pods",
                               labelSelector=f"app.kubernetes.io/component={component}")

    def on(self, component: str, node: str) -> dict:
        (found,) = [p for p in self.pods(component) if p["spec"].get("nodeName") == node]
        return found


@pytest.fixture(scope="module")
def archway_on_two(session_node, node_registry, tmp_path_factory):
    with two_real_nodes(session_node, node_registry, tmp_path_factory, "arm64-archway") as (plane, node, vm):
        mark = node_registry.mark()
        install = InClusterInstall.on_two_architectures(plane, node_registry, FOREIGN, archway_config={
            "registry": {"insecure_hosts": [node_registry.host]}})
        install.install()
        print(f"archway on both nodes: {', '.join(f'{k} {v:.0f} s' for k, v in install.timings.items())}")
        yield ArchwayOnTwo(plane, node, vm, install, node_registry, mark)


def test_archways_arm64_image_runs_a_webhook_replica_and_the_scheduler_on_the_arm64_node(archway_on_two):
    two = archway_on_two
    webhooks = two.pods("webhook")
    assert {p["spec"]["nodeName"] for p in webhooks} == {two.node.name, two.vm.name}, webhooks
    (scheduler,) = two.pods("scheduler")
    assert scheduler["spec"]["nodeName"] == two.vm.name
    for running in (*webhooks, scheduler):
        assert all(s["ready"] for s in running["status"]["containerStatuses"]), running["status"]
    # Each node's containerd fetched its own architecture's manifest of archway's index, no other.
    pushed = two.install.pushed["archway"]
    for node, address in ((two.vm.name, vm_address(MACHINES[FOREIGN])), (two.node.name, node_address())):
        arch = FOREIGN if node == two.vm.name else HOST
        fetched = {e.path.rsplit("/", 1)[1] for e in two.registry.requests_since(two.mark)
                   if e.remote == address and e.agent.startswith("containerd/")
                   and e.method == "GET" and "/v2/archway/manifests/sha256:" in e.path}
        assert pushed[arch] in fetched and pushed[HOST if arch == FOREIGN else FOREIGN] not in fetched, (
            node, fetched, pushed)
        (status,) = two.on("webhook", node)["status"]["containerStatuses"]
        assert status["imageID"].endswith("@" + pushed["index"]), status
    info = two.kube.get(f"/api/v1/nodes/{two.vm.name}")["status"]["nodeInfo"]
    assert info["architecture"] == FOREIGN


def test_the_arm64_replica_decides_as_the_amd64_one(archway_on_two):
    """The same reviews posted to each replica on its pod address: the same placement."""
    two = archway_on_two
    digests = whoami(two.registry, "whoami/replicas", [HOST, FOREIGN])
    assert set(digests) == {HOST, FOREIGN, "index"}
    images = {arch: two.registry.ref("whoami/replicas", arch) for arch in (HOST, FOREIGN)}
    images["both"] = two.registry.ref("whoami/replicas", "multi")
    urllib3.disable_warnings(urllib3.exceptions.InsecureRequestWarning)   # the pod's own address
    addresses = dict(two.install.webhook_addresses())      # one replica a node
    answers = {}
    for node in (two.node.name, two.vm.name):
        for kind, image in images.items():
            review = admission_review(image, "default")
            response = requests.post(f"{addresses[node]}/mutate", json=review, verify=False, timeout=30)
            assert response.status_code == 200, response.text
            answer = response.json()["response"]
            assert answer["allowed"] and answer["uid"] == review["request"]["uid"], answer
            answers[node, kind] = (json.loads(base64.b64decode(answer["patch"]))
                                   if "patch" in answer else None, answer.get("warnings"))
    for kind in images:
        assert answers[two.node.name, kind] == answers[two.vm.name, kind], kind
    for arch in (HOST, FOREIGN):
        assert f'"{arch}"' in json.dumps(answers[two.vm.name, arch][0])
        assert f'"{HOST if arch == FOREIGN else FOREIGN}"' not in json.dumps(answers[two.vm.name, arch][0])


def test_the_second_scheduler_on_arm64_filters_by_architecture_itself(archway_on_two):
    """Pods the webhook skips (archway.dev/skip) name the second scheduler: its extender, on the
    arm64 node, reads their images and keeps each off the node that cannot run it."""
    two = archway_on_two
    kube = two.kube
    namespace = two.plane.new_namespace(f"arm64-extender-{int(time.time()) % 10**6}")
    whoami(two.registry, "whoami/extender", [HOST, FOREIGN])
    for arch, node in ((FOREIGN, two.vm.name), (HOST, two.node.name)):
        body = pod(f"only-{arch}", [two.registry.ref("whoami/extender", arch)],
                   schedulerName=two.install.scheduler_name)
        body["metadata"]["labels"]["archway.dev/skip"] = "true"
        created = create_pod(kube, namespace, body)
        assert "archway.dev/architectures" not in (created["metadata"].get("annotations") or {})
        running = wait_running(kube, namespace, f"only-{arch}")
        assert running["spec"]["nodeName"] == node, describe(kube, namespace, f"only-{arch}")
