"""What the stand-in API server (apiserver.py) knows of Kubernetes' objects, apart from serving
them: Status bodies, object paths, the pods' binding and eviction, label and field selectors, merge patches, the List kinds, and
what a watch with a label selector receives for one change."""
import copy
import re
import time


def failure(code: int, reason: str, message: str, details: dict | None = None) -> dict:
    """The Status body of a refused request."""
    status = {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
              "message": message, "reason": reason, "code": code}
    if details:
        status["details"] = details
    return status


def resource_of(path: str) -> tuple[str, str, str]:
    """(group, plural, name) of an object path: /apis/coordination.k8s.io/v1/.../leases/x."""
    parts = path.strip("/").split("/")
    group = parts[1] if parts[0] == "apis" else ""
    return group, parts[-2] if len(parts) >= 2 else "", parts[-1]


def about(path: str) -> tuple[str, str, dict]:
    """(qualified resource, name, a Status's details) of the object at `path`: what a refusal
    says about it (`pods "p"`, `leases.coordination.k8s.io "x"`)."""
    group, plural, name = resource_of(path)
    details = {"name": name, "group": group, "kind": plural} if group else {"name": name,
                                                                           "kind": plural}
    return (f"{plural}.{group}" if group else plural), name, details


def matches(selector: str, obj: dict | None) -> bool:
    """Equality-based label selector: key, !key, key=value, key==value, key!=value."""
    if obj is None:
        return False
    labels = (obj.get("metadata") or {}).get("labels") or {}
    for term in filter(None, (t.strip() for t in selector.split(","))):
        if "!=" in term:
            key, value = term.split("!=", 1)
            if labels.get(key.strip()) == value.strip():
                return False
        elif "=" in term:
            key, value = term.replace("==", "=").split("=", 1)
            if labels.get(key.strip()) != value.strip():
                return False
        elif term.startswith("!"):
            if term[1:].strip() in labels:
                return False
        elif term not in labels:
            return False
    return True


def in_collection(collection: str, path: str) -> bool:
    """Whether objects of `collection` are listed at `path`: their own collection, or the
    all-namespaces path of their resource (/api/v1/pods lists /api/v1/namespaces/*/pods)."""
    if collection == path:
        return True
    parts, wanted = collection.split("/"), path.split("/")
    # /api/v1/namespaces/NS/pods vs /api/v1/pods (also /apis/GROUP/VERSION/...)
    return (len(parts) == len(wanted) + 2 and parts[-3] == "namespaces"
            and parts[:-3] + parts[-1:] == wanted)


