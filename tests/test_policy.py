"""Arch policy end to end: namespace modes and preferences read through a real apiserver's list
+ watch, audit counted, Events for pods no node can run; `archway explain` on manifests against
the real registry and on a live pod, and `archway report`, through a kubeconfig of that
apiserver. The module runs a control plane of its own (lab/cluster/controlplane.py): its Nodes
are the ones these cases need (amd-1, and arm-1 tainted against pods without a toleration), and
the workloads the report lists are the only ones in it."""
import base64
import json
import subprocess
import sys
import time

import jsonpatch
import kubernetes_validate
import pytest
import yaml

from lab.procs import REPO, wait_until
from tests.infra.fixtures import plain_registry
from tests.infra.siteclient import SiteClient

# Starts real servers (registries, archway serve, helm...): outside the fast inner loop.
pytestmark = pytest.mark.slow

ARM_TOLERATION = {"key": "kubernetes.io/arch", "operator": "Equal", "value": "arm64",
                  "effect": "NoSchedule"}
PREFERRED = "preferredDuringSchedulingIgnoredDuringExecution"


def validate(pod):
    for version in ("1.30.0", "1.33.0"):
        kubernetes_validate.validate(pod, version, strict=True)


def namespace(name, labels=None, annotations=None):
    meta = {"name": name}
    if labels:
        meta["labels"] = labels
    if annotations:
        meta["annotations"] = annotations
    return {"apiVersion": "v1", "kind": "Namespace", "metadata": meta}


def pod_spec(*images):
    return {"containers": [{"name": f"c{i}", "image": image} for i, image in enumerate(images)]}


@pytest.fixture(scope="module")
def images(plain_registry):
    r = plain_registry
    r.push_index("policy/multi", "1", ["linux/amd64", "linux/arm64"])
    r.push_image("policy/amd", "1", "linux/amd64")
    r.push_image("policy/arm", "1", "linux/arm64")
    r.push_image("policy/z", "1", "linux/s390x")
    return {"multi": r.ref("policy/multi", "1"), "amd": r.ref("policy/amd", "1"),
            "arm": r.ref("policy/arm", "1"), "z": r.ref("policy/z", "1"),
            "gone": r.ref("policy/gone", "1")}


@pytest.fixture(scope="module")
def apiserver(tmp_path_factory):
    """A control plane of this module's own: Nodes amd-1, and arm-1 tainted for arm64 pods."""
    from lab.cluster.controlplane import ControlPlane
    with ControlPlane(str(tmp_path_factory.mktemp("policy-plane")),
                      nodes=(("amd-1", "amd64"), ("arm-1", "arm64"))) as plane:
        plane.kube.patch("/api/v1/nodes/arm-1", {"spec": {"taints": [
            {"key": "kubernetes.io/arch", "value": "arm64", "effect": "NoSchedule"}]}})
        yield plane


@pytest.fixture(scope="module")
def config_file(plain_registry, apiserver, tmp_path_factory):
    directory = tmp_path_factory.mktemp("policy")
    path = directory / "archway.yaml"
    path.write_text(yaml.safe_dump({
        "registry": {"insecure_hosts": [plain_registry.host], "timeout_seconds": 2},
        "kubernetes": {"kubeconfig": apiserver.admin_kubeconfig},
        "placement": {"preferred_architectures": {"arm64": 80, "amd64": 20},
                      "tolerations": {"arm64": [ARM_TOLERATION]}},
        "server": {"state_dir": str(directory / "state"), "product": "webhook"},
    }))
    return str(path)


# --- the webhook: namespace modes and preferences through list + watch ---------------------------

