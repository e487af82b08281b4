"""Reads of the cluster for `explain pod/...`, `report` and pre-warming: the pod,
its Namespace, archway's Events, and every workload, as plain JSON through the kubeconfig.

Every call is bounded in time and size; lists are paged (limit/continue) so a large cluster
never arrives as one giant answer. An API error is an ArchwayError naming the call.
"""
from collections.abc import Iterator

from archway.errors import ArchwayError
from archway.kubeapi import LIST_PAGE_SIZE, ApiError, KubeApi

REQUEST_TIMEOUT_SECONDS = 30.0

# kind -> its collection: API prefix and plural (in a namespace: prefix/namespaces/NS/plural)
WORKLOAD_LISTS = {
    "Deployment": ("/apis/apps/v1", "deployments"),
    "StatefulSet": ("/apis/apps/v1", "statefulsets"),
    "DaemonSet": ("/apis/apps/v1", "daemonsets"),
    "ReplicaSet": ("/apis/apps/v1", "replicasets"),
    "CronJob": ("/apis/batch/v1", "cronjobs"),
    "Job": ("/apis/batch/v1", "jobs"),
    "Pod": ("/api/v1", "pods"),
}


POLICIES = "/apis/archway.dev/v1alpha1"   # objects/policies.py's GROUP and VERSION


class ClusterReader:
    def __init__(self, api_client):
        self.api_client = api_client
        self.api = KubeApi(api_client, timeout_seconds=REQUEST_TIMEOUT_SECONDS)

    @classmethod
    def from_config(cls, config) -> "ClusterReader":
        from archway.kubeclient import required_api_client
        return cls(required_api_client(config.kubernetes))

    def pod(self, namespace: str, name: str) -> dict:
        return self._get(f"get pod {namespace}/{name}", f"/api/v1/namespaces/{namespace}/pods/{name}")

    def namespace(self, name: str) -> dict | None:
        """The Namespace, or None when it cannot be read (the config's policy then applies)."""
        try:
            return self._get(f"get namespace {name}", f"/api/v1/namespaces/{name}")
        except ArchwayError:
            return None

    def workload(self, kind: str, namespace: str, name: str) -> dict:
        prefix, plural = WORKLOAD_LISTS[kind]
        return self._get(f"get {kind} {namespace}/{name}",
                         f"{prefix}/namespaces/{namespace}/{plural}/{name}")

    def nodes(self) -> list[dict]:
        return list(self._pages("list nodes", "/api/v1/nodes"))

    def events(self, namespace: str) -> list[dict]:
        """The namespace's events.k8s.io/v1 Events (archway writes in that API)."""
        return list(self._pages(f"list events in {namespace}",
                                f"/apis/events.k8s.io/v1/namespaces/{namespace}/events"))

    def workloads(self, kind: str, namespace: str | None = None) -> Iterator[dict]:
        """Every object of `kind` (in `namespace`, else in all), each with its `kind` set (a
        list's items do not carry it)."""
        prefix, plural = WORKLOAD_LISTS[kind]
        where = f"in {namespace}" if namespace else "in all namespaces"
        path = f"{prefix}/namespaces/{namespace}/{plural}" if namespace else f"{prefix}/{plural}"
        for item in self._pages(f"list {kind}s {where}", path):
            yield {**item, "kind": kind}

    def placement_policies(self) -> tuple[list[dict], list[dict]]:
        """(every PlacementPolicy, every ClusterPlacementPolicy): archway.dev/v1alpha1."""
        return (list(self._pages("list placementpolicies", f"{POLICIES}/placementpolicies")),
                list(self._pages("list clusterplacementpolicies",
                                 f"{POLICIES}/clusterplacementpolicies")))

    def _pages(self, what: str, path: str) -> Iterator[dict]:
        try:
            for page in self.api.pages(path, LIST_PAGE_SIZE):
                yield from page.get("items") or ()
        except ApiError as e:   # the cause kept: its status tells an API down from a refusal
            raise ArchwayError(f"Kubernetes API: {what}: {e}") from e

    def _get(self, what: str, path: str) -> dict:
        try:
            return self.api.request("GET", path)
        except ApiError as e:   # "404 NotFound: pods "x" not found", or why it is unreachable
            raise ArchwayError(f"Kubernetes API: {what}: {e}") from None
