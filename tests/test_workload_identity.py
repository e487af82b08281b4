"""Workload-identity pulls (KEP-4412): credential providers with `tokenAttributes` run for a pod
with a token of its own ServiceAccount.

On the real control plane, archway runs with exactly the RBAC the chart grants it (get
ServiceAccounts; create serviceaccounts/token in the opted-in namespaces only), and the lab's
plugin (lab/cluster/tokenplugin.py) believes no token until the API server's TokenReview says it
is genuine, for its audience, and of a ServiceAccount it has a registry credential for: the
authenticating registry opens to a pod only through a genuine token of its own ServiceAccount.
"""
import logging
import os
import time

import pytest
from prometheus_client import REGISTRY

from archway.cluster.pullsecrets import PullSecrets
from archway.cluster.workloadidentity import WorkloadIdentities
from archway.config import Config, CredentialProviderSettings, KubernetesSettings, RegistrySettings
from archway.errors import AuthError, ConfigError
from archway.kubeapi import KubeApi
from archway.kubeclient import build_api_client
from archway.podview import PodView
from archway.registry.providerconfig import parse_provider_config
from archway.registry.providerplugin import WorkloadIdentity, request_body
from archway.registry.providers import CredentialProviders
from archway.registry.resolver import Resolver
from lab.clock import ManualClock
from lab.cluster import tokenplugin
from tests.infra.fixtures import LOOPBACK_HOSTS, test_ca, token_registry

AUDIENCE = "registry.lab.archway.dev"
ROBOT = "lab.archway.dev/robot"
TOKEN_REVIEWS = [{"apiGroups": ["authentication.k8s.io"], "resources": ["tokenreviews"],
                  "verbs": ["create"]}]
CHART_RULES = [{"apiGroups": [""], "resources": ["serviceaccounts"],   # the chart's, cluster-wide
                "verbs": ["get", "list", "watch"]}]
TOKEN_RULES = [{"apiGroups": [""], "resources": ["serviceaccounts/token"], "verbs": ["create"]}]


def tokens_requested(outcome: str = "issued") -> float:
    return REGISTRY.get_sample_value("archway_service_account_token_requests_total",
                                     {"outcome": outcome}) or 0.0


# --- the config, read as strictly as the kubelet -------------------------------------------------

def config_with(attributes: dict, api_version="credentialprovider.kubelet.k8s.io/v1") -> bytes:
    import yaml
    return yaml.safe_dump({"apiVersion": "kubelet.config.k8s.io/v1",
                           "kind": "CredentialProviderConfig",
                           "providers": [{"name": "p", "matchImages": ["*.example"],
                                          "defaultCacheDuration": "5m", "apiVersion": api_version,
                                          "tokenAttributes": attributes}]}).encode()


GOOD = {"serviceAccountTokenAudience": AUDIENCE, "cacheType": "ServiceAccount",
        "requireServiceAccount": True, "requiredServiceAccountAnnotationKeys": [ROBOT],
        "optionalServiceAccountAnnotationKeys": ["lab.archway.dev/team"]}


def test_token_attributes_are_read_as_the_kubelet_reads_them():
    (spec,) = parse_provider_config(config_with(GOOD), "c.yaml")
    assert spec.token.audience == AUDIENCE and spec.token.cache_type == "ServiceAccount"
    assert spec.token.require_service_account is True
    assert spec.token.required_annotations == (ROBOT,)
    assert spec.token.optional_annotations == ("lab.archway.dev/team",)


@pytest.mark.parametrize("change, words", [
    ({"serviceAccountTokenAudience": ""}, "serviceAccountTokenAudience is required"),
    ({"cacheType": None}, "cacheType is required: Token or ServiceAccount"),
    ({"cacheType": "Pod"}, "cacheType is required: Token or ServiceAccount, got 'Pod'"),
    ({"requireServiceAccount": None}, "requireServiceAccount is required"),
    ({"requireServiceAccount": False}, "needs requireServiceAccount: true"),
    ({"requiredServiceAccountAnnotationKeys": ["not a key"]}, "must be a list of annotation keys"),
    ({"requiredServiceAccountAnnotationKeys": [ROBOT, ROBOT]}, "lists a key twice"),
    ({"optionalServiceAccountAnnotationKeys": [ROBOT]}, "both required and optional"),
    ({"audience": "x"}, "unknown field(s) audience"),
])
def test_a_bad_token_attribute_is_a_clear_error(change, words):
    attributes = {k: v for k, v in {**GOOD, **change}.items() if v is not None}
    with pytest.raises(ConfigError) as error:
        parse_provider_config(config_with(attributes), "c.yaml")
    assert words in str(error.value) and "providers[0].tokenAttributes" in str(error.value)