@pytest.fixture(scope="module")
def webhook(config_file, apiserver):
    from archway.config import load_config
    from archway.main.worker import build_worker
    for body in (namespace("audited", {"archway.dev/mode": "audit"}),
                 namespace("quiet", {"archway.dev/mode": "off"}),
                 namespace("amd-first", annotations={
                     "archway.dev/preferred-architectures": "amd64=90,arm64=10"}),
                 namespace("typo", {"archway.dev/mode": "enforced"}),
                 namespace("shop"), namespace("ops")):
        apiserver.kube.create("/api/v1/namespaces", body)
    worker = build_worker(load_config(config_file))
    worker.start()
    service = worker.webhook.service
    assert service.caches.namespaces.wait_synced(10) and worker.node_cache.wait_synced(10)
    yield SiteClient(worker), service
    service.caches.namespaces.stop()
    worker.node_cache.stop()


def admit(client, ns, *images, owner=None):
    metadata = {"generateName": "web-", "namespace": ns}
    if owner:
        metadata["ownerReferences"] = [{"apiVersion": "apps/v1", "kind": "ReplicaSet",
                                        "name": owner, "uid": "rs-uid", "controller": True}]
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": metadata, "spec": pod_spec(*images)}
    review = {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": {
        "uid": "u-1", "operation": "CREATE", "namespace": ns,
        "kind": {"group": "", "version": "v1", "kind": "Pod"},
        "resource": {"group": "", "version": "v1", "resource": "pods"}, "object": pod}}
    reply = client.post("/mutate", json=review)
    assert reply.status_code == 200
    response = reply.get_json()["response"]
    patched = pod
    if "patch" in response:
        patched = jsonpatch.apply_patch(pod, json.loads(base64.b64decode(response["patch"])))
        validate(patched)
    return response, patched


def audit_count(would):
    from archway import metrics
    return metrics.AUDIT_DECISIONS.labels(would)._value.get()


def test_enforce_adds_preferred_terms_and_tolerations(webhook, images):
    client, _ = webhook
    response, pod = admit(client, "shop", images["multi"])
    assert response["allowed"] and response["auditAnnotations"]["outcome"] == "mutated"
    affinity = pod["spec"]["affinity"]["nodeAffinity"]
    assert [(t["weight"], t["preference"]["matchExpressions"][0]["values"])
            for t in affinity[PREFERRED]] == [(80, ["arm64"]), (20, ["amd64"])]
    assert pod["spec"]["tolerations"] == [ARM_TOLERATION]
    (entry,) = json.loads(pod["metadata"]["annotations"]["archway.dev/images"])
    assert entry["architectures"] == ["amd64", "arm64"] and entry["digest"].startswith("sha256:")


def test_namespace_annotation_overrides_the_preferred_weights(webhook, images):
    client, _ = webhook
    _, pod = admit(client, "amd-first", images["multi"])
    assert [(t["weight"], t["preference"]["matchExpressions"][0]["values"]) for t in
            pod["spec"]["affinity"]["nodeAffinity"][PREFERRED]] == [(90, ["amd64"]),
                                                                   (10, ["arm64"])]


def test_audit_namespace_gets_annotations_only_and_is_counted(webhook, images):
    client, _ = webhook
    before = audit_count("mutated"), audit_count("denied")
    response, pod = admit(client, "audited", images["multi"])
    assert response["allowed"] and response["auditAnnotations"] == {
        "outcome": "audited", "would": "mutated", "architectures": "amd64,arm64"}
    assert "affinity" not in pod["spec"] and "tolerations" not in pod["spec"]
    assert pod["metadata"]["annotations"].keys() == {"archway.dev/architectures",
                                                     "archway.dev/images", "archway.dev/policy"}
    assert pod["metadata"]["annotations"]["archway.dev/policy"] == "namespace label"
    assert response["warnings"][0].startswith("audit mode: archway would have placed it")
    denied, _ = admit(client, "audited", images["amd"], images["arm"])   # no common arch
    assert denied["allowed"] and "would have denied" in denied["warnings"][0]
    assert (audit_count("mutated"), audit_count("denied")) == (before[0] + 1, before[1] + 1)


