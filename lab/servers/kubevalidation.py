"""What kube-apiserver's validation says about the writes archway makes, as field errors.

Written after k8s.io/kubernetes pkg/apis/core/validation (ValidatePodUpdate with the
KEP-3838 rules for gated pods, validateOnlyDeletedSchedulingGates, validateNodeSelectorMutation,
validateNodeAffinityMutation, validateOnlyAddedTolerations, ValidateObjectMetaUpdate) and
validation/events.go (ValidateEventCreate for events.k8s.io/v1). The stand-in API server answers
a write with any of these errors as the real one does: 422 Invalid with the causes.

Semantic equality is apimachinery's: a nil slice or map equals an empty one (absent == [] ==
{} for lists and for the string maps), a nil pointer to a struct does NOT equal an empty struct.
"""
import json
import re
from dataclasses import dataclass

_LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")
_NAME_PART = re.compile(r"^([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]$")
_DNS1123_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
_STRING_MAPS = frozenset({"nodeSelector", "labels", "annotations", "limits", "requests",
                          "overhead"})
_OPERATORS = ("In", "NotIn", "Exists", "DoesNotExist", "Gt", "Lt")
_REQUIRED = "requiredDuringSchedulingIgnoredDuringExecution"
_SPEC_FORBIDDEN = ("pod updates may not change fields other than `spec.containers[*].image`,"
                   "`spec.initContainers[*].image`,`spec.activeDeadlineSeconds`,"
                   "`spec.tolerations` (only additions to existing tolerations),"
                   "`spec.terminationGracePeriodSeconds` (allow it to be set to 1 if it was "
                   "previously negative)")


@dataclass(frozen=True)
class FieldError:
    kind: str         # Invalid | Forbidden | Required
    field: str
    detail: str
    value: object = None

    @property
    def reason(self) -> str:
        return {"Invalid": "FieldValueInvalid", "Forbidden": "FieldValueForbidden",
                "Required": "FieldValueRequired"}[self.kind]

    @property
    def body(self) -> str:
        if self.kind == "Invalid":
            return f"Invalid value: {json.dumps(self.value)}: {self.detail}"
        if self.kind == "Required":
            return "Required value" + (f": {self.detail}" if self.detail else "")
        return f"Forbidden: {self.detail}"

    def __str__(self) -> str:
        return f"{self.field}: {self.body}"


def invalid_status(kind: str, name: str, errors: list[FieldError]) -> dict:
    """The 422 Status the apiserver sends for `errors` about object `name` of `kind`."""
    listed = str(errors[0]) if len(errors) == 1 else "[" + ", ".join(map(str, errors)) + "]"
    return {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
            "message": f'{kind} "{name}" is invalid: {listed}', "reason": "Invalid",
            "details": {"name": name, "kind": kind,
                        "causes": [{"reason": e.reason, "message": e.body, "field": e.field}
                                   for e in errors]},
            "code": 422}


# --- semantic equality --------------------------------------------------------------------------

def normal(value, key: str = ""):
    """`value` with apimachinery's semantic-equality blanks removed."""
    if isinstance(value, dict):
        out = {}
        for k, v in value.items():
            v = normal(v, k)
            if v is None or v == [] or (v == {} and k in _STRING_MAPS):
                continue
            out[k] = v
        return out
    if isinstance(value, list):
        return [normal(v) for v in value]
    return value


def equal(a, b) -> bool:
    return normal({"x": a}) == normal({"x": b})


# --- pods ---------------------------------------------------------------------------------------

