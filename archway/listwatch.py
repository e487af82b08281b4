"""One list + watch loop, like an informer, shared by the node and namespace caches
(archway.watchcache), the extender's pod watch and the gate controller's watch of gated pods.

A subclass says what to list (`path`, `page_size`, `watch_query`) and what to keep from the
answer (`_slim`, `_on_list`, `_on_event`); this class does the rest: a daemon thread per serving
process, the first list, watches resumed from the last resourceVersion, a new list after 410
Gone, and retries with backoff that log once per outage. It reads through archway.kubeapi, so
every list page and watch event is bounded in size and every read in time.
"""
import logging
import random
import threading
from collections.abc import Callable, Iterable
from typing import Any

from archway.background import ProcessThread
from archway.kubeapi import MAX_LIST_BYTES, ApiError, KubeApi, WatchStream

log = logging.getLogger("archway.listwatch")


class ListWatch:
    what = "objects"          # for log lines: "node cache", "pod watch"
    path = ""                 # the collection: /api/v1/nodes
    watch_query: dict[str, str] = {}   # what the watch narrows to (a label selector)
    list_query: dict[str, str] = {}    # what the list narrows to (a field selector)
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
        # The first list is in and the watch follows the API now: not listing again, not
        # retrying after a failure. What the API makes now may arrive any moment.
        self._current = threading.Event()
        self._settled = threading.Event()     # synced, or the first attempt failed / no cluster
        self._stop = threading.Event()
        self._runner = ProcessThread(self._run, thread_name)
        self._stream: WatchStream | None = None

    # --- what subclasses say -----------------------------------------------------------------
    def _on_list(self, items: list) -> None:
        raise NotImplementedError

    def _on_event(self, kind: str, obj: dict) -> None:
        raise NotImplementedError

    def _on_no_cluster(self) -> None:
        """Called once when there is no cluster to watch."""

    def _slim(self, obj: dict) -> dict | None:
        """What _on_list needs of a listed object (paged lists keep only that); None: nothing."""
        return obj

    # --- control -------------------------------------------------------------------------------
    @property
    def synced(self) -> bool:
        return self._synced.is_set()

    @property
    def settled(self) -> bool:
        """wait_synced would return at once: synced, or no cluster, or the first list failed."""
        return self._settled.is_set()

    @property
    def current(self) -> bool:
        """Synced, and following the watch now (not listing again, not retrying)."""
        return self._current.is_set()

    def ensure_started(self) -> None:
        self._runner.start_once(self._reset)

    def _reset(self) -> None:
        self._synced.clear()
        self._current.clear()
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
        self._current.clear()
        stream = self._stream
        if stream is not None:
            stream.close()   # ends a read waiting for the next event
        self._runner.join(5)

    def feeding(self, work: Callable[[], None], forget: Callable[[], None]) -> None:
        """`work()` with this list + watch feeding it; then the watch stopped and what it fed
        forgotten (`forget()`): one leadership of a loop that acts on what it is fed (the gate
        controller's, remediation's). The next leadership has a watch and a first list of its
        own: one of a previous leadership, still ending, cannot feed it."""
        self.ensure_started()
        try:
            work()
        finally:
            self.stop()
            forget()

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
        api = KubeApi(api_client, timeout_seconds=self.request_timeout_seconds)
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
            except _Relist as why:
                self._current.clear()
                log.info("%s: %s: listing again", self.what, why)
                resource_version = None
            except Exception as e:  # any failure: retry with backoff
                self._current.clear()
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

    def _list(self, api: KubeApi) -> str:
        if self.page_size:
            pages: Iterable[dict] = api.pages(self.path, self.page_size,
                                              query=self.list_query)
        else:  # resourceVersion "0": served from the API server's watch cache, not etcd
            pages = [api.request("GET", self.path, query={**self.list_query, "resourceVersion": "0"},
                                 max_bytes=MAX_LIST_BYTES)]
        items: list = []
        meta: dict = {}
        for page in pages:
            items.extend(slim for slim in map(self._slim, page.get("items") or [])
                         if slim is not None)
            meta = page.get("metadata") or {}
        if self._stop.is_set():
            return ""
        self._on_list(items)
        self.lists += 1
        self._synced.set()
        self._current.set()
        self._settled.set()
        return meta.get("resourceVersion") or ""

    def _watch_from(self, api: KubeApi, resource_version: str) -> str:
        try:
            self._stream = stream = api.watch(
                self.path, dict(self.watch_query, resourceVersion=resource_version),
                timeout_seconds=self.watch_timeout_seconds)
            if self._stop.is_set():   # stopped while the watch was opening
                return resource_version
            self._current.set()       # again, after a failed watch resumed where it was
            for event in stream:
                if self._stop.is_set():
                    break
                obj = event.get("object") or {}
                rv = (obj.get("metadata") or {}).get("resourceVersion")
                kind = event.get("type")
                if kind in ("ADDED", "MODIFIED", "DELETED"):
                    self._on_event(kind, obj)
                if rv:
                    resource_version = rv
        except ApiError as e:
            if e.status == 410:
                raise _Relist("watch expired (410 Gone)") from None
            if e.reason == "TooLarge":   # a list page may hold what one watch event cannot
                raise _Relist(str(e)) from None
            raise
        finally:
            self._stream = None
        return resource_version

    def _recovered(self, failures: int) -> int:
        if failures:
            log.info("%s: the API server answers again after %d failed attempt(s)", self.what,
                     failures)
        return 0


class _Relist(Exception):
    """The watch cannot go on from its resourceVersion: list again."""


def _describe(error: Exception) -> str:
    if isinstance(error, ApiError):
        return f"API server answered {error}" if error.status else str(error)
    return f"{type(error).__name__}: {str(error)[:200]}"