def test_off_namespace_is_left_alone_without_reading_images(webhook, images, plain_registry):
    client, _ = webhook
    mark = plain_registry.mark()
    response, _ = admit(client, "quiet", images["gone"])
    assert response["allowed"] and "patch" not in response and "warnings" not in response
    assert plain_registry.requests_since(mark) == []


def test_a_label_archway_does_not_know_is_ignored_with_a_warning(webhook, images):
    client, _ = webhook
    response, _ = admit(client, "typo", images["multi"])
    assert response["auditAnnotations"]["outcome"] == "mutated"
    assert "archway.dev/mode='enforced'" in response["warnings"][0]


def test_a_namespace_label_change_arrives_through_the_watch(webhook, images, apiserver):
    client, service = webhook
    mark = apiserver.audit_mark()
    apiserver.kube.create("/api/v1/namespaces", namespace("later"))
    wait_until(lambda: "later" in service.caches.namespaces.items)
    assert admit(client, "later", images["multi"])[0]["auditAnnotations"]["outcome"] == "mutated"
    apiserver.kube.patch("/api/v1/namespaces/later", {"metadata": {"labels": {
        "archway.dev/mode": "off"}}})
    wait_until(lambda: service.caches.namespaces.items["later"].mode == "off")
    assert "patch" not in admit(client, "later", images["multi"])[0]
    # the watch brought both: no list again, and no request per admission
    asked = [(verb, uri) for verb, uri in apiserver.requests_since(mark, user="admin")
             if uri.split("?")[0] in ("/api/v1/namespaces", "/api/v1/namespaces/later")
             and verb in ("list", "get")]
    assert asked == [], asked


def test_pod_no_node_can_run_gets_a_warning_and_an_event_on_its_controller(webhook, images,
                                                                          apiserver):
    client, _ = webhook
    response, _ = admit(client, "shop", images["z"], owner="batch-7f9")
    assert response["allowed"]
    assert response["warnings"][0] == ("images are s390x-only; nodes: amd64; the pod would "
                                       "stay Pending")   # arm-1 is tainted against the pod

    def events():
        return [e for e in apiserver.kube.items("/apis/events.k8s.io/v1/namespaces/shop/events")
                if e["regarding"]["name"] == "batch-7f9"]
    wait_until(events)
    (event,) = events()
    assert event["reason"] == "ArchwayUnschedulable" and event["type"] == "Warning"
    assert event["regarding"] == {"apiVersion": "apps/v1", "kind": "ReplicaSet",
                                  "namespace": "shop", "name": "batch-7f9", "uid": "rs-uid"}
    assert event["reportingController"] == "archway.dev/archway"
    # an arm64-only pod tolerates arm-1 thanks to archway's toleration: no warning
    fine, _ = admit(client, "shop", images["arm"])
    assert not fine.get("warnings")


# --- archway explain -f ---------------------------------------------------------------------------

def archway(*args, stdin=None, timeout=60):
    return subprocess.run([sys.executable, "-m", "archway.main.cli", *args], cwd=REPO, input=stdin,
                          capture_output=True, text=True, timeout=timeout)


def deployment(name, *images):
    return {"apiVersion": "apps/v1", "kind": "Deployment",
            "metadata": {"name": name, "namespace": "shop"},
            "spec": {"selector": {"matchLabels": {"app": name}}, "template": {
                "metadata": {"labels": {"app": name}}, "spec": pod_spec(*images)}}}


def cronjob(name, *images):
    return {"apiVersion": "batch/v1", "kind": "CronJob", "metadata": {"name": name},
            "spec": {"schedule": "0 * * * *", "jobTemplate": {"spec": {"template": {
                "spec": {**pod_spec(*images), "restartPolicy": "OnFailure"}}}}}}


def bare_pod(name, *images):
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name},
            "spec": pod_spec(*images)}


def manifests(*docs):
    return "---\n".join(yaml.safe_dump(d) for d in docs)


