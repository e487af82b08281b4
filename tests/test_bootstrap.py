"""`archway certs bootstrap` against the real kube-apiserver (tests/conftest.py's control plane):
the MutatingWebhookConfiguration is the one the Helm chart renders, the Secrets are what the
webhook pods mount, and the real garbage collector removes them with it. The bootstrap runs as a
ServiceAccount with exactly the chart's certgen rules; what it wrote, in which order, is read
from the apiserver's audit log. Time moves by passing `now`; certificates are checked with the real
openssl. A writer that always wins (409 forever) is the one fault left to the stand-in."""
import base64
import datetime as dt
import os
import subprocess
import sys

import pytest
import yaml

from archway.certs import x509 as cx
from archway.certs.bootstrap import (
    BootstrapError,
    BootstrapSpec,
    ca_bundle_patch,
    run_bootstrap,
)
from archway.config import KubernetesSettings
from archway.kubeclient import build_api_client
from lab.kube import KubeError
from lab.procs import REPO, require_binary, wait_until
from lab.servers.apiserver import FakeApiServer

NS, SERVICE, SECRET, MWC = "bootstrap", "archway", "archway-tls", "archway-bootstrap-test"
TLS_PATH = f"/api/v1/namespaces/{NS}/secrets/{SECRET}"
CA_PATH = f"/api/v1/namespaces/{NS}/secrets/{SECRET}-ca"
MWC_PATH = f"/apis/admissionregistration.k8s.io/v1/mutatingwebhookconfigurations/{MWC}"
SECRETS = f"/api/v1/namespaces/{NS}/secrets"
PATHS = (CA_PATH, MWC_PATH, TLS_PATH)


@pytest.fixture(scope="module")
def chart_webhook_config(tmp_path_factory):
    """The chart's MutatingWebhookConfiguration, with its two webhooks (pods, and debug
    containers) so "every webhook" is tested; under its own name, and selecting no pod (other
    tests share the apiserver)."""
    home = tmp_path_factory.mktemp("helm")
    env = {**os.environ, **{f"HELM_{k}_HOME": str(home / k) for k in ("CACHE", "CONFIG", "DATA")}}
    out = subprocess.run(
        [require_binary("helm"), "template", "archway", os.path.join(REPO, "charts", "archway"),
         "-n", NS, "--show-only", "templates/mutatingwebhookconfiguration.yaml"],
        capture_output=True, text=True, env=env, timeout=60, check=True).stdout
    config = yaml.safe_load(out)
    assert "caBundle" not in config["webhooks"][0]["clientConfig"]   # bootstrap mode fills it
    config["metadata"]["name"] = MWC
    assert [w["name"] for w in config["webhooks"]] == ["pods.archway.dev",
                                                       "debug-containers.archway.dev"]
    for webhook in config["webhooks"]:
        webhook["objectSelector"] = {"matchLabels": {"archway-bootstrap-test": "never"}}
    return config


# The chart's certgen Role and ClusterRole (templates/certgen/_certgen.tpl): the bootstrap runs
# with exactly these rights.
CERTGEN_NAMESPACE_RULES = [
    {"apiGroups": [""], "resources": ["secrets"], "verbs": ["create"]},
    {"apiGroups": [""], "resources": ["secrets"], "verbs": ["get", "update"],
     "resourceNames": [SECRET, f"{SECRET}-ca"]}]
CERTGEN_CLUSTER_RULES = [
    {"apiGroups": ["admissionregistration.k8s.io"], "resources": ["mutatingwebhookconfigurations"],
     "verbs": ["get", "patch"], "resourceNames": [MWC]}]
CERTGEN_USER = f"system:serviceaccount:{NS}:certgen"
WRITES = ("create", "update", "patch", "delete")


