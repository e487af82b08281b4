"""A stand-in for kube-apiserver: no real one can be installed here.

It speaks the exact JSON of the few REST calls archway makes (GET of ServiceAccounts, Secrets,
Nodes, Namespaces and Pods, list + watch of Nodes, Namespaces and Pods, lists of workloads and
Events in one namespace or across all of them with field and label selectors and limit/continue
paging, create of Events, create/replace/patch of a Secret and a MutatingWebhookConfiguration,
replace of Pods, create/get/replace of Leases) and the scheduler's pod create and bind
(pods/binding) over plain HTTP, backed by an in-memory object store keyed by URL path. It is
deliberately narrow: anything archway does not call answers 404 like the real server does for an
unknown object.

Writes are checked as the real server checks them: a stale metadata.resourceVersion is 409
Conflict; a pod update goes through ValidatePodUpdate (the KEP-3838 rules for gated pods) and an
events.k8s.io/v1 Event through ValidateEventCreate (kubevalidation.py), 422 Invalid with field
causes otherwise. Every 4xx answer to a write other than 404 and 409 is kept in `rejections`.
Watches filter by labelSelector with the real server's transitions: an object that stops
matching arrives as DELETED, one that starts matching as ADDED.
"""
import base64
import copy
import json
import os
import re
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlsplit

import jsonpatch

from lab.httpd import BackgroundHTTPServer
from lab.servers.kubevalidation import invalid_status, validate_event_create, validate_pod_update


def _status(code: int, reason: str, message: str, details: dict | None = None) -> dict:
    status = {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
              "message": message, "reason": reason, "code": code}
    if details:
        status["details"] = details
    return status


def _resource(path: str) -> tuple[str, str, str]:
    """(group, plural, name) of an object path: /apis/coordination.k8s.io/v1/.../leases/x."""
    parts = path.strip("/").split("/")
    group = parts[1] if parts[0] == "apis" else ""
    return group, parts[-2] if len(parts) >= 2 else "", parts[-1]


def _qualified(group: str, plural: str) -> str:
    return f"{plural}.{group}" if group else plural


def _matches(selector: str, obj: dict | None) -> bool:
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


def _in_collection(collection: str, path: str) -> bool:
    """Whether objects of `collection` are listed at `path`: their own collection, or the
    all-namespaces path of their resource (/api/v1/pods lists /api/v1/namespaces/*/pods)."""
    if collection == path:
        return True
    parts, wanted = collection.split("/"), path.split("/")
    # /api/v1/namespaces/NS/pods vs /api/v1/pods (also /apis/GROUP/VERSION/...)
    return (len(parts) == len(wanted) + 2 and parts[-3] == "namespaces"
            and parts[:-3] + parts[-1:] == wanted)


def _merge(target, patch, strategic: bool):
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
                merged[item["name"]] = _merge(merged.get(item["name"], {}), item, strategic)
            result[key] = list(merged.values())
        else:
            result[key] = _merge(result.get(key), value, strategic)
    return result


# plural -> (List kind, apiVersion) of the collections archway lists.
_LISTS = {
    "nodes": ("NodeList", "v1"), "namespaces": ("NamespaceList", "v1"),
    "pods": ("PodList", "v1"), "events": ("EventList", "v1"),
    "secrets": ("SecretList", "v1"), "serviceaccounts": ("ServiceAccountList", "v1"),
    "deployments": ("DeploymentList", "apps/v1"), "statefulsets": ("StatefulSetList", "apps/v1"),
    "daemonsets": ("DaemonSetList", "apps/v1"), "replicasets": ("ReplicaSetList", "apps/v1"),
    "jobs": ("JobList", "batch/v1"), "cronjobs": ("CronJobList", "batch/v1"),
    "mutatingwebhookconfigurations": ("MutatingWebhookConfigurationList",
                                      "admissionregistration.k8s.io/v1"),
    "leases": ("LeaseList", "coordination.k8s.io/v1"),
}
# Field selectors the real server accepts (every resource: metadata.name/namespace).
_EVENT_FIELDS = {"involvedObject.kind", "involvedObject.namespace", "involvedObject.name",
                 "involvedObject.uid", "involvedObject.apiVersion", "involvedObject.fieldPath",
                 "involvedObject.resourceVersion", "reason", "reportingComponent", "source",
                 "type"}


def _field(obj: dict, dotted: str) -> str:
    value: object = obj
    for part in dotted.split("."):
        value = value.get(part) if isinstance(value, dict) else None
    if dotted == "source" and isinstance(value, dict):
        value = value.get("component")
    return "" if value is None else str(value)