def test_explain_manifests_that_can_run(config_file, images, tmp_path):
    path = tmp_path / "ok.yaml"
    service = {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "web"},
               "spec": {"ports": [{"port": 80}]}}
    the_list = {"apiVersion": "v1", "kind": "List",
                "items": [bare_pod("tool", images["arm"]), service]}
    path.write_text(manifests(deployment("web", images["multi"]), service,
                              cronjob("nightly", images["amd"]), the_list))
    result = archway("explain", "--json", "-f", str(path), "--config", config_file)
    assert result.returncode == 0, result.stderr
    web, nightly, tool = json.loads(result.stdout)
    assert [(w["kind"], w["name"]) for w in (web, nightly, tool)] == [
        ("Deployment", "web"), ("CronJob", "nightly"), ("Pod", "tool")]
    assert tool["origin"] == f"{path}, document 4, item 1"
    assert web["architectures"] == ["amd64", "arm64"] and web["can_run"]
    assert web["images"][0]["architectures"] == ["amd64", "arm64"]
    # the patch applies to the workload's pod and gives a valid pod
    template = deployment("web", images["multi"])["spec"]["template"]
    pod = jsonpatch.apply_patch({"apiVersion": "v1", "kind": "Pod",
                                 "metadata": {"name": "web-1", **template["metadata"]},
                                 "spec": template["spec"]}, web["patch"])
    validate(pod)
    assert pod["spec"]["tolerations"] == [ARM_TOLERATION]
    assert [t["weight"] for t in pod["spec"]["affinity"]["nodeAffinity"][PREFERRED]] == [80, 20]
    assert nightly["architectures"] == ["amd64"] and tool["architectures"] == ["arm64"]
    text = archway("explain", "-f", "-", "--config", config_file, stdin=path.read_text())
    assert text.returncode == 0
    assert "Deployment shop/web" in text.stdout and "runs on: amd64, arm64" in text.stdout
    multi = web["images"][0]
    assert multi["pinned"] == images["multi"].rsplit(":", 1)[0] + "@" + multi["digest"]
    assert f"(oci-index, {multi['pinned']})" in text.stdout
    assert "archway would apply this JSON patch:" in text.stdout


def test_explain_exits_1_when_a_workload_cannot_run_or_an_image_cannot_be_read(config_file,
                                                                              images, tmp_path):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps({"apiVersion": "v1", "kind": "List", "items": [
        deployment("fine", images["multi"]), cronjob("mixed", images["amd"], images["arm"]),
        deployment("missing", images["gone"])]}))
    result = archway("explain", "--json", "-f", str(path), "--config", config_file)
    assert result.returncode == 1, result.stderr
    fine, mixed, missing = json.loads(result.stdout)
    assert fine["can_run"] and not mixed["can_run"] and not missing["can_run"]
    assert mixed["architectures"] == [] and "share no CPU architecture" in mixed["message"]
    assert missing["images"][0]["error"] and missing["architectures"] is None
    text = archway("explain", "-f", str(path), "--config", config_file)
    assert text.returncode == 1 and "CANNOT RUN" in text.stdout


def test_explain_a_directory_reads_every_manifest_under_it(config_file, images, tmp_path):
    (tmp_path / "base").mkdir()
    (tmp_path / "base" / "web.yaml").write_text(manifests(deployment("web", images["multi"])))
    (tmp_path / "jobs.json").write_text(json.dumps(cronjob("nightly", images["amd"])))
    (tmp_path / "tool.yml").write_text(manifests(bare_pod("tool", images["arm"])))
    (tmp_path / "README.md").write_text("not a manifest")
    result = archway("explain", "--json", "-f", str(tmp_path), "--config", config_file)
    assert result.returncode == 0, result.stderr
    rows = json.loads(result.stdout)
    assert [(r["name"], r["origin"]) for r in rows] == [
        ("web", f"{tmp_path / 'base' / 'web.yaml'}, document 1"),
        ("nightly", f"{tmp_path / 'jobs.json'}, document 1"),
        ("tool", f"{tmp_path / 'tool.yml'}, document 1")]
    (tmp_path / "mixed.yaml").write_text(manifests(cronjob("mixed", images["amd"], images["arm"])))
    result = archway("explain", "-f", str(tmp_path), "--config", config_file)
    assert result.returncode == 1 and "CronJob mixed" in result.stdout


