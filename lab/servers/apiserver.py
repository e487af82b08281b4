"""A stand-in for kube-apiserver: no real one can be installed here.

It speaks the exact JSON of the few REST calls archway makes (GET of ServiceAccounts, Secrets,
Nodes, Namespaces and Pods, list + watch of Nodes, Namespaces and Pods, lists of workloads and
Events in one namespace or across all of them with field and label selectors and limit/continue
paging, create of Events, create/replace/patch of a Secret and a MutatingWebhookConfiguration,
replace of Pods, create/get/replace of Leases), the scheduler's pod create and bind
(pods/binding) and pods/eviction, over plain HTTP, backed by an in-memory object store keyed by
URL path. It is deliberately narrow: anything archway does not call answers 404 like the real server does for an
unknown object.

Writes are checked as the real server checks them: a stale metadata.resourceVersion is 409
Conflict; a pod update goes through ValidatePodUpdate (the KEP-3838 rules for gated pods) and an
events.k8s.io/v1 Event through ValidateEventCreate (kubevalidation.py), 422 Invalid with field
causes otherwise. Every 4xx answer to a write other than 404 and 409 is kept in `rejections`.
Watches filter by labelSelector and fieldSelector (pods: spec.nodeName too) with the real
server's transitions: an object that stops matching arrives as DELETED, one that starts matching
as ADDED.
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
from lab.servers.apiobjects import (
    LISTS,
    POD_SUBRESOURCES,
    about,
    failure,
    field_selector,
    in_collection,
    matches,
    merge,
    resource_of,
    seen_as,
)
from lab.servers.kubevalidation import invalid_status, validate_event_create, validate_pod_update


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
        handler = type("Handler", (ApiRequestHandler,), {"api": self})
        self._server = BackgroundHTTPServer(handler, server_class=_QuietServer)
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


class ApiRequestHandler(BaseHTTPRequestHandler):
    """One request to `api` (a FakeApiServer: each server serves a subclass naming itself)."""
    api: FakeApiServer
    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True  # headers and body go in separate writes

    def log_message(self, *args):
        pass

    def _reply(self, code: int, body: dict):
        if self.command != "GET" and 400 <= code < 500 and code not in (404, 409):
            self.api.rejections.append((self.command, self.path, code, body.get("message", "")))
        if code == 409 and body.get("reason") == "Conflict":
            self.api.conflicts += 1
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
        self.api.requests.append((method, self.path))
        if self.api.delay_seconds:
            time.sleep(self.api.delay_seconds)
        for prefix, code in self.api.faults.items():
            if path.startswith(prefix):
                return self._reply(code, failure(code, "Forbidden" if code == 403
                                                 else "InternalError", "injected fault"))
        try:
            getattr(self, f"_{method.lower()}")(path, query)
        except json.JSONDecodeError:
            self._reply(400, failure(400, "BadRequest", "body is not JSON"))

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
        resource, name, details = about(path)
        self._reply(404, failure(404, "NotFound", f'{resource} "{name}" not found', details))

    def _conflict(self, path):
        resource, name, details = about(path)
        self._reply(409, failure(
            409, "Conflict", f'Operation cannot be fulfilled on {resource} "{name}": the object '
            'has been modified; please apply your changes to the latest version and try again',
            details))

    def _get(self, path, query):
        if query.get("watch", ["false"])[0].lower() in ("true", "1"):
            return self._watch(path, query)
        with self.api._lock:
            if path in self.api.objects:
                return self._reply(200, self.api.objects[path])
            self._list(path, query)

    def _list(self, path, query):
        """The objects of the collection at `path` (lock held)."""
        api, plural = self.api, path.rsplit("/", 1)[1]
        selector = query.get("labelSelector", [""])[0]
        # Its own collection, or every namespace's: /apis/apps/v1/deployments lists
        # /apis/apps/v1/namespaces/*/deployments/*.
        keyed = sorted((p, o) for p, o in api.objects.items()
                       if in_collection(p.rsplit("/", 1)[0], path) and matches(selector, o))
        if not (keyed or plural in LISTS or any(in_collection(e[1], path) for e in api._events)):
            return self._not_found(path)
        try:
            keep = field_selector(query.get("fieldSelector", [""])[0], plural)
        except ValueError as e:
            return self._reply(400, failure(400, "BadRequest", str(e)))
        keyed = [(p, o) for p, o in keyed if keep(o)]
        meta = {"resourceVersion": str(api._rv)}
        if int(query.get("limit", ["0"])[0] or 0) > 0 or "continue" in query:
            try:
                keyed = self._page(keyed, query, meta)
            except LookupError as e:
                return self._reply(e.args[0], e.args[1])
        kind, api_version = LISTS.get(plural, (plural.capitalize() + "List", "v1"))
        group = re.match(r"^/apis/([^/]+/[^/]+)/", path)
        if group:   # e.g. events.k8s.io/v1 Events: the group's own apiVersion
            api_version = group.group(1)
        self._reply(200, {"kind": kind, "apiVersion": api_version, "metadata": meta,
                          "items": [o for _, o in keyed]})

    def _page(self, keyed: list, query: dict, meta: dict) -> list:
        """One page of `keyed` in key order, `meta` given the list's resourceVersion and the
        token that says where the next page starts and at which resourceVersion the list began
        (as the real server's does); LookupError(code, Status) for a token it refuses."""
        limit = int(query.get("limit", ["0"])[0] or 0)
        start, rv = "", self.api._rv
        if "continue" in query:
            try:
                token = json.loads(base64.b64decode(query["continue"][0]))
                start, rv = token["start"], int(token["rv"])
            except (ValueError, KeyError, TypeError):
                raise LookupError(400, failure(400, "BadRequest", "continue key is not valid")) from None
            if rv < self.api._oldest_rv:
                raise LookupError(410, failure(410, "Expired",
                                               "The provided continue parameter is too old"))
        rest = [(p, o) for p, o in keyed if p > start]
        page = rest[:limit] if limit > 0 else rest
        meta["resourceVersion"] = str(rv)
        if len(rest) > len(page):
            meta["continue"] = base64.b64encode(json.dumps(
                {"v": "meta.k8s.io/v1", "rv": rv, "start": page[-1][0]}).encode()).decode()
            meta["remainingItemCount"] = len(rest) - len(page)
        return page

    def _watch(self, path, query):
        api = self.api
        selector = query.get("labelSelector", [""])[0]
        fields_text = query.get("fieldSelector", [""])[0]
        try:
            fields = field_selector(fields_text, path.rsplit("/", 1)[1]) if fields_text else None
        except ValueError as e:
            return self._reply(400, failure(400, "BadRequest", str(e)))
        since = int(query.get("resourceVersion", ["0"])[0] or 0)
        timeout = min(float(query.get("timeoutSeconds", ["30"])[0]), 30.0)
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        end = time.monotonic() + timeout
        try:
            if since and since < api._oldest_rv:
                self._chunk({"type": "ERROR", "object": failure(
                    410, "Expired", f"too old resource version: {since}")})
                return self._chunk(None)
            while True:
                with api._lock:
                    pending = [e for e in api._events if e[0] > since and in_collection(e[1], path)]
                    if not pending:
                        remaining = end - time.monotonic()
                        if remaining <= 0 or api._stopping:
                            break
                        api._lock.wait(min(remaining, 0.5))
                        continue
                for rv, _, event_type, obj, old in pending:
                    shown = seen_as(event_type, obj, old, selector, fields)
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
        if "/pods/" in path and path.rsplit("/", 1)[1] in POD_SUBRESOURCES:
            subresource = POD_SUBRESOURCES[path.rsplit("/", 1)[1]]
            return self._pod_subresource(path.rsplit("/", 1)[0], obj, subresource)
        if path.endswith("/pods") and isinstance(obj, dict):
            # The real server starts every pod Pending (PrepareForCreate).
            obj = {**obj, "status": {"phase": "Pending"}}
        namespace = re.match(r".*/namespaces/([^/]+)/[a-z]+$", path)
        if namespace:
            meta = obj.setdefault("metadata", {})
            if meta.setdefault("namespace", namespace.group(1)) != namespace.group(1):
                return self._reply(400, failure(
                    400, "BadRequest", "the namespace of the provided object does not "
                                       "match the namespace sent on the request"))
        target = f"{path}/{obj.get('metadata', {}).get('name', '')}"
        if path.startswith("/apis/events.k8s.io/v1/namespaces/"):
            errors = validate_event_create(obj, path.split("/")[5])
            if errors:
                return self._reply(422, invalid_status(
                    "Event", obj.get("metadata", {}).get("name", ""), errors))
        with self.api._lock:
            if target in self.api.objects:
                resource, name, details = about(target)
                return self._reply(409, failure(409, "AlreadyExists",
                                                f'{resource} "{name}" already exists', details))
            self._reply(201, self.api._store(target, obj, "ADDED"))

    def _pod_subresource(self, pod_path, body, answer):
        """POST pods/NAME/binding or /eviction: `answer(pod, body)` (apiobjects) says the reply
        and what becomes of the pod (a new one, DELETED, or None: unchanged)."""
        with self.api._lock:
            pod = self.api.objects.get(pod_path)
            if pod is None:
                return self._not_found(pod_path)
            code, reply, change = answer(pod, body)
            if change == "DELETED":
                self.api.delete(pod_path)
            elif change is not None:
                self.api._store(pod_path, change, "MODIFIED")
        self._reply(code, reply)

    def _put(self, path, query):
        obj = self._body()
        with self.api._lock:
            if path not in self.api.objects:
                return self._not_found(path)
            if obj.get("metadata", {}).get("name") != path.rsplit("/", 1)[1]:
                return self._reply(400, failure(
                    400, "BadRequest", "the name of the object does not match the name on the URL"))
            self._update(path, obj)

    def _update(self, path, obj):
        """Store `obj` over the object at `path` as the real server does (lock held)."""
        current = self.api.objects[path]
        sent = obj.get("metadata", {}).get("resourceVersion")
        if sent and sent != current["metadata"]["resourceVersion"]:
            return self._conflict(path)
        if resource_of(path)[1] == "pods":
            errors = validate_pod_update(
                current, obj, mutable_scheduling_directives=self.api.mutable_scheduling_directives)
            if errors:
                return self._reply(422, invalid_status("Pod", path.rsplit("/", 1)[1], errors))
            obj = dict(obj)
            if "status" in current:  # the main resource never changes status
                obj["status"] = current["status"]
            else:
                obj.pop("status", None)
        self._reply(200, self.api._store(path, obj, "MODIFIED"))

    def _patch(self, path, query):
        content_type = self.headers.get("Content-Type", "").split(";")[0]
        patch = self._body()
        with self.api._lock:
            if path not in self.api.objects:
                return self._not_found(path)
            current = self.api.objects[path]
            if content_type == "application/json-patch+json":
                try:
                    updated = jsonpatch.apply_patch(current, patch)
                except (jsonpatch.JsonPatchException, jsonpatch.JsonPointerException) as e:
                    return self._reply(422, failure(422, "Invalid", str(e)))
            elif content_type in ("application/merge-patch+json",
                                  "application/strategic-merge-patch+json"):
                updated = merge(current, patch, content_type.startswith("application/strategic"))
            else:
                return self._reply(415, failure(415, "UnsupportedMediaType", content_type))
            self._update(path, updated)

    def _delete(self, path, query):
        with self.api._lock:
            if path not in self.api.objects:
                return self._not_found(path)
            obj = self.api.delete(path)
        self._reply(200, obj)
