"""charts/archway with the real helm v3: lint --strict and template for the default values, every
TLS mode and the feature toggles; every rendered manifest validated by kubernetes-validate
(strict) for Kubernetes 1.30 and 1.33; the CRD kinds it renders checked for their required fields
here (and the alert expressions by the real promtool); the archway config it renders loaded by
archway.config; the KubeSchedulerConfiguration compared with `archway scheduler-config`."""
import base64
import functools
import json
import os
import re
import subprocess
import sys

import kubernetes_validate
import pytest
import yaml

from archway.config import config_from_dict
from archway.placement.archset import pod_arch_constraint
from archway.podview import PodView
from archway.server.master import GRACEFUL_TIMEOUT_SECONDS
from archway.vocabulary import ARCH_KEYS, SKIP_ANNOTATION
from archway.webhook.admission import parse_review, skip_reason
from lab.procs import REPO, require_binary
from tests.test_operating import declared

# Starts real servers (registries, archway serve, helm...): outside the fast inner loop.
pytestmark = pytest.mark.slow

CHART = os.path.join(REPO, "charts", "archway")
RELEASE, NS = "arch", "archway-system"
KUBE_VERSIONS = ("1.30.0", "1.33.0")
FIXTURES = os.path.join(REPO, "tests", "fixtures", "chart")
CA_B64 = base64.b64encode(b"-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----\n").decode()

CASES = {
    "default": [],
    "cert-manager": ["--set", "tls.mode=cert-manager"],
    "cert-manager-own-issuer": ["--set", "tls.mode=cert-manager",
                                "--set", "tls.certManager.issuerRef.name=corp-ca",
                                "--set", "tls.certManager.issuerRef.kind=ClusterIssuer"],
    "user-secret": ["--set", "tls.mode=secret", "--set", "tls.secretName=my-webhook-tls",
                    "--set", f"tls.secret.caBundle={CA_B64}"],
    "scheduler-on": ["--set", "scheduler.enabled=true"],
    "scheduler-name-on": ["--set", "scheduler.setSchedulerName=true",
                          "--set", "scheduler.name=arch-aware", "--set", "scheduler.extender.port=9444",
                          "--set", "scheduler.extender.nodeCacheCapable=false",
                          "--set", "scheduler.extender.weight=3",
                          "--set", "config.prometheus.url=http://prometheus.monitoring:9090"],
    "monitoring": ["--set", "metrics.serviceMonitor.enabled=true", "--set", "scheduler.enabled=true",
                   "--set", "metrics.prometheusRule.enabled=true",
                   "--set", "scheduler.extender.exposeMetrics=true"],
    "image-digest": ["--set", "image.repository=registry.example.com/platform/archway",
                     "--set", "image.tag=v1.2.3", "--set", f"image.digest=sha256:{'ab' * 32}"],
    "registry-access-eks": ["-f", os.path.join(FIXTURES, "registry-access-eks.yaml"),
                            "--set", "scheduler.enabled=true"],
    "registry-access-gke": ["-f", os.path.join(FIXTURES, "registry-access-gke.yaml"),
                            "--set", "scheduler.enabled=true"],
    "workload-identity": ["-f", os.path.join(FIXTURES, "workload-identity.yaml")],
    "arch-policy": ["--set", "scheduler.setSchedulerName=true",
                    "--set", "config.admission.mode=audit",
                    "--set", "config.admission.deny_unschedulable=true",
                    "--set", "config.placement.preferred_architectures.arm64=80",
                    "--set-json", 'config.placement.tolerations={"arm64": [{"key": '
                                  '"kubernetes.io/arch", "operator": "Equal", "value": "arm64", '
                                  '"effect": "NoSchedule"}]}'],
    "no-prewarm": ["--set", "config.registry.prewarm.enabled=false"],
    "remediation-off": ["--set", "config.registry.prewarm.enabled=false",
                        "--set", "config.remediation.learn_failed_architectures=false",
                        "--set", "config.remediation.watch_tags=false"],
    "remediation-off-prewarm-on": ["--set", "config.remediation.learn_failed_architectures=false",
                                   "--set", "config.remediation.watch_tags=false"],
    "remediation-no-evict": ["--set", "config.remediation.evict=false",
                             "--set-json", "config.extender.max_utilisation=0.8"],
    "remediation-no-logs": ["--set", "config.remediation.read_logs=false"],
    "unresolved-admit": ["--set", "config.admission.unresolved=admit",
                         "--set", "config.placement.fallback_architectures={amd64}"],
    "no-renewal-custom-config": ["--set", "tls.bootstrap.renewal.enabled=false",
                                 "--set", "config.prometheus.url=http://prometheus.monitoring:9090",
                                 "--set", "config.prometheus.window=90s",
                                 "--set", "config.extender.herd_control=false",
                                 "--set", "config.registry.insecure_hosts={registry.lab:5000}",
                                 "--set", "webhook.excludeNamespaces={kube-system,monitoring}",
                                 "--set", "scheduler.enabled=true"],
    "production": ["-f", os.path.join(FIXTURES, "production.yaml")],
    "empty-values": ["-f", os.path.join(FIXTURES, "empty-values.yaml")],
    "rbac-off": ["--set", "rbac.create=false", "--set", "scheduler.enabled=true"],
    "skip-arch-pinned": ["--set", "webhook.skipArchPinnedPods=true"],
    "debug-containers-off": ["--set", "config.admission.debug_containers=off",
                             "--set", "webhook.failurePolicy=Fail"],
    "no-crds": ["--set", "crds.install=false"],
    "registry-events": ["--set", "registryEvents.enabled=true",
                        "--set", "registryEvents.tokenSecret.name=registry-events",
                        "--set", "config.registry.events.per_source_per_second=5",
                        "--set-json", 'networkPolicy.registryEventsFrom=[{"ipBlock": '
                                      '{"cidr": "10.0.0.0/8"}}]'],
}


@pytest.fixture(scope="session")
def helm_env(tmp_path_factory):
    home = tmp_path_factory.mktemp("helm-home")
    env = {**os.environ}
    for k in ("CACHE", "CONFIG", "DATA"):
        env[f"HELM_{k}_HOME"] = str(home / k.lower())
    return env


def helm(helm_env, *args, check=True):
    return subprocess.run([require_binary("helm"), *args], capture_output=True, text=True,
                          env=helm_env, timeout=120, check=check)


@pytest.fixture(scope="session")
def render(helm_env):
    @functools.cache
    def _render(case: str, kube_version: str = "1.33.0") -> tuple:
        out = helm(helm_env, "template", RELEASE, CHART, "-n", NS, "--kube-version", kube_version,
                   *CASES[case]).stdout
        return tuple(d for d in yaml.safe_load_all(out) if d)
    return _render


def find(docs, kind, name=None):
    found = [d for d in docs if d["kind"] == kind and (name is None or d["metadata"]["name"] == name)]
    assert found, f"no {kind} {name or ''} rendered"
    return found


def one(docs, kind, name=None):
    found = find(docs, kind, name)
    assert len(found) == 1, [d["metadata"]["name"] for d in found]
    return found[0]


def archway_configs(docs) -> dict[str, dict]:
    cm = one(docs, "ConfigMap", f"{RELEASE}-archway-config")
    return {key: yaml.safe_load(text) for key, text in cm["data"].items()}


def container(deployment, name):
    return next(c for c in deployment["spec"]["template"]["spec"]["containers"] if c["name"] == name)


# --- lint, template, schema validation ---------------------------------------------------------

@pytest.mark.parametrize("case", sorted(CASES))
def test_lint_strict(helm_env, case):
    result = helm(helm_env, "lint", "--strict", CHART, "--namespace", NS, *CASES[case], check=False)
    assert result.returncode == 0, result.stdout + result.stderr


GO_DURATION = re.compile(r"^([0-9]+(\.[0-9]+)?(ns|us|µs|ms|s|m|h))+$")


def check_custom_resource(doc):
    """Required fields of the CRD kinds kubernetes-validate has no schema for."""
    kind, spec = doc["kind"], doc.get("spec") or {}
    assert doc["metadata"].get("name") and doc["metadata"].get("namespace")
    if kind == "Certificate":
        assert doc["apiVersion"] == "cert-manager.io/v1"
        assert spec["secretName"] and spec["issuerRef"]["name"]
        assert spec.get("dnsNames") or spec.get("commonName")
        assert spec["privateKey"]["algorithm"] in ("RSA", "ECDSA", "Ed25519")
        for key in ("duration", "renewBefore"):
            assert key not in spec or GO_DURATION.match(spec[key])
        assert set(spec.get("usages", [])) <= {"digital signature", "key encipherment",
                                                "server auth", "client auth", "cert sign"}
        assert set(spec) <= {"secretName", "issuerRef", "dnsNames", "commonName", "duration",
                             "renewBefore", "privateKey", "usages", "isCA", "ipAddresses",
                             "secretTemplate", "subject"}
    elif kind == "Issuer":
        assert doc["apiVersion"] == "cert-manager.io/v1"
        kinds = set(spec) & {"selfSigned", "ca", "acme", "vault", "venafi"}
        assert len(kinds) == 1 and set(spec) == kinds
        if "ca" in spec:
            assert spec["ca"]["secretName"]
    elif kind == "ServiceMonitor":
        assert doc["apiVersion"] == "monitoring.coreos.com/v1"
        assert "matchLabels" in spec["selector"] and spec["endpoints"]
        for endpoint in spec["endpoints"]:
            assert endpoint.get("port") and endpoint.get("scheme") in ("http", "https")
            assert GO_DURATION.match(endpoint.get("interval", "30s"))
            assert set(endpoint.get("tlsConfig", {})) <= {"ca", "serverName", "insecureSkipVerify"}
    elif kind == "PrometheusRule":
        assert doc["apiVersion"] == "monitoring.coreos.com/v1"
        for group in spec["groups"]:
            assert group["name"] and group["rules"]
            for rule in group["rules"]:
                assert rule["expr"] and (("alert" in rule) != ("record" in rule))
                assert GO_DURATION.match(rule.get("for", "0s"))
    else:
        pytest.fail(f"unexpected custom kind {kind}")


@pytest.mark.parametrize("kube_version", KUBE_VERSIONS)
@pytest.mark.parametrize("case", sorted(CASES))
def test_every_manifest_validates(render, case, kube_version):
    docs = render(case, kube_version)
    custom = 0
    for doc in docs:
        try:
            kubernetes_validate.validate(doc, kube_version, strict=True)
        except kubernetes_validate.SchemaNotFoundError:
            check_custom_resource(doc)
            custom += 1
        except kubernetes_validate.ValidationError as e:
            pytest.fail(f"{doc['kind']} {doc['metadata']['name']}: {e.message}")
    expected_custom = {"cert-manager": 4, "cert-manager-own-issuer": 1, "monitoring": 3,
                       "production": 3, "empty-values": 2}
    assert custom == expected_custom.get(case, 0)


def test_validation_is_really_strict(render):
    """Control: the validator used above rejects an unknown field in a rendered Deployment."""
    deployment = yaml.safe_load(yaml.safe_dump(one(render("default"), "Deployment", f"{RELEASE}-archway")))
    deployment["spec"]["template"]["spec"]["containers"][0]["readOnlyRootFileSystem"] = True
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, "1.33.0", strict=True)