def test_token_attributes_need_the_v1_request():
    with pytest.raises(ConfigError, match="needs apiVersion credentialprovider.kubelet.k8s.io/v1"):
        parse_provider_config(config_with(GOOD, "credentialprovider.kubelet.k8s.io/v1beta1"), "c")


def test_the_request_carries_the_token_and_annotations_and_the_identity_hides_its_token():
    (spec,) = parse_provider_config(config_with(GOOD), "c.yaml")
    identity = WorkloadIdentity("team-a", "puller", "uid-1", "secret-token", 0.0, ((ROBOT, "r1"),))
    body = request_body(spec, "reg.example/app", identity)
    assert body == (b'{"kind":"CredentialProviderRequest","apiVersion":'
                    b'"credentialprovider.kubelet.k8s.io/v1","image":"reg.example/app",'
                    b'"serviceAccountToken":"secret-token",'
                    b'"serviceAccountAnnotations":{"lab.archway.dev/robot":"r1"}}\n')
    assert "secret-token" not in repr(identity)


# --- on the real control plane -----------------------------------------------------------------

class Lab:
    """Namespaces, ServiceAccounts, archway's identity and the plugin's, on the control plane."""

    def __init__(self, plane, registry, tmp_path, ca):
        self.plane, self.kube, self.registry, self.ca = plane, plane.kube, registry, ca
        suffix = str(int(time.time() * 1000) % 10**8)
        self.a, self.b, self.c = (plane.new_namespace(f"wi-{x}-{suffix}") for x in "abc")
        home = plane.new_namespace(f"wi-archway-{suffix}")
        # archway: the chart's rules; tokens only where it is opted in (a and b, not c)
        self.archway_kubeconfig = plane.identity(
            home, "archway", cluster_rules=CHART_RULES,
            namespace_rules={self.a: TOKEN_RULES, self.b: TOKEN_RULES})
        self.reviewer_kubeconfig = plane.identity(home, "reviewer", cluster_rules=TOKEN_REVIEWS)
        self.bin_dir = str(tmp_path / "bin")
        self.calls_path = str(tmp_path / "calls.jsonl")
        self.token_file = str(tmp_path / "token")
        self.config_path = str(tmp_path / "providers.yaml")
        tokenplugin.install(self.bin_dir)
        # The same ServiceAccount name in a and b; only a's may pull (alice's credential).
        for namespace in (self.a, self.b, self.c):
            self.account(namespace, "puller", {ROBOT: f"robot-of-{namespace}"})
        self.account(self.a, "unmarked", {})

    def account(self, namespace: str, name: str, annotations: dict) -> dict:
        return self.kube.create(f"/api/v1/namespaces/{namespace}/serviceaccounts",
                                {"metadata": {"name": name, "annotations": annotations}})

    def configure(self, extra_env=(), **options) -> None:
        import yaml
        entry = tokenplugin.provider_entry(
            match=[self.registry.host], audience=AUDIENCE, kubeconfig=self.reviewer_kubeconfig,
            calls=self.calls_path, accounts={f"{self.a}/puller": ("alice", self.registry.users["alice"])},
            required=[ROBOT], optional=["lab.archway.dev/team"],
            extra_env={"TOKEN_FILE": self.token_file, **dict(extra_env)}, **options)
        with open(self.config_path, "w") as f:
            yaml.safe_dump({"apiVersion": "kubelet.config.k8s.io/v1",
                            "kind": "CredentialProviderConfig", "providers": [entry]}, f)

    def settings(self) -> RegistrySettings:
        return RegistrySettings(allow_hosts=LOOPBACK_HOSTS, ca_file=self.ca.cert_path,
                                credential_providers=CredentialProviderSettings(
                                    config=self.config_path, bin_dir=self.bin_dir))

    def pull_secrets(self, namespaces=None, **options) -> PullSecrets:
        """archway's, as the serving processes build it from their config."""
        self.configure(**options)
        namespaces = (self.a, self.b) if namespaces is None else namespaces
        return PullSecrets.from_config(Config(registry=self.settings(), kubernetes=KubernetesSettings(
            kubeconfig=self.archway_kubeconfig, pull_secret_namespaces=(),
            service_account_token_namespaces=namespaces)))

    def identities(self, clock, **options) -> WorkloadIdentities:
        """The token-mode providers alone, on a clock the test moves."""
        self.configure(**options)
        client, _ = build_api_client(KubernetesSettings(kubeconfig=self.archway_kubeconfig))
        providers = CredentialProviders(self.config_path, self.bin_dir, 10.0, clock=clock)
        return WorkloadIdentities(KubeApi(client), providers, namespaces=(self.a,), clock=clock)

    def pod(self, namespace: str, account: str, image: str) -> PodView:
        return PodView.of({"metadata": {"name": "p", "namespace": namespace},
                           "spec": {"serviceAccountName": account,
                                    "containers": [{"name": "c", "image": image}]}})

    def calls(self) -> list[dict]:
        return tokenplugin.calls(self.calls_path)