def validate_pod_update(old: dict, new: dict, *,
                        mutable_scheduling_directives: bool = True) -> list[FieldError]:
    """`mutable_scheduling_directives=False`: an apiserver before KEP-3838 (1.26, with
    scheduling gates on), where a gated pod's nodeSelector and affinity are as fixed as any
    other pod's and only the deletion of gates is allowed."""
    errors = _validate_meta_update(old.get("metadata") or {}, new.get("metadata") or {})
    old_spec, new_spec = old.get("spec") or {}, new.get("spec") or {}
    errors += _validate_pod_spec(new_spec)
    errors += _validate_labels(new.get("metadata") or {})
    for field in ("containers", "initContainers"):
        if len(old_spec.get(field) or []) != len(new_spec.get(field) or []):
            errors.append(FieldError("Forbidden", f"spec.{field}",
                                     "pod updates may not add or remove containers"))
            return errors
    errors += _only_added_tolerations(new_spec.get("tolerations") or [],
                                      old_spec.get("tolerations") or [])
    errors += _only_deleted_gates(new_spec.get("schedulingGates") or [],
                                  old_spec.get("schedulingGates") or [])
    if equal(old_spec, new_spec):
        return errors
    munged = _with_mutable_fields_of(old_spec, new_spec)
    if old_spec.get("schedulingGates") and mutable_scheduling_directives:
        errors += _scheduling_directives(old_spec, new_spec, munged)
    if not equal(munged, old_spec):
        errors.append(FieldError("Forbidden", "spec", _SPEC_FORBIDDEN))
    return errors


def _with_mutable_fields_of(old_spec: dict, new_spec: dict) -> dict:
    """A copy of `new_spec` with what any pod update may change (images, the deadline, gates,
    tolerations: each validated on its own) as it was in `old_spec`."""
    munged = json.loads(json.dumps(new_spec))
    for field in ("containers", "initContainers"):
        for mine, theirs in zip(munged.get(field) or [], old_spec.get(field) or []):
            mine["image"] = theirs.get("image")
    # activeDeadlineSeconds may be set or lowered (validated on its own; not by archway).
    for field in ("activeDeadlineSeconds", "schedulingGates", "tolerations"):
        _set(munged, field, old_spec.get(field))
    return munged


def _scheduling_directives(old_spec: dict, new_spec: dict, munged: dict) -> list[FieldError]:
    """A gated pod's nodeSelector and node affinity may gain terms (KEP-3838): the errors if
    they lost or changed one; `munged` given the old ones back, for the rest of the comparison."""
    errors = _node_selector_mutation(new_spec.get("nodeSelector") or {},
                                     old_spec.get("nodeSelector") or {})
    _set(munged, "nodeSelector", old_spec.get("nodeSelector"))
    old_affinity = old_spec.get("affinity")
    old_na = old_affinity.get("nodeAffinity") if isinstance(old_affinity, dict) else None
    new_affinity = new_spec.get("affinity")
    new_na = new_affinity.get("nodeAffinity") if isinstance(new_affinity, dict) else None
    errors += _node_affinity_mutation(new_na, old_na)
    munged_affinity = munged.get("affinity")
    if munged_affinity is None and old_na is None:
        pass
    elif munged_affinity is None:
        munged["affinity"] = {"nodeAffinity": old_na}
    elif old_affinity is None and not munged_affinity.get("podAffinity") \
            and not munged_affinity.get("podAntiAffinity"):
        del munged["affinity"]
    else:
        _set(munged_affinity, "nodeAffinity", old_na)
    return errors


def _set(obj: dict, key: str, value) -> None:
    if value is None:
        obj.pop(key, None)
    else:
        obj[key] = value


def _validate_meta_update(old: dict, new: dict) -> list[FieldError]:
    errors = []
    for key in ("name", "namespace", "uid", "creationTimestamp"):
        if (old.get(key) or "") != (new.get(key) or ""):
            errors.append(FieldError("Invalid", f"metadata.{key}", "field is immutable",
                                     new.get(key)))
    return errors


