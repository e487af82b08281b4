"""Reads of the cluster for the commands run by people (`explain pod/...`, `report`): the pod,
its Namespace, archway's Events, and every workload, as plain JSON through the kubeconfig.

Every call is bounded in time and size; lists are paged (limit/continue) so a large cluster
never arrives as one giant answer. An API error is an ArchwayError naming the call.
"""
import json
from collections.abc import Iterator

from archway.errors import ArchwayError

REQUEST_TIMEOUT_SECONDS = 30.0
PAGE_SIZE = 500
MAX_RESPONSE_BYTES = 64 * 1024 * 1024

# kind -> (API class name, list method for all namespaces, list method in one namespace)
WORKLOAD_LISTS = {
    "Deployment": ("AppsV1Api", "list_deployment_for_all_namespaces", "list_namespaced_deployment"),
    "StatefulSet": ("AppsV1Api", "list_stateful_set_for_all_namespaces",
                    "list_namespaced_stateful_set"),
    "DaemonSet": ("AppsV1Api", "list_daemon_set_for_all_namespaces", "list_namespaced_daemon_set"),
    "ReplicaSet": ("AppsV1Api", "list_replica_set_for_all_namespaces",
                   "list_namespaced_replica_set"),
    "CronJob": ("BatchV1Api", "list_cron_job_for_all_namespaces", "list_namespaced_cron_job"),
    "Job": ("BatchV1Api", "list_job_for_all_namespaces", "list_namespaced_job"),
    "Pod": ("CoreV1Api", "list_pod_for_all_namespaces", "list_namespaced_pod"),
}


class ClusterReader:
    def __init__(self, api_client):
        from kubernetes import client
        self._client = client
        self.api_client = api_client
        self.core = client.CoreV1Api(api_client)

    @classmethod
    def from_config(cls, config) -> "ClusterReader":
        from .pullsecrets import build_api_client
        api_client, _ = build_api_client(config.kubernetes)
        if api_client is None:
            raise ArchwayError("no Kubernetes cluster configured: set KUBECONFIG, or "
                               "kubernetes.kubeconfig in the config file")
        return cls(api_client)

    def pod(self, namespace: str, name: str) -> dict:
        return self._call(f"get pod {namespace}/{name}", self.core.read_namespaced_pod,
                          name, namespace)

    def namespace(self, name: str) -> dict | None:
        """The Namespace, or None when it cannot be read (the config's policy then applies)."""
        try:
            return self._call(f"get namespace {name}", self.core.read_namespace, name)
        except ArchwayError:
            return None

    def nodes(self) -> list[dict]:
        return list(self._pages("list nodes", self.core.list_node))

    def events(self, namespace: str) -> list[dict]:
        """The namespace's events.k8s.io/v1 Events (archway writes in that API)."""
        api = self._client.EventsV1Api(self.api_client)
        return list(self._pages(f"list events in {namespace}", api.list_namespaced_event,
                                namespace))

    def workloads(self, kind: str, namespace: str | None = None) -> Iterator[dict]:
        """Every object of `kind` (in `namespace`, else in all), each with its `kind` set (a
        list's items do not carry it)."""
        api_name, all_method, one_method = WORKLOAD_LISTS[kind]
        api = getattr(self._client, api_name)(self.api_client)
        where = f"in {namespace}" if namespace else "in all namespaces"
        if namespace:
            pages = self._pages(f"list {kind}s {where}", getattr(api, one_method), namespace)
        else:
            pages = self._pages(f"list {kind}s {where}", getattr(api, all_method))
        for item in pages:
            yield {**item, "kind": kind}

    def _pages(self, what: str, method, *args, **kwargs) -> Iterator[dict]:
        token = None
        while True:
            page = self._call(what, method, *args, limit=PAGE_SIZE,
                              **({"_continue": token} if token else {}), **kwargs)
            yield from page.get("items") or ()
            token = (page.get("metadata") or {}).get("continue")
            if not token:
                return

    def _call(self, what: str, method, *args, **kwargs) -> dict:
        from kubernetes.client.rest import ApiException
        try:
            response = method(*args, _preload_content=False,
                              _request_timeout=REQUEST_TIMEOUT_SECONDS, **kwargs)
            body = response.read(MAX_RESPONSE_BYTES + 1)
        except ApiException as e:
            raise ArchwayError(f"Kubernetes API: {what}: {_api_words(e)}") from None
        except Exception as e:  # urllib3's transport errors: all mean unreachable
            raise ArchwayError(f"Kubernetes API: {what}: unreachable "
                               f"({type(e).__name__})") from None
        if len(body) > MAX_RESPONSE_BYTES:
            raise ArchwayError(f"Kubernetes API: {what}: answer larger than "
                               f"{MAX_RESPONSE_BYTES} bytes")
        try:
            data = json.loads(body)
        except ValueError:
            raise ArchwayError(f"Kubernetes API: {what}: the answer is not JSON") from None
        if not isinstance(data, dict):
            raise ArchwayError(f"Kubernetes API: {what}: unexpected answer")
        return data


def _api_words(error) -> str:
    message = ""
    try:
        message = json.loads(error.body).get("message", "")
    except (TypeError, ValueError, AttributeError):
        pass
    words = f"HTTP {error.status}" + (f" {error.reason}" if error.reason else "")
    return f"{words}: {message}" if message else words