def _field_selector(text: str, plural: str):
    """A predicate for `fieldSelector`; ValueError with the real server's words when a field
    is not supported for this resource."""
    allowed = {"metadata.name", "metadata.namespace"} | (_EVENT_FIELDS if plural == "events"
                                                         else set())
    tests = []
    for clause in filter(None, text.split(",")):
        match = re.match(r"^([\w.]+)\s*(==|!=|=)\s*(.*)$", clause)
        if not match:
            raise ValueError(f"invalid selector: '{clause}'; can't understand '{clause}'")
        field, op, value = match.groups()
        if field not in allowed:
            raise ValueError(f'field label not supported: {field}')
        tests.append((field, op != "!=", value))
    return lambda obj: all((_field(obj, f) == v) == equal for f, equal, v in tests)


def _seen_as(event_type: str, obj: dict, old: dict | None, selector: str) -> str | None:
    """What a watch with `selector` receives for one change (None: nothing)."""
    if not selector:
        return event_type
    now, before = _matches(selector, obj), _matches(selector, old)
    if event_type == "MODIFIED":
        if now and before:
            return "MODIFIED"
        return "ADDED" if now else "DELETED" if before else None
    if event_type == "DELETED":
        return "DELETED" if before or now else None
    return event_type if now else None


class _QuietServer(ThreadingHTTPServer):
    def handle_error(self, request, client_address):
        # A client that gave up (archway's deadline passed) closes the socket mid-reply:
        # expected in fault tests, not worth a traceback. A bug in the stand-in is.
        if not isinstance(sys.exc_info()[1], (BrokenPipeError, ConnectionResetError)):
            super().handle_error(request, client_address)