def _validate_labels(meta: dict) -> list[FieldError]:
    errors = []
    for key, value in (meta.get("labels") or {}).items():
        if not isinstance(value, str) or len(value) > 63 or not _LABEL_VALUE.match(value):
            errors.append(FieldError("Invalid", "metadata.labels", "a valid label must be an "
                                     "empty string or consist of alphanumeric characters, '-', "
                                     "'_' or '.'", value))
        if not _qualified_name(key):
            errors.append(FieldError("Invalid", "metadata.labels", "name part must consist of "
                                     "alphanumeric characters, '-', '_' or '.'", key))
    return errors


def _qualified_name(name) -> bool:
    if not isinstance(name, str) or not name:
        return False
    prefix, _, part = name.rpartition("/")
    if prefix and (len(prefix) > 253 or not _DNS1123_SUBDOMAIN.match(prefix)):
        return False
    return len(part) <= 63 and bool(_NAME_PART.match(part))


def _validate_pod_spec(spec: dict) -> list[FieldError]:
    """The parts of ValidatePodSpec an update by archway could get wrong."""
    errors = []
    for key, value in (spec.get("nodeSelector") or {}).items():
        if not isinstance(value, str) or not _LABEL_VALUE.match(value) or len(value) > 63:
            errors.append(FieldError("Invalid", "spec.nodeSelector", "a valid label value", value))
        if not _qualified_name(key):
            errors.append(FieldError("Invalid", "spec.nodeSelector", "a qualified name", key))
    affinity = spec.get("affinity") or {}
    required = (affinity.get("nodeAffinity") or {}).get(_REQUIRED)
    if required is not None:
        path = f"spec.affinity.nodeAffinity.{_REQUIRED}.nodeSelectorTerms"
        terms = required.get("nodeSelectorTerms") or []
        if not terms:
            errors.append(FieldError("Required", path, "must have at least one node selector term"))
        for i, term in enumerate(terms):
            for j, req in enumerate(term.get("matchExpressions") or []):
                errors += _requirement(req, f"{path}[{i}].matchExpressions[{j}]")
    for i, gate in enumerate(spec.get("schedulingGates") or []):
        if not _qualified_name(gate.get("name")):
            errors.append(FieldError("Invalid", f"spec.schedulingGates[{i}].name",
                                     "must be a qualified name", gate.get("name")))
    return errors


def _requirement(req: dict, path: str) -> list[FieldError]:
    operator, values = req.get("operator"), req.get("values") or []
    if operator not in _OPERATORS:
        return [FieldError("Invalid", f"{path}.operator", "not a valid selector operator",
                           operator)]
    if operator in ("In", "NotIn") and not values:
        return [FieldError("Required", f"{path}.values",
                           "must be specified when `operator` is 'In' or 'NotIn'")]
    if operator in ("Exists", "DoesNotExist") and values:
        return [FieldError("Forbidden", f"{path}.values",
                           "may not be specified when `operator` is 'Exists' or 'DoesNotExist'")]
    errors = []
    if not _qualified_name(req.get("key")):
        errors.append(FieldError("Invalid", f"{path}.key", "must be a qualified name",
                                 req.get("key")))
    for value in values:
        if operator in ("In", "NotIn") and (not _LABEL_VALUE.match(str(value)) or len(value) > 63):
            errors.append(FieldError("Invalid", f"{path}.values", "a valid label value", value))
    return errors


def _only_deleted_gates(new: list, old: list) -> list[FieldError]:
    old_names = {g.get("name") for g in old}
    return [FieldError("Forbidden", f"spec.schedulingGates[{i}].name",
                       f"only deletion is allowed, but found new scheduling gate "
                       f"'{g.get('name')}'")
            for i, g in enumerate(new) if g.get("name") not in old_names]


def _only_added_tolerations(new: list, old: list) -> list[FieldError]:
    errors = []
    for toleration in old:
        if not any(equal(toleration, t) for t in new):
            errors.append(FieldError("Forbidden", "spec.tolerations",
                                     "existing toleration can not be modified except its "
                                     "tolerationSeconds", toleration))
    return errors


