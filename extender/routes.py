"""The scheduler extender: `POST /scheduler/filter` keeps a pod off nodes whose architecture its
images cannot run on; `POST /scheduler/prioritize` prefers nodes with less network traffic.

kube-scheduler calls these for every pod of the profile that lists archway as extender (the
second scheduler the webhook's `schedulerName` points at). The extender is configured
`ignorable: true`, so any error here only costs the pod archway's opinion, never its scheduling;
that is why unknown things pass instead of blocking.
"""
import json
import logging
import os
import socket
import threading
import time

from flask import Flask, Response, request
from werkzeug.exceptions import RequestEntityTooLarge

from archway import metrics
from archway.extender.ceiling import Ceiling
from archway.extender.herd import Herd, PodWatch, added_traffic, pod_bandwidth, pod_key
from archway.extender.prometheus import TrafficPoller
from archway.extender.traffic import (
    NEUTRAL_SCORE,
    TrafficScale,
    load_score,
    node_loads,
    scores_of,
)
from archway.extender.wire import (
    MalformedExtenderArgs,
    TooManyNodes,
    filter_result_json,
    host_priority_entry,
    host_priority_list_json,
    parse_extender_args,
)
from archway.nodes import NodeCache
from archway.podview import PodShapeError, PodView
from archway.vocabulary import (
    ANNOTATION_ARCHITECTURES,
    common_architectures,
    parse_architectures,
    told_architectures,
)

log = logging.getLogger("archway.extender")

# Full-Nodes mode sends every candidate Node, far above the admission body limit, so the
# extender routes set their own: 5,000 Nodes (Kubernetes' largest supported cluster) with
# kubelet's 50 status.images each measure 58.8 MB in JSON (bench/cluster.py), 11.8 KB a node.
# Parsing holds about twice the body (wire.py), so a worker's threads stay within a few GB.
MAX_BODY_BYTES = 64 * 1024 * 1024
# Kept back from extender.deadline_seconds to build and send the answer.
ANSWER_MARGIN_SECONDS = 0.1
# Bounds each socket read of a request body (gunicorn's gthread sockets block without limit)...
BODY_READ_TIMEOUT_SECONDS = 5.0
# ... and the whole body: these large bodies are read by a handler thread, not by the worker's
# main loop (archway.worker), so a client dripping one is cut off here. 64 MiB over loopback
# takes well under a second; kube-scheduler gives up on the call after its httpTimeout anyway.
BODY_DEADLINE_SECONDS = 10.0


def read_body(environ: dict, limit: int, deadline: float) -> bytes:
    """Up to `limit` bytes of the request body, all of it in by `deadline`, else TimeoutError
    (archway.app answers 408). gunicorn reads a body in a loop of socket reads that each wait
    at most BODY_READ_TIMEOUT_SECONDS, which a client sending a byte now and then never trips:
    at the deadline a timer shuts the socket's receiving side, which ends that loop (over plain
    HTTP, the extender sidecar's, the 408 still goes out; a TLS session is over)."""
    sock = environ.get("gunicorn.socket")
    if sock is None:   # not under gunicorn (a test client): nothing can stall
        return environ["wsgi.input"].read(limit)
    sock.settimeout(BODY_READ_TIMEOUT_SECONDS)
    expired = threading.Event()

    def cut_off() -> None:
        expired.set()
        # Through a duplicate of the descriptor: SSLSocket.shutdown would drop the TLS layer
        # the answer still needs.
        with socket.socket(fileno=os.dup(sock.fileno())) as raw:
            raw.shutdown(socket.SHUT_RD)

    timer = threading.Timer(max(0.0, deadline - time.monotonic()), cut_off)
    timer.daemon = True
    timer.start()
    try:
        body = environ["wsgi.input"].read(limit)
    except Exception:
        if expired.is_set():
            raise TimeoutError("request body not complete before its deadline") from None
        raise
    finally:
        timer.cancel()
    if expired.is_set():
        raise TimeoutError("request body not complete before its deadline")
    return body


# --- pure decisions ---------------------------------------------------------------------------

def annotated_architectures(pod: PodView) -> frozenset[str] | None:
    """The set the webhook wrote into the pod at admission, or None when it is absent/blank."""
    value = pod.annotations.get(ANNOTATION_ARCHITECTURES)
    if value is None:
        return None
    archs = parse_architectures(value)
    return archs or None


def shared_architectures(results: dict) -> tuple[frozenset[str] | None, str]:
    """(S, explanation): the placement decision's S of these results (unresolvable or arch-less
    images do not shrink it), and which image told what."""
    told = told_architectures(results)
    if not told:
        return None, "no image told its architectures"
    detail = "; ".join(f"{image}: {', '.join(sorted(archs))}" for image, archs in told.items())
    return common_architectures(told), detail


