"""Pull credentials of a pod, read through the real `kubernetes` client from the real apiserver
(tests/conftest.py's control plane), its RBAC refusing what a Role does not grant; a slow API
is the stand-in's fault to inject."""
import base64
import json
import time
from types import SimpleNamespace

import pytest

from archway.cluster.pullsecrets import PullSecrets
from archway.cluster.serviceaccounts import ServiceAccountCache, account_facts
from archway.config import RegistrySettings
from archway.errors import ConfigError
from archway.kubeclient import build_api_client
from archway.podview import PodView
from lab.cluster.controlplane import kubeconfig
from lab.servers.apiserver import FakeApiServer

NS = "pull-secrets"


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
    values = {"enabled": "auto", "kubeconfig": None, "secret_cache_seconds": 60.0,
              "pull_secret_namespaces": ("*",)}
    values.update(kw)
    return SimpleNamespace(**values)


class RealApi:
    def __init__(self, plane, kubeconfig_path: str):
        self.plane = plane
        self.kubeconfig_path = kubeconfig_path


@pytest.fixture(scope="module")
def api(control_plane, tmp_path_factory):
    kube = control_plane.kube
    if kube.exists(f"/api/v1/namespaces/{NS}"):
        kube.delete(f"/api/v1/namespaces/{NS}")
        kube.wait_for(lambda: not kube.exists(f"/api/v1/namespaces/{NS}"), timeout=60)
    control_plane.new_namespace(NS)
    base = f"/api/v1/namespaces/{NS}"
    kube.create(f"{base}/serviceaccounts", account("builder", "sa-cred", "pod-cred"))
    kube.create(f"{base}/secrets", docker_secret("pod-cred", "reg.example:5000", "pod-user"))
    kube.create(f"{base}/secrets", docker_secret("sa-cred", "other.example", "sa-user"))
    kube.create(f"{base}/secrets", docker_secret("legacy", "https://old.example/v1/", legacy=True))
    kube.create(f"{base}/secrets", {"apiVersion": "v1", "kind": "Secret", "type": "Opaque",
                                    "data": {"password": "c2VjcmV0"}, "metadata": {"name": "opaque"}})
    # JSON (the apiserver checks that much), but no docker config in it.
    kube.create(f"{base}/secrets", {"apiVersion": "v1", "kind": "Secret",
                                    "type": "kubernetes.io/dockerconfigjson",
                                    "data": {".dockerconfigjson": base64.b64encode(
                                        b'{"auths": "not a map"}').decode()},
                                    "metadata": {"name": "broken"}})
    yield RealApi(control_plane, control_plane.admin_kubeconfig)
    kube.delete(f"/api/v1/namespaces/{NS}")


def limited_reader(api, tmp_path) -> str:
    """A kubeconfig of a ServiceAccount whose Role lets it read every secret but pod-cred."""
    kube, base = api.plane.kube, f"/api/v1/namespaces/{NS}"
    rbac = f"/apis/rbac.authorization.k8s.io/v1/namespaces/{NS}"
    if not kube.exists(f"{base}/serviceaccounts/limited"):
        kube.create(f"{base}/serviceaccounts", {"metadata": {"name": "limited"}})
        kube.create(f"{rbac}/roles", {"metadata": {"name": "limited"}, "rules": [
            {"apiGroups": [""], "resources": ["serviceaccounts"], "verbs": ["get"]},
            {"apiGroups": [""], "resources": ["secrets"], "verbs": ["get"],
             "resourceNames": ["sa-cred", "legacy", "opaque", "broken"]}]})
        kube.create(f"{rbac}/rolebindings", {"metadata": {"name": "limited"}, "roleRef": {
            "apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "limited"},
            "subjects": [{"kind": "ServiceAccount", "name": "limited", "namespace": NS}]})
    token = kube.service_account_token(NS, "limited", seconds=600)
    return kubeconfig(str(tmp_path / "limited.kubeconfig"), api.plane.server, api.plane.ca_path,
                      token)


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
    ("missing", "pull secret pull-secrets/missing: not found"),
    ("opaque", "pull secret pull-secrets/opaque is not a usable docker config secret"),
    ("broken", "pull secret pull-secrets/broken is not a usable docker config secret"),
])
def test_unusable_secret_degrades_with_a_warning(api, name, words):
    creds = secrets_for(api).credentials_for(pod(name, "pod-cred"), time.monotonic() + 2)
    assert creds.warnings == (words,)
    assert creds.keyring.lookup("reg.example:5000") is not None  # the rest is still used


def test_forbidden_reads_degrade_with_a_warning_and_no_secret_text(api, tmp_path):
    client, source = build_api_client(k8s_settings(kubeconfig=limited_reader(api, tmp_path)))
    # Its Role grants no list of ServiceAccounts: their watch never syncs, GETs stand in.
    accounts = ServiceAccountCache(lambda: client, max_backoff_seconds=1.0)
    try:
        creds = PullSecrets(client, source=source, accounts=accounts).credentials_for(
            pod("pod-cred", "sa-cred"), time.monotonic() + 2)
    finally:
        accounts.stop()
    assert not accounts.synced
    assert creds.warnings == ("pull secret pull-secrets/pod-cred: archway may not read it "
                              "(HTTP 403; check its RBAC)",)
    assert creds.keyring.lookup("other.example").username == "sa-user"   # the readable one
    assert creds.keyring.lookup("reg.example:5000") is None


