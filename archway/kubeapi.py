"""JSON over the Kubernetes API, for every call archway makes to it: the list + watch caches, the
gate controller with its Lease and Events, explain/report and pre-warming.

A thin layer over the official client's ApiClient (which already knows the kubeconfig or the
in-cluster service account, TLS and tokens): plain dicts in and out, every call bounded in time
and every body in size, errors as one exception carrying the API's HTTP status and Status reason.
"""
import json
from collections.abc import Iterator
from typing import Any

from kubernetes.client.rest import ApiException

from archway.errors import ArchwayError

MAX_OBJECT_BYTES = 4 * 1024 * 1024     # a pod is at most ~1.5 MiB in etcd; a list page more
MAX_LIST_BYTES = 64 * 1024 * 1024
# Objects per list page (limit/continue) for every reader that lists: a page of full Nodes or
# Pods stays far below MAX_LIST_BYTES, and 5,000 objects take 10 round trips.
LIST_PAGE_SIZE = 500
MAX_WATCH_LINE_BYTES = 4 * 1024 * 1024


class ApiError(ArchwayError):
    """The API answered an error (status, Status reason) or could not be reached (status 0)."""

    def __init__(self, status: int, reason: str, message: str):
        super().__init__(f"{status} {reason}: {message}" if status else message)
        self.status = status
        self.reason = reason
        self.message = message


class KubeApi:
    def __init__(self, api_client, *, timeout_seconds: float = 10.0):
        self.client = api_client
        self.timeout_seconds = timeout_seconds

    def request(self, method: str, path: str, *, body: Any = None, query: dict | None = None,
                content_type: str = "application/json", timeout: float | None = None,
                max_bytes: int = MAX_OBJECT_BYTES) -> dict:
        response = self._call(method, path, body, query, content_type,
                              timeout or self.timeout_seconds)
        try:
            data = response.read(max_bytes + 1)
        finally:
            response.release_conn()
        if len(data) > max_bytes:
            raise ApiError(0, "TooLarge", f"{method} {path}: answer larger than {max_bytes} bytes")
        try:
            answer = json.loads(data)
        except ValueError:
            raise ApiError(0, "NotJSON", f"{method} {path}: the answer is not JSON") from None
        if not isinstance(answer, dict):   # every answer of the API is an object
            raise ApiError(0, "NotJSON", f"{method} {path}: the answer is not a JSON object")
        return answer

    def read_text(self, method: str, path: str, *, query: dict | None = None,
                  timeout: float | None = None, max_bytes: int = 65536) -> str:
        """A text answer (a container's log), cut at `max_bytes` (not an error: the caller
        asked for so much and no more), undecodable bytes replaced."""
        response = self._call(method, path, None, query, "application/json",
                              timeout or self.timeout_seconds)
        try:
            data = response.read(max_bytes)
        finally:
            response.release_conn()
        return data.decode("utf-8", "replace")

    def pages(self, path: str, page_size: int, *, timeout: float | None = None,
              query: dict | None = None) -> Iterator[dict]:
        """The pages of a list, `page_size` objects each (limit/continue), each page at most
        MAX_LIST_BYTES; the last one's metadata has the list's resourceVersion. `query`: its
        selectors."""
        token = None
        while True:
            page_query = {**(query or {}), **({"continue": token} if token else {}),
                          "limit": str(page_size)}
            page = self.request("GET", path, query=page_query, timeout=timeout,
                                max_bytes=MAX_LIST_BYTES)
            yield page
            token = (page.get("metadata") or {}).get("continue")
            if not token:
                return

    def watch(self, path: str, query: dict, *, timeout_seconds: int) -> "WatchStream":
        """A watch from `query`'s resourceVersion, open until the server ends it (after
        `timeout_seconds`) or it is closed."""
        query = dict(query, watch="true", timeoutSeconds=str(timeout_seconds),
                     allowWatchBookmarks="true")
        # Connect bounded; each read may wait for the server's own timeoutSeconds and a margin.
        return WatchStream(self._call("GET", path, None, query, "application/json",
                                      (self.timeout_seconds, timeout_seconds + 30)))

    def _call(self, method, path, body, query, content_type, timeout):
        """The urllib3 response of a 2xx answer, not yet read; ApiError otherwise."""
        try:
            method, url, headers, body, _ = self.client.param_serialize(
                method, path, query_params=list((query or {}).items()),
                header_params={"Accept": "application/json", "Content-Type": content_type},
                body=body, auth_settings=["BearerToken"])
            response = self.client.call_api(method, url, header_params=headers, body=body,
                                            _request_timeout=timeout).response
        except ApiException as e:
            raise ApiError(int(e.status or 0), "Unreachable", str(e.reason)[:200]) from None
        except Exception as e:
            host = getattr(getattr(self.client, "configuration", None), "host", "")
            raise ApiError(0, "Unreachable", unreachable(host, e)) from None
        if 200 <= response.status < 300:
            return response
        try:
            data = response.read(65536)
        except Exception:
            data = b""
        finally:
            response.release_conn()
        raise _api_error(response.status, response.reason, data)


