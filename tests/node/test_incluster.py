"""archway installed in the cluster as users install it (lab/cluster/incluster.py): its pods on
the real node, the apiserver calling the webhook through the chart's Service, a rollout of
archway itself under steady pod creation, and `helm uninstall` with its hooks as Jobs."""
import os
import subprocess
import threading
import time

import pytest

from lab.cluster.nodeimages import OciImage, go_binary, machine_arch
from lab.kube import pod_path
from tests.e2e.workloads import create_deployment, deployment, pods_of, wait_bound

ARCH_ANNOTATION = "archway.dev/architectures"


def pause_image(registry) -> str:
    """A long-running image of this machine's architecture only, in the node's registry."""
    OciImage.of({"/pause": go_binary("pause")}, entrypoint=["/pause"]).push(
        registry, "node/pause", "1")
    return f"{registry.host}/node/pause:1"


def fresh_namespace(plane, prefix: str) -> str:
    return plane.new_namespace(f"{prefix}-{int(time.time() * 1000) % 10**8}")


def test_archway_runs_in_the_cluster_and_places_a_deployment_on_the_real_node(in_cluster,
                                                                              node_registry):
    plane, node = in_cluster.plane, in_cluster.node
    kube = plane.kube
    running = kube.items(pod_path(in_cluster.namespace))
    assert running and all(p["spec"]["nodeName"] == node.name for p in running)
    (configuration,) = [w for w in kube.items(
        "/apis/admissionregistration.k8s.io/v1/mutatingwebhookconfigurations")
        if w["metadata"]["name"].startswith(in_cluster.release)]
    assert all("service" in hook["clientConfig"] and "url" not in hook["clientConfig"]
               for hook in configuration["webhooks"])

    namespace = fresh_namespace(plane, "placed")
    create_deployment(kube, namespace, deployment("web", [pause_image(node_registry)], replicas=2))
    pods = wait_bound(kube, namespace, "web", 2, timeout=90)
    for pod in pods:
        assert pod["metadata"]["annotations"][ARCH_ANNOTATION] == machine_arch()
        assert pod["spec"]["nodeName"] == node.name
    kube.wait_for(lambda: all(p["status"].get("phase") == "Running"
                              for p in pods_of(kube, namespace, "web")) or None,
                  timeout=120, what="the Deployment's pods Running on the real node")


def test_kubectl_describe_pod_shows_archways_event_about_it(in_cluster, node_registry):
    """A pod no node can run, created by its name: `kubectl describe pod` (Events selected by
    the pod's uid) shows archway's ArchwayUnschedulable, written by archway's pods."""
    plane = in_cluster.plane
    node_registry.push_image("node/s390x", "1", "linux/s390x")
    namespace = fresh_namespace(plane, "describe")
    plane.kube.create(pod_path(namespace), {"metadata": {"name": "lonely"}, "spec": {
        "containers": [{"name": "c", "image": f"{node_registry.host}/node/s390x:1"}]}})
    env = {k: v for k, v in os.environ.items() if "proxy" not in k.lower()}

    def described():
        done = subprocess.run([plane.binary("kubectl"), "--kubeconfig", plane.admin_kubeconfig,
                               "describe", "pod", "lonely", "-n", namespace],
                              capture_output=True, text=True, timeout=60, env=env)
        assert done.returncode == 0, done.stderr
        return done.stdout if "ArchwayUnschedulable" in done.stdout else None
    text = plane.kube.wait_for(described, timeout=60, what="archway's Event in kubectl describe")
    assert "images are s390x-only" in text


def restart_deployments(in_cluster) -> None:
    """`kubectl rollout restart` of archway's Deployments, waited for."""
    kube = in_cluster.plane.kube
    deployments = in_cluster.resource_names()["Deployment"]
    stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    for name in deployments:
        kube.patch(f"/apis/apps/v1/namespaces/{in_cluster.namespace}/deployments/{name}",
                   {"spec": {"template": {"metadata": {"annotations": {
                       "kubectl.kubernetes.io/restartedAt": stamp}}}}})
    kube.wait_for(lambda: all(_rolled_out(kube, in_cluster.namespace, name)
                              for name in deployments) or None,
                  timeout=240, what="archway's Deployments rolled out")


