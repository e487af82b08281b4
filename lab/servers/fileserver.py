"""HTTPS servers for SIF tests: a static file server with Range support, and a stand-in for the
Sylabs library API. Both bind 127.0.0.1 on a free port, use a certificate from the test CA, and
record every request (path, Range header, Authorization, status, body bytes actually sent).

    files = FileServer(ca, {"/img/busybox.sif": "/path/on/disk.sif"})
    files.url("/img/busybox.sif"); files.requests; files.ignore_range = True

    library = LibraryServer(ca)
    library.add_image("e/c/busybox", "latest", "amd64", image_id="...", hash="sha256.<hex>")
"""
import datetime
import json
import re
import ssl
import threading
import time
import uuid
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler
from urllib.parse import parse_qs, unquote, urlsplit

from lab.httpd import BackgroundHTTPServer
from lab.tls import CertificateAuthority

_RANGE = re.compile(r"^bytes=(\d*)-(\d*)$")
_CHUNK = 64 * 1024


@dataclass
class Served:
    method: str
    path: str
    query: str
    range: str | None           # the Range header as received
    authorization: str | None
    status: int
    bytes_sent: int             # body bytes written to the socket


class _HttpsServer:
    """A threaded HTTPS server whose handler calls `self.handle(request)`."""

    def __init__(self, ca: CertificateAuthority, name: str):
        self.ca_path = ca.cert_path  # what a client trusts to reach it
        self.requests: list[Served] = []
        self._lock = threading.Lock()
        self._busy = 0   # requests being answered, not recorded yet
        pair = ca.issue(f"{name}-{uuid.uuid4().hex[:8]}", ["127.0.0.1", "localhost"])
        self._server = BackgroundHTTPServer(self._handler(), tls=pair)
        self.port = self._server.port

    @property
    def host(self) -> str:
        return f"127.0.0.1:{self.port}"

    def url(self, path: str = "") -> str:
        return f"https://{self.host}{path}"

    def settle(self, timeout: float = 10.0) -> None:
        """Wait until every request being answered is recorded: a request is recorded after its
        answer is sent, so its client may have read the answer before the record exists."""
        end = time.monotonic() + timeout
        while self._busy and time.monotonic() < end:
            time.sleep(0.01)

    def clear(self) -> None:
        """Forget what was recorded, a previous test's last request included."""
        self.settle()
        with self._lock:
            self.requests.clear()

    def wait_for_requests(self, count: int, timeout: float = 10.0) -> list[Served]:
        """The requests once `count` have been recorded (a response is recorded after it is
        sent, which for a client that hangs up early is when the server notices)."""
        end = time.monotonic() + timeout
        while len(self.requests) < count and time.monotonic() < end:
            time.sleep(0.01)
        return list(self.requests)

    def record(self, entry: Served) -> None:
        with self._lock:
            self.requests.append(entry)

    def stop(self) -> None:
        self._server.stop()

    def _handler(self):
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"   # keep-alive, as real servers do

            def log_message(self, *args):
                pass

            def do_GET(self):
                server._answer(self)

            def do_HEAD(self):
                server._answer(self)

        return Handler

    def _answer(self, request) -> None:
        with self._lock:
            self._busy += 1
        try:
            self.handle(request)
        finally:
            with self._lock:
                self._busy -= 1

    def handle(self, request) -> None:
        raise NotImplementedError

    @staticmethod
    def send(request, status: int, headers: dict, body_parts, *, length: int | None) -> int:
        """Send a response; `length=None` means no Content-Length (the body ends at close).
        Returns the body bytes written before the client went away."""
        request.send_response(status)
        for key, value in headers.items():
            request.send_header(key, value)
        if length is None:
            request.send_header("Connection", "close")
            request.close_connection = True
        else:
            request.send_header("Content-Length", str(length))
        request.end_headers()
        sent = 0
        if request.command == "HEAD":
            return 0
        try:
            for part in body_parts:
                request.wfile.write(part)
                sent += len(part)
        except (BrokenPipeError, ConnectionResetError, ssl.SSLError, OSError):
            request.close_connection = True
        return sent


