"""Workloads and their pods: a Pod, or the pod template of a Deployment, StatefulSet, DaemonSet,
ReplicaSet, Job or CronJob, read from manifests or from the cluster. Pure functions.

`archway explain` and `archway report` decide on these pods exactly as the webhook would decide
on the pods the controllers create from them.
"""
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from archway.errors import ArchwayError
from archway.podview import PodView

# kind -> where the pod template is (a Pod is its own pod).
TEMPLATE_PATHS: dict[str, tuple[str, ...]] = {
    "Pod": (),
    "Deployment": ("spec", "template"),
    "StatefulSet": ("spec", "template"),
    "DaemonSet": ("spec", "template"),
    "ReplicaSet": ("spec", "template"),
    "Job": ("spec", "template"),
    "CronJob": ("spec", "jobTemplate", "spec", "template"),
}


@dataclass(frozen=True)
class Workload:
    kind: str
    namespace: str
    name: str
    pod: dict          # a Pod object: the template's metadata and spec
    origin: str = ""   # where it was read: "deploy.yaml, document 2"

    @property
    def display_name(self) -> str:
        return f"{self.kind} {self.namespace + '/' if self.namespace else ''}{self.name or '-'}"


def pod_of(obj: dict) -> dict:
    """The Pod a workload object makes (its template as a Pod); ArchwayError when malformed."""
    kind = str(obj.get("kind"))
    template: object = obj
    for key in TEMPLATE_PATHS[kind]:
        template = template.get(key) if isinstance(template, dict) else None
    if not isinstance(template, dict):
        raise ArchwayError(f"{kind} has no pod template at {'.'.join(TEMPLATE_PATHS[kind])}")
    if kind == "Pod":
        return obj
    metadata = _mapping(template.get("metadata"))
    namespace = _mapping(obj.get("metadata")).get("namespace")
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {**metadata, **({"namespace": namespace} if namespace else {})},
            "spec": template.get("spec") or {}}


def workloads_in(objects: Iterable, origin: str = "") -> Iterator[Workload]:
    """The workloads among `objects` (parsed manifest documents); a `List` (kind v1 List, or any
    *List with items) is opened; other kinds (Services, ConfigMaps...) are skipped."""
    for i, obj in enumerate(objects, 1):
        where = f"{origin}, document {i}" if origin else f"document {i}"
        yield from _workloads(obj, where)


def _workloads(obj, where: str) -> Iterator[Workload]:
    if not isinstance(obj, dict):
        return
    kind = obj.get("kind")
    if isinstance(kind, str) and kind.endswith("List") and isinstance(obj.get("items"), list):
        for j, item in enumerate(obj["items"], 1):
            yield from _workloads(item, f"{where}, item {j}")
        return
    if kind not in TEMPLATE_PATHS:
        return
    metadata = _mapping(obj.get("metadata"))
    name = metadata.get("name") or metadata.get("generateName") or ""
    yield Workload(kind, metadata.get("namespace") or "", str(name), pod_of(obj), where)


def _mapping(value: object) -> dict:
    return value if isinstance(value, dict) else {}


def controller_of(obj: dict) -> dict | None:
    """The ownerReference that controls `obj` (controller: true), if any."""
    for ref in (obj.get("metadata") or {}).get("ownerReferences") or ():
        if isinstance(ref, dict) and ref.get("controller"):
            return ref
    return None


# What `report` lists: objects whose controller is one of these is covered by that controller.
OWNING_KINDS = frozenset(TEMPLATE_PATHS) - {"Pod"}


def is_top_level(obj: dict) -> bool:
    """True unless a workload kind archway reports controls `obj` (a Deployment's ReplicaSet, a
    CronJob's Job, a ReplicaSet's Pod): each workload is reported once, at its top."""
    owner = controller_of(obj)
    return owner is None or owner.get("kind") not in OWNING_KINDS


@dataclass(frozen=True)
class Wanted:
    """An image the cluster runs, and a pod that runs it."""
    image: str
    pod: PodView       # a pod that runs it: its pull secrets open a private registry


def wanted_images(objects, exclude_namespaces=()) -> list[Wanted]:
    """The distinct images (per namespace, ServiceAccount and pull secrets) that the listed
    workloads and pods run, in the order found; malformed objects are skipped."""
    found: dict[tuple, Wanted] = {}
    for obj in objects:
        try:
            pod = PodView.of(pod_of(obj))
        except (ArchwayError, KeyError):
            continue
        if pod.namespace in exclude_namespaces:
            continue
        for image in pod.images:
            key = (image, pod.namespace, pod.service_account, pod.pull_secret_names)
            found.setdefault(key, Wanted(image, pod))
    return list(found.values())
