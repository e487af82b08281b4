"""charts/archway with the real helm v3: lint --strict and template for the default values, every
TLS mode and the feature toggles; every rendered manifest validated by kubernetes-validate
(strict) for Kubernetes 1.30 and 1.33; the CRD kinds it renders checked for their required fields
here (and the alert expressions by the real promtool); the archway config it renders loaded by
archway.config; the KubeSchedulerConfiguration compared with `archway scheduler-config`."""
import base64
import functools
import os
import re
import subprocess

import kubernetes_validate
import pytest
import yaml

from tests.infra.procs import REPO, require_binary
from archway.config import config_from_dict

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
    "scheduler-off": ["--set", "scheduler.enabled=false"],
    "scheduler-name-on": ["--set", "scheduler.setSchedulerName=true",
                          "--set", "scheduler.name=arch-aware", "--set", "scheduler.extender.port=9444",
                          "--set", "scheduler.extender.nodeCacheCapable=false",
                          "--set", "scheduler.extender.weight=3"],
    "monitoring": ["--set", "metrics.serviceMonitor.enabled=true",
                   "--set", "metrics.prometheusRule.enabled=true",
                   "--set", "scheduler.extender.exposeMetrics=true"],
    "image-digest": ["--set", "image.repository=registry.example.com/platform/archway",
                     "--set", "image.tag=v1.2.3", "--set", f"image.digest=sha256:{'ab' * 32}"],
    "registry-access-eks": ["-f", os.path.join(FIXTURES, "registry-access-eks.yaml")],
    "registry-access-gke": ["-f", os.path.join(FIXTURES, "registry-access-gke.yaml")],
    "no-renewal-custom-config": ["--set", "tls.bootstrap.renewal.enabled=false",
                                 "--set", "config.prometheus.url=http://prometheus.monitoring:9090",
                                 "--set", "config.registry.insecure_hosts={registry.lab:5000}",
                                 "--set", "webhook.excludeNamespaces={kube-system,monitoring}"],
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
    @functools.lru_cache(maxsize=None)
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
    expected_custom = {"cert-manager": 4, "cert-manager-own-issuer": 1, "monitoring": 3}
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
    assert set(alerts) == {"ArchwayWebhookDown", "ArchwayHighFailOpenRate", "ArchwayPrometheusDataStale"}
    # The metric names are the ones archway exports (webhook/metrics.py, webhook/traffic.py).
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
    (["--set", "tls.mode=secret"], "secretName"),
    (["--set", "scheduler.extender.httpTimeout=2 seconds"], "httpTimeout"),
    (["--set", "replicas=3"], "replicas"),
    (["--set", "credentialProviders.providers[0].name=ecr", "--set",
      "credentialProviders.providers[0].apiVersion=credentialprovider.kubelet.k8s.io/v9"], "apiVersion"),
    (["--set", "registryHosts.hostPath=relative/certs.d"], "hostPath"),
    (["--set", "config.registry.proxy.urls=http://p:3128"], "urls"),
])
def test_schema_rejects_wrong_values(helm_env, values, complaint):
    result = helm(helm_env, "lint", "--strict", CHART, *values, check=False)
    assert result.returncode != 0
    assert complaint in result.stdout + result.stderr