def test_reads_are_cached(api):
    secrets = secrets_for(api)
    mark = api.plane.audit_mark()
    for _ in range(3):
        secrets.credentials_for(pod("pod-cred", sa="builder"), time.monotonic() + 2)
    reads = [uri for verb, uri in api.plane.requests_since(mark)
             if verb == "get" and uri.startswith(f"/api/v1/namespaces/{NS}/")]
    assert len(reads) == 3, reads     # the ServiceAccount and 2 secrets, once


def _account_reads(api, mark) -> list[str]:
    return [uri for verb, uri in api.plane.requests_since(mark)
            if verb == "get" and uri.startswith(f"/api/v1/namespaces/{NS}/serviceaccounts/")]


def test_service_accounts_come_from_a_watch_never_a_read_per_pod(api):
    """Issue 28: a burst of pods whose ServiceAccount is new to a reader costs no read of it (the
    TTL cache of GETs cost one per namespace, per worker, per expiry: 2-6 per burst of 100), and
    a change of its imagePullSecrets is seen when the watch delivers it, within
    secret_cache_seconds (60 s here) -- the GETs' cache served the old names until it expired."""
    kube, accounts_path = api.plane.kube, f"/api/v1/namespaces/{NS}/serviceaccounts"
    reader = PullSecrets.from_config(SimpleNamespace(registry=RegistrySettings(), kubernetes=k8s_settings(
        kubeconfig=api.kubeconfig_path)))
    try:
        assert reader.credentials_for(pod(), time.monotonic() + 5).warnings == ()  # starts it
        kube.create(accounts_path, account("fresh", "sa-cred"))
        kube.wait_for(lambda: getattr(reader, "accounts", None) is not None
                      and reader.accounts.pull_secrets(NS, "fresh") == ("sa-cred",),
                      timeout=30, what="the new ServiceAccount in the reader's watch")
        mark = api.plane.audit_mark()
        for _ in range(50):
            creds = reader.credentials_for(pod(sa="fresh"), time.monotonic() + 2)
            assert creds.keyring.lookup("other.example").username == "sa-user"
        kube.patch(f"{accounts_path}/fresh", {"imagePullSecrets": [{"name": "pod-cred"}]})
        kube.wait_for(lambda: reader.credentials_for(pod(sa="fresh"), time.monotonic() + 2)
                      .keyring.lookup("reg.example:5000") is not None,
                      timeout=30, what="the ServiceAccount's new imagePullSecrets used")
        assert _account_reads(api, mark) == []
        # Deleted: the watch forgets it, and a GET answers (404: nothing to use).
        kube.delete(f"{accounts_path}/fresh")
        kube.wait_for(lambda: reader.accounts.pull_secrets(NS, "fresh") is None, timeout=30,
                      what="the deleted ServiceAccount gone from the watch")
        assert len(reader.credentials_for(pod(sa="fresh"), time.monotonic() + 2).keyring) == 0
        assert _account_reads(api, mark) == [f"{accounts_path}/fresh"]
    finally:
        if getattr(reader, "accounts", None) is not None:
            reader.accounts.stop()


def test_service_account_facts_keep_the_secret_names_only():
    full = {"metadata": {"namespace": "a", "name": "b", "uid": "u", "annotations": {"x": "y"}},
            "secrets": [{"name": "token"}],
            "imagePullSecrets": [{"name": "one"}, {"name": ""}, "junk", {"name": "two"}]}
    facts = account_facts(full)
    assert facts is not None and (facts.name, facts.pull_secrets) == ("a/b", ("one", "two"))
    assert account_facts({"metadata": {"name": "no-namespace"}}) is None
    assert account_facts({"metadata": {"namespace": "a", "name": "b"},
                          "imagePullSecrets": "not a list"}).pull_secrets == ()


def test_slow_api_is_bounded_by_the_deadline(tmp_path):
    slow = FakeApiServer()      # the fault: an apiserver that takes 4 s to answer
    slow.delay_seconds = 4.0
    try:
        client, source = build_api_client(k8s_settings(kubeconfig=slow.kubeconfig(str(tmp_path))))
        start = time.monotonic()
        creds = PullSecrets(client, source=source).credentials_for(pod("pod-cred"),
                                                                   time.monotonic() + 0.3)
        elapsed = time.monotonic() - start
    finally:
        slow.stop()
    assert elapsed < 2.5        # the deadline's, not the apiserver's 4 s (a busy 2-core machine)
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
    assert PullSecrets(None, source=build_api_client(k8s_settings())[1]).api_kind == (
        "unusable (see the log)")             # /readyz: never the path (issue 30)
    monkeypatch.delenv("KUBECONFIG")
    client, source = build_api_client(k8s_settings())
    assert client is None and source == "none"
    creds = PullSecrets(None, source=source).credentials_for(pod("regcred"), time.monotonic() + 1)
    assert creds.warnings == ("pull secrets not read (no Kubernetes API configured): regcred",)
    assert build_api_client(k8s_settings(enabled="off")) == (None, "disabled")
    off = PullSecrets(None, source="disabled")
    assert (off.api_kind, PullSecrets(None, source="none").api_kind) == ("disabled", "none")
    from archway.kubeclient import IN_CLUSTER, api_kind
    assert api_kind(IN_CLUSTER, connected=True) == "in-cluster"
    assert api_kind(f"kubeconfig {tmp_path}/config", connected=True) == "kubeconfig"
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

    from archway.config import config_from_dict
    from archway.main.worker import build_worker
    api = FakeApiServer()
    try:
        config = config_from_dict({"kubernetes": {"kubeconfig": api.kubeconfig(str(tmp_path))},
                                   "server": {"tls": False}})
        worker = build_worker(config, product="all")
        worker.node_cache.ensure_started()
        extender = worker.extender
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
            worker.webhook.service.caches.namespaces.stop()
    finally:
        api.stop()
