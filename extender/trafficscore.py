"""The traffic signal: prefer nodes whose network link is less busy (traffic.py's curves on the
sample prometheus.py's poller keeps), corrected by herd control for the pods placed since that
sample (herd.py), so a burst of pods inside one refresh does not all land on the quietest node.
"""
from collections.abc import Mapping
from itertools import filterfalse

from archway.cluster.nodes import NodeCache

from .herd import Herd, PodWatch, added_traffic, pod_bandwidth, pod_key
from .prometheus import TrafficPoller, TrafficSnapshot
from .signals import ScoreTable, SignalScores
from .traffic import NodeLoad, TrafficScale, load_score, match_by_name, node_loads, scores_of
from .wire import NEUTRAL_SCORE, SCORE_TAILS, ExtenderArgs, host_priority_head

_NO_NODES: dict = {}


class ScoreBook:
    """One snapshot's scores for a set of nodes (the node cache's, or one request's), kept as a
    ScoreTable so the nodes' answers are serialised once per snapshot, not per pod."""

    def __init__(self, snapshot: TrafficSnapshot, names, addresses, match: str):
        self.scale = TrafficScale.of(snapshot.traffic.values())
        self.loads: Mapping[str, NodeLoad] = node_loads(
            snapshot.traffic, snapshot.capacity, names, match=match, node_addresses=addresses)
        self.table = ScoreTable(scores_of(self.loads, self.scale, names))

    @classmethod
    def matched(cls, snapshot: TrafficSnapshot, nodes: "MatchedNodes") -> "ScoreBook":
        """The same book for name matching, from the sample's key scores and a match kept
        while the nodes and the series keys stay the same: copies and joins at C speed, no
        Python step per node (a new sample must not hold the GIL of a serving worker)."""
        book = cls.__new__(cls)
        book.scale, by_key = snapshot.scores()
        book.loads = _MatchedLoads(nodes.key_of, snapshot.traffic, snapshot.capacity)
        scores = dict.fromkeys(nodes.names, NEUTRAL_SCORE)
        scores.update(zip(nodes.key_of, map(by_key.__getitem__, nodes.key_of.values())))
        entries = dict(zip(nodes.names, map(str.__add__, nodes.heads,
                                            map(SCORE_TAILS.__getitem__, scores.values()))))
        book.table = ScoreTable(scores, entries)
        return book

    def adjusted(self, placements, running, default: float) -> dict[str, int]:
        """node -> score for the nodes of this book that pods were placed on since the sample,
        their estimated traffic added."""
        loads = self.loads
        mine = [p for p in placements if p.node in loads]
        if not mine:
            return {}
        traffic = {p.node: loads[p.node].traffic for p in mine}
        added = added_traffic(mine, traffic, running, default)
        return {node: load_score(loads[node], self.scale, extra) for node, extra in added.items()}


class MatchedNodes:
    """The cached nodes matched by name to a sample's series keys, and their entries' heads:
    kept while neither changes (a refresh brings new values for the same keys)."""

    def __init__(self, nodes: dict, keys):
        self.source = nodes                   # the node cache's dict it was made from
        self.names = list(nodes)
        self.keys = keys                      # the series keys it was matched against
        self.key_of = match_by_name(keys, self.names)
        self.heads = [host_priority_head(name) for name in self.names]


class _MatchedLoads(Mapping):
    """node -> NodeLoad, looked up when asked (herd control's few nodes, the ceiling's
    candidates) rather than made for every node at each sample."""

    def __init__(self, key_of: dict[str, str], traffic: dict, capacity: dict):
        self._key_of, self._traffic, self._capacity = key_of, traffic, capacity

    def __getitem__(self, node: str) -> NodeLoad:
        key = self._key_of[node]
        return NodeLoad(self._traffic[key], self._capacity.get(key))

    def __contains__(self, node) -> bool:
        return node in self._key_of

    def __iter__(self):
        return iter(self._key_of)

    def __len__(self) -> int:
        return len(self._key_of)


