"""Workload-identity pulls (KEP-4412) through the webhook, on the real control plane: a replica of
the chart's `archway serve`, running as the chart's webhook ServiceAccount with the RBAC the chart
renders for rbac.serviceAccountTokenNamespaces, admits pods whose only way into the lab's
authenticating registry is a genuine token of their own ServiceAccount, which the lab's plugin
(lab/cluster/tokenplugin.py) checks with a TokenReview before it answers.

- a pod of the opted-in namespace is placed on its image's architecture, with no pull secret;
- a pod of another namespace, whose ServiceAccount has the same name and annotations, is gated:
  no token of its ServiceAccount is requested (the apiserver's audit log says so), nor of the
  first namespace's;
- no token is in archway's log, and the requests are counted.
"""
import os
import time

import pytest
import yaml

from lab.cluster import tokenplugin
from lab.cluster.chart import CHART
from lab.cluster.controlplane import stop_process
from tests.infra.fixtures import LOOPBACK_HOSTS, test_ca, token_registry

from .test_image_records import admit
from .workloads import pod

AUDIENCE = "registry.e2e.archway.dev"
ROBOT = "e2e.archway.dev/robot"


def chart_token_rbac(archway, namespaces: list[str]) -> list[dict]:
    """The token-requester ClusterRole and bindings the chart renders for these namespaces."""
    values = archway.plane.path("values-workload-identity.yaml")
    with open(values, "w") as f:
        yaml.safe_dump(archway.values, f)
    out = archway.helm("template", archway.release, CHART, "--values", values, "--set",
                       "rbac.serviceAccountTokenNamespaces={" + ",".join(namespaces) + "}").stdout
    return [d for d in yaml.safe_load_all(out)
            if d and d["metadata"]["name"].endswith("-token-requester")]


class Identity:
    def __init__(self, archway, control_plane, registry, ca, tmp_path):
        self.kube, self.plane, self.registry = control_plane.kube, control_plane, registry
        suffix = str(int(time.time() * 1000) % 10**6)
        self.a = control_plane.new_namespace(f"e2e-wi-a-{suffix}")
        self.b = control_plane.new_namespace(f"e2e-wi-b-{suffix}")
        for namespace in (self.a, self.b):
            self.kube.create(f"/api/v1/namespaces/{namespace}/serviceaccounts",
                             {"metadata": {"name": "puller", "annotations": {ROBOT: "robot-1"}}})
        self.rbac = chart_token_rbac(archway, [self.a])
        for doc in self.rbac:
            archway.apply(doc)
        reviewer = control_plane.identity(self.a, "token-reviewer", cluster_rules=[
            {"apiGroups": ["authentication.k8s.io"], "resources": ["tokenreviews"],
             "verbs": ["create"]}])
        bin_dir = str(tmp_path / "bin")
        tokenplugin.install(bin_dir)
        self.calls_path, self.token_file = str(tmp_path / "calls.jsonl"), str(tmp_path / "token")
        config = str(tmp_path / "providers.yaml")
        entry = tokenplugin.provider_entry(
            match=[registry.host], audience=AUDIENCE, kubeconfig=reviewer, calls=self.calls_path,
            accounts={f"{self.a}/puller": ("alice", registry.users["alice"])}, required=[ROBOT],
            extra_env={"TOKEN_FILE": self.token_file})
        with open(config, "w") as f:
            yaml.safe_dump({"apiVersion": "kubelet.config.k8s.io/v1",
                            "kind": "CredentialProviderConfig", "providers": [entry]}, f)
        self.replica = archway.start_replica("archway-identity-replica", {
            "registry": {"ca_file": ca.cert_path, "allow_hosts": list(LOOPBACK_HOSTS),
                         "credential_providers": {"config": config, "bin_dir": bin_dir}},
            "kubernetes": {"service_account_token_namespaces": [self.a]}})

    def token_requests(self, mark: int) -> list[str]:
        return [uri for verb, uri in self.plane.requests_since(mark)
                if verb == "create" and uri.endswith("/token")]


@pytest.fixture(scope="module")
def identity(archway, control_plane, token_registry, test_ca, tmp_path_factory):
    token_registry.push_image("wi/app", "v1", "linux/arm64")
    lab = Identity(archway, control_plane, token_registry, test_ca,
                   tmp_path_factory.mktemp("workload-identity"))
    yield lab
    stop_process(lab.replica.process)
    archway.replicas.remove(lab.replica)
    for doc in lab.rbac:
        control_plane.kube.delete(archway.object_path(doc))
    for namespace in (lab.a, lab.b):
        control_plane.kube.delete(f"/api/v1/namespaces/{namespace}")


def test_a_pod_is_placed_with_its_own_service_accounts_token_and_no_pull_secret(identity):
    image = identity.registry.ref("wi/app", "v1")
    mark = identity.plane.audit_mark()
    started = time.monotonic()
    first = admit(identity.replica, identity.a, pod("wi", [image], serviceAccountName="puller"))
    cold = time.monotonic() - started
    assert first == {"architectures": "arm64", "gated": False}, identity.replica.log(40)
    (call,) = tokenplugin.calls(identity.calls_path)
    assert call["user"] == f"system:serviceaccount:{identity.a}:puller" and call["answered"]
    assert call["audiences"] == [AUDIENCE] and call["annotations"] == {ROBOT: "robot-1"}
    assert identity.token_requests(mark) == [
        f"/api/v1/namespaces/{identity.a}/serviceaccounts/puller/token"]
    started = time.monotonic()
    again = admit(identity.replica, identity.a, pod("wi-2", [image], serviceAccountName="puller"))
    warm = time.monotonic() - started
    assert again == first
    metrics = identity.replica.get("/metrics").text
    assert 'archway_service_account_token_requests_total{outcome="issued"}' in metrics
    print(f"\nworkload identity through the webhook: first admission {cold * 1000:.0f} ms "
          f"(token, plugin + TokenReview, registry), next {warm * 1000:.0f} ms")


def test_another_namespace_is_not_read_and_no_token_of_anyone_is_requested_for_it(identity):
    image = identity.registry.ref("wi/app", "v1")
    mark = identity.plane.audit_mark()
    calls_before = len(tokenplugin.calls(identity.calls_path))
    other = admit(identity.replica, identity.b, pod("wi", [image], serviceAccountName="puller"))
    assert other == {"architectures": None, "gated": True}
    assert identity.token_requests(mark) == []
    assert len(tokenplugin.calls(identity.calls_path)) == calls_before


def test_no_token_is_in_archways_log_and_nothing_was_refused(identity):
    assert os.path.getsize(identity.token_file) > 100
    with open(identity.token_file) as f:
        token = f.read()
    log = identity.replica.log(100000)
    assert token not in log and token[-40:] not in log
    assert "403" not in log and "orbidden" not in log
