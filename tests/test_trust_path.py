"""archway checks its own trust path and the leader repairs it (issue 38, findings 1 and 2;
certs/trustpath.py): the caBundle of every webhook of its MutatingWebhookConfiguration against
the certificate a webhook pod serves (its mounted files) and the TLS Secret, repaired with the
certificate Job's own code (certs/bootstrap.py) against the lab's API stand-in, which checks
resourceVersions and applies JSON patches as the real server does. On the code before this
change nothing compared them: a corrupted caBundle or a deleted Secret stayed so until the
daily CronJob ran (and these imports fail)."""
import base64
import datetime as dt
import json
import os
import subprocess

import pytest
import yaml
from prometheus_client import REGISTRY

from archway.certs import x509 as cx
from archway.certs.bootstrap import BootstrapSpec, run_bootstrap
from archway.certs.cli import bootstrap_spec
from archway.certs.trustpath import (
    INSTALLED_SELECTION,
    SELECTION_FIELDS,
    STATUS_FILE,
    Observation,
    TrustWatch,
    distrust,
    problems_of,
    selection_problems,
    trust_fact,
)
from archway.config import KubernetesSettings, config_from_dict
from archway.kubeclient import build_api_client
from lab.procs import REPO, require_binary
from lab.servers.apiserver import FakeApiServer

NS, SERVICE, SECRET, MWC = "trust", "archway", "archway-tls", "archway"
TLS_PATH = f"/api/v1/namespaces/{NS}/secrets/{SECRET}"
CA_PATH = f"/api/v1/namespaces/{NS}/secrets/{SECRET}-ca"
MWC_PATH = f"/apis/admissionregistration.k8s.io/v1/mutatingwebhookconfigurations/{MWC}"
SPEC = BootstrapSpec(namespace=NS, service=SERVICE, secret=SECRET, webhook_config=MWC)
WRITES = ("POST", "PUT", "PATCH", "DELETE")


def webhook(name: str) -> dict:
    return {"name": name, "clientConfig": {"service": {"name": SERVICE, "namespace": NS,
                                                       "path": "/mutate", "port": 443}}}


@pytest.fixture
def api():
    server = FakeApiServer()
    server.put(MWC_PATH, {"apiVersion": "admissionregistration.k8s.io/v1",
                          "kind": "MutatingWebhookConfiguration",
                          "metadata": {"name": MWC, "uid": "mwc-uid"},
                          "webhooks": [webhook("pods.archway.dev"), webhook("pods-v2.archway.dev")]})
    yield server
    server.stop()


@pytest.fixture
def client(api, tmp_path):
    c, _ = build_api_client(KubernetesSettings(kubeconfig=api.kubeconfig(str(tmp_path))))
    yield c
    c.close()


class Pod:
    """A webhook pod: the TLS Secret mounted as files (what it serves), its run directory."""

    def __init__(self, api, client, tmp_path):
        run_bootstrap(SPEC, client)                   # the chart's certificate Job, once
        self.api = api
        self.tls = tmp_path / "tls"
        self.tls.mkdir()
        data = secret_data(api, TLS_PATH)
        (self.tls / "tls.crt").write_bytes(data["tls.crt"])
        (self.tls / "tls.key").write_bytes(data["tls.key"])
        self.served = data["tls.crt"]
        self.run_dir = tmp_path / "run"
        self.run_dir.mkdir()
        self.client = client

    def watch(self, repair: BootstrapSpec | None = SPEC) -> TrustWatch:
        return TrustWatch(self.client, configuration=MWC, cert_file=str(self.tls / "tls.crt"),
                          key_file=str(self.tls / "tls.key"), repair=repair,
                          status_path=str(self.run_dir / STATUS_FILE))

    def writes(self) -> list[tuple[str, str]]:
        return [(m, p.split("?")[0]) for m, p in self.api.requests if m in WRITES]


@pytest.fixture
def pod(api, client, tmp_path):
    return Pod(api, client, tmp_path)


def secret_data(api, path) -> dict[str, bytes]:
    return {k: base64.b64decode(v) for k, v in api.get(path)["data"].items()}


def ca_bundles(api) -> list[str]:
    return [w["clientConfig"].get("caBundle") for w in api.get(MWC_PATH)["webhooks"]]


def trusted(bundle: str, cert_pem: bytes) -> bool:
    return distrust(bundle, cx.load_cert(cert_pem), f"{SERVICE}.{NS}.svc", cx.utcnow()) is None