@pytest.mark.parametrize("values, complaint", [
    (["--set", "webhook.timeoutSeconds=3"], "must be above config.admission.deadline_seconds"),
    (["--set", "scheduler.extender.httpTimeout=2s"], "must be above config.extender.deadline_seconds"),
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

def test_webhook_configuration_defaults(render):
    docs = render("default")
    mwc = one(docs, "MutatingWebhookConfiguration")
    [webhook] = mwc["webhooks"]
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
    assert pdb["spec"]["minAvailable"] == 1
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
    assert webhook.placement.scheduler_name is None          # default: never a Pending pod


def test_bootstrap_mode_jobs_and_rbac(render):
    docs = render("default")
    mwc = one(docs, "MutatingWebhookConfiguration")
    assert "caBundle" not in mwc["webhooks"][0]["clientConfig"]
    assert "annotations" not in mwc["metadata"]
    jobs = {j["metadata"]["name"]: j for j in find(docs, "Job")}
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
    assert reader["rules"] == [{"apiGroups": [""], "resources": ["serviceaccounts", "secrets"],
                                "verbs": ["get"]}]


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
    assert not [d for d in docs if d["kind"] in ("Job", "CronJob")]

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
    assert not [d for d in docs if d["kind"] in ("Job", "CronJob", "Certificate", "Issuer")]


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
    ("default", dict(http_timeout="3s", lease_namespace=NS)),
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
    from archway.app import create_app
    routes = {rule.rule for rule in create_app(sidecar).url_map.iter_rules()}
    assert routes == {f"/scheduler/{extender['filterVerb']}",
                      f"/scheduler/{extender['prioritizeVerb']}",
                      "/healthz", "/readyz", "/metrics"}

    # The profile's name is the one the webhook injects (when it injects one).
    webhook = config_from_dict(archway_configs(docs)["webhook.yaml"])
    webhook_routes = {rule.rule for rule in create_app(webhook).url_map.iter_rules()}
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
    docs = render("default")
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

    off = render("scheduler-off")
    assert not [d for d in off if "scheduler" in d["metadata"]["name"]]
    assert set(archway_configs(off)) == {"webhook.yaml"}


def test_monitoring_scrapes_the_webhook_over_verified_tls(render):
    docs = render("monitoring")
    monitor = one(docs, "ServiceMonitor", f"{RELEASE}-archway")
    service = one(docs, "Service", f"{RELEASE}-archway")
    assert monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    [endpoint] = monitor["spec"]["endpoints"]
    assert endpoint["port"] == service["spec"]["ports"][0]["name"] and endpoint["path"] == "/metrics"
    assert endpoint["tlsConfig"]["ca"]["secret"] == {"name": f"{RELEASE}-archway-tls", "key": "ca.crt"}
    assert endpoint["tlsConfig"]["serverName"] == f"{RELEASE}-archway.{NS}.svc"
    sidecar = config_from_dict(archway_configs(docs)["extender.yaml"])
    assert sidecar.server.bind == "0.0.0.0:8444"        # exposeMetrics: reachable for scraping


# --- registry access as the nodes have it --------------------------------------------------------

def pods(docs):
    return {d["metadata"]["name"]: d["spec"]["template"]["spec"] for d in find(docs, "Deployment")}


def test_credential_providers_get_the_kubelets_files_in_every_archway_pod(render):
    from archway.registry.providers import parse_provider_config
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

def archway_containers(docs) -> list[dict]:
    """Every container and initContainer of every workload that runs archway's own image."""
    found = []
    for doc in docs:
        spec = doc.get("spec", {})
        pod = (spec.get("jobTemplate", {}).get("spec", spec)).get("template", {}).get("spec")
        for c in (pod or {}).get("containers", []) + (pod or {}).get("initContainers", []):
            if "kube-scheduler" not in c["image"]:
                found.append(c)
    return found


def test_image_digest_pins_every_archway_container(render):
    default = archway_containers(render("default"))
    assert default and {c["image"] for c in default} == {"ghcr.io/archway/archway:0.1.0"}
    pinned = archway_containers(render("image-digest"))
    assert len(pinned) == len(default)
    assert {c["image"] for c in pinned} == {f"registry.example.com/platform/archway@sha256:{'ab' * 32}"}


def test_schema_rejects_a_digest_that_is_not_sha256(helm_env):
    result = helm(helm_env, "template", RELEASE, CHART, "--set", "image.digest=v1.2.3", check=False)
    assert result.returncode != 0 and "/image/digest" in result.stderr


def test_dockerfile_user_is_the_charts_security_context():
    with open(os.path.join(REPO, "Dockerfile")) as f:
        (user,) = re.findall(r"^USER\s+(\S+)\s*$", f.read(), re.MULTILINE)
    with open(os.path.join(CHART, "values.yaml")) as f:
        security = yaml.safe_load(f)["podSecurityContext"]
    assert user == f"{security['runAsUser']}:{security['runAsGroup']}"
    assert security["fsGroup"] == security["runAsGroup"]   # the emptyDir state dir is the user's
