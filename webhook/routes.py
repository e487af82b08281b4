"""The webhook product's HTTP side: POST /mutate, declared once (archway.server.routes), its
answer the admission service's (service.py).

The server reads the body within server.max_body_bytes (a larger one is a 413 before the
service sees it) and asks the route first on its loop: a pod whose images, pull secrets and
policy are all in memory is answered there, without a thread hand-off; any other waits for a
handler thread. The deadline counts from the request's arrival and stops short of the
apiserver's `?timeout=`.
"""
import json

from archway.deadline import caller_timeout
from archway.server.routes import Reply, Request, Route

from .service import AdmissionService

LIMIT_NAME = "server.max_body_bytes"


def mutate_route(service: AdmissionService, max_body: int) -> Route:
    def mutate(request: Request) -> Reply | None:
        answer = service.review(request.body, started=request.arrived,
                                timeout=caller_timeout(request.query), peer=request.peer,
                                at_once=not request.may_wait)
        if answer is None:
            return None
        return Reply(answer.status, json.dumps(answer.body, separators=(",", ":")).encode())

    return Route("POST", "/mutate", mutate, max_body=max_body, limit_name=LIMIT_NAME,
                 on_loop=True)