@pytest.fixture
def lab(control_plane, token_registry, tmp_path, test_ca):
    token_registry.push_image("wi/app", "v1", "linux/arm64")
    return Lab(control_plane, token_registry, tmp_path, test_ca)


def resolve(lab, pod: PodView, credentials):
    return Resolver(lab.settings()).resolve(lab.registry.ref("wi/app", "v1"),
                                            keyring=credentials.keyring, scope=pod.namespace,
                                            deadline=time.monotonic() + 20)


def test_the_image_is_read_only_with_a_genuine_token_of_the_pods_own_service_account(lab, caplog):
    caplog.set_level(logging.DEBUG)
    secrets = lab.pull_secrets()
    image = lab.registry.ref("wi/app", "v1")
    pod = lab.pod(lab.a, "puller", image)
    before = tokens_requested()
    started = time.monotonic()
    credentials = secrets.credentials_for(pod, time.monotonic() + 20)
    first = time.monotonic() - started
    assert credentials.warnings == () and credentials.complete
    assert resolve(lab, pod, credentials).architectures == {"arm64"}
    assert lab.registry.token_server.requests[-1].user == "alice"
    (call,) = lab.calls()
    # The API server vouched for it: this pod's ServiceAccount, for the provider's audience,
    # with the annotations the provider names (the optional one absent: not sent).
    assert call["user"] == f"system:serviceaccount:{lab.a}:puller"
    assert call["audiences"] == [AUDIENCE] and call["answered"]
    assert call["annotations"] == {ROBOT: f"robot-of-{lab.a}"}
    assert call["image"] == f"{lab.registry.host}/wi/app"
    assert tokens_requested() == before + 1
    # Cached per ServiceAccount: the next pod of it costs no token and no plugin run.
    started = time.monotonic()
    again = secrets.credentials_for(lab.pod(lab.a, "puller", image), time.monotonic() + 20)
    cached = time.monotonic() - started
    assert again.keyring == credentials.keyring and len(lab.calls()) == 1
    assert tokens_requested() == before + 1
    # The token is in no log line, no warning, no error.
    with open(lab.token_file) as f:
        token = f.read()
    assert len(token) > 100 and token not in caplog.text
    print(f"\nworkload identity: first pod {first * 1000:.0f} ms (TokenRequest + plugin + "
          f"TokenReview), next pod {cached * 1000:.2f} ms (cached per ServiceAccount)")


def test_a_burst_of_a_service_accounts_pods_costs_one_token_and_one_plugin_run(lab):
    from concurrent.futures import ThreadPoolExecutor
    secrets = lab.pull_secrets()
    pods = [lab.pod(lab.a, "puller", lab.registry.ref("wi/app", "v1")) for _ in range(32)]
    before = tokens_requested()
    started = time.monotonic()
    with ThreadPoolExecutor(16) as pool:
        answers = list(pool.map(lambda p: secrets.credentials_for(p, time.monotonic() + 20), pods))
    took = time.monotonic() - started
    assert {len(a.keyring) for a in answers} == {1} and all(a.warnings == () for a in answers)
    assert tokens_requested() == before + 1 and len(lab.calls()) == 1
    print(f"\nworkload identity: 32 pods of one ServiceAccount, 16 at once: {took * 1000:.0f} ms, "
          f"1 TokenRequest, 1 plugin run")


def test_another_namespaces_service_account_is_never_used(lab):
    secrets = lab.pull_secrets()
    # b/puller has the same name and the annotation, but the plugin sees b's own identity.
    pod = lab.pod(lab.b, "puller", lab.registry.ref("wi/app", "v1"))
    credentials = secrets.credentials_for(pod, time.monotonic() + 20)
    (call,) = lab.calls()
    assert call["user"] == f"system:serviceaccount:{lab.b}:puller" and not call["answered"]
    assert call["annotations"] == {ROBOT: f"robot-of-{lab.b}"}
    assert any("has no registry credential here" in w for w in credentials.warnings)
    with pytest.raises(AuthError):
        resolve(lab, pod, credentials)


