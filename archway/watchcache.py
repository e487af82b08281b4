"""A list + watch cache of one kind of Kubernetes object, like an informer, holding only facts.

The extender's node cache and the webhook's namespace cache are both this loop: list once, watch
from the list's resourceVersion, list again on 410 Gone, back off while the API is down. Only the
few facts archway uses of each object are kept (`facts(obj) -> fact with a .name, or None`), so a
large cluster costs kilobytes, not the full objects.
"""
import json
import logging
import random
import threading
from collections.abc import Callable
from typing import Any, Generic, TypeVar

from archway.background import ProcessThread

log = logging.getLogger("archway.watchcache")

F = TypeVar("F")


class WatchCache(Generic[F]):
    """List + watch in a background thread, started lazily in the process that uses it.

    `items` (name -> fact) is replaced, never mutated, so request threads read it without a
    lock; `version` changes whenever a fact changes (a status heartbeat that changes no fact
    does not). `list_call(CoreV1Api)` returns the bound list method (`api.list_node`).
    """

    def __init__(self, api_client_factory, *, what: str, list_call: Callable[[Any], Callable],
                 facts: Callable[[dict], F | None], watch_timeout_seconds: int = 240,
                 request_timeout_seconds: float = 30.0, max_backoff_seconds: float = 30.0):
        self._api_client_factory = api_client_factory
        self.what = what
        self._list_call = list_call
        self._facts = facts
        self.watch_timeout_seconds = watch_timeout_seconds
        self.request_timeout_seconds = request_timeout_seconds
        self.max_backoff_seconds = max_backoff_seconds
        self.items: dict[str, F] = {}
        self.version = 0
        self.available: bool | None = None   # None: not known yet; False: no cluster configured
        self.lists = 0                        # how many full lists were made (re-lists included)
        self._synced = threading.Event()
        self._settled = threading.Event()     # synced, or the first attempt failed / no cluster
        self._stop = threading.Event()
        self._runner = ProcessThread(self._run, f"archway-{what}-cache")
        self._watch: Any = None

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
        first attempt failed (the cache keeps retrying in the background)."""
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
            log.warning("%s cache disabled: cannot build a Kubernetes client: %s", self.what, e)
            api_client = None
        if api_client is None:
            self.available = False
            self._settled.set()
            log.info("no Kubernetes cluster configured: the %s cache stays empty", self.what)
            return
        self.available = True
        from kubernetes import client
        list_method = self._list_call(client.CoreV1Api(api_client))
        backoff = 0.0
        failures = 0
        resource_version = None
        while not self._stop.is_set():
            try:
                if resource_version is None:
                    resource_version = self._list(list_method)
                    backoff, failures = 0.0, self._recovered(failures)
                resource_version = self._watch_from(list_method, resource_version)
                backoff, failures = 0.0, self._recovered(failures)
            except _Gone:
                log.info("%s watch expired (410 Gone): listing again", self.what)
                resource_version = None
            except Exception as e:
                if self._stop.is_set():
                    break
                # A first list that fails (no RBAC, API down) must not make every caller wait
                # for a sync that is not coming.
                self._settled.set()
                failures += 1
                backoff = min(self.max_backoff_seconds, max(0.5, backoff * 2))
                # One warning per outage; the retries after it are debug noise.
                (log.warning if failures == 1 else log.debug)(
                    "%s cache: %s; retrying with backoff (%.1f s now)", self.what, _describe(e),
                    backoff)
                self._stop.wait(backoff * random.uniform(0.8, 1.2))

    def _list(self, list_method) -> str:
        response = list_method(resource_version="0", _preload_content=False,
                               _request_timeout=self.request_timeout_seconds)
        try:
            data = json.loads(response.data)
        finally:
            response.release_conn()
        facts = {}
        for item in data.get("items") or []:
            fact = self._facts(item)
            if fact is not None:
                facts[fact.name] = fact  # type: ignore[attr-defined]
        self._replace(facts)
        self.lists += 1
        if not self._synced.is_set():
            log.info("%s cache synced: %d %ss", self.what, len(facts), self.what)
        self._synced.set()
        self._settled.set()
        return (data.get("metadata") or {}).get("resourceVersion") or ""

    def _watch_from(self, list_method, resource_version: str) -> str:
        from kubernetes import watch
        from kubernetes.client.rest import ApiException

        def list_objects(**kwargs):  # no return annotation: the Watch hands back plain dicts
            return list_method(**kwargs)

        self._watch = w = watch.Watch()
        try:
            for event in w.stream(list_objects, resource_version=resource_version,
                                  allow_watch_bookmarks=True,
                                  timeout_seconds=self.watch_timeout_seconds,
                                  _request_timeout=(self.request_timeout_seconds,
                                                    self.watch_timeout_seconds + 30)):
                if self._stop.is_set():
                    break
                obj = event.get("raw_object") or event.get("object") or {}
                rv = (obj.get("metadata") or {}).get("resourceVersion")
                kind = event.get("type")
                if kind in ("ADDED", "MODIFIED"):
                    self._upsert(self._facts(obj))
                elif kind == "DELETED":
                    self._delete((obj.get("metadata") or {}).get("name"))
                if rv:
                    resource_version = rv
        except ApiException as e:
            if e.status == 410:
                raise _Gone() from None
            raise
        finally:
            self._watch = None
        return resource_version

    # --- copy-on-write updates ------------------------------------------------------------------
    def _replace(self, facts: dict) -> None:
        if facts != self.items:
            self.items = facts
            self.version += 1

    def _upsert(self, fact: F | None) -> None:
        if fact is None:
            return
        name = fact.name  # type: ignore[attr-defined]
        if self.items.get(name) == fact:
            return
        items = dict(self.items)
        items[name] = fact
        self.items = items
        self.version += 1

    def _delete(self, name) -> None:
        if name in self.items:
            items = dict(self.items)
            del items[name]
            self.items = items
            self.version += 1

    def _recovered(self, failures: int) -> int:
        if failures:
            log.info("%s cache: the API server answers again after %d failed attempt(s)",
                     self.what, failures)
        return 0


class _Gone(Exception):
    """The watch's resourceVersion is too old: list again."""


def _describe(error: Exception) -> str:
    status = getattr(error, "status", None)
    reason = getattr(error, "reason", None)
    if status:
        return f"API server answered {status} {reason or ''}".strip()
    return f"{type(error).__name__}: {str(error)[:200]}"