class Api:
    """The real apiserver: the admin sets the scene, the bootstrap runs as the chart's certgen
    ServiceAccount, and what it wrote is read from the apiserver's audit log."""

    def __init__(self, plane):
        self.plane = plane
        self.kube = plane.kube
        self.certgen = plane.identity(NS, "certgen", cluster_rules=CERTGEN_CLUSTER_RULES,
                                      namespace_rules={NS: CERTGEN_NAMESPACE_RULES})
        self._mark = 0

    def kubeconfig(self, _directory: str) -> str:
        return self.certgen

    def mark(self) -> None:
        self._mark = self.plane.audit_mark()

    def writes(self) -> list[tuple[str, str]]:
        """(verb, path) of every write the bootstrap made since mark(), in order."""
        return [(verb, uri.split("?")[0]) for verb, uri in
                self.plane.requests_since(self._mark, user=CERTGEN_USER) if verb in WRITES]

    def get(self, path: str) -> dict | None:
        try:
            return self.kube.get(path)
        except KubeError as e:
            if e.status == 404:
                return None
            raise

    def put(self, path: str, body: dict) -> dict:
        return self.kube.put(path, body)

    def create(self, path: str, body: dict) -> dict:
        return self.kube.create(path.rsplit("/", 1)[0], body)

    def delete(self, path: str) -> None:
        self.kube.delete(path)
        wait_until(lambda: self.get(path) is None, 30, f"{path} to be gone")


@pytest.fixture(scope="module")
def api_server(control_plane):
    if not control_plane.kube.exists(f"/api/v1/namespaces/{NS}"):
        control_plane.new_namespace(NS)
    return Api(control_plane)


@pytest.fixture
def api(api_server, chart_webhook_config):
    """The namespace emptied of the Secrets, and the chart's webhook configuration afresh."""
    for path in PATHS:
        if api_server.get(path) is not None:
            api_server.delete(path)
    api_server.create(MWC_PATH, chart_webhook_config)
    api_server.mark()
    return api_server


@pytest.fixture(scope="module")
def client(api_server):
    c, _ = build_api_client(KubernetesSettings(kubeconfig=api_server.certgen))
    yield c
    c.close()


SPEC = BootstrapSpec(namespace=NS, service=SERVICE, secret=SECRET, webhook_config=MWC)
NAMES = {"archway", "archway.bootstrap", "archway.bootstrap.svc", "archway.bootstrap.svc.cluster.local"}


def later(days: float) -> dt.datetime:
    return cx.utcnow() + dt.timedelta(days=days)


def secret_data(api, path) -> dict[str, bytes]:
    return {k: base64.b64decode(v) for k, v in api.get(path)["data"].items()}


def ca_bundles(api) -> list[bytes]:
    return [base64.b64decode(w["clientConfig"]["caBundle"]) for w in api.get(MWC_PATH)["webhooks"]]


def openssl_verify(tmp_path, bundle: bytes, cert: bytes, at: dt.datetime | None = None) -> str:
    (tmp_path / "bundle.pem").write_bytes(bundle)
    (tmp_path / "leaf.pem").write_bytes(cert)
    args = [require_binary("openssl"), "verify", "-CAfile", str(tmp_path / "bundle.pem"),
            "-purpose", "sslserver", "-verify_hostname", "archway.bootstrap.svc"]
    if at:
        args += ["-attime", str(int(at.timestamp()))]
    out = subprocess.run(args + [str(tmp_path / "leaf.pem")], capture_output=True, text=True)
    return (out.stdout + out.stderr).strip()


