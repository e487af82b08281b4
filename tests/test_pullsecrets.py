"""Pull credentials of a pod, read through the real `kubernetes` client from the stand-in apiserver."""
import base64
import json
import time
from types import SimpleNamespace

import pytest

from archway.errors import ConfigError
from archway.kubeclient import build_api_client
from archway.podview import PodView
from archway.webhook.pullsecrets import PullSecrets
from tests.infra.apiserver import FakeApiServer

NS = "team-a"


def docker_secret(name, host, user="alice", password="pw", legacy=False):
    auth = base64.b64encode(f"{user}:{password}".encode()).decode()
    if legacy:
        data = {".dockercfg": base64.b64encode(json.dumps({host: {"auth": auth}}).encode()).decode()}
        kind = "kubernetes.io/dockercfg"
    else:
        data = {".dockerconfigjson": base64.b64encode(
            json.dumps({"auths": {host: {"auth": auth}}}).encode()).decode()}
        kind = "kubernetes.io/dockerconfigjson"
    return {"apiVersion": "v1", "kind": "Secret", "type": kind, "data": data,
            "metadata": {"name": name, "namespace": NS}}


def account(name, *secrets):
    obj = {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": name, "namespace": NS}}
    if secrets:
        obj["imagePullSecrets"] = [{"name": s} for s in secrets]
    return obj


def pod(*pull_secrets, sa=None):
    spec = {"containers": [{"name": "a", "image": "x"}]}
    if pull_secrets:
        spec["imagePullSecrets"] = [{"name": s} for s in pull_secrets]
    if sa:
        spec["serviceAccountName"] = sa
    return PodView.of({"metadata": {"namespace": NS}, "spec": spec})


def k8s_settings(**kw):
    values = {"enabled": "auto", "kubeconfig": None, "secret_cache_seconds": 60.0}
    values.update(kw)
    return SimpleNamespace(**values)


@pytest.fixture(scope="module")
def api(tmp_path_factory):
    server = FakeApiServer()
    base = f"/api/v1/namespaces/{NS}"
    server.put(f"{base}/serviceaccounts/default", account("default"))
    server.put(f"{base}/serviceaccounts/builder", account("builder", "sa-cred", "pod-cred"))
    server.put(f"{base}/secrets/pod-cred", docker_secret("pod-cred", "reg.example:5000", "pod-user"))
    server.put(f"{base}/secrets/sa-cred", docker_secret("sa-cred", "other.example", "sa-user"))
    server.put(f"{base}/secrets/legacy", docker_secret("legacy", "https://old.example/v1/",
                                                      legacy=True))
    server.put(f"{base}/secrets/opaque", {"apiVersion": "v1", "kind": "Secret", "type": "Opaque",
                                          "data": {"password": "c2VjcmV0"},
                                          "metadata": {"name": "opaque", "namespace": NS}})
    server.put(f"{base}/secrets/broken", {"apiVersion": "v1", "kind": "Secret",
                                          "type": "kubernetes.io/dockerconfigjson",
                                          "data": {".dockerconfigjson": "bm90IGpzb24="},
                                          "metadata": {"name": "broken", "namespace": NS}})
    server.kubeconfig_path = server.kubeconfig(str(tmp_path_factory.mktemp("kube")))
    yield server
    server.stop()


def secrets_for(api, **kw):
    client, source = build_api_client(k8s_settings(kubeconfig=api.kubeconfig_path))
    return PullSecrets(client, source=source, **kw)


def test_pod_and_service_account_secrets_are_merged_pod_first(api):
    creds = secrets_for(api).credentials_for(pod("pod-cred", sa="builder"), time.monotonic() + 2)
    assert creds.warnings == () and creds.secrets_used == 2
    assert creds.keyring.lookup("reg.example:5000").username == "pod-user"
    assert creds.keyring.lookup("other.example").username == "sa-user"


def test_legacy_dockercfg_secret(api):
    creds = secrets_for(api).credentials_for(pod("legacy"), time.monotonic() + 2)
    assert creds.keyring.lookup("old.example").username == "alice"


@pytest.mark.parametrize("name, words", [
    ("missing", "pull secret team-a/missing: not found"),
    ("opaque", "pull secret team-a/opaque is not a usable docker config secret"),
    ("broken", "pull secret team-a/broken is not a usable docker config secret"),
])
def test_unusable_secret_degrades_with_a_warning(api, name, words):
    creds = secrets_for(api).credentials_for(pod(name, "pod-cred"), time.monotonic() + 2)
    assert creds.warnings == (words,)
    assert creds.keyring.lookup("reg.example:5000") is not None  # the rest is still used


def test_forbidden_reads_degrade_with_a_warning_and_no_secret_text(api):
    api.faults[f"/api/v1/namespaces/{NS}/secrets/pod-cred"] = 403
    try:
        creds = secrets_for(api).credentials_for(pod("pod-cred"), time.monotonic() + 2)
    finally:
        api.faults.clear()
    assert creds.warnings == ("pull secret team-a/pod-cred: archway may not read it "
                              "(HTTP 403; check its RBAC)",)
    assert len(creds.keyring) == 0


def test_reads_are_cached(api):
    secrets = secrets_for(api)
    before = api.count("GET", f"/api/v1/namespaces/{NS}/")
    for _ in range(3):
        secrets.credentials_for(pod("pod-cred", sa="builder"), time.monotonic() + 2)
    assert api.count("GET", f"/api/v1/namespaces/{NS}/") - before == 3  # SA + 2 secrets, once


def test_slow_api_is_bounded_by_the_deadline(api):
    api.delay_seconds = 2.0
    try:
        start = time.monotonic()
        creds = secrets_for(api).credentials_for(pod("pod-cred"), time.monotonic() + 0.3)
        elapsed = time.monotonic() - start
    finally:
        api.delay_seconds = 0.0
    assert elapsed < 0.8
    assert any("unreachable or too slow" in w or "deadline" in w for w in creds.warnings)


def test_unreachable_api_degrades_to_anonymous(tmp_path):
    dead = FakeApiServer()
    path = dead.kubeconfig(str(tmp_path))
    dead.stop()
    client, source = build_api_client(k8s_settings(kubeconfig=path))
    creds = PullSecrets(client, source=source).credentials_for(pod("pod-cred"),
                                                               time.monotonic() + 1)
    assert len(creds.keyring) == 0
    assert "Kubernetes API unreachable or too slow" in " ".join(creds.warnings)


def test_no_api_configured(monkeypatch, tmp_path):
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "absent"))
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert build_api_client(k8s_settings()) == (
        None, f"KUBECONFIG names {tmp_path / 'absent'}, which does not exist")
    monkeypatch.delenv("KUBECONFIG")
    client, source = build_api_client(k8s_settings())
    assert client is None and source == "none"
    creds = PullSecrets(None, source=source).credentials_for(pod("regcred"), time.monotonic() + 1)
    assert creds.warnings == ("pull secrets not read (no Kubernetes API configured): regcred",)
    assert build_api_client(k8s_settings(enabled="off")) == (None, "disabled")
    off = PullSecrets(None, source="disabled")
    assert off.credentials_for(pod("regcred"), time.monotonic() + 1).warnings == ()