def merge(target, patch, strategic: bool):
    """RFC 7386 merge patch; with `strategic`, lists of named objects merge by `name` as the
    real server does for webhooks, containers and volumes."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    result = copy.deepcopy(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        elif (strategic and isinstance(value, list) and isinstance(result.get(key), list)
              and all(isinstance(v, dict) and "name" in v for v in value + result[key])):
            merged = {item["name"]: item for item in result[key]}
            for item in value:
                if item.get("$patch") == "delete":   # the directive that removes an item
                    merged.pop(item["name"], None)
                    continue
                merged[item["name"]] = merge(merged.get(item["name"], {}), item, strategic)
            result[key] = list(merged.values())
        else:
            result[key] = merge(result.get(key), value, strategic)
    return result


# plural -> (List kind, apiVersion) of the collections archway lists.
LISTS = {
    "nodes": ("NodeList", "v1"), "namespaces": ("NamespaceList", "v1"),
    "pods": ("PodList", "v1"), "events": ("EventList", "v1"),
    "secrets": ("SecretList", "v1"), "serviceaccounts": ("ServiceAccountList", "v1"),
    "deployments": ("DeploymentList", "apps/v1"), "statefulsets": ("StatefulSetList", "apps/v1"),
    "daemonsets": ("DaemonSetList", "apps/v1"), "replicasets": ("ReplicaSetList", "apps/v1"),
    "jobs": ("JobList", "batch/v1"), "cronjobs": ("CronJobList", "batch/v1"),
    "mutatingwebhookconfigurations": ("MutatingWebhookConfigurationList",
                                      "admissionregistration.k8s.io/v1"),
    "leases": ("LeaseList", "coordination.k8s.io/v1"),
    # archway's own kinds: as with its CRDs installed
    "placementpolicies": ("PlacementPolicyList", "archway.dev/v1alpha1"),
    "clusterplacementpolicies": ("ClusterPlacementPolicyList", "archway.dev/v1alpha1"),
}
# Field selectors the real server accepts (every resource: metadata.name/namespace).
EVENT_FIELDS = {"involvedObject.kind", "involvedObject.namespace", "involvedObject.name",
                 "involvedObject.uid", "involvedObject.apiVersion", "involvedObject.fieldPath",
                 "involvedObject.resourceVersion", "reason", "reportingComponent", "source",
                 "type"}


def field_value(obj: dict, dotted: str) -> str:
    value: object = obj
    for part in dotted.split("."):
        value = value.get(part) if isinstance(value, dict) else None
    if dotted == "source" and isinstance(value, dict):
        value = value.get("component")
    return "" if value is None else str(value)


def field_selector(text: str, plural: str):
    """A predicate for `fieldSelector`; ValueError with the real server's words when a field
    is not supported for this resource."""
    allowed = {"metadata.name", "metadata.namespace"} | (EVENT_FIELDS if plural == "events"
                                                         else set()) \
        | ({"spec.nodeName"} if plural == "pods" else set())
    tests = []
    for clause in filter(None, text.split(",")):
        match = re.match(r"^([\w.]+)\s*(==|!=|=)\s*(.*)$", clause)
        if not match:
            raise ValueError(f"invalid selector: '{clause}'; can't understand '{clause}'")
        field, op, value = match.groups()
        if field not in allowed:
            raise ValueError(f'field label not supported: {field}')
        tests.append((field, op != "!=", value))
    return lambda obj: all((field_value(obj, f) == v) == equal for f, equal, v in tests)


def seen_as(event_type: str, obj: dict, old: dict | None, selector: str,
            fields=None) -> str | None:
    """What a watch with label `selector` and `fields` (a field_selector predicate; None: no
    field selector) receives for one change (None: nothing)."""
    if not selector and fields is None:
        return event_type

    def selected(o: dict | None) -> bool:
        return matches(selector, o) and (fields is None or fields(o))
    now, before = selected(obj), selected(old)
    if event_type == "MODIFIED":
        if now and before:
            return "MODIFIED"
        return "ADDED" if now else "DELETED" if before else None
    if event_type == "DELETED":
        return "DELETED" if before or now else None
    return event_type if now else None

CREATED = {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Success", "code": 201}


def bound(pod: dict, binding) -> tuple[int, dict, dict | None]:
    """POST pods/NAME/binding as the real BindingREST answers it: 201 Status, the pod gets
    spec.nodeName and a PodScheduled condition (a MODIFIED watch event)."""
    pod_name = pod["metadata"]["name"]
    if not isinstance(binding, dict) or binding.get("kind", "Binding") != "Binding":
        return 400, failure(400, "BadRequest", "the body is not a Binding"), None
    if (binding.get("metadata") or {}).get("name") != pod_name:
        return 400, failure(400, "BadRequest",
                            "name in URL does not match name in Binding object"), None
    target = binding.get("target") or {}
    if target.get("kind", "") not in ("", "Node") or not target.get("name"):
        field = "target.kind" if target.get("kind", "") not in ("", "Node") else "target.name"
        return 422, failure(422, "Invalid", f'Binding.core "{pod_name}" is '
                            f'invalid: {field}: Invalid value'), None
    node = (pod.get("spec") or {}).get("nodeName")
    if node or pod["metadata"].get("deletionTimestamp"):
        return 409, failure(409, "Conflict", f'Operation cannot be fulfilled on pods '
                            f'"{pod_name}": pod {pod_name} is already assigned to node '
                            f'"{node}"'), None
    pod = copy.deepcopy(pod)
    pod.setdefault("spec", {})["nodeName"] = target["name"]
    status = pod.setdefault("status", {})
    status["conditions"] = [c for c in status.get("conditions") or []
                            if c.get("type") != "PodScheduled"] + [{
        "type": "PodScheduled", "status": "True", "lastProbeTime": None,
        "lastTransitionTime": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}]
    return 201, CREATED, pod


def evicted(pod: dict, eviction) -> tuple[int, dict, str | None]:
    """POST pods/NAME/eviction with no PodDisruptionBudget in the way (a 429 is a fault of the
    test's): the pod deleted at once, as for a pod no kubelet runs, its uid precondition checked
    (409 for another pod of that name)."""
    if not isinstance(eviction, dict) or eviction.get("kind") != "Eviction":
        return 400, failure(400, "BadRequest", "the body is not an Eviction"), None
    uid = ((eviction.get("deleteOptions") or {}).get("preconditions") or {}).get("uid")
    if uid and uid != pod["metadata"].get("uid"):
        return 409, failure(409, "Conflict", f"Precondition failed: UID in precondition: {uid}, "
                            f"UID in object meta: {pod['metadata'].get('uid')}"), None
    return 201, CREATED, "DELETED"


POD_SUBRESOURCES = {"binding": bound, "eviction": evicted}