def test_first_run_through_the_cli_creates_secrets_and_patches_every_webhook(api, tmp_path):
    kubeconfig = api.kubeconfig(str(tmp_path))
    run = subprocess.run(
        [sys.executable, "-m", "archway.main.cli", "certs", "bootstrap", "--kubeconfig", kubeconfig,
         "--namespace", NS, "--service", SERVICE, "--secret", SECRET, "--webhook-config", MWC],
        cwd=REPO, capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    assert f"TLS secret {NS}/archway-tls: created" in run.stdout
    assert "patched, 2 webhook(s)" in run.stdout
    assert "PRIVATE KEY" not in run.stdout + run.stderr

    tls = api.get(TLS_PATH)
    assert tls["type"] == "kubernetes.io/tls"
    data = secret_data(api, TLS_PATH)
    assert set(data) == {"tls.crt", "tls.key", "ca.crt"}
    assert api.get(CA_PATH)["type"] == "Opaque" and set(secret_data(api, CA_PATH)) == {"ca.crt", "ca.key"}
    assert "ca.key" not in data                     # the pods never get the CA's key

    assert ca_bundles(api) == [data["ca.crt"], data["ca.crt"]]
    assert openssl_verify(tmp_path, data["ca.crt"], data["tls.crt"]).endswith(": OK")
    leaf = cx.load_issued(data["tls.crt"], data["tls.key"]).cert
    assert cx.hosts_of(leaf) == NAMES
    # Two Secrets created, one patch; nothing else written.
    assert sorted(api.writes()) == [("create", SECRETS), ("create", SECRETS), ("patch", MWC_PATH)]
    # Everything else in the webhook configuration is as the chart rendered it.
    webhook = api.get(MWC_PATH)["webhooks"][0]
    assert webhook["failurePolicy"] == "Ignore" and webhook["clientConfig"]["service"]["name"] == SERVICE


def test_second_run_changes_nothing(api, client):
    first = run_bootstrap(SPEC, client)
    api.mark()
    second = run_bootstrap(SPEC, client)
    assert api.writes() == []
    assert (second.ca, second.certificate, second.webhook_config) == ("unchanged",) * 3
    assert second.serial == first.serial


def test_valid_certificate_left_alone_months_later(api, client):
    run_bootstrap(SPEC, client)
    before = secret_data(api, TLS_PATH)
    api.mark()
    result = run_bootstrap(SPEC, client, now=later(300))      # 65 days left > 30
    assert result.certificate == "unchanged" and api.writes() == []
    assert secret_data(api, TLS_PATH) == before


def test_expiring_certificate_renewed_under_the_same_ca(api, client, tmp_path):
    run_bootstrap(SPEC, client)
    before = secret_data(api, TLS_PATH)
    ca_before = secret_data(api, CA_PATH)
    api.mark()
    when = later(340)                                          # 25 days left < 30
    result = run_bootstrap(SPEC, client, now=when)
    after = secret_data(api, TLS_PATH)
    assert result.certificate == "renewed" and "expires" in result.reasons[0]
    assert after["tls.crt"] != before["tls.crt"] and after["tls.key"] != before["tls.key"]
    assert secret_data(api, CA_PATH) == ca_before
    # The caBundle does not change: pods still serving the old leaf stay trusted meanwhile.
    assert after["ca.crt"] == before["ca.crt"] and ca_bundles(api) == [before["ca.crt"]] * 2
    assert api.writes() == [("update", TLS_PATH)]
    assert openssl_verify(tmp_path, after["ca.crt"], after["tls.crt"], at=when).endswith(": OK")
    assert openssl_verify(tmp_path, after["ca.crt"], before["tls.crt"], at=when).endswith(": OK")


def test_wrong_ca_bundle_is_fixed_on_that_webhook_only(api, client):
    run_bootstrap(SPEC, client)
    good = api.get(MWC_PATH)["webhooks"][0]["clientConfig"]["caBundle"]
    stranger = base64.b64encode(cx.issue_ca("someone else", days=10).cert_pem).decode()
    config = api.get(MWC_PATH)
    config["webhooks"][1]["clientConfig"]["caBundle"] = stranger
    api.put(MWC_PATH, config)
    api.mark()
    result = run_bootstrap(SPEC, client)
    assert (result.webhook_config, result.webhooks_patched) == ("patched", 1)
    assert api.writes() == [("patch", MWC_PATH)]
    assert [w["clientConfig"]["caBundle"] for w in api.get(MWC_PATH)["webhooks"]] == [good, good]


def test_certificate_for_other_names_or_garbage_is_replaced(api, client):
    run_bootstrap(SPEC, client)
    other = BootstrapSpec(namespace=NS, service="renamed", secret=SECRET, webhook_config=MWC)
    result = run_bootstrap(other, client)
    assert result.certificate == "renewed" and "names" in result.reasons[0]
    leaf = cx.load_cert(secret_data(api, TLS_PATH)["tls.crt"])
    assert "renamed.bootstrap.svc" in cx.hosts_of(leaf)

    tls = api.get(TLS_PATH)
    tls["data"]["tls.crt"] = base64.b64encode(b"not a certificate").decode()
    api.put(TLS_PATH, tls)
    result = run_bootstrap(other, client)
    assert result.certificate == "renewed" and "unusable" in result.reasons[0]
    assert cx.load_issued(secret_data(api, TLS_PATH)["tls.crt"], secret_data(api, TLS_PATH)["tls.key"])


def test_ca_rotation_trusts_both_cas_and_patches_before_serving(api, client, tmp_path):
    run_bootstrap(SPEC, client)
    # Years later: the leaf has been renewed under the CA, which has 400 days left...
    renewed_at = later(3650 - 400)
    assert run_bootstrap(SPEC, client, now=renewed_at).ca == "unchanged"
    old = secret_data(api, TLS_PATH)
    api.mark()
    # ...and ten days later the CA can no longer cover a full 365-day leaf + 30 days.
    when = renewed_at + dt.timedelta(days=10)
    result = run_bootstrap(SPEC, client, now=when)
    assert (result.ca, result.certificate) == ("renewed", "renewed")
    new = secret_data(api, TLS_PATH)
    bundle = cx.load_certs(new["ca.crt"])
    assert len(bundle) == 2 and bundle[1] == cx.load_cert(old["ca.crt"])
    assert ca_bundles(api) == [new["ca.crt"]] * 2
    # Order: CA Secret, then caBundle, then the serving Secret.
    assert api.writes() == [("update", CA_PATH), ("patch", MWC_PATH), ("update", TLS_PATH)]
    # Both the old leaf (pods not yet synced) and the new one verify against the caBundle.
    assert openssl_verify(tmp_path, new["ca.crt"], old["tls.crt"], at=when).endswith(": OK")
    assert openssl_verify(tmp_path, new["ca.crt"], new["tls.crt"], at=when).endswith(": OK")
    # The old caBundle alone would not have trusted the new leaf: the patch had to come first.
    assert not openssl_verify(tmp_path, old["ca.crt"], new["tls.crt"], at=when).endswith(": OK")

    # A run right after (e.g. post-upgrade after pre-upgrade) keeps both CAs.
    api.mark()
    run_bootstrap(SPEC, client, now=when + dt.timedelta(minutes=1))
    assert api.writes() == []
    # Once the old CA has expired it leaves the bundle.
    gone = when + dt.timedelta(days=400)
    run_bootstrap(SPEC, client, now=gone)
    assert len(cx.load_certs(secret_data(api, TLS_PATH)["ca.crt"])) == 1
    assert ca_bundles(api) == [secret_data(api, TLS_PATH)["ca.crt"]] * 2


def test_missing_webhook_config(api, client):
    api.delete(MWC_PATH)
    with pytest.raises(BootstrapError, match="not found"):
        run_bootstrap(SPEC, client)
    pre_install = BootstrapSpec(namespace=NS, service=SERVICE, secret=SECRET, webhook_config=MWC,
                                allow_missing_webhook_config=True)
    result = run_bootstrap(pre_install, client)
    assert result.webhook_config == "missing" and api.get(TLS_PATH) is not None


def owners(api, path) -> list[dict]:
    return api.get(path)["metadata"].get("ownerReferences") or []


def test_secrets_belong_to_the_webhook_configuration_so_uninstall_removes_them(
        api, client, chart_webhook_config):
    """Helm never knew the Secrets the bootstrap made: owned by the chart's webhook
    configuration, the garbage collector deletes them with it (`helm uninstall`). The
    pre-install run comes before that configuration exists; the post-install run adopts them."""
    api.delete(MWC_PATH)
    pre_install = BootstrapSpec(namespace=NS, service=SERVICE, secret=SECRET, webhook_config=MWC,
                                allow_missing_webhook_config=True)
    run_bootstrap(pre_install, client)
    assert owners(api, TLS_PATH) == owners(api, CA_PATH) == []
    data_before = {p: api.get(p)["data"] for p in (TLS_PATH, CA_PATH)}

    api.create(MWC_PATH, chart_webhook_config)              # helm creates it; post-install run
    uid = api.get(MWC_PATH)["metadata"]["uid"]
    result = run_bootstrap(SPEC, client)
    expected = [{"apiVersion": "admissionregistration.k8s.io/v1",
                 "kind": "MutatingWebhookConfiguration", "name": MWC, "uid": uid}]
    assert owners(api, TLS_PATH) == owners(api, CA_PATH) == expected
    # Adopting is not renewing: same certificate, same CA.
    assert (result.ca, result.certificate) == ("unchanged", "unchanged")
    assert {p: api.get(p)["data"] for p in (TLS_PATH, CA_PATH)} == data_before

    api.mark()                                               # owned: nothing more to write
    run_bootstrap(SPEC, client)
    assert api.writes() == []
    # A renewal keeps the ownerReference (and any other owner the Secret had).
    run_bootstrap(SPEC, client, now=later(340))
    assert owners(api, TLS_PATH) == expected
    # `helm uninstall` deletes the configuration: the garbage collector takes the Secrets.
    api.delete(MWC_PATH)
    wait_until(lambda: api.get(TLS_PATH) is None and api.get(CA_PATH) is None, 30,
               "the garbage collector to delete the Secrets")


def test_a_refusal_of_the_api_is_one_clear_line(api, tmp_path):
    """The real authorizer's 403: a ServiceAccount without the chart's certgen role."""
    api.kube.create(f"/api/v1/namespaces/{NS}/serviceaccounts",
                    {"metadata": {"name": "no-rights"}}) if not api.get(
        f"/api/v1/namespaces/{NS}/serviceaccounts/no-rights") else None
    token = api.kube.service_account_token(NS, "no-rights", seconds=600)
    kubeconfig = tmp_path / "no-rights.kubeconfig"
    kubeconfig.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "c",
        "clusters": [{"name": "c", "cluster": {"server": api.plane.server,
                                                "certificate-authority": api.plane.ca_path}}],
        "users": [{"name": "u", "user": {"token": token}}],
        "contexts": [{"name": "c", "context": {"cluster": "c", "user": "u"}}]}))
    refused, _ = build_api_client(KubernetesSettings(kubeconfig=str(kubeconfig)))
    try:
        with pytest.raises(BootstrapError, match="403") as error:
            run_bootstrap(SPEC, refused)
        assert "forbidden" in str(error.value)
    finally:
        refused.close()
    run = subprocess.run(
        [sys.executable, "-m", "archway.main.cli", "certs", "bootstrap", "--kubeconfig", str(kubeconfig),
         "--namespace", NS, "--service", SERVICE, "--secret", SECRET], cwd=REPO,
        capture_output=True, text=True, timeout=60)
    assert run.returncode == 2 and "403" in run.stderr and "Traceback" not in run.stderr
    assert len(run.stderr.strip().splitlines()) == 1, run.stderr


