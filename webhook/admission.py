"""AdmissionReview in and out (admission.k8s.io/v1 and v1beta1): parse, validate, answer.

Pure functions. A body the apiserver would never send is a typed AdmissionError carrying the
HTTP status to answer with (400, or 413 when oversized); the app turns it into a JSON reply.
"""
import base64
import json
from dataclasses import dataclass, field

from archway.errors import ArchwayError
from archway.logsafe import clip
from archway.placement.debugcontainers import DebugRequest, read_debug_request
from archway.placement.decision import Decision
from archway.placement.policy import opt_out_reason
from archway.podview import PodShapeError, PodView

API_VERSIONS = ("admission.k8s.io/v1", "admission.k8s.io/v1beta1")
OPERATIONS = ("CREATE", "UPDATE", "DELETE", "CONNECT")

MAX_WARNINGS = 5          # kubectl prints every warning; a wall of them helps nobody
MAX_WARNING_CHARS = 120   # the Kubernetes API conventions ask for warnings under 120 characters


class AdmissionError(ArchwayError):
    """The request body is not an AdmissionReview archway can answer."""
    status = 400


class BodyTooLarge(AdmissionError):
    status = 413


@dataclass(frozen=True)
class AdmissionRequest:
    api_version: str                 # echoed in the reply: the apiserver expects its own version
    uid: str
    operation: str
    kind: dict                       # {group, version, kind} of `object`
    resource: dict                   # {group, version, resource}
    sub_resource: str
    namespace: str
    name: str
    pod: PodView | None              # the pod of a pod CREATE, read and shape-checked
    dry_run: bool = False
    user: str = field(default="", compare=False)
    debug: DebugRequest | None = None   # an UPDATE of pods/ephemeralcontainers (kubectl debug)

    @property
    def is_pod_create(self) -> bool:
        return _is_pod_create(self.operation, self.resource, self.sub_resource)

    @property
    def display_name(self) -> str:
        """namespace/name for logs; `generateName*` for pods that have no name yet."""
        if self.pod is not None:
            return self.pod.display_name
        if self.debug is not None:
            return self.debug.pod.display_name
        return f"{self.namespace or '-'}/{self.name or '*'}"


def parse_review(body: bytes, max_bytes: int) -> AdmissionRequest:
    """Parse and validate an AdmissionReview request body."""
    if len(body) > max_bytes:
        raise BodyTooLarge(f"request body is larger than the limit of {max_bytes} bytes "
                           "(server.max_body_bytes)")
    try:
        review = json.loads(body)
    except (ValueError, UnicodeDecodeError) as e:   # integers over 4,300 digits too
        raise AdmissionError(f"request body is not JSON: {e}") from None
    except RecursionError:   # ~1,000 nested arrays or objects: no AdmissionReview nests so deep
        raise AdmissionError("request body nests too deeply to be an AdmissionReview") from None
    if not isinstance(review, dict):
        raise AdmissionError("request body must be a JSON object (an AdmissionReview)")
    api_version = review.get("apiVersion")
    if api_version not in API_VERSIONS:
        raise AdmissionError(f"apiVersion must be one of {', '.join(API_VERSIONS)}, "
                             f"got {_show(api_version)}")
    if review.get("kind") != "AdmissionReview":
        raise AdmissionError(f"kind must be AdmissionReview, got {_show(review.get('kind'))}")
    request = review.get("request")
    if not isinstance(request, dict):
        raise AdmissionError("AdmissionReview has no request object")
    uid = request.get("uid")
    if not isinstance(uid, str) or not uid:
        raise AdmissionError("request.uid must be a non-empty string")
    operation = request.get("operation")
    if operation not in OPERATIONS:
        raise AdmissionError(f"request.operation must be one of {', '.join(OPERATIONS)}, "
                             f"got {_show(operation)}")
    kind = _optional(request, "kind", dict, {})
    resource = _optional(request, "resource", dict, {})
    obj = _optional(request, "object", dict, None)
    dry_run = _optional(request, "dryRun", bool, False)
    user_info = _optional(request, "userInfo", dict, {})
    sub_resource = _optional(request, "subResource", str, "")
    namespace = _optional(request, "namespace", str, "")
    name = _optional(request, "name", str, "")
    pod = debug = None
    if _is_debug_update(operation, resource, sub_resource):
        debug = _debug_request(obj, request.get("oldObject"), namespace, name)
    elif _is_pod_create(operation, resource, sub_resource):
        if obj is None:
            raise AdmissionError("request.object must hold the pod for a pod CREATE")
        try:
            pod = PodView.of(obj, namespace=namespace, name=name)
        except PodShapeError as e:
            raise AdmissionError(f"request.object: {e}") from None
    return AdmissionRequest(
        api_version=api_version, uid=uid, operation=operation, kind=kind, resource=resource,
        sub_resource=sub_resource, namespace=namespace, name=name, pod=pod, dry_run=dry_run,
        user=user_info.get("username") if isinstance(user_info.get("username"), str) else "",
        debug=debug)