class FilterOutcome:
    __slots__ = ("keep", "unresolvable")

    def __init__(self):
        self.keep: list[int] = []                 # positions of the passing candidates
        self.unresolvable: dict[str, str] = {}    # node -> why it cannot run the pod


def filter_by_arch(pod_archs: frozenset[str] | None, node_archs, names, *,
                   why_none: str = "") -> FilterOutcome:
    """Which candidates may run the pod. `node_archs[i]` is node i's GOARCH or None (unknown).

    A mismatching node goes to FailedAndUnresolvableNodes: no preemption can change a node's
    architecture, and in FailedNodes the scheduler would consider evicting that node's pods for
    a pod that still could not run there.
    """
    outcome = FilterOutcome()
    if pod_archs is None:  # nothing known about the images: archway has no objection
        outcome.keep = list(range(len(names)))
        return outcome
    if not pod_archs:
        reason = f"the pod's images have no architecture in common ({why_none})"
        for name in names:
            outcome.unresolvable[name] = reason
        return outcome
    wanted = ", ".join(sorted(pod_archs))
    reasons: dict[str, str] = {}
    keep, unresolvable = outcome.keep, outcome.unresolvable
    for i, arch in enumerate(node_archs):
        if arch is None or arch in pod_archs:
            keep.append(i)
        else:
            why = reasons.get(arch)
            if why is None:
                why = reasons[arch] = (f"node arch {arch} not in the pod's images' "
                                       f"architectures {wanted}")
            unresolvable[names[i]] = why
    return outcome


_NO_NODES: dict = {}


class ScoreBook:
    """One snapshot's scores for a set of nodes, with their serialized HostPriority entries, so
    a 5,000-node prioritize is dictionary lookups and one join."""

    def __init__(self, snapshot, names, addresses, match: str):
        self.scale = TrafficScale.of(snapshot.traffic.values())
        self.loads = node_loads(snapshot.traffic, snapshot.capacity, names, match=match,
                                node_addresses=addresses)
        self.scores = scores_of(self.loads, self.scale, names)
        self.entries = {n: host_priority_entry(n, score) for n, score in self.scores.items()}

    def adjusted(self, placements, running, default: float) -> dict[str, tuple[int, str]]:
        """node -> (score, entry) for the nodes of this book that pods were placed on since the
        sample, their estimated traffic added."""
        loads = self.loads
        mine = [p for p in placements if p.node in loads]
        if not mine:
            return {}
        traffic = {p.node: loads[p.node].traffic for p in mine}
        added = added_traffic(mine, traffic, running, default)
        result = {}
        for node, extra in added.items():
            score = load_score(loads[node], self.scale, extra)
            result[node] = (score, host_priority_entry(node, score))
        return result


# --- the service --------------------------------------------------------------------------------