def helm_upgrade(in_cluster) -> None:
    """`helm upgrade --wait` with a changed value that rolls the webhook Deployment."""
    kube = in_cluster.plane.kube
    (webhook,) = [d["metadata"]["name"] for d in kube.items(
        f"/apis/apps/v1/namespaces/{in_cluster.namespace}/deployments")
        if d["spec"]["selector"]["matchLabels"].get("app.kubernetes.io/component") == "webhook"]
    path = f"/apis/apps/v1/namespaces/{in_cluster.namespace}/deployments/{webhook}"
    before = kube.get(path)["metadata"]["generation"]
    in_cluster.upgrade(values={"webhook": {"podAnnotations": {
        "archway.test/upgraded": str(time.time_ns())}}})
    assert kube.get(path)["metadata"]["generation"] > before      # it did roll
    kube.wait_for(lambda: _rolled_out(kube, in_cluster.namespace, webhook) or None,
                  timeout=240, what="archway's webhook rolled out")


class SteadyCreation:
    """Pods created at a steady rate (2 a second) on a thread of their own for as long as the
    `with` block runs, while archway is changed; every failed creation is a finding. `pod(i)`:
    the i-th pod. `created`: the objects the apiserver stored (what admission made of them)."""

    def __init__(self, kube, namespace: str, pod):
        self.kube, self.namespace, self.pod = kube, namespace, pod
        self.created: list[dict] = []
        self.failures: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._create_steadily)

    def _create_steadily(self) -> None:
        i = 0
        while not self._stop.is_set():
            try:
                self.created.append(self.kube.create(pod_path(self.namespace), self.pod(i)))
            except Exception as e:   # every failure is the finding
                self.failures.append(f"p{i}: {e}")
            i += 1
            self._stop.wait(0.5)

    def wait_for_more(self, count: int, *, what: str) -> None:
        """Until `count` more creations (or a failure), within a minute."""
        after = len(self.created) + count
        self.kube.wait_for(lambda: len(self.created) >= after or bool(self.failures) or None,
                           timeout=60, what=what)

    def __enter__(self) -> "SteadyCreation":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

@pytest.mark.timeout(900)      # the session's install when first, and a rollout
@pytest.mark.parametrize("change", [restart_deployments, helm_upgrade],
                         ids=["rollout-restart", "helm-upgrade"])
def test_a_change_of_archway_fails_no_creation_and_leaves_no_pod_unannotated(
        in_cluster, node_registry, change):
    """Pods created at a steady rate (2 a second) while archway's pods are replaced."""
    plane = in_cluster.plane
    kube = plane.kube
    image = pause_image(node_registry)
    namespace = fresh_namespace(plane, "rollout")

    def pod(i: int) -> dict:
        return {"metadata": {"name": f"p{i}"}, "spec": {
            "nodeSelector": {"kubernetes.io/arch": "arm64"},   # API-only: never runs
            "containers": [{"name": "c", "image": image}]}}

    with SteadyCreation(kube, namespace, pod) as creation:
        before = len(creation.created)
        change(in_cluster)
        during = len(creation.created) - before
        creation.wait_for_more(6, what="creations after the change")
    created, failures = creation.created, creation.failures
    assert failures == []
    unannotated = [p["metadata"]["name"] for p in kube.items(pod_path(namespace))
                   if ARCH_ANNOTATION not in (p["metadata"].get("annotations") or {})]
    # Creations went on while archway's pods were replaced (how many depends on how fast the
    # rollout was), and after it.
    assert during >= 2 and len(created) >= before + during + 6 and unannotated == []


def _rolled_out(kube, namespace: str, name: str) -> bool:
    deployment = kube.get(f"/apis/apps/v1/namespaces/{namespace}/deployments/{name}")
    status, want = deployment["status"], deployment["spec"]["replicas"]
    return (status.get("observedGeneration") == deployment["metadata"]["generation"]
            and status.get("updatedReplicas") == want and status.get("availableReplicas") == want
            and status.get("replicas") == want)


def test_helm_uninstall_runs_its_hooks_as_jobs_and_removes_every_gate(in_cluster, node_registry):
    """It uninstalls the session's install: the next test to ask for one installs again."""
    plane = in_cluster.plane
    kube = plane.kube
    namespace = fresh_namespace(plane, "uninstall")
    kube.create(pod_path(namespace), {"metadata": {"name": "held"}, "spec": {
        "schedulingGates": [{"name": "archway.dev/resolving"}],
        "containers": [{"name": "c", "image": pause_image(node_registry)}]}})
    assert kube.get(pod_path(namespace, "held"))["spec"].get("schedulingGates")
    mark = plane.audit_mark()
    in_cluster.uninstall()
    jobs = [uri for verb, uri in plane.requests_since(mark)
            if verb == "create" and "/jobs" in uri and in_cluster.namespace in uri]
    assert jobs, "helm ran no hook Job"
    assert not [w for w in kube.items(
        "/apis/admissionregistration.k8s.io/v1/mutatingwebhookconfigurations")
        if w["metadata"]["name"].startswith(in_cluster.release)]
    assert not kube.get(pod_path(namespace, "held"))["spec"].get("schedulingGates")