def test_alert_expressions_pass_promtool(render, tmp_path):
    rule = one(render("monitoring"), "PrometheusRule")
    path = tmp_path / "rules.yaml"
    path.write_text(yaml.safe_dump({"groups": rule["spec"]["groups"]}))
    out = subprocess.run([require_binary("promtool"), "check", "rules", str(path)],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
    alerts = {r["alert"]: r["expr"] for r in rule["spec"]["groups"][0]["rules"]}
    assert set(alerts) == {"ArchwayWebhookDown", "ArchwayHighFailOpenRate", "ArchwayPrometheusDataStale",
                           "ArchwayCertificateExpiresSoon", "ArchwayPodsGatedTooLong",
                           "ArchwayImageDroppedArchitecture", "ArchwayWebhookFailingOpen",
                           "ArchwayTrustPathBroken"}
    # The apiserver's own count of fail-opens of archway's webhook, by the name it renders.
    assert 'apiserver_admission_webhook_fail_open_count{name="pods.archway.dev",type="admit"}' \
        in alerts["ArchwayWebhookFailingOpen"]
    assert "archway_trust_path_ok" in alerts["ArchwayTrustPathBroken"]
    # pods gated longer than half of admission.gate_max_seconds (120 by default)
    assert alerts["ArchwayPodsGatedTooLong"].endswith(") > 60")
    assert "archway_gate_oldest_seconds" in alerts["ArchwayPodsGatedTooLong"]
    gated = next(r for r in rule["spec"]["groups"][0]["rules"]
                 if r.get("alert") == "ArchwayPodsGatedTooLong")
    url = gated["annotations"]["runbook_url"]
    assert url.endswith("/docs/runbooks/ArchwayPodsGatedTooLong.md")
    assert os.path.exists(os.path.join(REPO, "docs", "runbooks", "ArchwayPodsGatedTooLong.md"))
    # The metric names are the ones archway exports (archway/metrics.py declares them all).
    assert 'archway_admissions_total' in alerts["ArchwayHighFailOpenRate"]
    assert 'outcome="fail_open"' in alerts["ArchwayHighFailOpenRate"]
    assert "archway_prometheus_up" in alerts["ArchwayPrometheusDataStale"]
    monitors = {m["metadata"]["name"]: m for m in find(render("monitoring"), "ServiceMonitor")}
    services = {s["metadata"]["name"] for s in find(render("monitoring"), "Service")}
    for name, job in ((f"{RELEASE}-archway", "ArchwayWebhookDown"),
                      (f"{RELEASE}-archway-scheduler-metrics", "ArchwayPrometheusDataStale")):
        assert name in services and f'job="{name}"' in alerts[job]
    assert set(monitors) == {f"{RELEASE}-archway", f"{RELEASE}-archway-scheduler"}


@pytest.mark.parametrize("values, complaint", [
    (["--set", "webhook.failurePolicy=Sometimes"], "failurePolicy"),
    (["--set", "webhook.timeoutSeconds=31"], "timeoutSeconds"),
    (["--set", "tls.mode=magic"], "mode"),
    (["--set-string", "config.admission.deadline_seconds=3"], "deadline_seconds"),
    (["--set", "config.server.bind=0.0.0.0:1"], "server"),
    (["--set", "config.prometheus.match=fuzzy"], "match"),
    (["--set", "config.prometheus.window=2 minutes"], "window"),
    (["--set", "config.extender.default_pod_bytes_per_second=0"], "default_pod_bytes_per_second"),
    (["--set", "scheduler.extender.httpTimeout=2 seconds"], "httpTimeout"),
    (["--set", "replicas=3"], "replicas"),
    (["--set", "credentialProviders.providers[0].name=ecr", "--set",
      "credentialProviders.providers[0].apiVersion=credentialprovider.kubelet.k8s.io/v9"], "apiVersion"),
    (["--set", "registryHosts.hostPath=relative/certs.d"], "hostPath"),
    (["--set", "config.registry.proxy.urls=http://p:3128"], "urls"),
    (["--set", "config.admission.mode=off"], "mode"),
    (["--set", "config.placement.preferred_architectures.arm64=101"], "arm64"),
    (["--set", "config.placement.scheduler_name=x"], "scheduler_name"),
    (["--set-json", "config.extender.max_utilisation=1.5"], "max_utilisation"),
    (["--set", "config.remediation.evict=maybe"], "evict"),
    (["--set", "config.remediation.learn=true"], "learn"),
])
def test_schema_rejects_wrong_values(helm_env, values, complaint):
    result = helm(helm_env, "lint", "--strict", CHART, *values, check=False)
    assert result.returncode != 0
    assert complaint in result.stdout + result.stderr


@pytest.mark.parametrize("values, complaint", [
    (["--set", "webhook.timeoutSeconds=3"], "must be above config.admission.deadline_seconds"),
    (["--set", "scheduler.extender.httpTimeout=2s", "--set", "scheduler.enabled=true"],
     "must be above config.extender.deadline_seconds"),
    # Which value is missing, named (helm lint only reports a template's fail as INFO).
    (["--set", "tls.mode=secret"], "tls.mode=secret needs tls.secretName (the kubernetes.io/tls "
                                   "Secret you created) and tls.secret.caBundle"),
    (["--set", "tls.mode=secret", "--set", "tls.secretName=mine"],
     "tls.mode=secret needs tls.secret.caBundle (base64 of the PEM CA that signed it)"),
    (["--set", "tls.mode=secret", "--set", f"tls.secret.caBundle={CA_B64}"],
     "tls.mode=secret needs tls.secretName (the kubernetes.io/tls Secret you created)\n"),
    (["--set", "tls.bootstrap.renewBeforeDays=400"], "renewBeforeDays must be shorter"),
    (["--set", "tls.bootstrap.caDays=380"], "caDays must cover"),
    (["--set", "credentialProviders.enabled=true", "--set", "credentialProviders.hostPath=/x"],
     "needs credentialProviders.providers"),
    (["-f", os.path.join(FIXTURES, "registry-access-eks.yaml"),
      "--set", "credentialProviders.hostPath="], "needs the plugin executables"),
])
def test_template_refuses_timeouts_without_headroom(helm_env, values, complaint):
    result = helm(helm_env, "template", RELEASE, CHART, *values, check=False)
    assert result.returncode != 0 and complaint in result.stderr


# --- what the manifests say ---------------------------------------------------------------------

def pod_webhook(mwc: dict) -> dict:
    """The webhook pods are created through (the other one is debug-containers.archway.dev)."""
    [webhook] = [w for w in mwc["webhooks"] if w["name"] == "pods.archway.dev"]
    return webhook


def test_webhook_configuration_defaults(render):
    docs = render("default")
    mwc = one(docs, "MutatingWebhookConfiguration")
    webhook = pod_webhook(mwc)
    assert webhook["failurePolicy"] == "Ignore"
    assert webhook["sideEffects"] == "None"
    assert webhook["admissionReviewVersions"] == ["v1", "v1beta1"]
    assert webhook["reinvocationPolicy"] == "IfNeeded"
    assert webhook["rules"] == [{"operations": ["CREATE"], "apiGroups": [""], "apiVersions": ["v1"],
                                 "resources": ["pods"], "scope": "Namespaced"}]
    config = config_from_dict(archway_configs(docs)["webhook.yaml"])
    assert webhook["timeoutSeconds"] > config.admission.deadline_seconds
    [expression] = webhook["namespaceSelector"]["matchExpressions"]
    assert expression == {"key": "kubernetes.io/metadata.name", "operator": "NotIn",
                          "values": ["kube-system", NS]}
    assert set(config.admission.exclude_namespaces) == {"kube-system", NS}
    assert webhook["objectSelector"]["matchExpressions"] == [
        {"key": "archway.dev/skip", "operator": "NotIn", "values": ["true"]}]
    # It points at the Service, whose port reaches the container the config binds.
    service = one(docs, "Service", webhook["clientConfig"]["service"]["name"])
    assert webhook["clientConfig"]["service"] == {"name": service["metadata"]["name"], "namespace": NS,
                                                  "path": "/mutate", "port": service["spec"]["ports"][0]["port"]}
    deployment = one(docs, "Deployment", f"{RELEASE}-archway")
    port = container(deployment, "webhook")["ports"][0]
    assert service["spec"]["ports"][0]["targetPort"] == port["name"]
    assert config.server.bind == f"0.0.0.0:{port['containerPort']}" and config.server.tls


def test_webhook_deployment_hardening(render):
    docs = render("default")
    deployment = one(docs, "Deployment", f"{RELEASE}-archway")
    pod = deployment["spec"]["template"]["spec"]
    assert deployment["spec"]["replicas"] == 2
    assert pod["securityContext"]["runAsNonRoot"] is True
    keys = {c["topologyKey"] for c in pod["topologySpreadConstraints"]}
    assert keys == {"kubernetes.io/hostname", "topology.kubernetes.io/zone"}
    assert all(c["whenUnsatisfiable"] == "ScheduleAnyway" for c in pod["topologySpreadConstraints"])
    c = container(deployment, "webhook")
    assert c["securityContext"]["readOnlyRootFilesystem"] is True
    assert c["securityContext"]["allowPrivilegeEscalation"] is False
    assert c["resources"]["requests"]["cpu"] and c["resources"]["requests"]["memory"]
    assert c["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "https", "scheme": "HTTPS"}
    assert c["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "https", "scheme": "HTTPS"}
    # Writable places on a read-only root: /tmp (TMPDIR: the metrics dir) and the state dir.
    config = config_from_dict(archway_configs(docs)["webhook.yaml"])
    mounts = {m["mountPath"]: m for m in c["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert "emptyDir" in volumes[mounts["/tmp"]["name"]]
    assert "emptyDir" in volumes[mounts[config.server.state_dir]["name"]]
    assert {"name": "TMPDIR", "value": "/tmp"} in c["env"]
    # The certificate files the config names are the mounted Secret's items.
    tls_mount = mounts[os.path.dirname(config.server.cert_file)]
    secret = volumes[tls_mount["name"]]["secret"]
    assert secret["secretName"] == f"{RELEASE}-archway-tls"
    assert {i["path"] for i in secret["items"]} == {os.path.basename(config.server.cert_file),
                                                   os.path.basename(config.server.key_file)}
    pdb = one(docs, "PodDisruptionBudget")
    assert pdb["spec"]["maxUnavailable"] == 1 and "minAvailable" not in pdb["spec"]
    assert pdb["spec"]["selector"]["matchLabels"].items() <= \
        deployment["spec"]["template"]["metadata"]["labels"].items()
    # Config changes roll the pods.
    assert "checksum/config" in deployment["spec"]["template"]["metadata"]["annotations"]


def test_archway_config_loads_and_passes_values_through(render):
    configs = archway_configs(render("no-renewal-custom-config"))
    webhook = config_from_dict(configs["webhook.yaml"], origin="webhook.yaml")
    extender = config_from_dict(configs["extender.yaml"], origin="extender.yaml")
    for config in (webhook, extender):
        assert config.prometheus.url == "http://prometheus.monitoring:9090"
        assert config.registry.insecure_hosts == ("registry.lab:5000",)
        assert set(config.admission.exclude_namespaces) == {"kube-system", "monitoring", NS}
    assert extender.server.tls is False and extender.server.bind == "127.0.0.1:8444"
    assert extender.prometheus.window == "90s" and extender.extender.herd_control is False
    assert webhook.placement.scheduler_name is None          # default: never a Pending pod


def test_arch_policy_values_reach_the_webhook_config(render):
    webhook = config_from_dict(archway_configs(render("arch-policy"))["webhook.yaml"])
    assert webhook.admission.mode == "audit" and webhook.admission.deny_unschedulable
    assert webhook.placement.preferred_architectures == (("arm64", 80),)
    assert webhook.placement.tolerations == (("arm64", ({
        "key": "kubernetes.io/arch", "operator": "Equal", "value": "arm64",
        "effect": "NoSchedule"},)),)
    assert webhook.placement.scheduler_name == "archway-scheduler"   # merged, not replaced


def test_bootstrap_mode_jobs_and_rbac(render):
    docs = render("default")
    mwc = one(docs, "MutatingWebhookConfiguration")
    assert "caBundle" not in mwc["webhooks"][0]["clientConfig"]
    assert "cert-manager.io/inject-ca-from" not in mwc["metadata"].get("annotations", {})
    jobs = {j["metadata"]["name"]: j for j in find(docs, "Job") if "certgen" in j["metadata"]["name"]}
    assert set(jobs) == {f"{RELEASE}-archway-certgen-create", f"{RELEASE}-archway-certgen-patch"}
    hooks = {n: j["metadata"]["annotations"]["helm.sh/hook"] for n, j in jobs.items()}
    assert hooks[f"{RELEASE}-archway-certgen-create"] == "pre-install,pre-upgrade"
    assert hooks[f"{RELEASE}-archway-certgen-patch"] == "post-install,post-upgrade"
    deployment = one(docs, "Deployment", f"{RELEASE}-archway")
    secret_name = next(v["secret"]["secretName"] for v in deployment["spec"]["template"]["spec"]["volumes"]
                       if "secret" in v)
    for name, job in jobs.items():
        pod = job["spec"]["template"]["spec"]
        args = pod["containers"][0]["args"]
        assert args[:2] == ["certs", "bootstrap"]
        assert f"--secret={secret_name}" in args
        assert f"--webhook-config={mwc['metadata']['name']}" in args
        assert f"--service={mwc['webhooks'][0]['clientConfig']['service']['name']}" in args
        assert f"--namespace={NS}" in args
        assert ("--allow-missing-webhook-config" in args) == name.endswith("-create")
        # The hook Jobs run under the hook ServiceAccount, created before them.
        sa = one(docs, "ServiceAccount", pod["serviceAccountName"])
        assert sa["metadata"]["annotations"]["helm.sh/hook-weight"] == "-10"
        assert "pre-install" in sa["metadata"]["annotations"]["helm.sh/hook"]
    cron = one(docs, "CronJob")
    assert cron["spec"]["jobTemplate"]["spec"]["template"]["spec"]["serviceAccountName"] == f"{RELEASE}-archway-certgen"

    # Least privilege: the certgen roles touch two Secrets and one webhook configuration.
    for role in find(docs, "ClusterRole"):
        if "certgen" in role["metadata"]["name"]:
            assert role["rules"] == [{"apiGroups": ["admissionregistration.k8s.io"],
                                      "resources": ["mutatingwebhookconfigurations"],
                                      "resourceNames": [mwc["metadata"]["name"]],
                                      "verbs": ["get", "patch"]}]
    for role in find(docs, "Role"):
        if "certgen" in role["metadata"]["name"]:
            named = [r for r in role["rules"] if "resourceNames" in r]
            assert named == [{"apiGroups": [""], "resources": ["secrets"],
                              "resourceNames": [secret_name, f"{secret_name}-ca"],
                              "verbs": ["get", "update"]}]
    reader = one(docs, "ClusterRole", f"{RELEASE}-archway-pull-secret-reader")
    assert reader["rules"] == [{"apiGroups": [""], "resources": ["serviceaccounts"],
                                "verbs": ["get", "list", "watch"]},
                               # secrets: no longer here (rbac.pullSecretNamespaces)
                               {"apiGroups": [""], "resources": ["namespaces", "nodes"],
                                "verbs": ["list", "watch"]},
                               {"apiGroups": ["networking.k8s.io"], "resources": ["servicecidrs"],
                                "verbs": ["list"]},
                               # pre-warming (config.registry.prewarm.enabled, on by default)
                               {"apiGroups": [""], "resources": ["pods"], "verbs": ["list"]},
                               # and the workload caches (config.remediation, on by default)
                               {"apiGroups": ["apps"], "resources": ["deployments", "statefulsets",
                                                                     "daemonsets", "replicasets"],
                                "verbs": ["list", "watch"]},
                               {"apiGroups": ["batch"], "resources": ["jobs", "cronjobs"],
                                "verbs": ["list", "watch"]}]


def test_cert_manager_mode(render):
    docs = render("cert-manager")
    mwc = one(docs, "MutatingWebhookConfiguration")
    namespace, name = mwc["metadata"]["annotations"]["cert-manager.io/inject-ca-from"].split("/")
    serving = one(docs, "Certificate", name)
    assert namespace == NS and serving["metadata"]["namespace"] == NS
    service = mwc["webhooks"][0]["clientConfig"]["service"]["name"]
    assert serving["spec"]["dnsNames"] == [service, f"{service}.{NS}", f"{service}.{NS}.svc",
                                           f"{service}.{NS}.svc.cluster.local"]
    assert "server auth" in serving["spec"]["usages"]
    deployment = one(docs, "Deployment", f"{RELEASE}-archway")
    volumes = deployment["spec"]["template"]["spec"]["volumes"]
    assert serving["spec"]["secretName"] in [v["secret"]["secretName"] for v in volumes if "secret" in v]
    # The chain: self-signed Issuer -> CA Certificate -> CA Issuer -> serving Certificate.
    issuer = one(docs, "Issuer", serving["spec"]["issuerRef"]["name"])
    ca_cert = next(c for c in find(docs, "Certificate") if c["spec"].get("isCA"))
    assert issuer["spec"]["ca"]["secretName"] == ca_cert["spec"]["secretName"]
    assert one(docs, "Issuer", ca_cert["spec"]["issuerRef"]["name"])["spec"] == {"selfSigned": {}}
    # no certgen Job (the only Jobs are the uninstall hooks: gated pods released, Leases deleted)
    assert sorted(d["metadata"]["name"] for d in docs if d["kind"] in ("Job", "CronJob")) == [
        f"{RELEASE}-archway-cleanup", f"{RELEASE}-archway-gate-release"]

    own = render("cert-manager-own-issuer")
    assert [d["kind"] for d in own if d["kind"] in ("Issuer", "Certificate")] == ["Certificate"]
    assert one(own, "Certificate")["spec"]["issuerRef"] == {"name": "corp-ca", "kind": "ClusterIssuer"}


def test_user_secret_mode(render):
    docs = render("user-secret")
    mwc = one(docs, "MutatingWebhookConfiguration")
    assert mwc["webhooks"][0]["clientConfig"]["caBundle"] == CA_B64
    deployment = one(docs, "Deployment", f"{RELEASE}-archway")
    assert "my-webhook-tls" in [v["secret"]["secretName"]
                                for v in deployment["spec"]["template"]["spec"]["volumes"] if "secret" in v]
    assert [d["metadata"]["name"] for d in docs
            if d["kind"] in ("Job", "CronJob", "Certificate", "Issuer")] == [
        f"{RELEASE}-archway-cleanup", f"{RELEASE}-archway-gate-release"]


def expected_scheduler_config(**kwargs):
    from archway.extender.schedconfig import build_scheduler_config
    return build_scheduler_config(**kwargs)


def key_order(value):
    """Keys in document order at every level, to compare layouts and not only contents."""
    if isinstance(value, dict):
        return [(k, key_order(v)) for k, v in value.items()]
    if isinstance(value, list):
        return [key_order(v) for v in value]
    return None


@pytest.mark.parametrize("case, kwargs", [
    # No config.prometheus.url: no score signal, so no prioritizeVerb (a neutral call per pod).
    ("scheduler-on", dict(http_timeout="3s", lease_namespace=NS, prioritize=False)),
    ("scheduler-name-on", dict(scheduler_name="arch-aware", lease_name="arch-aware",
                               extender_url="http://127.0.0.1:9444/scheduler", weight=3,
                               node_cache_capable=False, http_timeout="3s", lease_namespace=NS)),
])
def test_scheduler_config_matches_archway_scheduler_config(render, case, kwargs):
    docs = render(case)
    scheduler = one(docs, "Deployment", f"{RELEASE}-archway-scheduler")
    cm = one(docs, "ConfigMap", f"{RELEASE}-archway-scheduler")
    rendered = yaml.safe_load(cm["data"]["scheduler-config.yaml"])
    expected = expected_scheduler_config(**kwargs)
    assert rendered == expected and key_order(rendered) == key_order(expected)

    # The scheduler container reads exactly that file.
    kube_scheduler = container(scheduler, "kube-scheduler")
    mount = next(m for m in kube_scheduler["volumeMounts"] if m["name"] == "scheduler-config")
    assert f"--config={mount['mountPath']}/scheduler-config.yaml" in kube_scheduler["command"]
    assert kube_scheduler["image"].startswith("registry.k8s.io/kube-scheduler:v1.33.")

    # The extender URL is the sidecar's own bind address, and the verbs are archway's routes.
    [extender] = rendered["extenders"]
    sidecar = config_from_dict(archway_configs(docs)["extender.yaml"])
    assert sidecar.server.tls is False
    assert extender["urlPrefix"] == f"http://{sidecar.server.bind}/scheduler"
    assert container(scheduler, "extender")["args"] == ["--config", "/etc/archway/config/extender.yaml", "serve"]
    # Each deployment serves its own product only: the sidecar no /mutate, the webhook no
    # extender routes; both their health and metrics.
    from archway.main.worker import build_worker
    routes = {route.path for route in build_worker(sidecar).site.routes.routes()}
    assert routes == {f"/scheduler/{extender['filterVerb']}",
                      f"/scheduler/{extender.get('prioritizeVerb', 'prioritize')}",
                      "/healthz", "/readyz", "/metrics"}
    assert ("prioritizeVerb" in extender) == bool(sidecar.prometheus.url)

    # The profile's name is the one the webhook injects (when it injects one).
    webhook = config_from_dict(archway_configs(docs)["webhook.yaml"])
    webhook_routes = {route.path for route in build_worker(webhook).site.routes.routes()}
    assert webhook_routes == {"/mutate", "/healthz", "/readyz", "/metrics"}
    [profile] = rendered["profiles"]
    if case == "scheduler-name-on":
        assert webhook.placement.scheduler_name == profile["schedulerName"] == "arch-aware"
    else:
        assert webhook.placement.scheduler_name is None

    # Its lease: the Role grants exactly the lease leader election uses, where it uses it.
    election = rendered["leaderElection"]
    lease_role = one(docs, "Role", f"{RELEASE}-archway-scheduler-lease")
    assert lease_role["metadata"]["namespace"] == election["resourceNamespace"]
    assert [election["resourceName"]] in [r.get("resourceNames") for r in lease_role["rules"]]


def test_second_scheduler_rbac(render):
    docs = render("scheduler-on")
    sa = f"{RELEASE}-archway-scheduler"
    subject = {"kind": "ServiceAccount", "name": sa, "namespace": NS}
    bound = {b["roleRef"]["name"] for b in find(docs, "ClusterRoleBinding") if subject in b["subjects"]}
    assert {"system:kube-scheduler", "system:volume-scheduler"} <= bound
    reader = one(docs, "RoleBinding", f"{sa}-authentication-reader")
    assert reader["metadata"]["namespace"] == "kube-system"
    assert reader["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role",
                                 "name": "extension-apiserver-authentication-reader"}
    assert subject in reader["subjects"]
    scheduler = one(docs, "Deployment", sa)
    assert scheduler["spec"]["template"]["spec"]["serviceAccountName"] == sa

    off = render("default")          # not used by the webhook, not asked for: not installed
    assert not [d for d in off if "scheduler" in d["metadata"]["name"]]
    assert set(archway_configs(off)) == {"webhook.yaml"}


def test_monitoring_scrapes_the_webhook_over_verified_tls(render):
    docs = render("monitoring")
    monitor = one(docs, "ServiceMonitor", f"{RELEASE}-archway")
    service = one(docs, "Service", f"{RELEASE}-archway")
    assert monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    [endpoint] = monitor["spec"]["endpoints"]
    # /metrics on the metrics-only port, not on the port the apiserver calls
    assert [p["name"] for p in service["spec"]["ports"]] == ["https", "https-metrics"]
    assert endpoint["port"] == "https-metrics" and endpoint["path"] == "/metrics"
    assert endpoint["tlsConfig"]["ca"]["secret"] == {"name": f"{RELEASE}-archway-tls", "key": "ca.crt"}
    assert endpoint["tlsConfig"]["serverName"] == f"{RELEASE}-archway.{NS}.svc"
    sidecar = config_from_dict(archway_configs(docs)["extender.yaml"])
    # exposeMetrics: the metrics address is reachable for scraping, the extender routes are not
    assert sidecar.server.bind == "127.0.0.1:8444" and sidecar.server.metrics_bind == "0.0.0.0:8445"
    extender_monitor = one(docs, "ServiceMonitor", f"{RELEASE}-archway-scheduler")
    extender_service = one(docs, "Service", f"{RELEASE}-archway-scheduler-metrics")
    [endpoint] = extender_monitor["spec"]["endpoints"]
    [port] = extender_service["spec"]["ports"]
    sidecar_ports = container(one(docs, "Deployment", f"{RELEASE}-archway-scheduler"),
                              "extender")["ports"]
    assert endpoint["port"] == port["name"] and sidecar_ports == [
        {"name": port["targetPort"], "containerPort": 8445, "protocol": "TCP"}]


# --- registry access as the nodes have it --------------------------------------------------------

def pods(docs):
    return {d["metadata"]["name"]: d["spec"]["template"]["spec"] for d in find(docs, "Deployment")}


def test_credential_providers_get_the_kubelets_files_in_every_archway_pod(render):
    from archway.registry.providerconfig import parse_provider_config
    docs = render("registry-access-eks")
    raw = one(docs, "ConfigMap", f"{RELEASE}-archway-config")["data"]["credential-providers.yaml"]
    (spec,) = parse_provider_config(raw.encode(), "rendered")   # archway's own strict reader
    assert spec.name == "ecr-credential-provider" and spec.default_cache_duration == 12 * 3600
    for name, archway_container in ((f"{RELEASE}-archway", "webhook"),
                                    (f"{RELEASE}-archway-scheduler", "extender")):
        pod = pods(docs)[name]
        config = config_from_dict(archway_configs(docs)[
            "webhook.yaml" if archway_container == "webhook" else "extender.yaml"])
        providers = config.registry.credential_providers
        mounts = {m["mountPath"]: m for m in container(
            one(docs, "Deployment", name), archway_container)["volumeMounts"]}
        volumes = {v["name"]: v for v in pod["volumes"]}
        config_mount = mounts[os.path.dirname(providers.config)]
        assert config_mount["readOnly"] and volumes[config_mount["name"]]["configMap"]["items"] == [
            {"key": "credential-providers.yaml", "path": os.path.basename(providers.config)}]
        bin_mount = mounts[providers.bin_dir]
        assert bin_mount["readOnly"]
        assert volumes[bin_mount["name"]]["hostPath"] == {
            "path": "/etc/eks/image-credential-provider", "type": "Directory"}
        # The node's certs.d, read-only at the same path, is the hosts_dir.
        assert config.registry.hosts_dir == "/etc/containerd/certs.d"
        assert mounts["/etc/containerd/certs.d"]["readOnly"]
        assert volumes[mounts["/etc/containerd/certs.d"]["name"]]["hostPath"]["path"] == \
            "/etc/containerd/certs.d"
        assert config.registry.proxy.url == "http://egress.corp.example:3128"
        assert "initContainers" not in pod
    for account in find(docs, "ServiceAccount"):
        if account["metadata"]["name"] in (f"{RELEASE}-archway", f"{RELEASE}-archway-scheduler"):
            assert account["metadata"]["annotations"] == {
                "eks.amazonaws.com/role-arn": "arn:aws:iam::111122223333:role/archway-ecr-read"}


def test_a_token_mode_provider_reaches_archway_with_its_namespaces_and_rights(render):
    from archway.registry.providerconfig import parse_provider_config
    docs = render("workload-identity")
    raw = one(docs, "ConfigMap", f"{RELEASE}-archway-config")["data"]["credential-providers.yaml"]
    (spec,) = parse_provider_config(raw.encode(), "rendered")
    assert spec.token.audience == "registry.corp.example" and spec.token.cache_type == "ServiceAccount"
    assert spec.token.required_annotations == ("registry.corp.example/robot",)
    config = config_from_dict(archway_configs(docs)["webhook.yaml"])
    assert config.kubernetes.service_account_token_namespaces == ("shop", "team-a")
    bound = sorted(d["metadata"]["namespace"] for d in find(docs, "RoleBinding")
                   if d["roleRef"]["name"] == f"{RELEASE}-archway-token-requester")
    assert bound == ["shop", "team-a"]


def test_provider_binaries_from_an_init_container(render):
    docs = render("registry-access-gke")
    for name in (f"{RELEASE}-archway", f"{RELEASE}-archway-scheduler"):
        pod = pods(docs)[name]
        (init,) = pod["initContainers"]
        assert init["name"] == "install-auth-provider-gcp"
        assert init["volumeMounts"] == [{"name": "credential-provider-bin", "mountPath": "/providers"}]
        volumes = {v["name"]: v for v in pod["volumes"]}
        assert "emptyDir" in volumes["credential-provider-bin"]
        assert not any("hostPath" in v for v in pod["volumes"])   # no node mount unless asked
    config = config_from_dict(archway_configs(docs)["webhook.yaml"])
    assert config.registry.credential_providers.timeout_seconds == 5
    assert config.registry.hosts_dir is None


def test_no_host_mounts_and_no_annotations_by_default(render):
    docs = render("default")
    for pod in pods(docs).values():
        assert not any("hostPath" in v for v in pod.get("volumes", []))
        assert "initContainers" not in pod
    assert all("annotations" not in sa["metadata"] or "helm.sh/hook" in sa["metadata"]["annotations"]
               for sa in find(docs, "ServiceAccount"))
    assert "credential-providers.yaml" not in archway_configs(docs)


# --- the archway image: repository, tag or digest; the Dockerfile's user --------------------------

# --- hardening: where archway's own pods run, how they stop, what they cost -------------------

ARCHWAY_IMAGE = "ghcr.io/archway/archway:"


def archway_pod_specs(docs) -> dict[str, dict]:
    """Every pod spec that runs the archway image: Deployments, hook Jobs, the renewal CronJob."""
    specs = {}
    for doc in docs:
        if doc["kind"] in ("Deployment", "Job"):
            spec = doc["spec"]["template"]["spec"]
        elif doc["kind"] == "CronJob":
            spec = doc["spec"]["jobTemplate"]["spec"]["template"]["spec"]
        else:
            continue
        if any(c["image"].startswith(ARCHWAY_IMAGE) for c in spec["containers"]):
            specs[f"{doc['kind']} {doc['metadata']['name']}"] = spec
    return specs


@pytest.mark.parametrize("case, archs", [("default", {"amd64", "arm64"}), ("production", {"arm64"}),
                                         ("empty-values", {"amd64", "arm64"})])
def test_archway_pods_run_only_where_the_image_can(render, case, archs):
    """Read by archway's own placement logic: every pod running the archway image is limited to
    linux nodes of the image's architectures, whatever node affinity the values add."""
    docs = render(case)
    specs = archway_pod_specs(docs)
    expected = {"Deployment arch-archway", "Job arch-archway-certgen-create",
                "Job arch-archway-certgen-patch", "CronJob arch-archway-certgen-renew",
                "Job arch-archway-gate-release", "Job arch-archway-cleanup"}
    if case != "default":
        expected.add("Deployment arch-archway-scheduler")
    assert set(specs) == expected
    for name, spec in specs.items():
        pod = PodView.of({"metadata": {"name": "x"}, "spec": spec}, namespace=NS)
        assert pod.node_selector["kubernetes.io/os"] == "linux", name
        constraint = pod_arch_constraint(pod)
        assert constraint is not None and not constraint.complement, name
        assert constraint.values == frozenset(archs), name
    if case == "production":
        webhook = specs["Deployment arch-archway"]
        # The user's terms are kept (ORed zones, the matchFields) and each one gains the arch.
        terms = webhook["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][
            "nodeSelectorTerms"]
        assert [t["matchExpressions"][0]["values"] for t in terms] == [["zone-a"], ["zone-b"]]
        assert terms[1]["matchFields"] == [{"key": "metadata.name", "operator": "NotIn",
                                            "values": ["old-node"]}]
        assert "podAntiAffinity" in webhook["affinity"]
        assert webhook["nodeSelector"]["node-role.kubernetes.io/infra"] == ""
        for job in ("Job arch-archway-certgen-create", "CronJob arch-archway-certgen-renew"):
            assert specs[job]["priorityClassName"] == "system-cluster-critical"
            assert specs[job]["tolerations"] == [{"key": "infra", "operator": "Exists",
                                                  "effect": "NoSchedule"}]
            assert specs[job]["nodeSelector"]["node-role.kubernetes.io/infra"] == ""


@pytest.mark.parametrize("case", ["default", "production"])
def test_archway_never_admits_its_own_pods(render, case):
    docs = render(case)
    webhook = pod_webhook(one(docs, "MutatingWebhookConfiguration"))
    excluded = webhook["namespaceSelector"]["matchExpressions"][0]
    assert excluded["operator"] == "NotIn" and NS in excluded["values"]
    # Belt and braces: its pods carry the label the objectSelector leaves out.
    [skip] = webhook["objectSelector"]["matchExpressions"]
    for name in ("arch-archway", "arch-archway-scheduler"):
        if case == "default" and name.endswith("scheduler"):
            continue
        labels = one(docs, "Deployment", name)["spec"]["template"]["metadata"]["labels"]
        assert skip["operator"] == "NotIn" and labels[skip["key"]] in skip["values"]


def test_architectures_must_be_listed(helm_env):
    result = helm(helm_env, "template", RELEASE, CHART, "--set", "image.architectures=null",
                  check=False)
    assert result.returncode != 0 and "architectures" in result.stderr


# Pods as the apiserver hands them to the webhook (tests/fixtures/admission), and variants.
def _fixture_pod(name):
    with open(os.path.join(REPO, "tests", "fixtures", "admission", name)) as f:
        return json.load(f)["request"]["object"]


def _pod(annotations=None, node_name=None, node_selector=None):
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p", "namespace": "team"},
           "spec": {"containers": [{"name": "c", "image": "reg.example/app:1"}]}}
    if annotations is not None:
        pod["metadata"]["annotations"] = annotations
    if node_name is not None:
        pod["spec"]["nodeName"] = node_name
    if node_selector is not None:
        pod["spec"]["nodeSelector"] = node_selector
    return pod


CEL_PODS = {
    "plain": _pod(),
    "fixture-multiarch": _fixture_pod("v1-pod-multiarch.json"),
    "fixture-opted-out": _fixture_pod("v1-pod-opted-out.json"),
    "fixture-bound-to-node": _fixture_pod("v1-pod-bound-to-node.json"),
    "fixture-existing-nodeselector": _fixture_pod("v1-pod-existing-nodeselector.json"),
    "skip-true": _pod(annotations={"archway.dev/skip": "true"}),
    "skip-false": _pod(annotations={"archway.dev/skip": "false"}),
    "skip-True": _pod(annotations={"archway.dev/skip": "True"}),
    "other-annotations": _pod(annotations={"team": "a"}),
    "empty-annotations": _pod(annotations={}),
    "node-name": _pod(node_name="worker-1"),
    "empty-node-name": _pod(node_name=""),
    "arch-pinned": _pod(node_selector={"kubernetes.io/arch": "arm64"}),
    "beta-arch-pinned": _pod(node_selector={"beta.kubernetes.io/arch": "amd64"}),
    "os-pinned": _pod(node_selector={"kubernetes.io/os": "linux"}),
    "empty-selector": _pod(node_selector={}),
}


def _archway_skips(pod: dict, *, arch_pinned_too: bool) -> bool:
    """What archway itself does with the pod: skip_reason (webhook/admission.py) and, for the
    optional condition, the nodeSelector part of placement's pod_arch_constraint."""
    review = {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
              "request": {"uid": "u", "operation": "CREATE", "namespace": "team",
                          "resource": {"group": "", "version": "v1", "resource": "pods"},
                          "object": pod}}
    request = parse_review(json.dumps(review).encode(), 1 << 20)
    if skip_reason(request, ()) is not None:
        return True
    view = PodView.of(pod, namespace="team")
    return arch_pinned_too and any(key in view.node_selector for key in ARCH_KEYS)


@pytest.mark.parametrize("case, arch_pinned_too", [("default", False), ("skip-arch-pinned", True)])
def test_match_conditions_send_exactly_the_pods_archway_would_decide(render, case, arch_pinned_too):
    """The rendered CEL, evaluated by a CEL implementation (cel-python) on real and edge-case
    pods, calls the webhook exactly when archway would not skip the pod anyway."""
    celpy = pytest.importorskip("celpy", reason="pip install cel-python (in the test extras)")
    webhook = pod_webhook(one(render(case), "MutatingWebhookConfiguration"))
    conditions = webhook["matchConditions"]
    assert len({c["name"] for c in conditions}) == len(conditions) <= 64
    env = celpy.Environment()
    programs = [env.program(env.compile(c["expression"])) for c in conditions]
    assert len(programs) == (3 if arch_pinned_too else 2)
    for name, pod in CEL_PODS.items():
        activation = {"object": celpy.json_to_cel(pod)}
        results = [program.evaluate(activation) for program in programs]
        assert all(isinstance(r, celpy.celtypes.BoolType) for r in results), (name, results)
        called = all(results)
        assert called == (not _archway_skips(pod, arch_pinned_too=arch_pinned_too)), name
    # The annotation the expressions name is the one archway reads.
    assert f"'{SKIP_ANNOTATION}'" in conditions[0]["expression"]


def debug_webhook(mwc: dict) -> dict | None:
    found = [w for w in mwc["webhooks"] if w["name"] == "debug-containers.archway.dev"]
    return found[0] if found else None


@pytest.mark.parametrize("case", ["default", "user-secret", "production", "debug-containers-off"])
def test_debug_containers_have_a_webhook_of_their_own(render, case):
    """kubectl debug's UPDATE of pods/ephemeralcontainers reaches archway through a second
    webhook: the pod webhook's conditions leave bound pods out, and a debugging session must
    never wait on archway being up (Ignore, whatever webhook.failurePolicy says)."""
    mwc = one(render(case), "MutatingWebhookConfiguration")
    pods, debug = pod_webhook(mwc), debug_webhook(mwc)
    assert pods["rules"] == [{"operations": ["CREATE"], "apiGroups": [""], "apiVersions": ["v1"],
                              "resources": ["pods"], "scope": "Namespaced"}]
    if case == "debug-containers-off":
        assert debug is None and len(mwc["webhooks"]) == 1 and pods["failurePolicy"] == "Fail"
        config = config_from_dict(archway_configs(render(case))["webhook.yaml"])
        assert config.admission.debug_containers == "off"
        return
    assert debug is not None and len(mwc["webhooks"]) == 2
    assert debug["rules"] == [{"operations": ["UPDATE"], "apiGroups": [""], "apiVersions": ["v1"],
                               "resources": ["pods/ephemeralcontainers"], "scope": "Namespaced"}]
    assert debug["failurePolicy"] == "Ignore" and debug["reinvocationPolicy"] == "Never"
    for same in ("clientConfig", "namespaceSelector", "objectSelector", "timeoutSeconds",
                 "sideEffects", "admissionReviewVersions"):
        assert debug[same] == pods[same], same
    # Sent only for bound pods that do not opt out, where archway would check something.
    celpy = pytest.importorskip("celpy", reason="pip install cel-python (in the test extras)")
    env = celpy.Environment()
    programs = [env.program(env.compile(c["expression"])) for c in debug["matchConditions"]]
    for name, pod in CEL_PODS.items():
        called = all(p.evaluate({"object": celpy.json_to_cel(pod)}) for p in programs)
        skipped = (pod["metadata"].get("annotations") or {}).get(SKIP_ANNOTATION) == "true" \
            or not pod["spec"].get("nodeName")
        assert called == (not skipped), name


def test_coverage_counts_only_the_pod_webhook(render):
    """The gate controller's coverage (gate/coverage.py) reads the pod CREATE webhook alone."""
    from archway.gate.coverage import pod_webhooks
    mwc = one(render("default"), "MutatingWebhookConfiguration")
    assert [w["name"] for w in pod_webhooks(mwc)] == ["pods.archway.dev"]


@pytest.mark.parametrize("values, complaint", [
    (["--set", "webhook.skipArchPinnedPods=true", "--set", "scheduler.setSchedulerName=true"],
     "cannot be used with scheduler.setSchedulerName"),
    (["--set", "webhook.skipArchPinnedPods=true", "--set", "config.admission.deny_on_conflict=true"],
     "cannot be used with config.admission.deny_on_conflict"),
    (["--set", "webhook.replicas=1", "--set", "webhook.podDisruptionBudget.minAvailable=1"],
     "minAvailable (1) must be below webhook.replicas (1)"),
    (["--set", "webhook.podDisruptionBudget.minAvailable=100%"], "must be below webhook.replicas"),
    (["--set", "webhook.terminationGracePeriodSeconds=12"],
     "terminationGracePeriodSeconds (12) must exceed webhook.preStopSleepSeconds (5) + 10 s"),
    (["--set", "scheduler.enabled=true", "--set", "scheduler.image.tag=v1.34.0"],
     "scheduler.image.tag v1.34.0 is newer than the cluster (v1.33.0)"),
])
def test_template_refuses_values_that_break_operations(helm_env, values, complaint):
    result = helm(helm_env, "template", RELEASE, CHART, "--kube-version", "1.33.0", *values,
                  check=False)
    assert result.returncode != 0 and complaint in result.stderr, result.stderr


@pytest.mark.parametrize("replicas", [1, 2, 3])
def test_disruption_budget_never_blocks_a_drain(helm_env, replicas):
    out = helm(helm_env, "template", RELEASE, CHART, "--set", f"webhook.replicas={replicas}",
               "--show-only", "templates/pdb.yaml").stdout
    pdb = yaml.safe_load(out)
    kubernetes_validate.validate(pdb, "1.30.0", strict=True)
    # With every replica ready one eviction is always allowed; a pod that is not ready can go.
    assert pdb["spec"]["maxUnavailable"] == 1
    assert pdb["spec"]["unhealthyPodEvictionPolicy"] == "AlwaysAllow"
    # minAvailable below the replica count is kept as given.
    if replicas > 1:
        out = helm(helm_env, "template", RELEASE, CHART, "--set", f"webhook.replicas={replicas}",
                   "--set", f"webhook.podDisruptionBudget.minAvailable={replicas - 1}",
                   "--show-only", "templates/pdb.yaml").stdout
        assert yaml.safe_load(out)["spec"]["minAvailable"] == replicas - 1


@pytest.mark.parametrize("case", ["default", "production"])
def test_a_rollout_drops_no_admission(render, case):
    """Stopping pod: preStop keeps it serving while its endpoint is withdrawn, then gunicorn
    finishes what is in flight within its graceful timeout, all inside the grace period."""
    deployment = one(render(case), "Deployment", f"{RELEASE}-archway")
    pod = deployment["spec"]["template"]["spec"]
    sleep = container(deployment, "webhook")["lifecycle"]["preStop"]["sleep"]["seconds"]
    assert sleep >= 5
    assert pod["terminationGracePeriodSeconds"] > sleep + GRACEFUL_TIMEOUT_SECONDS
    rolling = deployment["spec"]["strategy"]["rollingUpdate"]
    if pod.get("hostNetwork"):
        # A surge pod would find its host port taken on every node already running one: one
        # pod at a time, while the others (replicas > 1) serve.
        assert (rolling["maxUnavailable"], rolling["maxSurge"]) == (1, 0)
        assert deployment["spec"]["replicas"] > 1
    else:
        assert (rolling["maxUnavailable"], rolling["maxSurge"]) == (0, 1)


@pytest.mark.parametrize("kube_version, tag", [("1.30.0", "v1.30.0"), ("1.33.0", "v1.33.0"),
                                               ("v1.31.4-eks-a737599", "v1.31.4")])
def test_second_scheduler_follows_the_cluster_version(helm_env, kube_version, tag):
    out = helm(helm_env, "template", RELEASE, CHART, "--kube-version", kube_version,
               "--set", "scheduler.setSchedulerName=true",
               "--show-only", "templates/scheduler/deployment.yaml").stdout
    scheduler = yaml.safe_load(out)
    assert container(scheduler, "kube-scheduler")["image"] == f"registry.k8s.io/kube-scheduler:{tag}"
    # An older pinned tag is within the skew policy and kept.
    out = helm(helm_env, "template", RELEASE, CHART, "--kube-version", kube_version,
               "--set", "scheduler.enabled=true", "--set", "scheduler.image.tag=v1.29.9",
               "--show-only", "templates/scheduler/deployment.yaml").stdout
    assert container(yaml.safe_load(out), "kube-scheduler")["image"].endswith(":v1.29.9")


@pytest.mark.parametrize("case, installed", [("default", False), ("scheduler-on", True),
                                             ("scheduler-name-on", True), ("production", True)])
def test_second_scheduler_is_installed_when_used(render, case, installed):
    docs = render(case)
    names = {d["metadata"]["name"] for d in docs if d["kind"] in ("Deployment", "ConfigMap")}
    assert (f"{RELEASE}-archway-scheduler" in names) == installed
    assert ("extender.yaml" in archway_configs(docs)) == installed


def test_empty_values_render_like_empty_defaults(render):
    docs = render("empty-values")
    config = config_from_dict(archway_configs(docs)["webhook.yaml"])
    # null is "none": only the release namespace, in the webhook configuration and in archway's.
    assert config.admission.exclude_namespaces == (NS,)
    webhook = pod_webhook(one(docs, "MutatingWebhookConfiguration"))
    assert webhook["namespaceSelector"]["matchExpressions"][0]["values"] == [NS]
    policy = one(docs, "NetworkPolicy", f"{RELEASE}-archway")
    assert "from" not in policy["spec"]["ingress"][0] and policy["spec"]["policyTypes"] == ["Ingress"]


def test_cluster_domain_is_a_value(render, helm_env):
    docs = render("production")
    for spec in archway_pod_specs(docs).values():
        args = spec["containers"][0].get("args", [])
        if "bootstrap" in args:
            assert "--cluster-domain=corp.internal" in args
    out = helm(helm_env, "template", RELEASE, CHART, "-n", NS, "--set", "tls.mode=cert-manager",
               "--set", "clusterDomain=corp.internal",
               "--show-only", "templates/certmanager.yaml").stdout
    serving = next(d for d in yaml.safe_load_all(out) if d and d["kind"] == "Certificate"
                   and not d["spec"].get("isCA"))
    assert f"{RELEASE}-archway.{NS}.svc.corp.internal" in serving["spec"]["dnsNames"]
    assert not any("cluster.local" in n for n in serving["spec"]["dnsNames"])
    # The bootstrap default stays the kubelet's default.
    jobs = archway_pod_specs(render("default"))
    assert "--cluster-domain=cluster.local" in jobs["Job arch-archway-certgen-create"]["containers"][0]["args"]


def test_rbac_create_false_leaves_the_service_accounts_only(render):
    docs = render("rbac-off")
    assert not [d for d in docs if d["kind"] in ("Role", "ClusterRole", "RoleBinding",
                                                   "ClusterRoleBinding")]
    accounts = {d["metadata"]["name"] for d in find(docs, "ServiceAccount")}
    for spec in pods(docs).values():
        assert spec["serviceAccountName"] in accounts
    assert find(render("default"), "ClusterRole")   # control: created by default


def test_registry_events_open_a_port_with_its_token_secret(render, helm_env):
    """registryEvents: the listener's config (its own port, the token from its Secret, plain
    HTTP), the container and Service port, and the NetworkPolicy's opening for the peers named;
    none of it by default, and no install without the Secret's name."""
    docs = render("registry-events")
    config = config_from_dict(archway_configs(docs)["webhook.yaml"])
    events = config.registry.events
    assert (events.listen, events.tls, events.per_source_per_second) == ("0.0.0.0:8446", False, 5)
    pod = one(docs, "Deployment", f"{RELEASE}-archway")["spec"]["template"]["spec"]
    [container] = [c for c in pod["containers"] if c["name"] == "webhook"] or pod["containers"][:1]
    assert {"name": "registry-events", "containerPort": 8446, "protocol": "TCP"} in container["ports"]
    [mount] = [m for m in container["volumeMounts"] if m["name"] == "registry-events-token"]
    assert os.path.join(mount["mountPath"], "token") == events.token_file
    [volume] = [v for v in pod["volumes"] if v["name"] == "registry-events-token"]
    assert volume["secret"]["secretName"] == "registry-events"
    assert volume["secret"]["items"] == [{"key": "token", "path": "token"}]
    service = one(docs, "Service", f"{RELEASE}-archway")
    assert {"name": "registry-events", "port": 8446, "targetPort": "registry-events",
            "protocol": "TCP"} in service["spec"]["ports"]
    ingress = one(docs, "NetworkPolicy", f"{RELEASE}-archway")["spec"]["ingress"]
    assert {"ports": [{"port": "registry-events", "protocol": "TCP"}],
            "from": [{"ipBlock": {"cidr": "10.0.0.0/8"}}]} in ingress

    default = render("default")
    assert config_from_dict(archway_configs(default)["webhook.yaml"]).registry.events.listen is None
    assert "registry-events" not in json.dumps(default)
    done = helm(helm_env, "template", RELEASE, CHART, "-n", NS, "--set",
                "registryEvents.enabled=true", check=False)
    assert done.returncode != 0 and "registryEvents.tokenSecret.name" in done.stderr


def test_network_policy(render):
    """On by default: the webhook port open to every source (the apiserver's address is not
    predictable), /metrics only on the metrics port and only for the scrapers; egress as given."""
    docs = render("default")
    webhook = one(docs, "NetworkPolicy", f"{RELEASE}-archway")
    assert webhook["spec"]["policyTypes"] == ["Ingress"]   # egress not restricted by default
    calls, scrapes = webhook["spec"]["ingress"]
    assert calls == {"ports": [{"port": "https", "protocol": "TCP"}]}   # no `from`: anyone
    assert scrapes["ports"] == [{"port": "https-metrics", "protocol": "TCP"}]
    assert scrapes["from"] == [{"namespaceSelector": {}, "podSelector": {"matchLabels": {
        "app.kubernetes.io/name": "prometheus"}}}]
    config = config_from_dict(archway_configs(docs)["webhook.yaml"])
    assert config.server.metrics_bind == "0.0.0.0:8442" and config.server.bind == "0.0.0.0:8443"

    docs = render("production")
    webhook = one(docs, "NetworkPolicy", f"{RELEASE}-archway")
    deployment = one(docs, "Deployment", f"{RELEASE}-archway")
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert webhook["spec"]["podSelector"]["matchLabels"].items() <= labels.items()
    calls, scrapes = webhook["spec"]["ingress"]
    port_names = {p["name"] for p in container(deployment, "webhook")["ports"]}
    assert {p["port"] for r in (calls, scrapes) for p in r["ports"]} == port_names
    # Webhook calls from anywhere (the apiserver is not a pod); egress as given.
    assert "from" not in calls
    assert scrapes["from"] == [{"namespaceSelector": {"matchLabels": {
        "kubernetes.io/metadata.name": "monitoring"}}}]
    assert webhook["spec"]["policyTypes"] == ["Ingress", "Egress"]
    assert {p["port"] for r in webhook["spec"]["egress"] for p in r["ports"]} == {53, 443, 6443}
    scheduler = one(docs, "NetworkPolicy", f"{RELEASE}-archway-scheduler")
    [rule] = scheduler["spec"]["ingress"]
    sched = one(docs, "Deployment", f"{RELEASE}-archway-scheduler")
    declared = {p["name"] for c in sched["spec"]["template"]["spec"]["containers"]
                for p in c.get("ports", [])}
    assert {p["port"] for p in rule["ports"]} == declared == {"https-metrics", "http-metrics"}
    assert rule["from"] == scrapes["from"]


def test_no_scraper_listed_means_no_scraper_reaches_the_metrics(helm_env):
    out = helm(helm_env, "template", RELEASE, CHART, "-n", NS, "--set", "scheduler.enabled=true",
               "--set", "networkPolicy.metricsFrom=null").stdout
    docs = [d for d in yaml.safe_load_all(out) if d]
    assert one(docs, "NetworkPolicy", f"{RELEASE}-archway")["spec"]["ingress"] == [
        {"ports": [{"port": "https", "protocol": "TCP"}]}]
    assert one(docs, "NetworkPolicy", f"{RELEASE}-archway-scheduler")["spec"]["ingress"] == []
    off = helm(helm_env, "template", RELEASE, CHART, "-n", NS,
               "--set", "networkPolicy.enabled=false").stdout
    assert "kind: NetworkPolicy" not in off


def test_rbac_grants_secrets_and_pod_updates_only_where_a_feature_needs_them(helm_env, render):
    """Secrets (get) only in rbac.pullSecretNamespaces (none by default; "*" everywhere);
    `update pods` only with admission.unresolved gate; the Service ranges and the API server's
    EndpointSlice readable for the host policy."""
    def rendered(*args):
        out = helm(helm_env, "template", RELEASE, CHART, "-n", NS, *args).stdout
        return [d for d in yaml.safe_load_all(out) if d]

    def secret_rules(docs):
        return [(d["kind"], d["metadata"].get("namespace"), r["verbs"]) for d in docs
                if d["kind"] in ("ClusterRole", "Role") for r in d["rules"]
                if "secrets" in r["resources"] and d["metadata"]["name"].startswith(
                    f"{RELEASE}-archway") and "certgen" not in d["metadata"]["name"]]

    def bindings(docs, role):
        return sorted((d["kind"], d["metadata"].get("namespace") or "") for d in docs
                      if d["kind"] in ("ClusterRoleBinding", "RoleBinding")
                      and d["roleRef"]["name"] == role)

    default = render("default")
    role = f"{RELEASE}-archway-secret-reader"
    assert [r for r in secret_rules(default) if r[1] != NS] == [] and not bindings(default, role)
    some = rendered("--set", "rbac.pullSecretNamespaces={shop,team-a}")
    # (archway's own TLS Secrets in its namespace are the trust path's: test_trust_path)
    assert [r for r in secret_rules(some) if r[1] != NS] == [("ClusterRole", None, ["get"])]
    assert bindings(some, role) == [("RoleBinding", "shop"), ("RoleBinding", "team-a")]
    every = rendered("--set", "rbac.pullSecretNamespaces={*}")
    assert bindings(every, role) == [("ClusterRoleBinding", "")]
    # archway asks for Secrets only where it was granted them (no 403 per pod elsewhere)
    def namespaces(docs):
        return config_from_dict(archway_configs(docs)["webhook.yaml"]
                                ).kubernetes.pull_secret_namespaces
    assert namespaces(default) == () and namespaces(some) == ("shop", "team-a")
    assert namespaces(every) == ("*",)

    # ServiceAccount tokens (workload-identity pulls): nowhere by default; create of the
    # token subresource only, where rbac.serviceAccountTokenNamespaces says, and the config
    # asks for tokens there only.
    requester = f"{RELEASE}-archway-token-requester"
    assert not bindings(default, requester)
    assert not [d for d in default if d["metadata"].get("name") == requester]
    tokens = rendered("--set", "rbac.serviceAccountTokenNamespaces={shop}")
    assert one(tokens, "ClusterRole", requester)["rules"] == [
        {"apiGroups": [""], "resources": ["serviceaccounts/token"], "verbs": ["create"]}]
    assert bindings(tokens, requester) == [("RoleBinding", "shop")]
    assert bindings(rendered("--set", "rbac.serviceAccountTokenNamespaces={*}"), requester) == [
        ("ClusterRoleBinding", "")]
    def token_namespaces(docs):
        return config_from_dict(archway_configs(docs)["webhook.yaml"]
                                ).kubernetes.service_account_token_namespaces
    assert token_namespaces(default) == () and token_namespaces(tokens) == ("shop",)

    def pod_verbs(docs):
        gate = one(docs, "ClusterRole", f"{RELEASE}-archway-gate-controller")
        return [r["verbs"] for r in gate["rules"] if r["resources"] == ["pods"]]
    assert pod_verbs(default) == [["get", "list", "watch", "update"]]
    assert pod_verbs(render("unresolved-admit")) == [["get", "list", "watch"]]

    reader = one(default, "ClusterRole", f"{RELEASE}-archway-pull-secret-reader")
    assert {"apiGroups": ["networking.k8s.io"], "resources": ["servicecidrs"],
            "verbs": ["list"]} in reader["rules"]
    endpoints = one(default, "Role", f"{RELEASE}-archway-apiserver-endpoints")
    assert endpoints["metadata"]["namespace"] == "default" and endpoints["rules"] == [
        {"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"],
         "resourceNames": ["kubernetes"], "verbs": ["get"]}]


def test_host_network(render):
    docs = render("production")
    pod = one(docs, "Deployment", f"{RELEASE}-archway")["spec"]["template"]["spec"]
    assert pod["hostNetwork"] is True and pod["dnsPolicy"] == "ClusterFirstWithHostNet"
    config = config_from_dict(archway_configs(docs)["webhook.yaml"])
    assert config.server.bind == "0.0.0.0:9443"
    assert "hostNetwork" not in one(render("default"), "Deployment", f"{RELEASE}-archway")["spec"][
        "template"]["spec"]


def test_json_logs_reach_both_servers(render):
    configs = {k: config_from_dict(v) for k, v in archway_configs(render("production")).items()
               if k.endswith(".yaml") and k != "credential-providers.yaml"}
    assert {c.server.log_format for c in configs.values()} == {"json"}
    assert config_from_dict(archway_configs(render("default"))["webhook.yaml"]).server.log_format == "text"


# --- operating it: alerts, runbooks, dashboard ----------------------------------------------------

RUNBOOKS = os.path.join(REPO, "docs", "runbooks")
GATE_METRICS = {"archway_gated_pods", "archway_gate_wait_seconds", "archway_gate_releases_total"}


def declared_metrics() -> set[str]:
    return set(declared())


def metric_names(expr: str) -> set[str]:
    names = set(re.findall(r"\barchway_[a-z_]+", expr))
    return {re.sub(r"_(bucket|sum|count)$", "", n) for n in names}


def test_every_alert_has_a_runbook(render):
    rule = one(render("production"), "PrometheusRule")
    alerts = [r for g in rule["spec"]["groups"] for r in g["rules"] if "alert" in r]
    assert {a["alert"] for a in alerts} >= {"ArchwayWebhookDown", "ArchwayHighFailOpenRate",
                                            "ArchwayCertificateExpiresSoon",
                                            "ArchwayPrometheusDataStale"}
    for alert in alerts:
        url = alert["annotations"]["runbook_url"]
        assert url == ("https://github.com/archway/archway/blob/main/docs/runbooks/"
                       f"{alert['alert']}.md")
        with open(os.path.join(RUNBOOKS, f"{alert['alert']}.md")) as f:
            text = f.read()
        for section in ("## What it means", "## How to check", "## How to fix"):
            assert section in text, (alert["alert"], section)
        assert metric_names(alert["expr"]) <= declared_metrics()


def test_certificate_expiry_alert(render):
    rule = one(render("production"), "PrometheusRule")
    [alert] = [r for g in rule["spec"]["groups"] for r in g["rules"]
               if r.get("alert") == "ArchwayCertificateExpiresSoon"]
    assert "archway_tls_certificate_expiry_timestamp_seconds" in alert["expr"]
    assert "< 1209600" in alert["expr"]        # 14 days, the default


def test_grafana_dashboard(render, tmp_path):
    assert not [d for d in render("default") if d["metadata"]["name"].endswith("-dashboard")]
    cm = one(render("production"), "ConfigMap", f"{RELEASE}-archway-dashboard")
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert cm["metadata"]["annotations"] == {"grafana_folder": "archway"}
    dashboard = json.loads(cm["data"]["archway.json"])
    panels = {p["title"]: p for p in dashboard["panels"] if p["type"] != "row"}
    exprs = {t["expr"] for p in panels.values() for t in p["targets"]}
    used = set().union(*map(metric_names, exprs))
    assert used <= declared_metrics() | GATE_METRICS
    # What an operator asked to see, each from its metric.
    for needle in ("archway_admissions_total", "archway_admission_duration_seconds_bucket",
                   "archway_cache_lookups_total", "archway_registry_requests_total",
                   "archway_gated_pods", "archway_extender_requests_total",
                   "archway_tls_certificate_expiry_timestamp_seconds", "archway_build_info"):
        assert any(needle in e for e in exprs), needle
    # Latency is drawn against this release's deadline and webhook timeout.
    latency = panels["Admission latency against the webhook timeout"]
    assert {t["legendFormat"]: t["expr"] for t in latency["targets"]}["webhook timeout"] == "vector(5)"
    assert {t["legendFormat"]: t["expr"] for t in latency["targets"]}["archway deadline"] == "vector(3)"
    assert len({p["id"] for p in dashboard["panels"]}) == len(dashboard["panels"])
    # Every query is valid PromQL: the real promtool checks them as recording rules.
    rules = [{"record": f"archway:dashboard:{i}",
              "expr": e.replace("$__rate_interval", "5m").replace("$namespace", "x")}
             for i, e in enumerate(sorted(exprs))]
    path = tmp_path / "dashboard-rules.yaml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    out = subprocess.run([require_binary("promtool"), "check", "rules", str(path)],
                         capture_output=True, text=True, timeout=60, check=False)
    assert out.returncode == 0, out.stdout + out.stderr


@functools.cache
def _schema() -> dict:
    with open(os.path.join(CHART, "values.schema.json")) as f:
        return json.load(f)


def _schema_at(path: str) -> dict:
    node = _schema()
    for key in path.split("."):
        node = node.get("properties", {}).get(key, {})
    return node


def _schema_requires(path: str) -> bool:
    parent, _, leaf = path.rpartition(".")
    return leaf in (_schema_at(parent) if parent else _schema()).get("required", ())


def _value_paths(values: dict, prefix: str = "") -> list[str]:
    paths = []
    for key, value in values.items():
        path = f"{prefix}{key}"
        paths.append(path)
        if isinstance(value, dict) and "properties" in _schema_at(path):   # not free-form maps
            paths.extend(_value_paths(value, path + "."))
    return paths




def test_every_value_set_to_null_renders_or_names_itself(helm_env, tmp_path):
    """An emptied key (`key:` or --set key=null deletes Helm's default) never crashes a template
    on a nil: either the schema requires the key and names it, or the chart renders valid
    manifests as if it were empty. All optional keys are emptied at once, with every feature
    that reads them on; the required ones are named by the schema (checked on a few)."""
    with open(os.path.join(CHART, "values.yaml")) as f:
        paths = _value_paths(yaml.safe_load(f))
    required = [p for p in paths if _schema_requires(p)]
    nullable = [p for p in paths if p not in required]
    # a map emptied as a whole (resources) takes its keys with it
    nullable = [p for p in nullable if not any(p.startswith(q + ".") for q in nullable)]
    assert len(required) > 60 and len(nullable) > 50
    values: dict = {"scheduler": {"enabled": True}, "networkPolicy": {"enabled": True},
                    "metrics": {t: {"enabled": True} for t in
                                ("serviceMonitor", "prometheusRule", "grafanaDashboard")}}
    for path in nullable:
        *parents, leaf = path.split(".")
        node = values
        for parent in parents:
            node = node.setdefault(parent, {})
        node[leaf] = None
    file = tmp_path / "null.yaml"
    file.write_text(yaml.safe_dump(values))
    result = helm(helm_env, "template", RELEASE, CHART, "-n", NS, "-f", str(file), check=False)
    assert result.returncode == 0, result.stderr[-800:]
    docs = [d for d in yaml.safe_load_all(result.stdout) if d]
    for doc in docs:
        try:
            kubernetes_validate.validate(doc, "1.30.0", strict=True)
        except kubernetes_validate.SchemaNotFoundError:
            check_custom_resource(doc)
        except kubernetes_validate.ValidationError as e:
            pytest.fail(f"{doc['kind']} {doc['metadata']['name']}: {e.message}")
    assert {"Deployment", "NetworkPolicy", "PrometheusRule", "CronJob"} <= {d["kind"] for d in docs}
    for path in ("webhook.service", "tls.bootstrap.renewal", "config", "webhook.podDisruptionBudget"):
        result = helm(helm_env, "template", RELEASE, CHART, "--set", f"{path}=null", check=False)
        leaf = path.rpartition(".")[2]
        assert result.returncode != 0 and f"missing property '{leaf}'" in result.stderr, path


# --- gate on a miss (config.admission.unresolved) ---------------------------------------------------

def test_the_chart_gates_with_least_privilege_and_releases_on_uninstall(render):
    docs = render("default")
    webhook = config_from_dict(archway_configs(docs)["webhook.yaml"], origin="webhook.yaml")
    assert webhook.admission.unresolved == "gate" and webhook.admission.gate_max_seconds == 120
    account = f"{RELEASE}-archway"
    controller = one(docs, "ClusterRole", f"{RELEASE}-archway-gate-controller")
    assert controller["rules"] == [
        {"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch", "update"]},
        {"apiGroups": ["events.k8s.io"], "resources": ["events"], "verbs": ["create", "patch"]},
        # config.remediation.watch_tags: a new leader reads the ArchitecturesDropped raised
        {"apiGroups": [""], "resources": ["events"], "verbs": ["list"]},
        # config.remediation.learn_failed_architectures: a failing pod's workloads read, and
        # what was learned merged into their annotations; no update
        {"apiGroups": ["apps"], "resources": ["deployments", "statefulsets", "daemonsets",
                                              "replicasets"], "verbs": ["get", "patch"]},
        {"apiGroups": ["batch"], "resources": ["jobs", "cronjobs"], "verbs": ["get", "patch"]},
        # ... and the condition of a workload that can run nowhere (a CronJob's has none)
        {"apiGroups": ["apps"], "resources": ["deployments/status", "statefulsets/status",
                                              "daemonsets/status", "replicasets/status"],
         "verbs": ["patch"]},
        {"apiGroups": ["batch"], "resources": ["jobs/status"], "verbs": ["patch"]},
        # config.remediation.evict (on by default): pods failing with exec format error evicted
        {"apiGroups": [""], "resources": ["pods/eviction"], "verbs": ["create"]},
        # config.remediation.read_logs: the tail of a failed container whose status is silent
        {"apiGroups": [""], "resources": ["pods/log"], "verbs": ["get"]}]
    lease = one(docs, "Role", f"{RELEASE}-archway-gate-lease")
    assert lease["metadata"]["namespace"] == NS
    assert lease["rules"] == [
        {"apiGroups": ["coordination.k8s.io"], "resources": ["leases"], "verbs": ["create"]},
        {"apiGroups": ["coordination.k8s.io"], "resources": ["leases"],
         "resourceNames": ["archway-gate-controller"], "verbs": ["get", "update"]}]
    for kind, name in (("ClusterRoleBinding", controller["metadata"]["name"]),
                       ("RoleBinding", lease["metadata"]["name"])):
        binding = one(docs, kind, name)
        assert binding["subjects"] == [{"kind": "ServiceAccount", "name": account,
                                        "namespace": NS}]
    deployment = one(docs, "Deployment", f"{RELEASE}-archway")
    assert deployment["spec"]["template"]["spec"]["serviceAccountName"] == account

    hook = one(docs, "Job", f"{RELEASE}-archway-gate-release")
    assert hook["metadata"]["annotations"]["helm.sh/hook"] == "pre-delete"
    pod = hook["spec"]["template"]["spec"]
    assert pod["containers"][0]["args"] == ["gate", "release-all"]
    assert pod["containers"][0]["image"] == container(deployment, "webhook")["image"]
    hook_role = one(docs, "ClusterRole", pod["serviceAccountName"])
    assert hook_role["rules"] == [{"apiGroups": [""], "resources": ["pods"],
                                   "verbs": ["list", "get", "update"]}]
    for kind in ("ServiceAccount", "ClusterRole", "ClusterRoleBinding"):
        annotations = one(docs, kind, pod["serviceAccountName"])["metadata"]["annotations"]
        assert annotations["helm.sh/hook"] == "pre-delete"
        assert int(annotations["helm.sh/hook-weight"]) < 0   # before the Job


def test_admit_mode_has_no_uninstall_hook_and_passes_fallback_through(render):
    docs = render("unresolved-admit")
    assert not [j for j in docs if j["kind"] == "Job" and "gate-release" in j["metadata"]["name"]]
    webhook = config_from_dict(archway_configs(docs)["webhook.yaml"], origin="webhook.yaml")
    assert webhook.admission.unresolved == "admit"
    assert webhook.placement.fallback_architectures == ("amd64",)


# Keys of archway's config that the chart sets itself from other values (never by `config:`).
CHART_OWNED_KEYS = {"placement.scheduler_name", "placement.archway_scheduler",
                    "kubernetes.pull_secret_namespaces", "kubernetes.service_account_token_namespaces",
                    "kubernetes.webhook_configuration", "kubernetes.trust_repair",
                    "registry.events.listen", "registry.events.token_file",
                    "registry.events.tls"} | {
    f"server.{key}" for key in ("bind", "cert_file", "key_file", "log_every_admission",
                                "log_format", "max_body_bytes", "metrics_bind", "product",
                                "state_dir", "threads", "tls", "workers")}


def test_the_chart_schema_lets_every_config_key_through():
    """values.schema.json refuses unknown `config:` keys; every key archway reads must be
    settable there, except those the chart derives from its own values."""
    from archway.config import documented_keys

    def keys(node, prefix=""):
        found = set()
        for name, sub in (node.get("properties") or {}).items():
            if sub.get("properties") and sub.get("additionalProperties") is False:
                found |= keys(sub, f"{prefix}{name}.")
            else:
                found.add(prefix + name)
        return found

    with open(os.path.join(CHART, "values.schema.json")) as f:
        schema = json.load(f)
    assert keys(schema["properties"]["config"]) == set(documented_keys()) - CHART_OWNED_KEYS


def test_pre_warming_off_drops_the_workload_list_rules(render):
    def verbs(case, resource):
        reader = one(render(case), "ClusterRole", f"{RELEASE}-archway-pull-secret-reader")
        return [rule["verbs"] for rule in reader["rules"] if resource in rule["resources"]]

    assert verbs("default", "pods") == [["list"]] and verbs("no-prewarm", "pods") == []
    # the workload caches of config.remediation still list and watch them
    assert verbs("no-prewarm", "deployments") == [["list", "watch"]]
    assert verbs("remediation-off", "deployments") == []
    assert verbs("remediation-off-prewarm-on", "deployments") == [["list"]]


def test_remediation_rbac_follows_its_switches(render):
    """Least privilege: patch on the workload kinds only while archway learns, get always (the
    Events name a failing pod's workload), pods/eviction only with remediation.evict (the
    default) and learning, pods/log
    only while it learns with remediation.read_logs."""
    def rules(case):
        return one(render(case), "ClusterRole", f"{RELEASE}-archway-gate-controller")["rules"]

    def verbs(case, resource):
        return [r["verbs"] for r in rules(case) if resource in r["resources"]]

    assert verbs("default", "deployments") == [["get", "patch"]]
    assert verbs("default", "cronjobs") == [["get", "patch"]]
    assert verbs("default", "pods/eviction") == [["create"]]
    assert verbs("remediation-no-evict", "pods/eviction") == []
    assert verbs("remediation-off", "deployments") == [["get"]]
    assert verbs("remediation-off", "pods/eviction") == []
    # A failed container's log (pods/log get) only while learning with read_logs (the default).
    assert verbs("default", "pods/log") == [["get"]]
    assert verbs("remediation-off", "pods/log") == []
    assert verbs("remediation-off-prewarm-on", "pods/log") == []
    assert verbs("remediation-no-logs", "pods/log") == []
    assert not config_from_dict(archway_configs(render("remediation-no-logs"))["webhook.yaml"]
                                ).remediation.read_logs
    for case in ("default", "remediation-no-evict", "remediation-off"):
        assert not [r for r in rules(case) if {"update", "delete", "*"} & set(r["verbs"])
                    and r["resources"] != ["pods"]]
    default = config_from_dict(archway_configs(render("default"))["webhook.yaml"])
    assert default.remediation.evict and default.remediation.learn_failed_architectures
    kept = config_from_dict(archway_configs(render("remediation-no-evict"))["webhook.yaml"])
    assert not kept.remediation.evict


# --- a newcomer's install: long release names, emptied maps, labels, probes, notes, alerts -------

DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")
# Kubernetes' limits on metadata.name by kind: a Service is a DNS-1035 label; a Job's name goes
# into its pods' job-name label (63); a CronJob adds 11 characters to name its Jobs (52).
NAME_LIMITS = {"Service": 63, "Job": 63, "CronJob": 52, "Deployment": 63}
# The longest release name `helm install` accepts, with and without the chart name in it (the
# full name is then the release name alone).
LONG_RELEASES = ("r" * 53, "team-platform-archway-" + "x" * 31)


def labels_of(doc) -> list[dict]:
    """Every label map of a rendered object: its own, its selectors', its pod templates'."""
    found = [doc["metadata"].get("labels") or {}]
    spec = doc.get("spec") or {}
    found.append((spec.get("selector") or {}).get("matchLabels") or {})
    for template in (spec.get("template"), ((spec.get("jobTemplate") or {}).get("spec") or {})
                     .get("template")):
        if template:
            found.append((template.get("metadata") or {}).get("labels") or {})
    return found


def name_problems(docs) -> list[str]:
    problems = []
    for doc in docs:
        kind, name = doc["kind"], doc["metadata"]["name"]
        limit = NAME_LIMITS.get(kind, 253)
        pattern = DNS_LABEL if limit <= 63 else DNS_SUBDOMAIN
        if len(name) > limit or not pattern.match(name):
            problems.append(f"{kind} {name} ({len(name)} > {limit} or not a DNS name)")
        for labels in labels_of(doc):
            for key, value in labels.items():
                if len(str(value)) > 63 or not LABEL_VALUE.match(str(value)):
                    problems.append(f"{kind} {name}: label {key}={value}")
    return problems


@pytest.mark.parametrize("release", LONG_RELEASES)
def test_every_name_fits_for_the_longest_release_name(helm_env, release):
    """With every value set of CASES, so that every template renders at least once."""
    assert len(release) == 53
    sources, problems = set(), []
    for case, args in CASES.items():
        out = helm(helm_env, "template", release, CHART, "-n", NS, *args).stdout
        sources |= set(re.findall(r"^# Source: archway/(templates/\S+)$", out, re.M))
        problems += [f"{case}: {p}" for p in name_problems(d for d in yaml.safe_load_all(out) if d)]
    templates = {os.path.relpath(os.path.join(root, f), CHART)
                 for root, _, files in os.walk(os.path.join(CHART, "templates"))
                 for f in files if f.endswith(".yaml")}
    assert sources == templates
    assert not problems, "\n".join(sorted(set(problems)))


def test_the_name_check_is_really_strict():
    """Control: the check above refuses what the chart rendered before (a 66-character CronJob)."""
    cronjob = {"kind": "CronJob", "metadata": {"name": "r" * 53 + "-certgen-renew"}, "spec": {}}
    job = {"kind": "Job", "metadata": {"name": "x", "labels": {"a": "y" * 64}}, "spec": {}}
    assert len(name_problems([cronjob, job])) == 2


@pytest.mark.parametrize("path", ["webhook.resources", "scheduler.resources",
                                  "scheduler.extender.resources", "tls.bootstrap.resources",
                                  "metrics.prometheusRule.alertLabels", "podSecurityContext",
                                  "securityContext"])
def test_an_emptied_map_renders_as_empty(helm_env, path):
    """What the chart README promises for every map given as null (`--set key=null`)."""
    result = helm(helm_env, "template", RELEASE, CHART, "-n", NS, "--set", f"{path}=null",
                  "--set", "scheduler.enabled=true", "--set", "metrics.prometheusRule.enabled=true",
                  check=False)
    assert result.returncode == 0, result.stderr
    docs = [d for d in yaml.safe_load_all(result.stdout) if d]
    for doc in docs:
        kubernetes_validate.validate(doc, "1.33.0", strict=True) if doc["kind"] != "PrometheusRule" \
            else check_custom_resource(doc)
    specs = archway_pod_specs(docs)
    leaf = path.rpartition(".")[2]
    if leaf == "alertLabels":
        rules = [r for g in one(docs, "PrometheusRule")["spec"]["groups"] for r in g["rules"]]
        assert rules and all("labels" not in r for r in rules)
    elif leaf == "podSecurityContext":
        assert all("securityContext" not in spec for spec in specs.values())
    elif leaf == "securityContext":
        assert all("securityContext" not in c for s in specs.values() for c in s["containers"])
    else:
        deployment = {"webhook.resources": f"{RELEASE}-archway", "scheduler.resources":
                      f"{RELEASE}-archway-scheduler"}.get(path)
        emptied = [c for kind_name, s in specs.items() for c in s["containers"]
                   if "resources" not in c]
        assert emptied, path
        if deployment:
            names = {"webhook.resources": "webhook", "scheduler.resources": "kube-scheduler"}
            assert "resources" not in container(one(docs, "Deployment", deployment), names[path])


def test_kubernetes_maps_passed_as_written_may_be_emptied():
    """Every resources, labels, annotations and security context map of values.yaml is optional in
    the schema, so `--set key=null` empties it instead of failing with `missing property`."""
    with open(os.path.join(CHART, "values.yaml")) as f:
        paths = _value_paths(yaml.safe_load(f))
    passthrough = [p for p in paths if re.search(
        r"(^|\.)(resources|[a-zA-Z]*[lL]abels|[a-zA-Z]*[aA]nnotations|[a-zA-Z]*[sS]ecurityContext"
        r"|nodeSelector|tolerations|affinity|extraEnv|extraVolumes|extraVolumeMounts)$", p)]
    assert len(passthrough) > 25
    assert [p for p in passthrough if _schema_requires(p)] == []


def test_common_labels_reach_every_object_and_pod_template(helm_env):
    args = ["--set", "commonLabels.team=platform", "--set", "commonLabels.cost-center=c42",
            "--set", "webhook.podLabels.team=webhook-team",
            "--set", "commonLabels.app\\.kubernetes\\.io/component=overridden"]
    for case in ("monitoring", "default", "production"):
        out = helm(helm_env, "template", RELEASE, CHART, "-n", NS, *CASES[case], *args).stdout
        docs = [d for d in yaml.safe_load_all(out) if d]
        for doc in docs:
            assert doc["metadata"]["labels"]["cost-center"] == "c42", doc["metadata"]["name"]
        specs = 0
        for doc in docs:
            *_, template = labels_of(doc)
            if doc["kind"] not in ("Deployment", "Job", "CronJob"):
                continue
            specs += 1
            assert template["cost-center"] == "c42", doc["metadata"]["name"]
            # the selector labels and archway's skip label are never overridden
            assert template["app.kubernetes.io/component"] != "overridden"
            assert template["archway.dev/skip"] == "true"
            owned = doc["metadata"]["name"] == f"{RELEASE}-archway" and doc["kind"] == "Deployment"
            assert template["team"] == ("webhook-team" if owned else "platform")
        assert specs >= 2


def test_every_object_names_its_component(render):
    for case in ("monitoring", "production", "default"):
        for doc in render(case):
            assert doc["metadata"]["labels"].get("app.kubernetes.io/component"), \
                f"{doc['kind']} {doc['metadata']['name']}"
    config = one(render("default"), "ConfigMap", f"{RELEASE}-archway-config")
    assert config["metadata"]["labels"]["app.kubernetes.io/component"] == "config"


def test_the_extender_sidecar_is_ready_only_when_its_server_is(render, tmp_path, tmp_path_factory):
    """The sidecar's probes, run as the kubelet runs them (python3 -c in the container) against
    a real `archway serve` with the config the chart renders."""
    from lab.procs import Server, free_port
    from lab.tls import session_ca
    docs = render("scheduler-on")
    sidecar = container(one(docs, "Deployment", f"{RELEASE}-archway-scheduler"), "extender")
    config = archway_configs(docs)["extender.yaml"]
    port = free_port()

    def probe(kind):
        command = list(sidecar[kind]["exec"]["command"])
        assert command[:2] == ["python3", "-c"]
        command[2] = command[2].replace(":8444/", f":{port}/")
        done = subprocess.run([sys.executable, *command[1:]], capture_output=True, text=True,
                              timeout=30)
        # What fails becomes the probe's Event: one line that says why, never a traceback.
        assert done.returncode == 0 or (len(done.stderr.splitlines()) == 1 and
                                        f"127.0.0.1:{port}/" in done.stderr), done.stderr
        return done.returncode

    def serve(extra):
        config["server"] = {**config["server"], "bind": f"127.0.0.1:{port}",
                            "state_dir": str(tmp_path / "state"), "workers": 1}
        config["registry"] = {**(config.get("registry") or {}), **extra}
        path = tmp_path / "extender.yaml"
        path.write_text(yaml.safe_dump(config))
        return Server([sys.executable, "-m", "archway.main.cli", "--config", str(path), "serve"],
                      port=port, log_path=str(tmp_path / "serve.log"), cwd=str(tmp_path),
                      ready_timeout=60)

    assert "/readyz'" in sidecar["readinessProbe"]["exec"]["command"][2]
    assert probe("readinessProbe") != 0 and probe("livenessProbe") != 0     # nothing listening
    with serve({}):
        assert probe("readinessProbe") == 0 and probe("livenessProbe") == 0
    ca = tmp_path / "registry-ca.crt"
    with open(session_ca(tmp_path_factory).cert_path, "rb") as f:
        ca.write_bytes(f.read())
    with serve({"ca_file": str(ca)}):
        assert probe("readinessProbe") == 0
        ca.unlink()             # its registry CA gone: alive, but not ready
        assert probe("livenessProbe") == 0 and probe("readinessProbe") != 0


def notes(helm_env, tmp_path, *args) -> str:
    """NOTES.txt as `helm install` prints it: helm template does not render it, so a copy of
    the chart renders it through `tpl` into a ConfigMap (helm install --dry-run needs a cluster)."""
    import shutil
    chart = tmp_path / "chart"
    if not chart.exists():
        shutil.copytree(CHART, chart)
        shutil.copy(chart / "templates" / "NOTES.txt", chart / "notes-under-test.txt")
        (chart / "templates" / "zz-notes-under-test.yaml").write_text(
            "apiVersion: v1\nkind: ConfigMap\nmetadata: {name: notes}\ndata:\n  notes: |\n"
            '{{ tpl (.Files.Get "notes-under-test.txt") . | indent 4 }}\n')
    out = helm(helm_env, "template", RELEASE, str(chart), "-n", NS, "--show-only",
               "templates/zz-notes-under-test.yaml", *args).stdout
    return yaml.safe_load(out)["data"]["notes"]


def test_notes_say_what_gate_mode_means(helm_env, tmp_path):
    text = notes(helm_env, tmp_path)
    assert "config.admission.unresolved=gate" in text and "SchedulingGated" in text
    assert "after 120 s (gate_max_seconds) it is released\n   anyway, unplaced" in text
    assert "kubectl get pods -A -l archway.dev/gated=true" in text
    assert f"kubectl -n {NS} exec deploy/{RELEASE}-archway -- archway gate release-all" in text
    fallback = notes(helm_env, tmp_path, "--set", "config.placement.fallback_architectures={amd64}",
                     "--set", "config.admission.gate_max_seconds=300")
    assert "after 300 s" in fallback and "on amd64 (placement.fallback_architectures)" in fallback
    admit = notes(helm_env, tmp_path, "--set", "config.admission.unresolved=admit")
    assert "admit mode: it is admitted unplaced" in admit and "SchedulingGated" not in admit
    deny = notes(helm_env, tmp_path, "--set", "config.admission.unresolved=deny")
    assert "deny mode: it is refused" in deny
    long_name = notes(helm_env, tmp_path, "--set", "fullnameOverride=" + "n" * 63)
    assert "CronJob\n    " + "n" * 38 + "-certgen-renew" in long_name


@pytest.mark.parametrize("service_monitor", [True, False])
def test_webhook_down_alert_fires_only_when_a_scrape_says_so(helm_env, tmp_path, service_monitor):
    """promtool's rule unit tests: with the chart's ServiceMonitor no successful scrape at all is
    the outage (absent); without it, nothing may be scraping, and an unscraped webhook must not
    alert forever; scraped targets all down alert either way."""
    out = helm(helm_env, "template", RELEASE, CHART, "-n", NS,
               "--set", "metrics.prometheusRule.enabled=true",
               "--set", f"metrics.serviceMonitor.enabled={str(service_monitor).lower()}").stdout
    rule = one([d for d in yaml.safe_load_all(out) if d], "PrometheusRule")
    (tmp_path / "rules.yaml").write_text(yaml.safe_dump({"groups": rule["spec"]["groups"]}))
    alert = next(r for g in rule["spec"]["groups"] for r in g["rules"]
                 if r.get("alert") == "ArchwayWebhookDown")
    fired = [{"exp_labels": alert["labels"], "exp_annotations": alert["annotations"]}]

    def up(pod, values):
        return {"series": f'up{{job="{RELEASE}-archway",namespace="{NS}",pod="{pod}"}}',
                "values": values}

    def case(name, series, at, expected):
        return {"name": name, "interval": "1m", "input_series": series, "alert_rule_test": [
            {"eval_time": at, "alertname": "ArchwayWebhookDown", "exp_alerts": expected}]}

    tests = [case("nothing scrapes the webhook", [], "2h", fired if service_monitor else []),
             case("every webhook pod is down", [up("a", "0x30"), up("b", "0x30")], "10m", fired),
             case("one webhook pod is up", [up("a", "0x30"), up("b", "1x30")], "10m", []),
             case("the pods went away after a scrape", [up("a", "1 1 1 stale")], "20m",
                  fired if service_monitor else [])]
    (tmp_path / "tests.yaml").write_text(yaml.safe_dump(
        {"rule_files": ["rules.yaml"], "evaluation_interval": "1m", "tests": tests}))
    result = subprocess.run([require_binary("promtool"), "test", "rules", "tests.yaml"],
                            cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


def test_dropped_architecture_alert_fires_for_an_hour_after_a_drop(helm_env, tmp_path):
    """promtool's rule unit tests of ArchwayImageDroppedArchitecture: a tag re-pushed without
    arm64 (the counter goes up once) fires with the architecture at once and stops an hour later;
    a counter that never moves (or a new process starting at 0) does not fire. Without
    remediation.watch_tags nothing counts, and the chart leaves the alert out."""
    def rule_of(*values):
        out = helm(helm_env, "template", RELEASE, CHART, "-n", NS,
                   "--set", "metrics.prometheusRule.enabled=true", *values).stdout
        return one([d for d in yaml.safe_load_all(out) if d], "PrometheusRule")

    rule = rule_of()
    (tmp_path / "rules.yaml").write_text(yaml.safe_dump({"groups": rule["spec"]["groups"]}))
    alert = next(r for g in rule["spec"]["groups"] for r in g["rules"]
                 if r.get("alert") == "ArchwayImageDroppedArchitecture")
    assert alert["annotations"]["runbook_url"].endswith("/ArchwayImageDroppedArchitecture.md")
    assert os.path.exists(os.path.join(REPO, "docs", "runbooks",
                                       "ArchwayImageDroppedArchitecture.md"))
    series = f'archway_image_architectures_dropped_total{{job="{RELEASE}-archway",namespace="{NS}"'

    def case(name, values, at, fired):
        labels = {**alert["labels"], "architecture": "arm64"}
        expected = [{"exp_labels": labels, "exp_annotations": {
            **alert["annotations"],
            "summary": "An image tag used by a workload no longer offers arm64.",
            "description": alert["annotations"]["description"].replace(
                "{{ $labels.architecture }}", "arm64")}}] if fired else []
        return {"name": name, "interval": "1m", "input_series": [
            {"series": series + ',pod="a",architecture="arm64"}', "values": values}],
            "alert_rule_test": [{"eval_time": at, "alertname": "ArchwayImageDroppedArchitecture",
                                 "exp_alerts": expected}]}

    tests = [case("a tag dropped arm64 ten minutes ago", "0x10 1x100", "20m", True),
             case("an hour and more after the drop", "0x10 1x100", "80m", False),
             case("nothing dropped", "0x100", "50m", False),
             case("a new leader's counter starts at 0", "_x10 0x100", "50m", False)]
    (tmp_path / "tests.yaml").write_text(yaml.safe_dump(
        {"rule_files": ["rules.yaml"], "evaluation_interval": "1m", "tests": tests}))
    result = subprocess.run([require_binary("promtool"), "test", "rules", "tests.yaml"],
                            cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    quiet = rule_of("--set", "config.remediation.watch_tags=false")
    assert "ArchwayImageDroppedArchitecture" not in {r.get("alert") for g in quiet["spec"]["groups"]
                                                    for r in g["rules"]}


# --- the image a plain install runs, and the chart README's quickstart --------------------------

def quickstart() -> str:
    with open(os.path.join(CHART, "README.md")) as f:
        text = f.read()
    section = text.split("## Quickstart", 1)[1].split("\n## ", 1)[0]
    return re.search(r"```sh\n(.*?)```", section, re.S).group(1)


def test_the_default_image_tag_is_the_release_tag(render):
    """Releases tag the commit and the image vX.Y.Z (scripts/release.sh); the chart's default
    tag must be that one, not the bare appVersion nothing pushes."""
    with open(os.path.join(CHART, "Chart.yaml")) as f:
        app_version = yaml.safe_load(f)["appVersion"]
    images = {c["image"] for spec in archway_pod_specs(render("default")).values()
              for c in spec["containers"]}
    assert images == {f"ghcr.io/archway/archway:v{app_version}"}


def test_the_quickstart_installs_the_image_its_first_step_pushes(helm_env):
    """Step 1 pushes $REPO:v<appVersion> (release.sh image: tests/test_image.py runs it against a
    real registry); step 2's `helm install` must run exactly that image in every archway pod.
    The install itself runs against a real control plane in tests/test_image.py."""
    steps = quickstart()
    assert 'bash scripts/release.sh image "$REPO"' in steps
    install = re.search(r"^helm install (.*?)(?<!\\)$", steps.replace("\\\n", " "), re.M).group(1)
    args = [a.replace('"$REPO"', "registry.example.com/platform/archway")
            for a in install.split()]
    release_name, chart = args[:2]
    assert chart == "charts/archway"
    args = [a for a in args[2:] if a not in ("--wait", "--create-namespace")]
    args = [a for i, a in enumerate(args) if not (a == "--timeout" or args[i - 1] == "--timeout")]
    out = helm(helm_env, "template", release_name, os.path.join(REPO, chart), *args).stdout
    docs = [d for d in yaml.safe_load_all(out) if d]
    with open(os.path.join(CHART, "Chart.yaml")) as f:
        app_version = yaml.safe_load(f)["appVersion"]
    images = set()
    for doc in docs:
        spec = (doc.get("spec") or {}).get("template") or ((doc.get("spec") or {}).get(
            "jobTemplate") or {}).get("spec", {}).get("template")
        images |= {c["image"] for c in (spec or {}).get("spec", {}).get("containers", [])}
    assert images == {f"registry.example.com/platform/archway:v{app_version}"}
    # step 3's names are the ones the chart gives for that release name
    deployment = re.search(r"rollout status deployment/(\S+)", steps).group(1)
    assert deployment in {d["metadata"]["name"] for d in docs if d["kind"] == "Deployment"}


def test_every_job_of_the_chart_is_one_template():
    """The certgen Jobs, their CronJob and the gate-release hook run one `archway` command each
    through archway.commandJobSpec (templates/_jobs.tpl): the hook once copied certgen's pod spec
    line by line (issue 23)."""
    templates = os.path.join(CHART, "templates")
    spelled_out = sorted(os.path.relpath(os.path.join(top, name), templates)
                         for top, _, names in os.walk(templates) for name in names
                         if re.search(r"^\s*(backoffLimit:|restartPolicy: OnFailure)",
                                      open(os.path.join(top, name)).read(), re.M)
                         and name != "_jobs.tpl")
    assert spelled_out == [], "a Job's spec belongs in archway.commandJobSpec"


# --- uninstall always finishes; the second scheduler drains (issue 38, findings 4 and 9) ---------

def _hook_events(doc) -> set[str]:
    return set((doc["metadata"].get("annotations") or {}).get("helm.sh/hook", "").split(",")) - {""}


@pytest.mark.parametrize("case", ["default", "scheduler-on", "cert-manager"])
def test_every_hook_job_preempts_with_a_class_there_only_while_hooks_run(render, case):
    """On a full node a hook Job's pod must preempt a workload's, or `helm install/upgrade/
    uninstall --wait` never ends: each hook Job gets the chart's PriorityClass, itself a hook of
    every event a Job runs in (made first, deleted after), so nothing of it outlives a hook."""
    docs = render(case)
    (priority,) = find(docs, "PriorityClass")
    annotations = priority["metadata"]["annotations"]
    assert set(annotations["helm.sh/hook-delete-policy"].split(",")) == {
        "before-hook-creation", "hook-succeeded"}
    assert priority["value"] == 1000000 and priority["globalDefault"] is False
    jobs = [d for d in docs if d["kind"] == "Job"]
    assert jobs and all(_hook_events(j) for j in jobs)
    for job in jobs:
        assert job["spec"]["template"]["spec"]["priorityClassName"] == priority["metadata"]["name"]
    assert _hook_events(priority) == set().union(*(_hook_events(j) for j in jobs))
    hooks = [d for d in docs if _hook_events(d) and d is not priority]
    assert all(int(annotations["helm.sh/hook-weight"]) < int(d["metadata"]["annotations"][
        "helm.sh/hook-weight"]) for d in hooks)
    for cron in find(docs, "CronJob") if case != "cert-manager" else []:   # runs after the hooks
        assert "priorityClassName" not in cron["spec"]["jobTemplate"]["spec"]["template"]["spec"]


@pytest.mark.parametrize("values, expected", [
    (["--set", "tls.bootstrap.priorityClassName=system-cluster-critical"], "system-cluster-critical"),
    (["--set", "hooks.priorityClass.create=false"], None)])
def test_hook_jobs_take_a_named_class_or_none(helm_env, values, expected):
    docs = [d for d in yaml.safe_load_all(helm(helm_env, "template", RELEASE, CHART, "-n", NS,
                                                *values).stdout) if d]
    assert not [d for d in docs if d["kind"] == "PriorityClass"]
    for job in find(docs, "Job"):
        assert job["spec"]["template"]["spec"].get("priorityClassName") == expected


def test_the_post_delete_cleanup_deletes_exactly_the_leases_archways_processes_hold(render):
    """What `helm uninstall` leaves otherwise: the Leases the gate controller and the second
    scheduler create (helm does not own them). The cleanup may delete those, by name, and list
    pods, nothing else; it waits for the pods that would make them again."""
    docs = render("scheduler-on")
    held = {name for role in find(docs, "Role") if not _hook_events(role)
            for rule in role["rules"] if "leases" in rule["resources"]
            for name in rule.get("resourceNames", [])}
    assert held == {"archway-gate-controller", "archway-scheduler"}
    cleanup = one(docs, "Role", f"{RELEASE}-archway-cleanup")
    assert _hook_events(cleanup) == {"post-delete"}
    assert cleanup["rules"] == [
        {"apiGroups": [""], "resources": ["pods"], "verbs": ["list"]},
        {"apiGroups": ["coordination.k8s.io"], "resources": ["leases"],
         "resourceNames": sorted(held), "verbs": ["delete"]}]
    job = one(docs, "Job", f"{RELEASE}-archway-cleanup")
    args = job["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[0] == "cleanup" and {a for a in args if a.startswith("--lease=")} == {
        f"--lease={name}" for name in held}
    selector = next(a for a in args if a.startswith("--wait-for-pods=")).split("=", 1)[1]
    assert selector == (f"app.kubernetes.io/instance={RELEASE},"
                        "app.kubernetes.io/component in (webhook,scheduler)")
    assert job["spec"]["template"]["spec"]["serviceAccountName"] == cleanup["metadata"]["name"]


@pytest.mark.parametrize("replicas", [1, 2])
def test_the_second_scheduler_has_a_budget_that_never_blocks_a_drain(helm_env, replicas):
    docs = [d for d in yaml.safe_load_all(helm(
        helm_env, "template", RELEASE, CHART, "-n", NS, "--set", "scheduler.enabled=true",
        "--set", f"scheduler.replicas={replicas}").stdout) if d]
    scheduler = one(docs, "Deployment", f"{RELEASE}-archway-scheduler")
    pdb = one(docs, "PodDisruptionBudget", f"{RELEASE}-archway-scheduler")
    labels = scheduler["spec"]["template"]["metadata"]["labels"]
    assert pdb["spec"]["selector"]["matchLabels"].items() <= labels.items()
    webhook = one(docs, "Deployment", f"{RELEASE}-archway")["spec"]["template"]["metadata"]["labels"]
    assert not pdb["spec"]["selector"]["matchLabels"].items() <= webhook.items()
    assert pdb["spec"]["maxUnavailable"] == 1 and "minAvailable" not in pdb["spec"]
    assert pdb["spec"]["unhealthyPodEvictionPolicy"] == "AlwaysAllow"
    refused = helm(helm_env, "template", RELEASE, CHART, "--set", "scheduler.enabled=true",
                   "--set", "scheduler.podDisruptionBudget.maxUnavailable=0", check=False)
    assert refused.returncode != 0 and "maxUnavailable" in refused.stderr


def test_the_placement_policy_crds_are_rendered_upgraded_and_kept(render):
    """Templates (so `helm upgrade` upgrades them), kept on uninstall, off with crds.install."""
    crds = {d["spec"]["names"]["kind"]: d for d in find(render("default"), "CustomResourceDefinition")}
    for kind, scope, short in (("PlacementPolicy", "Namespaced", "pp"),
                               ("ClusterPlacementPolicy", "Cluster", "cpp")):
        crd = crds[kind]
        assert crd["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
        assert crd["spec"]["group"] == "archway.dev" and crd["spec"]["scope"] == scope
        assert crd["spec"]["names"]["categories"] == ["archway"]
        assert crd["spec"]["names"]["shortNames"] == [short]
        (version,) = crd["spec"]["versions"]
        assert version["name"] == "v1alpha1" and version["subresources"] == {"status": {}}
        columns = [c["name"] for c in version["additionalPrinterColumns"]]
        assert columns[:3] == ["Mode", "Priority", "Selector"] and columns[-1] == "Age"
        spec = version["schema"]["openAPIV3Schema"]["properties"]["spec"]
        assert ("namespaceSelector" in spec["properties"]) == (scope == "Cluster")
        rules = [r["rule"] for r in spec["x-kubernetes-validations"]]
        assert any("excludedArchitectures" in r for r in rules)
        status = version["schema"]["openAPIV3Schema"]["properties"]["status"]["properties"]
        assert {"observedGeneration", "conditions"} <= set(status)
    assert not [d for d in render("no-crds") if d["kind"] == "CustomResourceDefinition"]


def test_placement_policy_rbac_is_least_privilege_and_aggregated_to_namespace_roles(render):
    docs = render("default")
    reader = one(docs, "ClusterRole", f"{RELEASE}-archway-placement-policies")
    assert reader["rules"] == [
        {"apiGroups": ["archway.dev"], "resources": ["placementpolicies", "clusterplacementpolicies"],
         "verbs": ["list", "watch"]},
        {"apiGroups": ["archway.dev"],
         "resources": ["placementpolicies/status", "clusterplacementpolicies/status"],
         "verbs": ["update"]}]
    binding = one(docs, "ClusterRoleBinding", f"{RELEASE}-archway-placement-policies")
    assert [s["name"] for s in binding["subjects"]] == [f"{RELEASE}-archway"]
    edit = one(docs, "ClusterRole", f"{RELEASE}-archway-placementpolicies-edit")
    view = one(docs, "ClusterRole", f"{RELEASE}-archway-placementpolicies-view")
    labels = edit["metadata"]["labels"]
    assert labels["rbac.authorization.k8s.io/aggregate-to-admin"] == "true"
    assert labels["rbac.authorization.k8s.io/aggregate-to-edit"] == "true"
    assert view["metadata"]["labels"]["rbac.authorization.k8s.io/aggregate-to-view"] == "true"
    assert "aggregate-to-edit" not in str(view["metadata"]["labels"])
    assert {v for r in view["rules"] for v in r["verbs"]} == {"get", "list", "watch"}
    # ClusterPlacementPolicies: cluster admins only, aggregated to no role.
    aggregated = [d for d in docs if d["kind"] == "ClusterRole"
                  and any(k.startswith("rbac.authorization.k8s.io/aggregate-to")
                          for k in d["metadata"].get("labels", {}))]
    assert aggregated and "clusterplacementpolicies" not in str([r["rules"] for r in aggregated])
    scheduled = config_from_dict(archway_configs(render("no-renewal-custom-config"))["webhook.yaml"])
    assert scheduled.placement.archway_scheduler == "archway-scheduler"
    assert config_from_dict(archway_configs(docs)["webhook.yaml"]).placement.archway_scheduler is None