@pytest.mark.parametrize("settings, message", [
    (k8s_settings(enabled="yes"), "kubernetes.enabled must be auto or off"),
    (k8s_settings(kubeconfig="/nonexistent/kubeconfig"),
     "kubeconfig /nonexistent/kubeconfig is not usable"),
])
def test_bad_kubernetes_settings_fail_at_start(settings, message):
    with pytest.raises(ConfigError, match=message):
        build_api_client(settings)


# --- one Kubernetes client per process (issue 23) ------------------------------------------------

def test_a_worker_holds_one_api_client_for_every_reader(tmp_path):
    """Pull secrets, the Namespace cache, the Node cache and the extender's pod watch of one
    `archway serve` worker share one ApiClient (they built three or four, with two precedences);
    a forked process builds its own."""
    import gc
    import os

    from kubernetes.client import ApiClient

    from archway.app import create_app
    from archway.config import config_from_dict
    api = FakeApiServer()
    try:
        config = config_from_dict({"kubernetes": {"kubeconfig": api.kubeconfig(str(tmp_path))},
                                   "server": {"tls": False}})
        app = create_app(config, product="all")
        state = app.extensions["archway"]
        state.node_cache.ensure_started()
        extender = app.extensions["archway.extender"]
        if extender.pod_watch is not None:
            extender.pod_watch.ensure_started()
        try:
            clients = {id(o) for o in gc.get_objects()
                       if isinstance(o, ApiClient) and o.configuration.host == api.url}
            assert len(clients) == 1
            (shared,) = clients
            assert id(build_api_client(config.kubernetes)[0]) == shared
            pid = os.fork()
            if pid == 0:   # the child: a client of its own, for the same API
                child = build_api_client(config.kubernetes)[0]
                os._exit(0 if id(child) != shared and child.configuration.host == api.url else 1)
            assert os.waitpid(pid, 0)[1] == 0
        finally:
            extender.stop()
            app.extensions["archway.webhook"].namespaces.stop()
    finally:
        api.stop()