def test_explain_exits_1_when_a_workloads_own_arch_pin_excludes_its_images(config_file, images,
                                                                          tmp_path):
    """The CI pre-flight's reason to exist: a workload pinned (nodeSelector or required node
    affinity) to an arch its images lack never starts, whatever archway's config says."""
    pinned = deployment("pinned", images["amd"])
    pinned["spec"]["template"]["spec"]["nodeSelector"] = {"kubernetes.io/arch": "arm64"}
    agent = {"apiVersion": "apps/v1", "kind": "DaemonSet",
             "metadata": {"name": "agent", "namespace": "kube-system"},
             "spec": {"selector": {"matchLabels": {"app": "agent"}}, "template": {
                 "metadata": {"labels": {"app": "agent"}},
                 "spec": {**pod_spec(images["multi"]), "affinity": {"nodeAffinity": {
                     "requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
                         {"matchExpressions": [{"key": "kubernetes.io/arch", "operator": "In",
                                                "values": ["s390x", "ppc64le"]}]}]}}}}}}}
    wide = deployment("wide", images["multi"])   # pinned to one of its images' archs: fine
    wide["spec"]["template"]["spec"]["nodeSelector"] = {"kubernetes.io/arch": "arm64"}
    path = tmp_path / "pinned.yaml"
    path.write_text(manifests(pinned, agent, wide))
    result = archway("explain", "--json", "-f", str(path), "--config", config_file)
    assert result.returncode == 1, result.stderr
    pinned_row, agent_row, wide_row = json.loads(result.stdout)
    assert not pinned_row["can_run"] and not agent_row["can_run"] and wide_row["can_run"]
    assert pinned_row["cannot_run"] == ("the pod's own kubernetes.io/arch constraint (arm64) "
                                        "excludes every architecture its images support (amd64)")
    assert "(ppc64le, s390x)" in agent_row["cannot_run"]
    assert wide_row["cannot_run"] is None
    text = archway("explain", "-f", str(path), "--config", config_file)
    assert text.returncode == 1
    assert "CANNOT RUN: the pod's own kubernetes.io/arch constraint (arm64) excludes" in text.stdout
    # audit mode changes what archway does to pods, not whether they can run
    audit = tmp_path / "audit.yaml"
    audit.write_text(yaml.safe_dump({**yaml.safe_load(open(config_file)),
                                     "admission": {"mode": "audit"}}))
    result = archway("explain", "--json", "-f", str(path), "--config", str(audit))
    assert result.returncode == 1 and not json.loads(result.stdout)[0]["can_run"]


@pytest.mark.parametrize("args, stdin, words", [
    ([], None, "either -f FILE|- or pod/NAME"),
    (["-f", "-", "pod/x"], "", "either -f FILE|- or pod/NAME"),
    (["deployment/web"], None, "only pod/NAME"),
    (["-f", "/nonexistent/deploy.yaml"], None, "no such file: /nonexistent/deploy.yaml"),
    (["-f", "-"], "kind: [unclosed", "not valid YAML or JSON"),
    (["-f", "-", "--timeout", "0"], "", "--timeout"),
])
def test_explain_usage_errors_exit_2(args, stdin, words):
    result = archway("explain", *args, stdin=stdin)
    assert result.returncode == 2 and words in result.stderr and "Traceback" not in result.stderr


# --- archway explain pod/NAME and archway report against the real apiserver -------------------

