"""archway runs with exactly the rights the chart gives its ServiceAccounts: everything it does
in the other tests passes RBAC (the session's teardown fails on any 403 in its logs), and what
lies outside its role is refused by the real authorizer."""
import pytest
import yaml

from lab.kube import KubeError


def identity_of(archway, kube, component: str):
    """A client with the token archway's `component` process runs with, and its user name."""
    with open(archway.webhook.config_path if component == "webhook"
              else archway.extender.config_path) as f:
        kubeconfig = yaml.safe_load(f)["kubernetes"]["kubeconfig"]
    with open(kubeconfig) as f:
        token = yaml.safe_load(f)["users"][0]["user"]["token"]
    client = kube.as_user(token)
    review = client.create("/apis/authentication.k8s.io/v1/selfsubjectreviews",
                           {"apiVersion": "authentication.k8s.io/v1", "kind": "SelfSubjectReview"})
    return client, review["status"]["userInfo"]["username"]


def test_the_webhook_runs_as_the_charts_service_account_with_least_privilege(archway, kube):
    client, user = identity_of(archway, kube, "webhook")
    assert user == f"system:serviceaccount:{archway.namespace}:{archway.service_account('webhook')}"
    # What archway needs: the gated pods, Events, its Lease, caches, the cluster's addresses it
    # refuses to contact. Pull secrets only in rbac.pullSecretNamespaces: none by default.
    assert not client.can_i("get", "secrets", namespace="default")
    assert not client.can_i("get", "secrets", namespace="kube-system")
    assert client.can_i("list", "servicecidrs", group="networking.k8s.io")
    assert client.can_i("get", "endpointslices", namespace="default", group="discovery.k8s.io",
                        name="kubernetes")
    assert not client.can_i("get", "endpointslices", namespace="default",
                            group="discovery.k8s.io", name="other")
    assert client.can_i("update", "pods", namespace="default")   # the chart's default: gate
    assert client.can_i("watch", "nodes")
    assert client.can_i("watch", "serviceaccounts")   # their imagePullSecrets, no read per pod
    assert client.can_i("create", "events", namespace="default", group="events.k8s.io")
    assert client.can_i("update", "leases", namespace=archway.namespace, group="coordination.k8s.io",
                        name="archway-gate-controller")
    # What it must not do.
    for verb, resource, group in (("list", "secrets", ""), ("watch", "secrets", ""),
                                  ("create", "pods", ""), ("delete", "pods", ""),
                                  ("patch", "nodes", ""), ("update", "deployments", "apps"),
                                  ("create", "clusterrolebindings", "rbac.authorization.k8s.io")):
        assert not client.can_i(verb, resource, group=group), (verb, resource)
    assert not client.can_i("update", "leases", namespace=archway.namespace,
                            group="coordination.k8s.io", name="kube-scheduler")
    with pytest.raises(KubeError) as refused:
        client.items("/api/v1/secrets")
    assert refused.value.status == 403


def test_the_extender_runs_as_the_schedulers_service_account(archway, kube):
    client, user = identity_of(archway, kube, "extender")
    assert user == f"system:serviceaccount:{archway.namespace}:{archway.service_account('scheduler')}"
    assert client.can_i("watch", "nodes") and client.can_i("create", "bindings", namespace="x")
    assert not client.can_i("get", "secrets", namespace="default")
    with pytest.raises(KubeError) as refused:
        client.items("/api/v1/namespaces/default/secrets")
    assert refused.value.status == 403


def test_the_second_scheduler_has_every_right_it_uses(archway, control_plane):
    with open(control_plane.processes["archway-scheduler"].log, errors="replace") as f:
        log = f.read()
    assert "forbidden" not in log.lower(), [line for line in log.splitlines()
                                            if "forbidden" in line.lower()][:5]