class TrafficScore:
    """The traffic ScoreSignal (signals.py). Its book of the cached nodes is also what the
    filter's utilisation ceiling reads (`book`)."""

    weight = 1.0

    def __init__(self, config, traffic: TrafficPoller, node_cache: NodeCache | None,
                 cluster_client):
        self.config = config
        self.traffic = traffic
        self.node_cache = node_cache
        self.herd = Herd() if config.extender.herd_control else None
        self.pod_watch = PodWatch(cluster_client, self.herd) \
            if self.herd is not None and config.kubernetes.enabled != "off" else None
        # (key, ScoreBook or ScoreTable), each replaced as a whole.
        self._book: tuple = (None, None)
        self._matched: MatchedNodes | None = None
        self._uncached: tuple = (None, None)
        self._merged: tuple = (None, None)
        # The cached nodes' book is built when a snapshot arrives, off the request path.
        self.traffic.listeners.append(self._prepare)

    def stop(self) -> None:
        if self.pod_watch is not None:
            self.pod_watch.stop()

    def start(self) -> None:
        """The poller and the pod watch: as a worker boots (archway.main.serve), else on first use."""
        self.traffic.ensure_started()
        if self.pod_watch is not None:
            self.pod_watch.ensure_started()

    def scores(self, args: ExtenderArgs) -> SignalScores | None:
        self.start()
        snapshot = self.traffic.fresh_snapshot()
        if snapshot is None:
            return None   # no sample younger than prometheus.stale_after_seconds: no opinion
        names = args.names
        if args.nodes is not None:  # full mode: the request's own addresses are the freshest
            addresses = {node.name: node.addresses for node in args.nodes}
            books = [ScoreBook(snapshot, names, addresses, self.config.prometheus.match)]
        else:
            books = [self.book(snapshot)]
            known = books[0].table.scores
            missing = list(filterfalse(known.__contains__, names))   # at C speed
            if missing:  # names the node cache does not know (or no cache): work them out now
                books.append(self._uncached_book(snapshot, missing))
        table = self._table(books)
        herd = self.herd
        if herd is None:
            return SignalScores(table)
        key = pod_key(args.pod) if isinstance(args.pod, dict) else None
        placements = herd.since(snapshot.sampled_at, exclude=key)
        changed: dict[str, int] = {}
        for book in books:
            changed.update(book.adjusted(placements, herd.running,
                                         self.config.extender.default_pod_bytes_per_second))
        if key is not None and names:
            # Herd control's estimate until the pod watch sees the bind (or without a
            # cluster): the pod goes to the node traffic scores highest, the first on a tie.
            scores = {**table.scores, **changed} if changed else table.scores
            herd.guess(key, max(names, key=scores.__getitem__), pod_bandwidth(args.pod))
        return SignalScores(table, changed)

    def book(self, snapshot: TrafficSnapshot) -> ScoreBook:
        """The book of every cached node, rebuilt only when the traffic answer or the node set
        changes."""
        cache = self.node_cache
        if cache is not None:
            cache.ensure_started()
        nodes = cache.nodes if cache is not None else _NO_NODES
        last_key, book = self._book
        # The cache replaces its dict on every change, so identity tells whether it changed.
        if last_key is None or last_key[0] != snapshot.version or last_key[1] is not nodes:
            if self.config.prometheus.match == "name":
                book = ScoreBook.matched(snapshot, self._matched_nodes(snapshot, nodes))
            else:
                addresses = {name: fact.addresses for name, fact in nodes.items()}
                book = ScoreBook(snapshot, list(nodes), addresses, self.config.prometheus.match)
            self._book = ((snapshot.version, nodes), book)
        return book

    def _matched_nodes(self, snapshot: TrafficSnapshot, nodes: dict) -> MatchedNodes:
        matched = self._matched
        # The keys compared as sets, at C speed; the cache's dict is replaced on any change.
        if matched is None or matched.source is not nodes \
                or matched.keys != snapshot.traffic.keys():
            matched = MatchedNodes(nodes, snapshot.traffic.keys())
            self._matched = matched
        return matched

    def _prepare(self, snapshot: TrafficSnapshot) -> None:
        self.book(snapshot).table.entries   # noqa: B018 - made now, in the poller's thread

    def _uncached_book(self, snapshot: TrafficSnapshot, names) -> ScoreBook:
        # Without a node cache the scheduler tends to send the same candidate list pod after
        # pod: remember the last book until the traffic changes.
        key = (snapshot.version, tuple(names))
        last_key, book = self._uncached   # one tuple: request threads swap it atomically
        if key != last_key:
            book = ScoreBook(snapshot, names, {}, self.config.prometheus.match)
            self._uncached = (key, book)
        return book

    def _table(self, books: list[ScoreBook]) -> ScoreTable:
        if len(books) == 1:
            return books[0].table
        cached, uncached = books[0].table, books[1].table
        if not cached.scores:   # no node cache: every name is in the second book
            return uncached
        # Both, kept while they are the same two tables, so the merge is serialised once.
        last_key, merged = self._merged
        if last_key is None or last_key[0] is not cached or last_key[1] is not uncached:
            merged = ScoreTable({**cached.scores, **uncached.scores})
            self._merged = ((cached, uncached), merged)
        return merged