def unreachable(host: str, error: BaseException) -> str:
    """'Kubernetes API https://10.0.0.1:443 unreachable: Connection refused': the words of the
    innermost cause of a failed connection (urllib3 wraps it in one or two errors), no secret:
    neither the request nor its headers are in them."""
    seen = error
    while isinstance(getattr(seen, "reason", None), BaseException):   # MaxRetryError
        seen = seen.reason   # type: ignore[attr-defined]
    cause: BaseException | None = seen
    for _ in range(8):   # the chain of causes, bounded
        if cause is None or (isinstance(cause, OSError) and cause.strerror):
            break
        cause = cause.__cause__ or cause.__context__
    if isinstance(cause, OSError) and cause.strerror:
        why = cause.strerror
    else:   # "HTTPSConnection(host='h', port=1): Failed to ..." -> "Failed to ..."
        why = str(seen).split("): ", 1)[-1] or type(seen).__name__
    return f"Kubernetes API {host + ' ' if host else ''}unreachable: {why[:200]}"


def _api_error(status: int, reason: str, body: bytes) -> ApiError:
    """The API's Status (reason, message) when the body is one."""
    message = ""
    try:
        answer = json.loads(body)
        reason = str(answer.get("reason") or reason)
        message = str(answer.get("message") or "")
    except (ValueError, AttributeError, TypeError):
        pass
    return ApiError(int(status), str(reason or ""), message[:2000])


class WatchStream:
    """The events of one watch (dicts with type and object), each line bounded in size. An ERROR
    event (410 Gone...) is raised as ApiError. close() may come from another thread: it ends a
    read that is waiting for the next event."""

    def __init__(self, response):
        self._response = response

    def __iter__(self) -> Iterator[dict]:
        try:
            for line in _lines(self._response):
                event = json.loads(line)
                if event.get("type") == "ERROR":
                    status = event.get("object") or {}
                    raise ApiError(int(status.get("code") or 0), str(status.get("reason") or ""),
                                   str(status.get("message") or "watch error"))
                yield event
        finally:
            self._response.release_conn()

    def close(self) -> None:
        shutdown = getattr(self._response, "shutdown", None)   # urllib3 >= 2.3
        if shutdown is not None:
            try:
                shutdown()
            except (OSError, ValueError, RuntimeError):
                pass   # the reading thread ended the stream and closed its socket meanwhile


def _lines(response) -> Iterator[bytes]:
    """Newline-delimited JSON from a streamed body, each line bounded."""
    buffer = b""
    for chunk in response.stream(65536, decode_content=True):
        buffer += chunk
        while b"\n" in buffer:
            line, buffer = buffer.split(b"\n", 1)
            if line.strip():
                yield _bounded(line)
        _bounded(buffer)   # a line still arriving
    if buffer.strip():
        yield buffer


def _bounded(line: bytes) -> bytes:
    if len(line) > MAX_WATCH_LINE_BYTES:
        raise ApiError(0, "TooLarge", f"a watch event is larger than {MAX_WATCH_LINE_BYTES} bytes")
    return line