@pytest.fixture(scope="module")
def cluster(apiserver, images):
    """One workload of each kind, made by the real controllers from what an operator applies;
    archway's Warning Event on the web Deployment's ReplicaSet (as the webhook records it)."""
    kube = apiserver.kube
    web = deployment("web", images["multi"])
    web["spec"]["template"]["metadata"]["annotations"] = {
        "archway.dev/architectures": "amd64,arm64", "team": "shop"}   # as archway admitted it
    kube.create("/apis/apps/v1/namespaces/shop/deployments", web)
    nightly = kube.create("/apis/batch/v1/namespaces/ops/cronjobs", cronjob("nightly", images["amd"]))
    job_template = cronjob("nightly", images["amd"])["spec"]["jobTemplate"]
    kube.create("/apis/batch/v1/namespaces/ops/jobs", {   # what the CronJob makes on schedule
        "metadata": {"name": "nightly-28", "ownerReferences": [{
            "apiVersion": "batch/v1", "kind": "CronJob", "name": "nightly",
            "uid": nightly["metadata"]["uid"], "controller": True}]},
        "spec": job_template["spec"]})
    debug = bare_pod("debug", images["multi"])
    debug["spec"]["nodeSelector"] = {"kubernetes.io/arch": "amd64"}
    kube.create("/api/v1/namespaces/ops/pods", debug)
    selector = {"matchLabels": {"app": "db"}}
    kube.create("/apis/apps/v1/namespaces/ops/statefulsets", {
        "metadata": {"name": "db"}, "spec": {"selector": selector, "serviceName": "db",
                                             "template": {"metadata": {"labels": {"app": "db"}},
                                                          "spec": pod_spec(images["gone"])}}})
    kube.create("/apis/apps/v1/namespaces/kube-system/daemonsets", {
        "metadata": {"name": "agent"}, "spec": {
            "selector": {"matchLabels": {"app": "agent"}},
            "template": {"metadata": {"labels": {"app": "agent"}}, "spec": pod_spec(images["arm"])}}})
    # Every workload has its pods (the ones a report must not list again).
    pods = kube.wait_for(lambda: (found := {p["metadata"]["name"]: p for p in
                                            kube.items("/api/v1/pods")})
                         and any(n.startswith("web-") for n in found) and "db-0" in found
                         and any(n.startswith("nightly-28-") for n in found)
                         and any(n.startswith("agent-") for n in found) and found,
                         timeout=30, what="the controllers' pods")
    (web_pod,) = [p for n, p in pods.items() if n.startswith("web-")]
    replica_set = web_pod["metadata"]["ownerReferences"][0]
    kube.create("/apis/events.k8s.io/v1/namespaces/shop/events", {
        "metadata": {"name": f"{replica_set['name']}.archway"},
        "regarding": {"apiVersion": "apps/v1", "kind": "ReplicaSet", "name": replica_set["name"],
                      "namespace": "shop", "uid": replica_set["uid"]},
        "reason": "ArchwayUnschedulable", "type": "Warning", "note": "from archway",
        "action": "Admit", "eventTime": "2026-11-24T02:00:00.000000Z",
        "reportingController": "archway.dev/archway", "reportingInstance": "archway-1"})
    return {"pod": web_pod["metadata"]["name"], "replica_set": replica_set["name"],
            "nightly_image": images["amd"]}


def test_explain_a_live_pod_shows_its_annotations_and_archways_events(cluster, config_file):
    name, replica_set = cluster["pod"], cluster["replica_set"]
    result = archway("explain", f"pod/{name}", "-n", "shop", "--json", "--config", config_file)
    assert result.returncode == 0, result.stderr
    (pod,) = json.loads(result.stdout)
    assert pod["annotations"] == {"archway.dev/architectures": "amd64,arm64"}
    # archway's Event only: the ReplicaSet controller's SuccessfulCreate is not shown
    assert [(e["reason"], e["object"]) for e in pod["events"]] == [
        ("ArchwayUnschedulable", f"ReplicaSet/{replica_set}")]
    assert pod["architectures"] == ["amd64", "arm64"] and pod["can_run"]
    text = archway("explain", f"pod/{name}", "-n", "shop", "--config", config_file)
    assert "archway.dev/architectures: amd64,arm64" in text.stdout
    assert f"event Warning ArchwayUnschedulable on ReplicaSet/{replica_set}" in text.stdout
    missing = archway("explain", "pod/nope", "-n", "shop", "--config", config_file)
    assert missing.returncode == 2 and 'pods "nope" not found' in missing.stderr