class FileServer(_HttpsServer):
    """Static files (path -> file on disk or bytes) with single-range `Range` support.

    `ignore_range = True` makes it answer every GET with 200 and the whole file, as some servers
    do; `send_length = False` additionally leaves out Content-Length (close-delimited body).
    """

    def __init__(self, ca: CertificateAuthority, files: dict | None = None):
        self.files: dict[str, str | bytes] = dict(files or {})
        self.ignore_range = False
        self.send_length = True
        super().__init__(ca, "fileserver")

    def _content(self, path: str) -> bytes | None:
        source = self.files.get(path)
        if source is None or isinstance(source, bytes):
            return source
        with open(source, "rb") as f:
            return f.read()

    def handle(self, request) -> None:
        parts = urlsplit(request.path)
        range_header = request.headers.get("Range")
        data = self._content(unquote(parts.path))
        status, body = 200, b""
        headers = {"Content-Type": "application/octet-stream", "Accept-Ranges": "bytes",
                   "ETag": '"%x"' % (hash(data) & 0xFFFFFFFF) if data is not None else '"0"'}
        if data is None:
            status, body = 404, b"not found\n"
            headers["Content-Type"] = "text/plain"
        elif range_header and not self.ignore_range:
            window = parse_range(range_header, len(data))
            if window is None:
                status = 416
                headers["Content-Range"] = f"bytes */{len(data)}"
            else:
                start, end = window
                status, body = 206, data[start:end + 1]
                headers["Content-Range"] = f"bytes {start}-{end}/{len(data)}"
        else:
            body = data
        chunks = (body[i:i + _CHUNK] for i in range(0, len(body), _CHUNK))
        length = len(body) if (self.send_length or status != 200) else None
        sent = self.send(request, status, headers, chunks, length=length)
        self.record(Served(request.command, parts.path, parts.query, range_header,
                           request.headers.get("Authorization"), status, sent))

    def bytes_sent(self, path: str | None = None) -> int:
        return sum(r.bytes_sent for r in self.requests if path is None or r.path == path)


def parse_range(header: str, size: int) -> tuple[int, int] | None:
    """(first, last) for a single `bytes=` range (RFC 9110), None when not satisfiable."""
    match = _RANGE.match(header.strip())
    if not match or match.group(1) == match.group(2) == "":
        return None
    first, last = match.group(1), match.group(2)
    if first == "":                          # bytes=-N: the last N bytes
        n = int(last)
        return (max(0, size - n), size - 1) if n and size else None
    start = int(first)
    end = size - 1 if last == "" else min(int(last), size - 1)
    if start >= size or end < start:
        return None
    return start, end


# ---------------------------------------------------------------------------------------------
# The Sylabs library API stand-in


def _timestamp() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


class LibraryServer(_HttpsServer):
    """Speaks the two library endpoints archway uses, with the JSON shapes of
    sylabs/scs-library-client (Container with `archTags`, Image with `arch`/`hash`):

        GET /v1/containers/<entity>/<collection>/<container>   -> {"data": Container}
        GET /v1/images/<entity>/<collection>/<container>:<tag>?arch=<arch> -> {"data": Image}

    Errors: {"error": {"code": N, "message": "..."}}. With `token` set, requests without
    `Authorization: Bearer <token>` get 401. `arch_tags = False` drops archTags from container
    records, like libraries that predate multi-arch support.
    """

    def __init__(self, ca: CertificateAuthority, *, token: str | None = None):
        self.token = token
        self.arch_tags = True
        self.containers: dict[str, dict] = {}    # "e/c/x" -> Container record
        self.images: dict[str, dict] = {}        # image id -> Image record
        super().__init__(ca, "library")

    def add_image(self, path: str, tags, arch: str | None, *, image_id: str | None = None,
                  hash: str | None = None) -> dict:
        """Add an image of `arch` to container `path` (entity/collection/container) with `tags`."""
        entity, collection, name = path.split("/")
        tags = [tags] if isinstance(tags, str) else list(tags)
        image_id = image_id or uuid.uuid4().hex[:24]
        container = self.containers.setdefault(path, {
            "deleted": False, "createdBy": "5e1b6d4a2b3c4d5e6f708192", "createdAt": _timestamp(),
            "id": uuid.uuid4().hex[:24], "name": name, "description": "", "fullDescription": "",
            "collection": uuid.uuid4().hex[:24], "images": [], "imageTags": {}, "archTags": {},
            "size": 0, "downloadCount": 0, "stars": 0, "private": False, "readOnly": False,
            "customData": "", "entity": uuid.uuid4().hex[:24], "entityName": entity,
            "collectionName": collection})
        image = {
            "deleted": False, "createdBy": container["createdBy"], "createdAt": _timestamp(),
            "id": image_id, "hash": hash or "sha256." + uuid.uuid4().hex * 2, "description": "",
            "container": container["id"], "blob": uuid.uuid4().hex[:24], "size": 4096,
            "uploaded": True, "signed": False, "fingerprints": [], "encrypted": False,
            "customData": "", "entity": container["entity"], "entityName": entity,
            "collection": container["collection"], "collectionName": collection,
            "containerName": name, "tags": tags, "containerDescription": "",
            "containerStars": 0, "containerDownloads": 0}
        if arch is not None:
            image["arch"] = arch
        self.images[image_id] = image
        container["images"].append(image_id)
        for tag in tags:
            container["imageTags"][tag] = image_id
            if arch is not None:
                container["archTags"].setdefault(arch, {})[tag] = image_id
        return image

    def handle(self, request) -> None:
        parts = urlsplit(request.path)
        authorization = request.headers.get("Authorization")
        status, body = self._route(unquote(parts.path), parse_qs(parts.query), authorization)
        data = json.dumps(body).encode()
        sent = self.send(request, status, {"Content-Type": "application/json"}, [data],
                         length=len(data))
        self.record(Served(request.command, parts.path, parts.query, None, authorization,
                           status, sent))

    def _route(self, path: str, query: dict, authorization: str | None):
        if self.token and authorization != f"Bearer {self.token}":
            return _error(401, "Unauthorized")
        if path.startswith("/v1/containers/"):
            container = self.containers.get(path[len("/v1/containers/"):])
            if container is None:
                return _error(404, "container not found")
            record = dict(container)
            if not self.arch_tags:
                record.pop("archTags")
            return 200, {"data": record}
        if path.startswith("/v1/images/"):
            ref = path[len("/v1/images/"):]
            container_path, _, tag = ref.rpartition(":")
            container = self.containers.get(container_path)
            if container is None or not tag:
                return _error(404, "image not found")
            arch = query.get("arch", ["amd64"])[0]
            if tag.startswith("sha256."):
                found = [i for i in container["images"] if self.images[i]["hash"] == tag]
                image_id = found[0] if found else None
            else:
                image_id = container["archTags"].get(arch, {}).get(tag)
                legacy = container["imageTags"].get(tag)
                if image_id is None and legacy and "arch" not in self.images[legacy]:
                    image_id = legacy   # images pushed before the library knew arches
            if image_id is None:
                return _error(404, f"image {ref} for arch {arch} not found")
            return 200, {"data": self.images[image_id]}
        return _error(404, "Not Found")