def _is_pod_create(operation: str, resource: dict, sub_resource: str) -> bool:
    return (operation == "CREATE" and not sub_resource
            and resource.get("group", "") == "" and resource.get("resource") == "pods")


def _is_debug_update(operation: str, resource: dict, sub_resource: str) -> bool:
    """An ephemeral container added to a pod (`kubectl debug`): the subresource's UPDATE."""
    return (operation == "UPDATE" and sub_resource == "ephemeralcontainers"
            and resource.get("group", "") == "" and resource.get("resource") == "pods")


def _debug_request(obj, old, namespace: str, name: str) -> DebugRequest:
    if obj is None or old is None:
        raise AdmissionError("request.object and request.oldObject must hold the pod for an "
                             "UPDATE of pods/ephemeralcontainers")
    try:
        return read_debug_request(obj, old, namespace=namespace, name=name)
    except PodShapeError as e:
        raise AdmissionError(f"request.{e}") from None


def _optional(request: dict, key: str, kind: type, default):
    value = request.get(key)
    if value is None:
        return default
    if not isinstance(value, kind):
        raise AdmissionError(f"request.{key} must be {_TYPE_WORDS[kind]}, got {_show(value)}")
    return value


_TYPE_WORDS = {dict: "an object", str: "a string", bool: "true or false"}


def _show(value) -> str:
    text = json.dumps(value)
    return text if len(text) <= 40 else text[:37] + "..."


def skip_reason(request: AdmissionRequest, exclude_namespaces) -> str | None:
    """Why this request is allowed unchanged without looking at any image; None: decide."""
    if not request.is_pod_create:
        return f"{request.operation} of {request.resource.get('resource') or 'object'}" + (
            f"/{request.sub_resource}" if request.sub_resource else "")
    pod = request.pod
    assert pod is not None  # parse_review reads the pod of every pod CREATE
    opted_out = opt_out_reason(pod, exclude_namespaces)
    if opted_out is not None:
        return opted_out
    if pod.node_name:
        return "spec.nodeName is already set"  # bound by its creator: the scheduler never sees it
    return None


def review_response(request: AdmissionRequest, decision: Decision, *, warnings=(),
                    audit_annotations: dict | None = None) -> dict:
    """The AdmissionReview to send back for `decision` (same apiVersion as the request).
    `warnings` are the reply's, already capped (cap_warnings)."""
    response = {"uid": request.uid, "allowed": decision.allowed}
    if decision.allowed and decision.patch:
        # patchType only ever travels with a patch: the apiserver rejects one without the other.
        response["patchType"] = "JSONPatch"
        response["patch"] = base64.b64encode(json.dumps(list(decision.patch)).encode()).decode()
    if not decision.allowed:
        response["status"] = {"code": 403, "reason": "Forbidden", "message": decision.message}
    if warnings:
        response["warnings"] = list(warnings)
    if audit_annotations:
        response["auditAnnotations"] = dict(audit_annotations)
    return {"apiVersion": request.api_version, "kind": "AdmissionReview", "response": response}


def allow_unchanged(request: AdmissionRequest) -> dict:
    return review_response(request, Decision(allowed=True))


def cap_warnings(warnings) -> tuple[str, ...]:
    """At most MAX_WARNINGS printable lines of at most MAX_WARNING_CHARS, in the order given;
    the last line counts what was left out."""
    warnings = [clip(w, MAX_WARNING_CHARS) for w in warnings]
    if len(warnings) > MAX_WARNINGS:
        more = len(warnings) - (MAX_WARNINGS - 1)
        warnings = warnings[:MAX_WARNINGS - 1] + [f"... and {more} more warnings from archway"]
    return tuple(warnings)

