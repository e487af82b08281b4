"""A list + watch cache of one kind of Kubernetes object, holding only facts.

The extender's node cache and the webhook's namespace cache are both this: the list + watch loop
of archway.listwatch, keeping only the few facts archway uses of each object
(`facts(obj) -> fact with a .name, or None`), so a large cluster costs kilobytes, not the full
objects.
"""
import logging
from collections.abc import Callable
from typing import Generic, TypeVar

from archway.kubeapi import LIST_PAGE_SIZE
from archway.listwatch import ListWatch

log = logging.getLogger("archway.watchcache")
F = TypeVar("F")


class WatchCache(ListWatch, Generic[F]):
    """`items` (name -> fact) is replaced, never mutated, so request threads read it without a
    lock; `version` changes whenever a fact changes (a status heartbeat that changes no fact
    does not). `path` is the collection (/api/v1/nodes). Listed in pages, each cut down to its
    facts before the next is read: 5,000 full Nodes are ~60 MB of JSON in one answer (near the
    64 MiB cap of one response) and hundreds of thousands of objects at once."""

    page_size = LIST_PAGE_SIZE

    def __init__(self, api_client_factory, *, what: str, path: str,
                 facts: Callable[[dict], F | None], **kwargs):
        super().__init__(api_client_factory, thread_name=f"archway-{what}-cache", **kwargs)
        self.what = f"{what} cache"
        self.path = path
        self._facts = facts
        self.items: dict[str, F] = {}
        self.version = 0

    def _on_no_cluster(self) -> None:
        # Debug: `archway serve` says it once for the server (main/serve.py), not per cache
        # and worker.
        log.debug("no Kubernetes cluster configured: the %s stays empty", self.what)

    def _slim(self, obj: dict):
        return self._facts(obj)

    def _on_list(self, items: list) -> None:
        facts = {fact.name: fact for fact in items}   # already _slim's facts, Nones dropped
        self._replace(facts)
        if not self.synced:
            log.info("%s synced: %d items", self.what, len(facts))

    def _on_event(self, kind: str, obj: dict) -> None:
        if kind == "DELETED":
            self._delete(self._name_of(obj))
        else:
            self._upsert(self._facts(obj))

    def _name_of(self, obj: dict):
        """The key of `obj` in `items`, as its fact's .name is (a namespaced cache keys
        namespace/name)."""
        return (obj.get("metadata") or {}).get("name")

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
