"""A switchable gateway in front of a real registry, for fault injection.

Every request is forwarded to the registry behind it while `mode` is "pass"; "down" answers
503 and "rate_limited" answers 429 (with `retry_after` when set) without forwarding. The real
registry still answers everything that gets through, and its access log still counts it.
"""
import requests

from lab.servers.faults import Request, ScriptedServer

_HOP_BY_HOP = {"connection", "keep-alive", "transfer-encoding", "content-length", "host"}


class RegistryGateway:
    def __init__(self, target_url: str):
        self.target_url = target_url.rstrip("/")
        self.mode = "pass"
        self.retry_after: str | None = None
        self.refused: list[Request] = []       # requests answered 429/503 instead of forwarded
        self.before_forward = lambda request: None   # a hook run before each request goes on
        self._http = requests.Session()
        self._server = ScriptedServer(self._respond)

    @property
    def host(self) -> str:
        return self._server.host

    @property
    def requests(self) -> list[Request]:
        return self._server.requests

    def _respond(self, request: Request) -> tuple[int, dict, bytes]:
        if self.mode == "rate_limited":
            self.refused.append(request)
            headers = {"Retry-After": self.retry_after} if self.retry_after else {}
            return 429, headers, b'{"errors":[{"code":"TOOMANYREQUESTS","message":"slow down"}]}'
        if self.mode == "down":
            self.refused.append(request)
            return 503, {}, b"service unavailable"
        self.before_forward(request)
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP_BY_HOP}
        answer = self._http.request(request.method, self.target_url + request.path,
                                    headers=headers, data=request.body or None, timeout=10,
                                    allow_redirects=False)
        forwarded = {k: v for k, v in answer.headers.items() if k.lower() not in _HOP_BY_HOP}
        return answer.status_code, forwarded, answer.content

    def stop(self) -> None:
        self._server.stop()
        self._http.close()