def _node_selector_mutation(new: dict, old: dict) -> list[FieldError]:
    for key, value in old.items():
        if new.get(key) != value:
            return [FieldError("Invalid", "spec.nodeSelector", "only additions to "
                               "spec.nodeSelector are allowed (no mutations or deletions)", new)]
    return []


def _node_affinity_mutation(new_na, old_na) -> list[FieldError]:
    if not isinstance(old_na, dict) or old_na.get(_REQUIRED) is None:
        return []
    path = f"spec.affinity.nodeAffinity.{_REQUIRED}.nodeSelectorTerms"
    old_terms = old_na[_REQUIRED].get("nodeSelectorTerms") or []
    new_required = new_na.get(_REQUIRED) if isinstance(new_na, dict) else None
    new_terms = (new_required or {}).get("nodeSelectorTerms") or []
    if old_terms and len(old_terms) != len(new_terms):
        return [FieldError("Invalid", path, "no additions/deletions to non-empty "
                           "NodeSelectorTerms list are allowed", new_terms)]
    errors = []
    for i, (old_term, new_term) in enumerate(zip(old_terms, new_terms)):
        if not _only_additions(new_term, old_term):
            errors.append(FieldError("Invalid", f"{path}[{i}]", "only additions are allowed "
                                     "(no mutations or deletions)", new_term))
    return errors


def _only_additions(new_term: dict, old_term: dict) -> bool:
    for field in ("matchExpressions", "matchFields"):
        old, new = old_term.get(field) or [], new_term.get(field) or []
        if len(old) > len(new) or not all(any(equal(o, n) for n in new) for o in old):
            return False
    return True


# --- events.k8s.io/v1 ----------------------------------------------------------------------------

def validate_event_create(event: dict, namespace: str) -> list[FieldError]:
    """ValidateEventCreate for events.k8s.io/v1 (strict: the new-style Event)."""
    errors = _event_name(event.get("metadata") or {})
    regarding = event.get("regarding") or {}
    if not event.get("eventTime"):
        errors.append(FieldError("Required", "eventTime", ""))
    if event.get("type") not in ("Normal", "Warning"):
        errors.append(FieldError("Invalid", "type", f"has invalid value: {event.get('type')}", ""))
    if regarding.get("namespace") and regarding.get("namespace") != namespace:
        errors.append(FieldError("Invalid", "involvedObject.namespace",
                                 "does not match event.namespace", regarding.get("namespace")))
    controller = event.get("reportingController") or ""
    if not controller:
        errors.append(FieldError("Required", "reportingController", ""))
    elif not _qualified_name(controller):
        errors.append(FieldError("Invalid", "reportingController", "must be a qualified name",
                                 controller))
    return errors + _event_texts(event)


def _event_name(meta: dict) -> list[FieldError]:
    name = meta.get("name") or ""
    if not name:
        return [FieldError("Required", "metadata.name", "name or generateName is required")]
    if len(name) > 253 or not _DNS1123_SUBDOMAIN.match(name):
        return [FieldError("Invalid", "metadata.name", "a lowercase RFC 1123 subdomain", name)]
    return []


def _event_texts(event: dict) -> list[FieldError]:
    """The Event's required strings within their lengths, and no deprecated field set."""
    errors = []
    for field in ("reportingInstance", "action", "reason"):
        value = event.get(field) or ""
        if not value:
            errors.append(FieldError("Required", field, ""))
        elif len(value) > 128:
            errors.append(FieldError("Invalid", field, "can have at most 128 characters", ""))
    if len((event.get("note") or "").encode()) > 1024:   # Go's len: bytes
        errors.append(FieldError("Invalid", "message", "can have at most 1024 characters", ""))
    for field in ("deprecatedFirstTimestamp", "deprecatedLastTimestamp", "deprecatedCount",
                  "deprecatedSource"):
        if event.get(field):
            errors.append(FieldError("Invalid", field, "needs to be unset", ""))
    return errors
