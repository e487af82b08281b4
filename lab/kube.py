"""A small client of a real kube-apiserver for tests, the bench and scripts/cluster.sh: JSON over
HTTPS with a bearer token, errors as KubeError with the API's status and message.

    kube = Kube(server, token, ca_path)
    kube.create("/api/v1/namespaces/x/pods", pod)
    kube.get("/api/v1/namespaces/x/pods/p")                       # KubeError(404) when missing
    kube.wait_for(lambda: kube.get(path)["spec"].get("nodeName"), timeout=20, what="a binding")
"""
import json

import requests

from lab.procs import wait_until


class KubeError(Exception):
    def __init__(self, status: int, message: str, body: dict | None = None):
        super().__init__(f"{status}: {message}")
        self.status = status
        self.message = message
        self.body = body or {}


class Kube:
    def __init__(self, server: str, token: str, ca_path: str, *, timeout: float = 30.0):
        self.server = server.rstrip("/")
        self.token = token
        self.ca_path = ca_path
        self.timeout = timeout
        self.session = requests.Session()
        self.session.headers["Authorization"] = f"Bearer {token}"
        self.session.verify = ca_path
        self.session.trust_env = False   # never through a proxy from the environment
        self.last_warnings = ""           # the Warning headers of the last answer (admission warnings)

    def as_user(self, token: str) -> "Kube":
        """The same apiserver with another identity (a ServiceAccount token, say)."""
        return Kube(self.server, token, self.ca_path, timeout=self.timeout)

    def request(self, method: str, path: str, body=None, *, params=None,
                content_type: str = "application/json", timeout: float | None = None) -> dict:
        data = None if body is None else (body if isinstance(body, (bytes, str)) else json.dumps(body))
        response = self.session.request(method, self.server + path, data=data, params=params,
                                        headers={"Content-Type": content_type},
                                        timeout=timeout or self.timeout)
        self.last_warnings = response.headers.get("Warning", "")
        try:
            answer = response.json()
        except ValueError:
            answer = {"message": response.text[:500]}
        if response.status_code >= 400:
            message = answer.get("message") if isinstance(answer, dict) else None
            raise KubeError(response.status_code, message or response.reason, answer)
        return answer

    def get(self, path: str, **params) -> dict:
        return self.request("GET", path, params=params or None)

    def items(self, path: str, **params) -> list[dict]:
        return self.get(path, **params).get("items") or []

    def create(self, path: str, body: dict, **params) -> dict:
        return self.request("POST", path, body, params=params or None)

    def put(self, path: str, body: dict) -> dict:
        return self.request("PUT", path, body)

    def patch(self, path: str, body, kind: str = "merge") -> dict:
        types = {"merge": "application/merge-patch+json", "json": "application/json-patch+json",
                 "strategic": "application/strategic-merge-patch+json"}
        return self.request("PATCH", path, body, content_type=types[kind])

    def delete(self, path: str, **params) -> dict | None:
        try:
            return self.request("DELETE", path, params=params or None)
        except KubeError as e:
            if e.status == 404:
                return None
            raise

    def exists(self, path: str) -> bool:
        try:
            self.get(path)
            return True
        except KubeError as e:
            if e.status == 404:
                return False
            raise

    def service_account_token(self, namespace: str, name: str, seconds: int = 86400) -> str:
        """A bound token of the ServiceAccount (TokenRequest), as a pod running as it gets."""
        review = self.create(f"/api/v1/namespaces/{namespace}/serviceaccounts/{name}/token",
                             {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest",
                              "spec": {"expirationSeconds": seconds}})
        return review["status"]["token"]

    def can_i(self, verb: str, resource: str, *, namespace: str | None = None,
              group: str = "", name: str | None = None) -> bool:
        """SelfSubjectAccessReview: may this client's identity do it?"""
        attrs = {"verb": verb, "resource": resource, "group": group}
        if namespace:
            attrs["namespace"] = namespace
        if name:
            attrs["name"] = name
        review = self.create("/apis/authorization.k8s.io/v1/selfsubjectaccessreviews",
                             {"apiVersion": "authorization.k8s.io/v1",
                              "kind": "SelfSubjectAccessReview",
                              "spec": {"resourceAttributes": attrs}})
        return bool(review.get("status", {}).get("allowed"))

    def wait_for(self, condition, *, timeout: float = 30.0, what: str = "the condition"):
        """condition()'s first true value; KubeError 404 counts as not yet."""
        def attempt():
            try:
                return condition()
            except KubeError as e:
                if e.status == 404:
                    return None
                raise
        return wait_until(attempt, timeout=timeout, what=what)

    def events_for(self, namespace: str, name: str, kind: str = "Pod") -> list[dict]:
        """events.k8s.io/v1 Events regarding the object (what `kubectl describe` shows)."""
        selector = f"regarding.name={name},regarding.kind={kind}"
        return self.items(f"/apis/events.k8s.io/v1/namespaces/{namespace}/events",
                         fieldSelector=selector)


def pod_path(namespace: str, name: str = "") -> str:
    return f"/api/v1/namespaces/{namespace}/pods" + (f"/{name}" if name else "")