def gauge() -> float | None:
    return REGISTRY.get_sample_value("archway_trust_path_ok")


def repairs(outcome: str) -> float:
    return REGISTRY.get_sample_value("archway_trust_path_repairs_total", {"outcome": outcome}) or 0.0


def other_ca_bundle() -> str:
    other = cx.issue_ca("not archway's CA", days=30)
    return base64.b64encode(other.cert_pem).decode()


def test_a_sound_trust_path_is_ok_and_nothing_is_written(pod):
    pod.api.requests.clear()
    assert pod.watch().turn(leading=True) == []
    assert pod.writes() == []
    assert gauge() == 1
    assert trust_fact(str(pod.run_dir / STATUS_FILE), cx.utcnow().timestamp()).startswith("ok")


def test_a_corrupted_ca_bundle_is_reported_everywhere_and_patched_back_by_the_leader(pod):
    """Finding 1: the caBundle corrupted as on the real node; the apiserver failed open in
    silence until the 03:17 CronJob. Every pod reports it; the leader patches it back at its
    next turn, with the CA the Secrets hold: no new key, the served certificate trusted again."""
    good = ca_bundles(pod.api)
    config = pod.api.get(MWC_PATH)
    config["webhooks"][1]["clientConfig"]["caBundle"] = other_ca_bundle()
    pod.api.put(MWC_PATH, config)
    pod.api.requests.clear()

    follower = pod.watch().turn(leading=False)
    assert follower == ["webhook pods-v2.archway.dev has a caBundle that does not hold the CA "
                        "that signed the served certificate",
                        f"webhook pods-v2.archway.dev has a caBundle that does not hold the CA "
                        f"that signed Secret {NS}/{SECRET}'s certificate"]
    assert pod.writes() == [] and gauge() == 0
    fact = trust_fact(str(pod.run_dir / STATUS_FILE), cx.utcnow().timestamp())
    assert fact.startswith("the apiserver cannot reach archway as installed: webhook pods-v2.archway.dev")

    before = repairs("repaired")
    assert pod.watch().turn(leading=True) == []
    assert ca_bundles(pod.api) == good
    assert pod.writes() == [("PATCH", MWC_PATH)]          # the one webhook, nothing else
    assert secret_data(pod.api, TLS_PATH)["tls.crt"] == pod.served
    assert gauge() == 1 and repairs("repaired") == before + 1


def test_a_deleted_tls_secret_is_stored_again_with_the_pair_the_pod_serves(pod):
    """Finding 2: the TLS Secret deleted while pods run; a replacement pod could not mount it.
    The leader stores it again from what it serves (the CA still signs it): the same key and
    certificate, so no pod rotates and the caBundle stays as it is."""
    bundles = ca_bundles(pod.api)
    pod.api.delete(TLS_PATH)
    follower = pod.watch().turn(leading=False)
    assert follower == [f"Secret {NS}/{SECRET} is missing: a webhook pod starting now cannot "
                        "mount it"]
    assert pod.api.get(TLS_PATH) is None

    assert pod.watch().turn(leading=True) == []
    data = secret_data(pod.api, TLS_PATH)
    assert data["tls.crt"] == pod.served
    assert data["tls.key"] == (pod.tls / "tls.key").read_bytes()
    assert pod.api.get(TLS_PATH)["type"] == "kubernetes.io/tls"
    assert pod.api.get(TLS_PATH)["metadata"]["ownerReferences"][0]["uid"] == "mwc-uid"
    assert ca_bundles(pod.api) == bundles


def test_both_secrets_deleted_a_new_ca_is_trusted_beside_the_one_still_served(pod):
    """The CA's Secret gone too: a new CA and certificate, and the caBundle trusts both the new
    CA and the one that signed what the pods serve until the kubelet syncs the new Secret."""
    pod.api.delete(TLS_PATH)
    pod.api.delete(CA_PATH)
    assert pod.watch().turn(leading=True) == []
    data = secret_data(pod.api, TLS_PATH)
    assert data["tls.crt"] != pod.served
    for bundle in ca_bundles(pod.api):
        assert trusted(bundle, pod.served) and trusted(bundle, data["tls.crt"])
    assert len(cx.load_certs(base64.b64decode(ca_bundles(pod.api)[0]))) == 2