class Extender:
    """Holds what the two endpoints share: the resolver, the node cache, the traffic poller, and
    the prioritize answers precomputed for the cached nodes."""

    def __init__(self, config, resolver, *, node_cache: NodeCache | None = None,
                 traffic: TrafficPoller | None = None):
        self.config = config
        self._resolver = resolver
        if node_cache is None and config.extender.node_cache:
            node_cache = NodeCache(lambda: _cluster_client(config.kubernetes))
        self.node_cache = node_cache
        self.traffic = traffic or TrafficPoller(config.prometheus, shared_dir=_shared_dir())
        self.herd = Herd() if config.extender.herd_control else None
        self.pod_watch = PodWatch(lambda: _cluster_client(config.kubernetes), self.herd) \
            if self.herd is not None and config.kubernetes.enabled != "off" else None
        # (key, ScoreBook), each replaced as a whole.
        self._book: tuple = (None, None)
        self._uncached: tuple = (None, None)
        # The cached nodes' book is built when a snapshot arrives, off the request path.
        self.traffic.listeners.append(self._score_book)
        self._no_cache_logged = False
        limit = config.extender.max_utilisation
        self.ceiling = Ceiling(limit, self.traffic, config.prometheus) if limit else None

    def stop(self) -> None:
        """Stop the background parts: the traffic poller, the node cache and the pod watch."""
        for part in (self.traffic, self.node_cache, self.pod_watch):
            if part is not None:
                part.stop()

    @property
    def resolver(self):
        # create_app may hand over a factory so the resolver (and its threads) is built after
        # gunicorn forks the worker, not in the master.
        resolver = self._resolver
        if resolver is not None and not hasattr(resolver, "resolve_many") and callable(resolver):
            resolver = self._resolver = resolver()
        return resolver

    # --- filter ------------------------------------------------------------------------------
    def pod_architectures(self, pod: PodView,
                          deadline: float) -> tuple[frozenset[str] | None, str, str]:
        """(S or None, where it came from, explanation used when S is empty)."""
        archs = annotated_architectures(pod)
        if archs is not None:
            return archs, "annotation", ""
        images = pod.images
        resolver = self.resolver
        if not images or resolver is None:
            return None, "none", ""
        results = resolver.resolve_many(images, timeout=deadline - time.monotonic())
        archs, detail = shared_architectures(results)
        return archs, "resolver", detail

    def filter(self, args, started: float | None = None) -> tuple[bytes, str]:
        """`started`: time.monotonic() when the request arrived; the answer is due within
        extender.deadline_seconds of it."""
        deadline = ((started or time.monotonic()) + self.config.extender.deadline_seconds
                    - ANSWER_MARGIN_SECONDS)
        try:
            pod = PodView.of(args.pod)
        except PodShapeError as e:
            raise MalformedExtenderArgs(f"ExtenderArgs.Pod: {e}") from None
        pod_archs, source, detail = self.pod_architectures(pod, deadline)
        if args.nodes is not None:
            node_archs = [node.arch for node in args.nodes] if pod_archs else ()
            names = [node.name for node in args.nodes]
        else:
            names = args.node_names
            node_archs = self._cached_archs(names, deadline) if pod_archs else ()
        outcome = filter_by_arch(pod_archs, node_archs, names, why_none=detail)
        keep, lifted = outcome.keep, ""
        busy: dict[str, str] = {}
        if self.ceiling is not None and keep:
            keep, busy, lifted = self.ceiling.apply(args, names, keep,
                                                    lambda s: self._score_book(s).loads)
        # A wrong architecture is unresolvable; a busy link (FailedNodes) is load, which passes.
        body = filter_result_json(args, keep, busy, outcome.unresolvable)
        summary = (f"{pod.display_name}: "
                   f"archs={','.join(sorted(pod_archs)) if pod_archs is not None else 'unknown'} "
                   f"from {source}, {len(keep)}/{len(names)} nodes pass"
                   + (f", {len(busy)} above extender.max_utilisation" if busy else "") + lifted)
        return body, summary

    def _cached_archs(self, names: list[str], deadline: float) -> list[str | None]:
        """Arch per name from the node cache. A name the cache does not hold is treated as a
        node of unknown arch, so it passes: the cache trails the scheduler's own informer by a
        watch event at most (a node that just joined), or there is no cluster access at all;
        refusing would stall scheduling on archway's blind spot, while the pod's
        kubernetes.io/arch selector that the webhook set still guards the node."""
        cache = self.node_cache
        # The first call in a worker may arrive before the first list is in: wait for it
        # within the extender's deadline rather than answer blind.
        if cache is None or not cache.wait_synced(deadline - time.monotonic()):
            if not self._no_cache_logged:
                self._no_cache_logged = True
                log.warning("NodeNames filter without a node cache (extender.node_cache off, no "
                            "cluster access, or the first list is not done): every node passes")
            return [None] * len(names)
        nodes = cache.nodes
        return [fact.arch if fact is not None else None for fact in map(nodes.get, names)]

    # --- prioritize --------------------------------------------------------------------------
    def prioritize(self, args) -> bytes:
        names = args.names
        self.traffic.ensure_started()
        if self.pod_watch is not None:
            self.pod_watch.ensure_started()
        snapshot = self.traffic.fresh_snapshot()
        if snapshot is None:
            return host_priority_list_json([host_priority_entry(n, NEUTRAL_SCORE) for n in names])
        match = self.config.prometheus.match
        if args.nodes is not None:  # full mode: the request's own addresses are the freshest
            addresses = {node.name: node.addresses for node in args.nodes}
            books = [ScoreBook(snapshot, names, addresses, match)]
        else:
            books = [self._score_book(snapshot)]
            entries = books[0].entries
            missing = [n for n in names if n not in entries]
            if missing:  # names the node cache does not know (or no cache): work them out now
                books.append(self._uncached_book(snapshot, missing))
        entries, scores = books[0].entries, books[0].scores
        if len(books) > 1:
            entries, scores = {**entries, **books[1].entries}, {**scores, **books[1].scores}
        herd = self.herd
        if herd is None:
            return host_priority_list_json([entries[n] for n in names])
        key = pod_key(args.pod) if isinstance(args.pod, dict) else None
        placements = herd.since(snapshot.sampled_at, exclude=key)
        adjusted: dict[str, tuple[int, str]] = {}
        for book in books:
            adjusted.update(book.adjusted(placements, herd.running,
                                          self.config.extender.default_pod_bytes_per_second))
        if adjusted:  # copies at C speed beat a Python test per name
            entries = {**entries, **{n: entry for n, (_, entry) in adjusted.items()}}
            scores = {**scores, **{n: score for n, (score, _) in adjusted.items()}}
        answer = host_priority_list_json([entries[n] for n in names])
        if key is not None and names:
            # Herd control's estimate until the pod watch sees the bind (or without a
            # cluster): the pod goes to the node scored highest, the first of them on a tie.
            herd.guess(key, max(names, key=scores.__getitem__), pod_bandwidth(args.pod))
        return answer

    def _uncached_book(self, snapshot, names) -> ScoreBook:
        # Without a node cache the scheduler tends to send the same candidate list pod after
        # pod: remember the last book until the traffic changes.
        key = (snapshot.version, tuple(names))
        last_key, book = self._uncached   # one tuple: request threads swap it atomically
        if key != last_key:
            book = ScoreBook(snapshot, names, {}, self.config.prometheus.match)
            self._uncached = (key, book)
        return book

    def _score_book(self, snapshot) -> ScoreBook:
        """The book of every cached node, rebuilt only when the traffic answer or the node set
        changes."""
        cache = self.node_cache
        if cache is not None:
            cache.ensure_started()
        nodes = cache.nodes if cache is not None else _NO_NODES
        last_key, book = self._book
        # The cache replaces its dict on every change, so identity tells whether it changed.
        if last_key is None or last_key[0] != snapshot.version or last_key[1] is not nodes:
            addresses = {name: fact.addresses for name, fact in nodes.items()}
            book = ScoreBook(snapshot, list(nodes), addresses, self.config.prometheus.match)
            self._book = ((snapshot.version, nodes), book)
        return book


