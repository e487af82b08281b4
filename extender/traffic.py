"""What a node's network traffic is worth to prioritize: pure functions, tested without I/O.

Which series of a sample belongs to which node (by name or by address), a node's load (traffic
and, when known, link capacity), and THE curves that turn a load into a score 0..10. The sample
itself comes from prometheus.py's poller.
"""
import math
import sys
from collections import Counter, defaultdict
from dataclasses import dataclass

from .wire import MAX_SCORE, NEUTRAL_SCORE

LARGEST = sys.float_info.max   # every traffic and capacity figure is finite, at most this


def short_name(name: str) -> str:
    return name.split(".", 1)[0]


def match_by_name(series_keys, node_names) -> dict[str, str]:
    """node name -> series key. Exact matches first; otherwise a short host name matches an
    FQDN whose first label it is, in either direction, but only when exactly one series and
    one node share that short name: an ambiguous short name is not guessed."""
    keys = set(series_keys)
    series_by_short = defaultdict(list)
    for key in keys:
        series_by_short[short_name(key)].append(key)
    names = list(node_names)
    nodes_by_short = Counter(short_name(n.lower()) for n in names)
    matched = {}
    for name in names:
        lowered = name.lower()
        if lowered in keys:
            matched[name] = lowered
            continue
        short = short_name(lowered)
        # Two different FQDNs with the same first label are different hosts.
        candidates = [k for k in series_by_short.get(short, ()) if "." not in k or "." not in lowered]
        if len(candidates) == 1 and nodes_by_short[short] == 1:
            matched[name] = candidates[0]
    return matched


def instance_host(value: str) -> str:
    """The host part of an `instance` label: `10.0.0.1:9100` -> `10.0.0.1`, `[fd00::1]:9100`
    -> `fd00::1`; a bare address or name is returned as is."""
    value = value.strip().lower()
    if value.startswith("["):
        return value[1:value.find("]")] if "]" in value else value[1:]
    if value.count(":") == 1:
        return value.split(":", 1)[0]
    return value  # a bare IPv6 address or a name without a port


def match_by_address(series_keys, node_addresses) -> dict[str, list[str]]:
    """node name -> series keys whose host part is one of the node's status.addresses.
    An address two nodes claim is ambiguous and matches neither."""
    owners = defaultdict(set)
    for node, addresses in node_addresses.items():
        for address in addresses:
            owners[address.lower()].add(node)
    matched = defaultdict(list)
    for key in series_keys:
        nodes = owners.get(instance_host(key), ())
        if len(nodes) == 1:
            matched[next(iter(nodes))].append(key)
    return dict(matched)


@dataclass(frozen=True)
class TrafficScale:
    """Scores on a log scale between the quietest (10) and the busiest (0) series of the whole
    query, so a node's score does not depend on which other nodes happen to be candidates and
    one very busy node does not flatten every other difference."""
    low: float
    high: float

    @classmethod
    def of(cls, values) -> "TrafficScale":
        logs = [math.log1p(v) for v in values]
        return cls(min(logs), max(logs)) if logs else cls(0.0, 0.0)

    def score(self, value: float) -> int:
        if self.high - self.low < 1e-9:
            return NEUTRAL_SCORE  # every node is as busy as every other: no preference
        position = (math.log1p(value) - self.low) / (self.high - self.low)
        return max(0, min(MAX_SCORE, round(MAX_SCORE * (1.0 - position))))


def node_traffic(traffic: dict[str, float], node_names, *, match: str = "name",
                 node_addresses=None) -> dict[str, float]:
    """node name -> bytes/s for the nodes some series belongs to."""
    if match == "address":
        wanted = set(node_names)
        addresses = {n: a for n, a in (node_addresses or {}).items() if n in wanted}
        # Several exporters for one node measure the same traffic: take the largest, not the sum.
        return {node: max(traffic[k] for k in keys)
                for node, keys in match_by_address(traffic, addresses).items()}
    return {node: traffic[key] for node, key in match_by_name(traffic, node_names).items()}


def utilisation_score(utilisation: float) -> int:
    """THE curve: round(10 x (1 - sqrt(u))) with u = traffic / capacity clamped to 0..1.
    Monotone; the square root keeps resolution where most nodes are (1 % -> 9, 4 % -> 8,
    25 % -> 5, 64 % -> 2, 100 % and above -> 0)."""
    u = min(1.0, max(0.0, utilisation))
    return max(0, min(MAX_SCORE, round(MAX_SCORE * (1.0 - math.sqrt(u)))))


@dataclass(frozen=True)
class NodeLoad:
    traffic: float              # bytes/s
    capacity: float | None      # bytes/s the traffic could reach; None: unknown


def load_score(load: NodeLoad, scale: TrafficScale, added: float = 0.0) -> int:
    """A node's score: from its utilisation when its capacity is known, else (no speed data)
    from its absolute traffic ranked among every node of the query (TrafficScale)."""
    traffic = min(load.traffic + added, LARGEST)
    if load.capacity:
        return utilisation_score(traffic / load.capacity)
    return scale.score(traffic)


def node_loads(traffic: dict[str, float], capacity: dict[str, float], node_names, *,
               match: str = "name", node_addresses=None) -> dict[str, NodeLoad]:
    """node name -> NodeLoad for the nodes some traffic series belongs to. A node's capacity
    is the capacity series of the same key (node_label value) as its traffic series."""
    if match == "address":
        names = list(node_names)
        per_node = node_traffic(traffic, names, match=match, node_addresses=node_addresses)
        links = node_traffic(capacity, per_node, match=match, node_addresses=node_addresses) \
            if capacity else {}
        return {node: NodeLoad(value, links.get(node)) for node, value in per_node.items()}
    # Name matching once, for both: it is most of a 5,000-node book's cost.
    return {node: NodeLoad(traffic[key], capacity.get(key))
            for node, key in match_by_name(traffic, node_names).items()}


def key_scores(traffic: dict[str, float], capacity: dict[str, float]
               ) -> tuple[TrafficScale, dict[str, int]]:
    """(the scale, series key -> score) of a sample: a node's score is its key's (scores_of with
    name matching), so the poller works these out once, away from the processes that answer."""
    scale = TrafficScale.of(traffic.values())
    return scale, {key: load_score(NodeLoad(value, capacity.get(key)), scale)
                   for key, value in traffic.items()}


def scores_of(loads: dict[str, NodeLoad], scale: TrafficScale, names) -> dict[str, int]:
    """THE decision: a score 0..10 per node; lower utilisation (or traffic, without capacity)
    scores higher, a node without traffic data gets NEUTRAL_SCORE. The extender's ScoreBook
    keeps these per snapshot."""
    return {n: load_score(loads[n], scale) if n in loads else NEUTRAL_SCORE for n in names}
