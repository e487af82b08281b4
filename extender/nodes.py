"""What archway knows about the cluster's nodes: name, architecture, addresses.

A nodeCacheCapable scheduler sends only node names, so the extender needs the labels from
somewhere; asking the API server per node or per call would put the whole cluster's scheduling
latency on that round trip. Instead one list + watch keeps a small in-memory map, like an
informer, with only the three facts archway uses (a 5,000-node cluster's full Node objects would
be hundreds of megabytes; these facts are a few hundred kilobytes).
"""
import json
import logging
import random
import threading
from dataclasses import dataclass

from archway.registry.platforms import normalize
from archway.background import ProcessThread
from archway.webhook.placement import ARCH_KEYS

log = logging.getLogger("archway.nodes")


def _normal_arch(value) -> str | None:
    if not isinstance(value, str) or not value.strip():
        return None
    return normalize("linux", value).architecture  # normalize() is memoised


def node_arch(node: dict) -> str | None:
    """The node's GOARCH: label kubernetes.io/arch, then the beta label, then what the kubelet
    reported in status.nodeInfo.architecture; None when none is usable."""
    meta = node.get("metadata")
    labels = meta.get("labels") if isinstance(meta, dict) else None
    if isinstance(labels, dict):
        for key in ARCH_KEYS:  # kubernetes.io/arch, then the deprecated beta label
            arch = _normal_arch(labels.get(key))
            if arch:
                return arch
    status = node.get("status")
    info = status.get("nodeInfo") if isinstance(status, dict) else None
    return _normal_arch(info.get("architecture")) if isinstance(info, dict) else None


def node_addresses(node: dict) -> tuple[str, ...]:
    """status.addresses[].address (InternalIP, ExternalIP, Hostname...), lower-cased."""
    status = node.get("status")
    entries = status.get("addresses") if isinstance(status, dict) else None
    if not isinstance(entries, list):
        return ()
    return tuple(e["address"].lower() for e in entries
                 if isinstance(e, dict) and isinstance(e.get("address"), str) and e["address"])


@dataclass(frozen=True)
class NodeFacts:
    name: str
    arch: str | None
    addresses: tuple[str, ...]


def node_facts(node: dict) -> NodeFacts | None:
    meta = node.get("metadata") if isinstance(node, dict) else None
    name = meta.get("name") if isinstance(meta, dict) else None
    if not isinstance(name, str) or not name:
        return None
    return NodeFacts(name, node_arch(node), node_addresses(node))


class NodeCache:
    """List + watch of Nodes in a background thread, started lazily in the process that serves.

    `nodes` is replaced, never mutated, so request threads read it without a lock; `version`
    changes whenever a fact the extender uses changes (a heartbeat status update does not).
    """

    def __init__(self, api_client_factory, *, watch_timeout_seconds: int = 240,
                 request_timeout_seconds: float = 30.0, max_backoff_seconds: float = 30.0):
        self._api_client_factory = api_client_factory
        self.watch_timeout_seconds = watch_timeout_seconds
        self.request_timeout_seconds = request_timeout_seconds
        self.max_backoff_seconds = max_backoff_seconds
        self.nodes: dict[str, NodeFacts] = {}
        self.version = 0
        self.available: bool | None = None   # None: not known yet; False: no cluster configured
        self.lists = 0                        # how many full lists were made (re-lists included)
        self._synced = threading.Event()
        self._settled = threading.Event()     # synced, or the first attempt failed / no cluster
        self._stop = threading.Event()
        self._runner = ProcessThread(self._run, "archway-node-cache")
        self._watch = None

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
            log.warning("node cache disabled: cannot build a Kubernetes client: %s", e)
            api_client = None
        if api_client is None:
            self.available = False
            self._settled.set()
            log.info("no Kubernetes cluster configured: the node cache stays empty and "
                     "NodeNames filter calls let every node pass")
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
                    backoff, failures = 0.0, _recovered(failures)
                resource_version = self._watch_from(api, resource_version)
                backoff, failures = 0.0, _recovered(failures)
            except _Gone:
                log.info("node watch expired (410 Gone): listing again")
                resource_version = None
            except Exception as e:
                if self._stop.is_set():
                    break
                # A first list that fails (no RBAC for nodes, API down) must not make every
                # NodeNames call wait for a sync that is not coming.
                self._settled.set()
                failures += 1
                backoff = min(self.max_backoff_seconds, max(0.5, backoff * 2))
                # One warning per outage; the retries after it are debug noise.
                (log.warning if failures == 1 else log.debug)(
                    "node cache: %s; retrying with backoff (%.1f s now)", _describe(e), backoff)
                self._stop.wait(backoff * random.uniform(0.8, 1.2))

    def _list(self, api) -> str:
        response = api.list_node(resource_version="0", _preload_content=False,
                                 _request_timeout=self.request_timeout_seconds)
        try:
            data = json.loads(response.data)
        finally:
            response.release_conn()
        items = data.get("items") or []
        facts = {}
        for item in items:
            fact = node_facts(item)
            if fact is not None:
                facts[fact.name] = fact
        self._replace(facts)
        self.lists += 1
        if not self._synced.is_set():
            log.info("node cache synced: %d nodes", len(facts))
        self._synced.set()
        self._settled.set()
        return (data.get("metadata") or {}).get("resourceVersion") or ""

    def _watch_from(self, api, resource_version: str) -> str:
        from kubernetes import watch
        from kubernetes.client.rest import ApiException

        def list_node(**kwargs):  # no return annotation: the Watch hands back plain dicts
            return api.list_node(**kwargs)

        self._watch = w = watch.Watch()
        try:
            for event in w.stream(list_node, resource_version=resource_version,
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
                    self._upsert(node_facts(obj))
                elif kind == "DELETED":
                    self._delete(((obj.get("metadata") or {}).get("name")))
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
        if facts != self.nodes:
            self.nodes = facts
            self.version += 1

    def _upsert(self, fact: NodeFacts | None) -> None:
        if fact is None or self.nodes.get(fact.name) == fact:
            return
        nodes = dict(self.nodes)
        nodes[fact.name] = fact
        self.nodes = nodes
        self.version += 1

    def _delete(self, name) -> None:
        if name in self.nodes:
            nodes = dict(self.nodes)
            del nodes[name]
            self.nodes = nodes
            self.version += 1


def _recovered(failures: int) -> int:
    if failures:
        log.info("node cache: the API server answers again after %d failed attempt(s)", failures)
    return 0


class _Gone(Exception):
    """The watch's resourceVersion is too old: list again."""


def _describe(error: Exception) -> str:
    status = getattr(error, "status", None)
    reason = getattr(error, "reason", None)
    if status:
        return f"API server answered {status} {reason or ''}".strip()
    return f"{type(error).__name__}: {str(error)[:200]}"