def _shared_dir() -> str | None:
    """Where the workers of one `archway serve` share the traffic snapshot: inside the per-run
    directory serve.py makes for their metrics (PROMETHEUS_MULTIPROC_DIR). None outside it."""
    directory = metrics.multiprocess_dir()
    return os.path.join(directory, "traffic") if directory else None


def _cluster_client(kubernetes_settings):
    from archway.kubeclient import build_api_client
    return build_api_client(kubernetes_settings)[0]


# --- HTTP -----------------------------------------------------------------------------------------

def register_extender(app: Flask, config, resolver, *, extender: Extender | None = None,
                      node_cache: NodeCache | None = None) -> None:
    """Add POST /scheduler/filter and /scheduler/prioritize to `app`. `resolver` is a
    archway.registry.resolver.Resolver, a zero-argument factory of one, or None (pod arch then comes
    from the webhook's annotation only). `extender` replaces the one built from `config`."""
    extender = extender or Extender(config, resolver, node_cache=node_cache)
    app.extensions["archway.extender"] = extender

    def read_args():
        if request.content_length is not None and request.content_length > MAX_BODY_BYTES:
            raise RequestEntityTooLarge()
        body = read_body(request.environ, MAX_BODY_BYTES + 1,
                         time.monotonic() + BODY_DEADLINE_SECONDS)
        if len(body) > MAX_BODY_BYTES:   # a chunked body without a length
            raise RequestEntityTooLarge()
        try:
            return parse_extender_args(body)
        except TooManyNodes as e:
            raise RequestEntityTooLarge(str(e)) from None

    def filter_view():
        started, arrived = time.perf_counter(), time.monotonic()
        try:
            args = read_args()
            body, summary = extender.filter(args, arrived)
        except MalformedExtenderArgs as e:
            return _bad_request("filter", e, started)
        _finished("filter", "ok", started)
        log.info("filter %s (%.1f ms)", summary,
                 (time.perf_counter() - started) * 1000)
        return Response(body, 200, mimetype="application/json")

    def prioritize_view():
        started = time.perf_counter()
        try:
            args = read_args()
            body = extender.prioritize(args)
        except MalformedExtenderArgs as e:
            return _bad_request("prioritize", e, started)
        _finished("prioritize", "ok", started)
        return Response(body, 200, mimetype="application/json")

    app.add_url_rule("/scheduler/filter", "scheduler_filter", filter_view, methods=["POST"])
    app.add_url_rule("/scheduler/prioritize", "scheduler_prioritize", prioritize_view,
                     methods=["POST"])


def _bad_request(verb: str, error: Exception, started: float) -> Response:
    _finished(verb, "bad_request", started)
    metrics.bad_request(400)
    log.info("%s: 400 %s", verb, error)
    return Response(json.dumps({"error": f"malformed ExtenderArgs: {error}"}), 400,
                    mimetype="application/json")


def _finished(verb: str, outcome: str, started: float) -> None:
    metrics.EXTENDER_REQUESTS.labels(verb, outcome).inc()
    metrics.EXTENDER_DURATION.labels(verb).observe(time.perf_counter() - started)

