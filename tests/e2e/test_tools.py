"""The operator's tools against the real API: pre-warming after a start, `archway explain pod/`
and `archway report`."""
import json
import os
import subprocess

import yaml

from lab.cluster.chart import archway_command
from lab.cluster.controlplane import stop_process
from lab.kube import pod_path

from .workloads import create_deployment, create_pod, deployment, gated, pod, pods_of, wait_bound


def run_archway(control_plane, tmp_path, images, *args: str) -> subprocess.CompletedProcess:
    config = tmp_path / "archway.yaml"
    config.write_text(yaml.safe_dump({"registry": {"insecure_hosts": [images.registry.host]}}))
    env = dict(os.environ, KUBECONFIG=control_plane.admin_kubeconfig)
    return subprocess.run(archway_command() + ["--config", str(config), *args], env=env,
                          capture_output=True, text=True, timeout=60)


def test_explain_shows_a_live_pods_images_and_placement(
        archway, control_plane, kube, namespace, images, tmp_path):
    create_pod(kube, namespace, pod("web", [images.ref("e2e/multi")], init=[images.ref("e2e/arm64")]))
    done = run_archway(control_plane, tmp_path, images, "explain", "pod/web", "-n", namespace, "--json")
    assert done.returncode == 0, done.stderr
    (explained,) = json.loads(done.stdout)
    assert explained["architectures"] == ["arm64"]
    assert {i["image"] for i in explained["images"]} >= {images.ref("e2e/multi"), images.ref("e2e/arm64")}
    missing = run_archway(control_plane, tmp_path, images, "explain", "pod/nope", "-n", namespace)
    assert missing.returncode != 0 and "nope" in missing.stderr


def test_report_lists_each_workload_once_with_what_it_can_move_to(
        archway, control_plane, kube, namespace, images, tmp_path):
    create_deployment(kube, namespace, deployment("amd", [images.ref("e2e/amd64")], replicas=2))
    create_deployment(kube, namespace, deployment("multi", [images.ref("e2e/multi")], replicas=2))
    wait_bound(kube, namespace, "amd", 2)
    wait_bound(kube, namespace, "multi", 2)
    done = run_archway(control_plane, tmp_path, images, "report", "-n", namespace,
                       "--target-arch", "arm64", "--json")
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    rows = report["workloads"] if isinstance(report, dict) else report
    by_name = {row["name"]: row for row in rows}
    assert set(by_name) == {"amd", "multi"}, by_name   # Deployments, not their ReplicaSets or pods
    assert by_name["multi"]["kind"] == by_name["amd"]["kind"] == "Deployment"
    assert (by_name["multi"]["movable"], by_name["multi"]["architectures"]) == ("yes", ["amd64", "arm64"])
    assert (by_name["amd"]["movable"], by_name["amd"]["lacking"]) == ("no", [images.ref("e2e/amd64")])


def test_pre_warming_after_a_start_places_pods_of_running_workloads_through_a_registry_outage(
        archway, kube, namespace, images, slow_registry):
    slow_registry.delay = 0.0
    image = images.ref("e2e/arm64", images.fresh("e2e/arm64"), via="slow")
    # The workload exists before archway starts (created while it was down: failurePolicy
    # Ignore let its pods through unplaced).
    stop_process(archway.webhook.process)
    try:
        create_deployment(kube, namespace, deployment("warm", [image], replicas=1))
        wait_bound(kube, namespace, "warm", 1)
    finally:
        mark = images.registry.mark()
        log = archway.webhook.process.log
        logged = os.path.getsize(log)        # the restarted server appends to the same file
        archway.restart_webhook()
    # Pre-warming reads the running workload's image without any admission asking for it.
    kube.wait_for(lambda: images.registry.manifest_gets(mark, "e2e/arm64"), timeout=20,
                  what="pre-warming to read the workload's image")

    with open(archway.webhook.config_path) as f:
        workers = yaml.safe_load(f)["server"]["workers"]

    def prewarmed() -> bool:
        """Each worker has said it is done (its lookups settled, answers in its cache)."""
        with open(log, "rb") as f:
            f.seek(logged)
            return f.read().count(b"pre-warming done: ") >= workers
    kube.wait_for(prewarmed, timeout=30, what="pre-warming done in both workers")
    slow_registry.delay = 3.0      # now the registry is too slow for any admission
    kube.patch(f"/apis/apps/v1/namespaces/{namespace}/deployments/warm/scale",
               {"spec": {"replicas": 3}})
    pods = wait_bound(kube, namespace, "warm", 3, timeout=30)
    new = [p for p in pods if "archway.dev/architectures" in (p["metadata"].get("annotations") or {})]
    assert len(new) == 2, [p["metadata"].get("annotations") for p in pods]
    assert not any(gated(p) for p in pods_of(kube, namespace, "warm"))
    assert all(kube.get(pod_path(namespace, p["metadata"]["name"]))["metadata"]["annotations"][
        "archway.dev/architectures"] == "arm64" for p in new)