def test_a_pod_still_serving_what_the_secrets_replaced_waits_for_the_kubelet(pod):
    """The Secrets and the caBundle agree, but this pod's files still hold a pair they no longer
    trust (the kubelet syncs within about a minute): the leader reports it, writes nothing and
    counts no repair, at every turn."""
    other = cx.issue_ca("an older CA", days=30)
    stale = cx.issue_serving_cert(other, [f"{SERVICE}.{NS}.svc"], days=10)
    (pod.tls / "tls.crt").write_bytes(stale.cert_pem)
    (pod.tls / "tls.key").write_bytes(stale.key_pem)
    pod.api.requests.clear()
    before = repairs("repaired")
    for _ in range(2):
        assert pod.watch().turn(leading=True) == [
            "webhook pods.archway.dev has a caBundle that does not hold the CA that signed the "
            "served certificate",
            "webhook pods-v2.archway.dev has a caBundle that does not hold the CA that signed the "
            "served certificate"]
    assert pod.writes() == [] and repairs("repaired") == before


def test_without_a_repair_it_only_reports(pod):
    """cert-manager's cainjector (or the user) owns the caBundle: archway never writes it."""
    config = pod.api.get(MWC_PATH)
    config["webhooks"][0]["clientConfig"]["caBundle"] = other_ca_bundle()
    pod.api.put(MWC_PATH, config)
    pod.api.requests.clear()
    problems = pod.watch(repair=None).turn(leading=True)
    assert problems == ["webhook pods.archway.dev has a caBundle that does not hold the CA that "
                        "signed the served certificate"]
    assert pod.writes() == []
    assert not any("/secrets/" in p for _, p in pod.api.requests)   # not even read