def _error(code: int, message: str):
    return code, {"error": {"code": code, "message": message}}


# ---------------------------------------------------------------------------------------------
# A recording reverse proxy (the registry's access log does not show request headers)


class RecordingProxy(_HttpsServer):
    """HTTPS in front of an upstream HTTP(S) server: forwards GET/HEAD unchanged and records each
    request's Range and Authorization headers and the body bytes it passed back.

    It exists because a real registry's access log shows neither; the upstream stays the real
    server and answers every request itself.
    """

    _HOP_BY_HOP = {"connection", "keep-alive", "transfer-encoding", "te", "trailer", "upgrade",
                   "proxy-authorization", "proxy-authenticate", "content-length"}

    def __init__(self, ca: CertificateAuthority, upstream_url: str, *, upstream_ca: str | None = None):
        target = urlsplit(upstream_url)
        if not target.hostname:
            raise ValueError(f"upstream {upstream_url!r} names no host")
        self._upstream_host = target.hostname
        self._upstream_port = target.port
        self._upstream_tls = target.scheme == "https"
        self._upstream_context = (ssl.create_default_context(cafile=upstream_ca)
                                  if self._upstream_tls else None)
        super().__init__(ca, "proxy")

    def handle(self, request) -> None:
        import http.client
        upstream: http.client.HTTPConnection
        if self._upstream_tls:
            upstream = http.client.HTTPSConnection(self._upstream_host, self._upstream_port,
                                                   context=self._upstream_context, timeout=30)
        else:
            upstream = http.client.HTTPConnection(self._upstream_host, self._upstream_port,
                                                  timeout=30)
        headers = {k: v for k, v in request.headers.items()
                   if k.lower() not in self._HOP_BY_HOP and k.lower() != "host"}
        try:
            upstream.request(request.command, request.path, headers=headers)
            answer = upstream.getresponse()
            body = answer.read()
            status, reply_headers = answer.status, [
                (k, v) for k, v in answer.getheaders() if k.lower() not in self._HOP_BY_HOP]
        finally:
            upstream.close()
        request.send_response(status)
        for key, value in reply_headers:
            request.send_header(key, value)
        request.send_header("Content-Length", str(len(body)))
        request.end_headers()
        sent = 0
        if request.command != "HEAD":
            try:
                request.wfile.write(body)
                sent = len(body)
            except OSError:
                request.close_connection = True
        parts = urlsplit(request.path)
        self.record(Served(request.command, parts.path, parts.query, request.headers.get("Range"),
                           request.headers.get("Authorization"), status, sent))