def test_a_writer_that_always_wins_is_given_up_on(tmp_path):
    """409 on every write, forever: only the stand-in can be made to do that."""
    stand_in = FakeApiServer()
    try:
        stand_in.faults[f"/api/v1/namespaces/{NS}/secrets"] = 409
        client, _ = build_api_client(KubernetesSettings(kubeconfig=stand_in.kubeconfig(str(tmp_path))))
        try:
            with pytest.raises(BootstrapError, match="409"):
                run_bootstrap(SPEC, client)
        finally:
            client.close()
    finally:
        stand_in.stop()


def test_spec_rejects_inconsistent_lifetimes():
    with pytest.raises(BootstrapError, match="renew-before"):
        BootstrapSpec(namespace=NS, service=SERVICE, secret=SECRET, days=20, renew_before_days=30)
    with pytest.raises(BootstrapError, match="ca-days"):
        BootstrapSpec(namespace=NS, service=SERVICE, secret=SECRET, days=365, ca_days=366)


def test_ca_bundle_patch_is_guarded_by_names():
    config = {"webhooks": [{"name": "a", "clientConfig": {"caBundle": "Rk9P"}},
                           {"name": "b"}]}
    assert ca_bundle_patch(config, "Rk9P") == [
        {"op": "test", "path": "/webhooks/1/name", "value": "b"},
        {"op": "add", "path": "/webhooks/1/clientConfig", "value": {}},
        {"op": "add", "path": "/webhooks/1/clientConfig/caBundle", "value": "Rk9P"}]
    assert ca_bundle_patch({"webhooks": []}, "x") == []
