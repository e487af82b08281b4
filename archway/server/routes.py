"""The one routing table of a server: each route declared once, by the product that answers it.

A route's handler takes a Request (the whole body already read, within the route's limit) and
gives a Reply. Where it is answered is the server's business (archway.server.loop): a route
declared `on_loop` is first asked on the worker's main loop with `request.may_wait` False, and
its handler answers there when the answer waits for nothing (a cache hit) or returns None, and
the same request goes to a handler thread, asked again with `may_wait` True. Other routes are
always answered on a thread. Every answer the server gives itself (404, 405, 413, malformed
HTTP) is JSON with a reason, as the products' own are.

No sockets, no clock: the server's loop and a test's client call `first_answer` and `answer`
alike.
"""
import json
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from http import HTTPStatus

log = logging.getLogger("archway.server")

JSON = "application/json"
INTERNAL_ERROR = "internal error; see archway's log"


@dataclass(frozen=True, slots=True)
class Request:
    method: str
    path: str
    query: str = ""                      # after the '?', undecoded
    headers: Mapping[str, str] = field(default_factory=dict)   # lower-case names
    body: bytes = b""
    arrived: float = 0.0                 # time.monotonic() when it began arriving
    peer: str = "-"                      # the client's address
    may_wait: bool = True                # False: on the main loop, answer only what waits for nothing


@dataclass(frozen=True, slots=True)
class Reply:
    status: int
    body: bytes
    content_type: str = JSON
    headers: tuple[tuple[str, str], ...] = ()


Handler = Callable[[Request], "Reply | None"]


def error_reply(status: int, message: str, headers: tuple[tuple[str, str], ...] = ()) -> Reply:
    """The JSON answer `{"error": message}` every refusal of archway's has."""
    return Reply(status, json.dumps({"error": message}).encode(), JSON, headers)


def phrase(status: int) -> str:
    try:
        return HTTPStatus(status).phrase
    except ValueError:
        return "Unknown"


@dataclass(frozen=True, slots=True)
class Route:
    """`max_body`: the largest body the route reads; `limit_name`: how an operator knows that
    limit (the 413 says it); `on_loop`: the handler may be asked on the main loop first (see
    the module docstring)."""
    method: str
    path: str
    handler: Handler
    max_body: int = 64 * 1024
    limit_name: str = "the route's limit"
    on_loop: bool = False

    def too_large(self, length: int | None) -> Reply:
        size = f"of {length} bytes " if length is not None else ""
        return error_reply(413, f"request body {size}exceeds {self.limit_name} ({self.max_body})")


class Routes:
    """Routes by path and method; GET routes answer HEAD too. `not_found`: what a 404 says
    (default: the routes there are)."""

    def __init__(self, routes: tuple[Route, ...] | list[Route] = (), *, not_found: str = ""):
        self._by_path: dict[str, dict[str, Route]] = {}
        self.not_found = not_found
        for route in routes:
            self.add(route)

    def add(self, route: Route) -> None:
        methods = self._by_path.setdefault(route.path, {})
        if route.method in methods:
            raise ValueError(f"{route.method} {route.path} is declared twice")
        methods[route.method] = route
        if route.method == "GET":
            methods.setdefault("HEAD", route)

    def find(self, method: str, path: str) -> Route | Reply:
        """The route, or the JSON 404 / 405 that answers instead."""
        methods = self._by_path.get(path)
        if methods is None:
            return error_reply(404, self.not_found or
                               f"Not Found: {method} {path}; archway serves {self.served()}")
        route = methods.get(method)
        if route is None:
            allowed = ", ".join(sorted(methods))
            return error_reply(405, f"Method Not Allowed: {method} {path}; archway serves "
                                    f"{self.served()}", (("Allow", allowed),))
        return route

    def served(self) -> str:
        """'POST /mutate, GET /healthz, ...': what a 404 or 405 tells the client."""
        return ", ".join(f"{route.method} {route.path}" for route in self.routes())

    def routes(self) -> list[Route]:
        return [route for methods in self._by_path.values()
                for method, route in methods.items() if method == route.method]


@dataclass(frozen=True)
class Site:
    """What one worker serves: `routes` on every listener but those `by_port` names (a
    metrics-only address, say); `plain_ports`: ports answered without TLS when the others
    have it (registry.events.tls false)."""
    routes: Routes
    by_port: Mapping[int, Routes] = field(default_factory=dict)
    plain_ports: frozenset[int] = frozenset()

    def routes_for(self, port: int | None) -> Routes:
        return self.by_port.get(port, self.routes) if port is not None else self.routes


def first_answer(route: Route, request: Request) -> Reply | None:
    """On the main loop: the route's answer when it waits for nothing; None: `answer` it on a
    thread."""
    if not route.on_loop:
        return None
    try:
        return route.handler(replace(request, may_wait=False) if request.may_wait else request)
    except Exception:   # the thread's own call answers it (a 500, logged)
        return None


def answer(route: Route, request: Request) -> Reply:
    """On a handler thread: the route's answer; a handler's bug is a JSON 500 and a log line."""
    try:
        reply = route.handler(replace(request, may_wait=True))
        if reply is None:
            raise RuntimeError("a handler that may wait gave no answer")
        return reply
    except Exception:
        log.exception("unhandled error on %s %s", request.method, request.path)
        return error_reply(500, INTERNAL_ERROR)