def test_nothing_is_repaired_while_the_configuration_is_gone_or_going(pod):
    """`helm uninstall` deletes the configuration and the garbage collector its Secrets: the
    leader must not store them again."""
    pod.api.delete(TLS_PATH)
    config = pod.api.get(MWC_PATH)
    config["metadata"]["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    pod.api.put(MWC_PATH, config)
    pod.api.requests.clear()
    assert pod.watch().turn(leading=True)
    pod.api.delete(MWC_PATH)
    assert pod.watch().turn(leading=True) == [f"MutatingWebhookConfiguration {MWC} not found"]
    assert [w for w in pod.writes() if w[0] != "DELETE"] == []


def test_an_api_that_does_not_answer_is_not_checked_not_broken(pod):
    pod.api.faults[MWC_PATH] = 503
    assert pod.watch().turn(leading=True) == []
    fact = trust_fact(str(pod.run_dir / STATUS_FILE), cx.utcnow().timestamp())
    assert fact.startswith("not checked: ")


def test_a_stale_status_is_not_shown_as_ok(tmp_path):
    path = tmp_path / STATUS_FILE
    path.write_text(json.dumps({"checked_at": 1000.0, "problems": []}))
    assert trust_fact(str(path), 1000.0).startswith("ok")
    assert trust_fact(str(path), 1100.0) == "not checked for 100 s"
    assert trust_fact(str(tmp_path / "none.json"), 1000.0) == "not checked yet"


def test_what_a_client_would_refuse():
    now = cx.utcnow()
    ca = cx.issue_ca("ca", days=30, now=now)
    leaf = cx.issue_serving_cert(ca, ["archway.trust.svc"], days=10, now=now)
    bundle = base64.b64encode(ca.cert_pem).decode()
    assert distrust(bundle, leaf.cert, "archway.trust.svc", now) is None
    assert distrust(None, leaf.cert, None, now) == "has no caBundle"
    assert distrust("bm90IFBFTQ==", leaf.cert, None, now) == \
        "has a caBundle that is not a PEM certificate bundle"
    assert distrust(bundle, leaf.cert, "other.trust.svc", now) == \
        "would find not naming other.trust.svc in"
    assert distrust(bundle, leaf.cert, None, now + dt.timedelta(days=11)) == \
        "would find expired (or not yet valid)"
    seen = Observation(MWC, {"webhooks": [{"name": "w", "clientConfig": {
        "url": "https://archway.example:8443/mutate", "caBundle": bundle}}]}, leaf.cert_pem)
    assert problems_of(seen, now) == ["webhook w would find not naming archway.example in the "
                                      "served certificate"]
    unreadable = Observation(MWC, {"webhooks": []}, b"garbage")
    assert problems_of(unreadable, now) == ["the served certificate cannot be read"]


def test_readyz_shows_the_trust_path_and_stays_ready(pod, tmp_path):
    """Every webhook pod unready would not restore trust (the apiserver's call fails either
    way) and would stall drains, rollouts and the `helm upgrade --wait` whose certificate Job
    patches the caBundle: /readyz says it, with 200."""
    from archway.cluster.pullsecrets import PullSecrets
    from archway.main.worker import build_worker
    from tests.infra.siteclient import SiteClient
    config = config_from_dict({"server": {"state_dir": str(tmp_path / "state")},
                               "kubernetes": {"enabled": "off", "webhook_configuration": MWC}})
    app = SiteClient(build_worker(config, pull_secrets=PullSecrets(None, source="disabled"),
                     controller_status=str(pod.run_dir / "gate-controller.json")))
    config_now = pod.api.get(MWC_PATH)
    config_now["webhooks"][0]["clientConfig"]["caBundle"] = other_ca_bundle()
    pod.api.put(MWC_PATH, config_now)
    pod.watch(repair=None).turn(leading=True)
    answer = app.get("/readyz")
    assert answer.status_code == 200
    assert answer.get_json()["trust_path"].startswith(
        "the apiserver cannot reach archway as installed: webhook pods.archway.dev has a caBundle")


def chart_objects(*values: str) -> list[dict]:
    out = subprocess.run([require_binary("helm"), "template", "archway",
                          os.path.join(REPO, "charts", "archway"), "-n", NS, *values],
                         capture_output=True, text=True, timeout=60, check=True).stdout
    return [d for d in yaml.safe_load_all(out) if d]


def webhook_file_config(objects: list[dict]) -> dict:
    (cm,) = [d for d in objects if d["kind"] == "ConfigMap" and "webhook.yaml" in d["data"]]
    return yaml.safe_load(cm["data"]["webhook.yaml"])


def test_a_configuration_edited_to_send_no_pods_is_reported_and_never_written_back(pod):
    """Finding 6 of hardening round 6: the namespaceSelector edited to match nothing looked
    healthy. The chart's record of what it installed (the configuration's annotation, as
    rendered: the next test) tells the edit; nothing is written (an admin may mean it)."""
    (installed,) = [d for d in chart_objects() if d["kind"] == "MutatingWebhookConfiguration"]
    configuration = pod.api.get(MWC_PATH)
    configuration["metadata"]["annotations"] = {
        INSTALLED_SELECTION: installed["metadata"]["annotations"][INSTALLED_SELECTION]}
    configuration["webhooks"] = [{**mine, **{f: w[f] for f in SELECTION_FIELDS if f in w}}
                                 for mine, w in zip(configuration["webhooks"], installed["webhooks"])]
    for mine, w in zip(configuration["webhooks"], installed["webhooks"]):
        mine["name"] = w["name"]
    configuration = pod.api.put(MWC_PATH, configuration)
    watch = pod.watch()
    assert watch.turn(leading=True) == [] and gauge() == 1
    edited = dict(configuration, webhooks=[dict(configuration["webhooks"][0], namespaceSelector={
        "matchLabels": {"no-such-label": "x"}}), *configuration["webhooks"][1:]])
    pod.api.put(MWC_PATH, edited)
    pod.api.requests.clear()
    (problem,) = watch.turn(leading=True)
    assert problem.startswith("webhook pods.archway.dev: namespaceSelector not as the chart "
                              "installed it"), problem
    assert pod.writes() == [] and gauge() == 0
    fact = trust_fact(str(pod.run_dir / STATUS_FILE), cx.utcnow().timestamp())
    assert fact.startswith("the apiserver cannot reach archway as installed: webhook pods.archway.dev: namespaceSelector")
    # The revisit keeps to what was installed: a pod of namespace "shop" is still covered.
    from archway.gate.coverage import pod_webhooks, webhook_covers
    labels = {"kubernetes.io/metadata.name": "shop"}
    assert webhook_covers(pod_webhooks(pod.api.get(MWC_PATH)), labels, {})
    assert not webhook_covers(pod_webhooks(edited | {"metadata": {}}), labels, {})


def test_the_charts_record_of_its_selection_is_what_it_renders():
    for extra in ((), ("--set", "config.admission.debug_containers=off"),
                  ("--set", "webhook.failurePolicy=Fail", "--set", "webhook.skipArchPinnedPods=true")):
        (mwc,) = [d for d in chart_objects(*extra) if d["kind"] == "MutatingWebhookConfiguration"]
        recorded = json.loads(mwc["metadata"]["annotations"][INSTALLED_SELECTION])
        assert set(recorded) == {w["name"] for w in mwc["webhooks"]}, extra
        for w in mwc["webhooks"]:
            assert recorded[w["name"]] == {f: w[f] for f in SELECTION_FIELDS}, (extra, w["name"])
        assert selection_problems(mwc) == []


def test_the_chart_repairs_with_the_certificate_jobs_own_arguments_in_bootstrap_mode_only():
    objects = chart_objects()
    kube = webhook_file_config(objects)["kubernetes"]
    assert kube["webhook_configuration"] == "archway"
    (job,) = [d for d in objects if d["kind"] == "CronJob"]
    (container,) = job["spec"]["jobTemplate"]["spec"]["template"]["spec"]["containers"]
    assert kube["trust_repair"] == container["args"]
    spec = bootstrap_spec(kube["trust_repair"])
    assert (spec.namespace, spec.service, spec.secret, spec.webhook_config) == \
        (NS, "archway", "archway-tls", "archway")
    assert not spec.allow_missing_webhook_config
    for mode in ("cert-manager", "secret"):
        extra = ["--set", f"tls.mode={mode}", "--set", "tls.secretName=mine",
                 "--set", "tls.secret.caBundle=eA=="]
        kube = webhook_file_config(chart_objects(*extra))["kubernetes"]
        assert kube["webhook_configuration"] == "archway" and "trust_repair" not in kube


def rules(objects: list[dict], kind: str, name: str) -> list[dict]:
    (found,) = [d for d in objects if d["kind"] == kind and d["metadata"]["name"] == name]
    return found["rules"]


def test_the_chart_grants_the_repair_its_own_objects_only():
    objects = chart_objects()
    assert rules(objects, "ClusterRole", "archway-trust-path") == [
        {"apiGroups": ["admissionregistration.k8s.io"],
         "resources": ["mutatingwebhookconfigurations"], "resourceNames": ["archway"],
         "verbs": ["get", "patch"]}]
    assert rules(objects, "Role", "archway-trust-path") == [
        {"apiGroups": [""], "resources": ["secrets"], "verbs": ["create"]},
        {"apiGroups": [""], "resources": ["secrets"],
         "resourceNames": ["archway-tls", "archway-tls-ca"], "verbs": ["get", "update"]}]
    checked_only = chart_objects("--set", "tls.mode=cert-manager")
    assert rules(checked_only, "ClusterRole", "archway-trust-path")[0]["verbs"] == ["get"]
    assert not [d for d in checked_only if d["kind"] == "Role"
                and d["metadata"]["name"] == "archway-trust-path"]


def test_bootstrap_spec_refuses_what_the_command_would():
    from archway.certs.bootstrap import BootstrapError
    with pytest.raises(BootstrapError, match="archway certs bootstrap"):
        bootstrap_spec(["certs", "bootstrap", "--service=a"])
    with pytest.raises(BootstrapError, match="--days"):
        bootstrap_spec(["--service=a", "--secret=b", "--namespace=c", "--days=x"])


def test_the_gate_process_builds_the_check_from_the_config(tmp_path):
    from archway.gate.process import trust_watch
    base = {"server": {"cert_file": "/tls/tls.crt", "key_file": "/tls/tls.key"}}
    assert trust_watch(config_from_dict(base), None) is None
    watch = trust_watch(config_from_dict({**base, "kubernetes": {
        "webhook_configuration": MWC,
        "trust_repair": ["certs", "bootstrap", "--service=archway", f"--namespace={NS}",
                         f"--secret={SECRET}", f"--webhook-config={MWC}"]}}), None)
    assert watch is not None and watch.repair == SPEC
    assert (watch.cert_file, watch.key_file) == ("/tls/tls.crt", "/tls/tls.key")


def test_archway_serve_refuses_repair_arguments_the_command_would_refuse(tmp_path):
    from archway.errors import ConfigError
    from archway.main.serve import serve
    config = config_from_dict({"server": {"state_dir": str(tmp_path / "state")},
                               "kubernetes": {"enabled": "off",
                                              "trust_repair": ["certs", "bootstrap", "--days=0"]}})
    with pytest.raises(ConfigError, match="kubernetes.trust_repair: archway certs bootstrap"):
        serve(config, bind="127.0.0.1:1")      # refused before anything binds
