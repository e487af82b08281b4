"""A worker's routes called in-process, as archway's loop calls them (archway.server.loop): the
route found (or the JSON 404/405), the body's limit (413), the loop's try first for an `on_loop`
route, then the thread's call. No sockets: the server's own tests cover those."""
import json as jsonlib
import time

from archway.server.routes import Reply, Request, Route, Site, answer, first_answer


class Response:
    def __init__(self, reply: Reply, answered_on_loop: bool):
        self.status_code = reply.status
        self.data = reply.body
        self.headers = {"Content-Type": reply.content_type, **dict(reply.headers)}
        self.mimetype = reply.content_type.split(";")[0]
        self.on_loop = answered_on_loop

    @property
    def text(self) -> str:
        return self.data.decode()

    def get_json(self):
        return jsonlib.loads(self.data)

    @property
    def json(self):
        return self.get_json()


class SiteClient:
    """`site`: a Site, or a Worker (archway.main.worker) whose site it is; `port`: the
    listener's port (server.metrics_bind's serves other routes)."""

    def __init__(self, site, port: int | None = None, peer: str = "127.0.0.1"):
        self.site: Site = site if isinstance(site, Site) else site.site
        self.port = port
        self.peer = peer

    def open(self, method: str, path: str, *, data: bytes | str | None = None, json=None,
             headers: dict | None = None, arrived: float | None = None,
             content_type: str | None = None) -> Response:
        path, _, query = path.partition("?")
        if json is not None:
            data = jsonlib.dumps(json)
        body = data.encode() if isinstance(data, str) else (data or b"")
        found = self.site.routes_for(self.port).find(method, path)
        if not isinstance(found, Route):
            return Response(found, True)
        if len(body) > found.max_body:
            return Response(found.too_large(len(body)), True)
        names = {k.lower(): v for k, v in (headers or {}).items()}
        if content_type:
            names["content-type"] = content_type
        request = Request(method, path, query, names, body,
                          time.monotonic() if arrived is None else arrived, self.peer)
        reply = first_answer(found, request)
        if reply is not None:
            return Response(reply, True)
        return Response(answer(found, request), False)

    def get(self, path: str, **kwargs) -> Response:
        return self.open("GET", path, **kwargs)

    def post(self, path: str, **kwargs) -> Response:
        return self.open("POST", path, **kwargs)
