"""One list + watch loop, like an informer, shared by the node and namespace caches
(archway.watchcache) and the extender's pod watch.

A subclass says what to list (`_list_call`) and what to keep from the answer (`_on_list`,
`_on_event`); this class does the rest: a daemon thread per serving process, the first list,
watches resumed from the last resourceVersion, a new list after 410 Gone, and retries with
backoff that log once per outage.
"""
import json
import logging
import random
import threading
from collections.abc import Callable
from typing import Any

from archway.background import ProcessThread

log = logging.getLogger("archway.listwatch")


class ListWatch:
    what = "objects"          # for log lines: "node cache", "pod watch"
    # None: one list from the API server's watch cache (resourceVersion "0"); a number: pages
    # of that many objects (limit/continue), each cut down by _slim before the next is read, so
    # a cluster with very many objects never sits in memory (or one response) whole.
    page_size: int | None = None

    def __init__(self, api_client_factory: Callable[[], Any], *, watch_timeout_seconds: int = 240,
                 request_timeout_seconds: float = 30.0, max_backoff_seconds: float = 30.0,
                 thread_name: str = "archway-list-watch"):
        self._api_client_factory = api_client_factory
        self.watch_timeout_seconds = watch_timeout_seconds
        self.request_timeout_seconds = request_timeout_seconds
        self.max_backoff_seconds = max_backoff_seconds
        self.available: bool | None = None   # None: not known yet; False: no cluster configured
        self.lists = 0                        # how many full lists were made (re-lists included)
        self._synced = threading.Event()
        self._settled = threading.Event()     # synced, or the first attempt failed / no cluster
        self._stop = threading.Event()
        self._runner = ProcessThread(self._run, thread_name)
        self._watch: Any = None

    # --- what subclasses say -----------------------------------------------------------------
    def _list_call(self, api: Any, **kwargs: Any) -> Any:
        raise NotImplementedError

    def _on_list(self, items: list) -> None:
        raise NotImplementedError

    def _on_event(self, kind: str, obj: dict) -> None:
        raise NotImplementedError

    def _on_no_cluster(self) -> None:
        """Called once when there is no cluster to watch."""

    def _slim(self, obj: dict) -> dict:
        """What _on_list needs of a listed object (paged lists keep only that)."""
        return obj

    # --- control -------------------------------------------------------------------------------
    @property
    def synced(self) -> bool:
        return self._synced.is_set()

    def ensure_started(self) -> None:
        self._runner.start_once(self._reset)

    def _reset(self) -> None:
        self._synced.clear()
        self._settled.clear()
        self._stop.clear()

    def wait_synced(self, timeout: float) -> bool:
        """True once the first list is in; returns at once when there is no cluster or the
        first attempt failed (the loop keeps retrying in the background)."""
        self.ensure_started()
        self._settled.wait(max(0.0, timeout))
        return self._synced.is_set()

    def stop(self) -> None:
        self._stop.set()
        watch = self._watch
        if watch is not None:
            watch.stop()
        self._runner.join(5)

    # --- the loop ----------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            api_client = self._api_client_factory()
        except Exception as e:  # a broken kubeconfig must not kill the worker
            log.warning("%s disabled: cannot build a Kubernetes client: %s", self.what, e)
            api_client = None
        if api_client is None:
            self.available = False
            self._settled.set()
            self._on_no_cluster()
            return
        self.available = True
        from kubernetes import client
        api = client.CoreV1Api(api_client)
        backoff = 0.0
        failures = 0
        resource_version = None
        while not self._stop.is_set():
            try:
                if resource_version is None:
                    resource_version = self._list(api)
                    backoff, failures = 0.0, self._recovered(failures)
                resource_version = self._watch_from(api, resource_version)
                backoff, failures = 0.0, self._recovered(failures)
            except _Gone:
                log.info("%s: watch expired (410 Gone): listing again", self.what)
                resource_version = None
            except Exception as e:  # any failure: retry with backoff
                if self._stop.is_set():
                    break
                # A first list that fails (no RBAC, API down) must not make callers wait for a
                # sync that is not coming.
                self._settled.set()
                failures += 1
                backoff = min(self.max_backoff_seconds, max(0.5, backoff * 2))
                # One warning per outage; the retries after it are debug noise.
                (log.warning if failures == 1 else log.debug)(
                    "%s: %s; retrying with backoff (%.1f s now)", self.what, _describe(e), backoff)
                self._stop.wait(backoff * random.uniform(0.8, 1.2))

    def _list(self, api: Any) -> str:
        items: list = []
        token = None
        while True:
            paging: dict[str, Any]
            if self.page_size:
                paging = {"limit": self.page_size, **({"_continue": token} if token else {})}
            else:  # resourceVersion "0": served from the API server's watch cache, not etcd
                paging = {"resource_version": "0"}
            response = self._list_call(api, _preload_content=False,
                                       _request_timeout=self.request_timeout_seconds, **paging)
            try:
                data = json.loads(response.data)
            finally:
                response.release_conn()
            items.extend(self._slim(item) for item in data.get("items") or [])
            meta = data.get("metadata") or {}
            token = meta.get("continue")
            if not self.page_size or not token:
                break
        self._on_list(items)
        self.lists += 1
        self._synced.set()
        self._settled.set()
        return meta.get("resourceVersion") or ""

    def _watch_from(self, api: Any, resource_version: str) -> str:
        from kubernetes import watch
        from kubernetes.client.rest import ApiException

        def list_call(**kwargs):  # no return annotation: the Watch hands back plain dicts
            return self._list_call(api, **kwargs)

        self._watch = w = watch.Watch()
        try:
            for event in w.stream(list_call, resource_version=resource_version,
                                  allow_watch_bookmarks=True,
                                  timeout_seconds=self.watch_timeout_seconds,
                                  _request_timeout=(self.request_timeout_seconds,
                                                    self.watch_timeout_seconds + 30)):
                if self._stop.is_set():
                    break
                obj = event.get("raw_object") or event.get("object") or {}
                rv = (obj.get("metadata") or {}).get("resourceVersion")
                kind = event.get("type")
                if kind in ("ADDED", "MODIFIED", "DELETED"):
                    self._on_event(kind, obj)
                if rv:
                    resource_version = rv
        except ApiException as e:
            if e.status == 410:
                raise _Gone() from None
            raise
        finally:
            self._watch = None
        return resource_version

    def _recovered(self, failures: int) -> int:
        if failures:
            log.info("%s: the API server answers again after %d failed attempt(s)", self.what,
                     failures)
        return 0


class _Gone(Exception):
    """The watch's resourceVersion is too old: list again."""


def _describe(error: Exception) -> str:
    status = getattr(error, "status", None)
    reason = getattr(error, "reason", None)
    if status:
        return f"API server answered {status} {reason or ''}".strip()
    return f"{type(error).__name__}: {str(error)[:200]}"
