"""What the end-to-end tests create and look at: pods and Deployments, where they were bound,
their gates and Events, through the real API."""
import yaml

from lab.kube import Kube, KubeError, pod_path


def pod(name: str, images: list[str], *, init: list[str] = (), **spec) -> dict:
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "labels": {"app": name}},
            "spec": {"containers": [{"name": f"c{i}", "image": image} for i, image in enumerate(images)],
                     **({"initContainers": [{"name": f"init{i}", "image": image}
                                            for i, image in enumerate(init)]} if init else {}),
                     **spec}}


def deployment(name: str, images: list[str], *, replicas: int = 3, init: list[str] = (),
               **spec) -> dict:
    template = pod(name, images, init=init, **spec)
    return {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": name},
            "spec": {"replicas": replicas, "selector": {"matchLabels": {"app": name}},
                     "template": {"metadata": template["metadata"], "spec": template["spec"]}}}


def create_pod(kube: Kube, namespace: str, body: dict) -> dict:
    return kube.create(pod_path(namespace), body)


def create_deployment(kube: Kube, namespace: str, body: dict) -> dict:
    return kube.create(f"/apis/apps/v1/namespaces/{namespace}/deployments", body)


def pods_of(kube: Kube, namespace: str, app: str) -> list[dict]:
    return kube.items(pod_path(namespace), labelSelector=f"app={app}")


def node_arch(kube: Kube, node: str) -> str:
    return kube.get(f"/api/v1/nodes/{node}")["metadata"]["labels"]["kubernetes.io/arch"]


def wait_bound(kube: Kube, namespace: str, app: str, count: int, timeout: float = 30.0) -> list[dict]:
    """The `count` pods of `app`, once every one has a node."""
    def bound():
        pods = pods_of(kube, namespace, app)
        return pods if len(pods) >= count and all(p["spec"].get("nodeName") for p in pods) else None
    return kube.wait_for(bound, timeout=timeout, what=f"{count} pods of {app} bound to nodes")


def arches_of(kube: Kube, pods: list[dict]) -> set[str]:
    return {node_arch(kube, p["spec"]["nodeName"]) for p in pods}


def gated(pod_obj: dict) -> bool:
    return any(g.get("name") == "archway.dev/resolving" for g in pod_obj["spec"].get("schedulingGates") or [])


def describe(kube: Kube, namespace: str, name: str) -> str:
    """A pod and its Events, for assertion messages."""
    try:
        obj = kube.get(pod_path(namespace, name))
    except KubeError as e:
        obj = {"error": str(e)}
    events = kube.events_for(namespace, name)
    return yaml.safe_dump({"pod": obj, "events": [(e.get("reason"), e.get("note")) for e in events]})


def metric(archway, name: str, **labels) -> float:
    """A sample of an `archway serve`'s /metrics (summed over its series matching `labels`)."""
    total = 0.0
    for line in archway.get("/metrics").text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            head, _, value = line.rpartition(" ")
            if all(f'{k}="{v}"' in head for k, v in labels.items()):
                total += float(value)
    return total