def test_report_lists_each_workload_once_with_its_readiness_for_arm64(cluster, config_file):
    result = archway("report", "--target-arch", "aarch64", "--json", "--config", config_file)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["target_arch"] == "arm64"
    rows = {(w["kind"], w["namespace"], w["name"]): w for w in report["workloads"]}
    assert set(rows) == {("Deployment", "shop", "web"), ("StatefulSet", "ops", "db"),
                         ("DaemonSet", "kube-system", "agent"), ("CronJob", "ops", "nightly"),
                         ("Pod", "ops", "debug")}   # owned ReplicaSets, Jobs and Pods: once
    assert rows[("Deployment", "shop", "web")]["movable"] == "yes"
    assert rows[("CronJob", "ops", "nightly")]["movable"] == "no"
    assert rows[("CronJob", "ops", "nightly")]["lacking"] == [cluster["nightly_image"]]
    assert rows[("Pod", "ops", "debug")]["movable"] == "no"
    assert rows[("Pod", "ops", "debug")]["pinned"] == "amd64"
    assert rows[("StatefulSet", "ops", "db")]["movable"] == "unknown"
    assert report["summary"] == {"workloads": 5, "yes": 2, "no": 2, "unknown": 1}
    assert "Deployment(s)" in result.stderr   # progress on stderr
    table = archway("report", "--target-arch", "arm64", "--config", config_file)
    header, *lines = table.stdout.splitlines()
    # RUNS ON: the architectures of the nodes its pods are bound to ("-": none bound).
    assert header.split() == ["NAMESPACE", "KIND", "NAME", "ARCHITECTURES", "RUNS", "ON", "TO",
                              "ARM64", "WHY", "NOT"]
    assert any(line.split()[:4] == ["ops", "CronJob", "nightly", "amd64"]
               and line.split()[4] in ("-", "amd64") and line.split()[5] == "no"
               for line in lines), lines


def test_report_pages_through_long_lists(cluster, config_file, monkeypatch, capsys, apiserver):
    from archway.cluster import reads as cluster_module
    from archway.main import cli
    monkeypatch.setattr(cluster_module, "LIST_PAGE_SIZE", 1)
    mark = apiserver.audit_mark()
    assert cli.main(["report", "--json", "--config", config_file]) == 0
    report = json.loads(capsys.readouterr().out)
    assert len(report["workloads"]) == 5 and report["target_arch"] is None
    pages = [uri for verb, uri in apiserver.requests_since(mark, user="admin")
             if verb == "list" and uri.startswith("/api/v1/pods?")]
    pods = len(apiserver.kube.items("/api/v1/pods"))
    assert len(pages) == pods and all("continue=" in uri for uri in pages[1:])   # one per page


def test_explain_and_report_never_show_the_password_of_a_sif_url():
    from archway.cluster.workloads import workloads_in
    from archway.errors import NotFound
    from archway.podview import PodView
    from archway.tools.explanation import image_json
    from archway.tools.report import assess, row_json
    image = "https://robot:s3cret@files.example/tools/x.sif"
    row = image_json(image, NotFound("gone"))
    assert "s3cret" not in json.dumps(row) and row["image"] == "https://***@files.example/tools/x.sif"
    (workload,) = workloads_in([bare_pod("tool", image)])
    assessed = assess(workload, PodView.of(workload.pod), {image: NotFound("gone")}, "arm64")
    assert assessed.movable == "unknown" and "s3cret" not in json.dumps(row_json(assessed))