class FakeApiServer:
    def __init__(self):
        self.objects: dict[str, dict] = {}
        self.requests: list[tuple[str, str]] = []
        self.faults: dict[str, int] = {}      # path prefix -> HTTP status to answer instead
        self.delay_seconds = 0.0
        self.rejections: list[tuple[str, str, int, str]] = []  # (method, path, code, message)
        self.conflicts = 0
        self.mutable_scheduling_directives = True   # False: validate pod updates as 1.26 does
        # (rv, collection, type, object, the object before the change or None)
        self._events: list[tuple[int, str, str, dict, dict | None]] = []
        self._oldest_rv = 0
        self._rv = 100
        self._lock = threading.Condition()
        self._stopping = False
        self._server = BackgroundHTTPServer(self._handler_class(), server_class=_QuietServer)
        self.port = self._server.port
        self.url = f"http://127.0.0.1:{self.port}"

    # --- what tests call -------------------------------------------------------------------
    def put(self, path: str, obj: dict) -> dict:
        """Store an object at its REST path (e.g. /api/v1/namespaces/ns/secrets/name)."""
        with self._lock:
            return self._store(path, obj, "MODIFIED" if path in self.objects else "ADDED")

    def get(self, path: str) -> dict | None:
        with self._lock:
            return copy.deepcopy(self.objects.get(path))

    def delete(self, path: str) -> dict:
        with self._lock:
            obj = self.objects.pop(path)
            self._rv += 1  # a deletion is a change of its own, with its own resourceVersion
            obj["metadata"]["resourceVersion"] = str(self._rv)
            self._record(path.rsplit("/", 1)[0], "DELETED", obj, obj)
            return obj

    def emit(self, collection: str, event_type: str, obj: dict) -> None:
        """Apply a change as a watch event (ADDED/MODIFIED/DELETED) on `collection`."""
        path = f"{collection}/{obj['metadata']['name']}"
        if event_type == "DELETED":
            self.delete(path)
        else:
            with self._lock:
                self._store(path, obj, event_type)

    def expire_history(self) -> None:
        """Forget past events so a watch from an older resourceVersion gets 410 Gone."""
        with self._lock:
            self._oldest_rv = self._rv
            self._events.clear()

    def kubeconfig(self, directory: str) -> str:
        path = os.path.join(directory, "kubeconfig")
        with open(path, "w") as f:
            json.dump({
                "apiVersion": "v1", "kind": "Config", "current-context": "stand-in",
                "clusters": [{"name": "stand-in", "cluster": {"server": self.url}}],
                "users": [{"name": "stand-in", "user": {"token": "stand-in-token"}}],
                "contexts": [{"name": "stand-in",
                              "context": {"cluster": "stand-in", "user": "stand-in"}}],
            }, f)
        return path

    def count(self, method: str, path_prefix: str) -> int:
        return sum(1 for m, p in self.requests if m == method and p.startswith(path_prefix))

    def stop(self) -> None:
        with self._lock:
            self._stopping = True
            self._lock.notify_all()
        self._server.stop()

    # --- store -----------------------------------------------------------------------------
    def _store(self, path: str, obj: dict, event_type: str) -> dict:
        old = self.objects.get(path)
        obj = copy.deepcopy(obj)
        self._rv += 1
        meta = obj.setdefault("metadata", {})
        meta["resourceVersion"] = str(self._rv)
        meta.setdefault("name", path.rsplit("/", 1)[1])
        meta.setdefault("uid", f"uid-{self._rv}")
        meta.setdefault("creationTimestamp", time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
        parts = path.strip("/").split("/")
        if "namespaces" in parts[:-2] and parts.index("namespaces") + 1 < len(parts) - 2:
            meta.setdefault("namespace", parts[parts.index("namespaces") + 1])
        self.objects[path] = obj
        self._record(path.rsplit("/", 1)[0], event_type, obj, old)
        return copy.deepcopy(obj)

    def _record(self, collection, event_type, obj, old=None):
        self._events.append((self._rv, collection, event_type, copy.deepcopy(obj),
                             copy.deepcopy(old)))
        self._lock.notify_all()

    # --- HTTP ------------------------------------------------------------------------------
    def _handler_class(self):
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"
            disable_nagle_algorithm = True  # headers and body go in separate writes

            def log_message(self, *args):
                pass

            def _reply(self, code: int, body: dict):
                if self.command != "GET" and 400 <= code < 500 and code not in (404, 409):
                    server.rejections.append((self.command, self.path, code,
                                              body.get("message", "")))
                if code == 409 and body.get("reason") == "Conflict":
                    server.conflicts += 1
                data = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _body(self):
                length = int(self.headers.get("Content-Length") or 0)
                return json.loads(self.rfile.read(length) or b"null")

            def _handle(self, method):
                parts = urlsplit(self.path)
                path, query = parts.path.rstrip("/"), parse_qs(parts.query)
                server.requests.append((method, self.path))
                if server.delay_seconds:
                    time.sleep(server.delay_seconds)
                for prefix, code in server.faults.items():
                    if path.startswith(prefix):
                        return self._reply(code, _status(code, "Forbidden" if code == 403
                                                         else "InternalError", "injected fault"))
                try:
                    getattr(self, f"_{method.lower()}")(path, query)
                except json.JSONDecodeError:
                    self._reply(400, _status(400, "BadRequest", "body is not JSON"))

            def do_GET(self):
                self._handle("GET")

            def do_POST(self):
                self._handle("POST")

            def do_PUT(self):
                self._handle("PUT")

            def do_PATCH(self):
                self._handle("PATCH")

            def do_DELETE(self):
                self._handle("DELETE")

            def _not_found(self, path):
                group, kind, name = _resource(path)
                self._reply(404, _status(404, "NotFound",
                                         f'{_qualified(group, kind)} "{name}" not found',
                                         {"name": name, "group": group, "kind": kind}
                                         if group else {"name": name, "kind": kind}))

            def _conflict(self, path):
                group, kind, name = _resource(path)
                self._reply(409, _status(
                    409, "Conflict", f'Operation cannot be fulfilled on {_qualified(group, kind)} '
                    f'"{name}": the object has been modified; please apply your changes to the '
                    'latest version and try again',
                    {"name": name, "group": group, "kind": kind} if group else
                    {"name": name, "kind": kind}))

            def _get(self, path, query):
                if query.get("watch", ["false"])[0].lower() in ("true", "1"):
                    return self._watch(path, query)
                selector = query.get("labelSelector", [""])[0]
                with server._lock:
                    if path in server.objects:
                        return self._reply(200, server.objects[path])
                    plural = path.rsplit("/", 1)[1]
                    # Its own collection, or every namespace's: /apis/apps/v1/deployments lists
                    # /apis/apps/v1/namespaces/*/deployments/*.
                    keyed = sorted((p, o) for p, o in server.objects.items()
                                   if _in_collection(p.rsplit("/", 1)[0], path)
                                   and _matches(selector, o))
                    if not (keyed or plural in _LISTS or any(
                            _in_collection(e[1], path) for e in server._events)):
                        return self._not_found(path)
                    try:
                        keep = _field_selector(query.get("fieldSelector", [""])[0], plural)
                    except ValueError as e:
                        return self._reply(400, _status(400, "BadRequest", str(e)))
                    keyed = [(p, o) for p, o in keyed if keep(o)]
                    meta = {"resourceVersion": str(server._rv)}
                    limit = int(query.get("limit", ["0"])[0] or 0)
                    if limit > 0 or "continue" in query:
                        # Pages in key order; the token says where the next one starts and
                        # at which resourceVersion the list began (as the real server's does).
                        start, rv = "", server._rv
                        if "continue" in query:
                            try:
                                token = json.loads(base64.b64decode(query["continue"][0]))
                                start, rv = token["start"], int(token["rv"])
                            except (ValueError, KeyError, TypeError):
                                return self._reply(400, _status(
                                    400, "BadRequest", "continue key is not valid"))
                            if rv < server._oldest_rv:
                                return self._reply(410, _status(
                                    410, "Expired", "The provided continue parameter is too old"))
                        rest = [(p, o) for p, o in keyed if p > start]
                        keyed = rest[:limit] if limit > 0 else rest
                        meta["resourceVersion"] = str(rv)
                        if len(rest) > len(keyed):
                            meta["continue"] = base64.b64encode(json.dumps(
                                {"v": "meta.k8s.io/v1", "rv": rv, "start": keyed[-1][0]}).encode()).decode()
                            meta["remainingItemCount"] = len(rest) - len(keyed)
                    kind, api_version = _LISTS.get(plural, (plural.capitalize() + "List", "v1"))
                    group = re.match(r"^/apis/([^/]+/[^/]+)/", path)
                    if group:   # e.g. events.k8s.io/v1 Events: the group's own apiVersion
                        api_version = group.group(1)
                    return self._reply(200, {"kind": kind, "apiVersion": api_version,
                                             "metadata": meta, "items": [o for _, o in keyed]})

            def _watch(self, path, query):
                selector = query.get("labelSelector", [""])[0]
                since = int(query.get("resourceVersion", ["0"])[0] or 0)
                timeout = min(float(query.get("timeoutSeconds", ["30"])[0]), 30.0)
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Transfer-Encoding", "chunked")
                self.end_headers()
                end = time.monotonic() + timeout
                try:
                    if since and since < server._oldest_rv:
                        self._chunk({"type": "ERROR", "object": _status(
                            410, "Expired", f"too old resource version: {since}")})
                        return self._chunk(None)
                    while True:
                        with server._lock:
                            pending = [e for e in server._events
                                       if e[0] > since and _in_collection(e[1], path)]
                            if not pending:
                                remaining = end - time.monotonic()
                                if remaining <= 0 or server._stopping:
                                    break
                                server._lock.wait(min(remaining, 0.5))
                                continue
                        for rv, _, event_type, obj, old in pending:
                            shown = _seen_as(event_type, obj, old, selector)
                            if shown:
                                self._chunk({"type": shown, "object": obj})
                            since = rv
                    self._chunk(None)
                except (BrokenPipeError, ConnectionResetError):
                    pass

            def _chunk(self, event):
                data = b"" if event is None else json.dumps(event).encode() + b"\n"
                self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
                self.wfile.flush()

            def _post(self, path, query):
                obj = self._body()
                if path.endswith("/binding") and "/pods/" in path:
                    return self._bind(path.rsplit("/", 1)[0], obj)
                if path.endswith("/pods") and isinstance(obj, dict):
                    # The real server starts every pod Pending (PrepareForCreate).
                    obj = {**obj, "status": {"phase": "Pending"}}
                namespace = re.match(r".*/namespaces/([^/]+)/[a-z]+$", path)
                if namespace:
                    meta = obj.setdefault("metadata", {})
                    if meta.setdefault("namespace", namespace.group(1)) != namespace.group(1):
                        return self._reply(400, _status(
                            400, "BadRequest", "the namespace of the provided object does not "
                                               "match the namespace sent on the request"))
                target = f"{path}/{obj.get('metadata', {}).get('name', '')}"
                if path.startswith("/apis/events.k8s.io/v1/namespaces/"):
                    errors = validate_event_create(obj, path.split("/")[5])
                    if errors:
                        return self._reply(422, invalid_status(
                            "Event", obj.get("metadata", {}).get("name", ""), errors))
                with server._lock:
                    if target in server.objects:
                        group, kind, name = _resource(target)
                        return self._reply(409, _status(
                            409, "AlreadyExists", f'{_qualified(group, kind)} "{name}" already exists',
                            {"name": name, "group": group, "kind": kind} if group else
                            {"name": name, "kind": kind}))
                    self._reply(201, server._store(target, obj, "ADDED"))

            def _bind(self, pod_path, binding):
                """POST pods/NAME/binding as the real BindingREST answers it: 201 Status, the pod
                gets spec.nodeName and a PodScheduled condition (a MODIFIED watch event)."""
                pod_name = pod_path.rsplit("/", 1)[1]
                if not isinstance(binding, dict) or binding.get("kind", "Binding") != "Binding":
                    return self._reply(400, _status(400, "BadRequest", "the body is not a Binding"))
                if (binding.get("metadata") or {}).get("name") != pod_name:
                    return self._reply(400, _status(400, "BadRequest",
                                                    "name in URL does not match name in Binding object"))
                target = binding.get("target") or {}
                if target.get("kind", "") not in ("", "Node") or not target.get("name"):
                    field = "target.kind" if target.get("kind", "") not in ("", "Node") else "target.name"
                    return self._reply(422, _status(422, "Invalid", f'Binding.core "{pod_name}" is '
                                                    f'invalid: {field}: Invalid value'))
                with server._lock:
                    pod = server.objects.get(pod_path)
                    if pod is None:
                        return self._not_found(pod_path)
                    node = (pod.get("spec") or {}).get("nodeName")
                    if node or pod["metadata"].get("deletionTimestamp"):
                        return self._reply(409, _status(
                            409, "Conflict", f'Operation cannot be fulfilled on pods "{pod_name}": '
                            f'pod {pod_name} is already assigned to node "{node}"'))
                    pod = copy.deepcopy(pod)
                    pod.setdefault("spec", {})["nodeName"] = target["name"]
                    status = pod.setdefault("status", {})
                    status["conditions"] = [c for c in status.get("conditions") or []
                                            if c.get("type") != "PodScheduled"] + [{
                        "type": "PodScheduled", "status": "True", "lastProbeTime": None,
                        "lastTransitionTime": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}]
                    server._store(pod_path, pod, "MODIFIED")
                self._reply(201, {"kind": "Status", "apiVersion": "v1", "metadata": {},
                                  "status": "Success", "code": 201})

            def _put(self, path, query):
                obj = self._body()
                with server._lock:
                    if path not in server.objects:
                        return self._not_found(path)
                    if obj.get("metadata", {}).get("name") != path.rsplit("/", 1)[1]:
                        return self._reply(400, _status(
                            400, "BadRequest", "the name of the object does not match the name "
                            "on the URL"))
                    self._update(path, obj)

            def _update(self, path, obj):
                """Store `obj` over the object at `path` as the real server does (lock held)."""
                current = server.objects[path]
                sent = obj.get("metadata", {}).get("resourceVersion")
                if sent and sent != current["metadata"]["resourceVersion"]:
                    return self._conflict(path)
                if _resource(path)[1] == "pods":
                    errors = validate_pod_update(
                        current, obj,
                        mutable_scheduling_directives=server.mutable_scheduling_directives)
                    if errors:
                        return self._reply(422, invalid_status("Pod", path.rsplit("/", 1)[1],
                                                               errors))
                    obj = dict(obj)
                    if "status" in current:  # the main resource never changes status
                        obj["status"] = current["status"]
                    else:
                        obj.pop("status", None)
                self._reply(200, server._store(path, obj, "MODIFIED"))

            def _patch(self, path, query):
                content_type = self.headers.get("Content-Type", "").split(";")[0]
                patch = self._body()
                with server._lock:
                    if path not in server.objects:
                        return self._not_found(path)
                    current = server.objects[path]
                    if content_type == "application/json-patch+json":
                        try:
                            updated = jsonpatch.apply_patch(current, patch)
                        except (jsonpatch.JsonPatchException, jsonpatch.JsonPointerException) as e:
                            return self._reply(422, _status(422, "Invalid", str(e)))
                    elif content_type in ("application/merge-patch+json",
                                          "application/strategic-merge-patch+json"):
                        updated = _merge(current, patch, content_type.startswith("application/strategic"))
                    else:
                        return self._reply(415, _status(415, "UnsupportedMediaType", content_type))
                    self._update(path, updated)

            def _delete(self, path, query):
                with server._lock:
                    if path not in server.objects:
                        return self._not_found(path)
                    obj = server.delete(path)
                self._reply(200, obj)

        return Handler