def test_a_service_account_without_the_required_annotation_is_read_as_the_kubelet_would_pull(lab):
    secrets = lab.pull_secrets()
    before = tokens_requested()
    pod = lab.pod(lab.a, "unmarked", lab.registry.ref("wi/app", "v1"))
    credentials = secrets.credentials_for(pod, time.monotonic() + 20)
    assert credentials.warnings == (
        f"ServiceAccount {lab.a}/unmarked lacks the annotation {ROBOT} that credential provider "
        f"{tokenplugin.NAME} requires: the kubelet pulls without its credentials, and so archway "
        f"reads the image",)
    assert lab.calls() == [] and tokens_requested() == before   # no token, no plugin run
    with pytest.raises(AuthError):
        resolve(lab, pod, credentials)


def test_no_token_is_requested_outside_the_opted_in_namespaces(lab):
    before = tokens_requested()
    for namespaces, namespace in (((lab.a, lab.b), lab.c), ((), lab.a)):
        secrets = lab.pull_secrets(namespaces=namespaces)
        pod = lab.pod(namespace, "puller", lab.registry.ref("wi/app", "v1"))
        credentials = secrets.credentials_for(pod, time.monotonic() + 20)
        assert credentials.warnings == (
            f"images not read as ServiceAccount {namespace}/puller (namespace {namespace} is not "
            f"in archway's rbac.serviceAccountTokenNamespaces): credential provider "
            f"{tokenplugin.NAME}",)
        with pytest.raises(AuthError):
            resolve(lab, pod, credentials)
    assert lab.calls() == [] and tokens_requested() == before


def test_the_rbac_refuses_a_token_where_archway_is_not_granted_one(lab):
    # Opted in by the config but not by RBAC: the API's refusal, said plainly, counted.
    secrets = lab.pull_secrets(namespaces=("*",))
    before = tokens_requested("refused")
    pod = lab.pod(lab.c, "puller", lab.registry.ref("wi/app", "v1"))
    credentials = secrets.credentials_for(pod, time.monotonic() + 20)
    assert credentials.warnings == (
        f"ServiceAccount {lab.c}/puller: archway may not request its token (HTTP 403; check "
        f"rbac.serviceAccountTokenNamespaces)",)
    assert tokens_requested("refused") == before + 1 and lab.calls() == []
    # The refusal is repeated for a few seconds, not asked again for every pod.
    again = secrets.credentials_for(lab.pod(lab.c, "puller", pod.images[0]), time.monotonic() + 20)
    assert again.warnings == credentials.warnings and tokens_requested("refused") == before + 1


@pytest.mark.parametrize("cache_type, runs_after_refresh", [("ServiceAccount", 1), ("Token", 2)])
def test_answers_are_cached_per_service_account_or_per_token(lab, cache_type, runs_after_refresh):
    clock = ManualClock(time.monotonic())
    identities = lab.identities(clock, cache_type=cache_type)
    pod = lab.pod(lab.a, "puller", lab.registry.ref("wi/app", "v1"))
    before = tokens_requested()
    first, _, _ = identities.credentials_for(pod, clock() + 20)
    clock.now += 0.5 * 600   # half the token's life: the same token, the same answer
    assert identities.credentials_for(pod, clock() + 20)[0] == first and len(lab.calls()) == 1
    # Past four fifths of the token's 10 minutes: a new token; the plugin's answer (10m) is
    # kept per ServiceAccount, but one read with the old token is not handed on with the new.
    clock.now += 0.3 * 600 + 1
    second, _, _ = identities.credentials_for(pod, clock() + 20)
    assert tokens_requested() == before + 2
    assert len(lab.calls()) == runs_after_refresh and second == first


def test_past_the_deadline_nothing_is_asked_and_the_answer_says_it_is_incomplete(lab):
    secrets = lab.pull_secrets()
    before = tokens_requested() + tokens_requested("failed")
    pod = lab.pod(lab.a, "puller", lab.registry.ref("wi/app", "v1"))
    credentials = secrets.credentials_for(pod, time.monotonic() - 1)
    assert not credentials.complete and lab.calls() == []
    assert tokens_requested() + tokens_requested("failed") == before


def test_a_plugin_that_echoes_its_token_does_not_put_it_in_a_warning(lab, caplog):
    secrets = lab.pull_secrets(extra_env={"ECHO_TOKEN": "1", "TOKEN_FILE": lab.token_file})
    pod = lab.pod(lab.a, "puller", lab.registry.ref("wi/app", "v1"))
    credentials = secrets.credentials_for(pod, time.monotonic() + 20)
    with open(lab.token_file) as f:
        token = f.read()
    (warning,) = credentials.warnings
    assert "refusing token [service account token]" in warning
    assert token not in warning and token not in caplog.text
    assert os.path.getsize(lab.token_file) > 100
