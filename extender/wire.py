"""The kube-scheduler extender wire format (k8s.io/kube-scheduler/extender/v1), parsed and built fast.

The Go types carry no json tags, so the scheduler sends Go field names (`Pod`, `Nodes`,
`NodeNames`) and decodes our reply case-insensitively; we accept any case and emit the exact
names. In full-Nodes mode a filter call carries every candidate Node object (megabytes for a big
cluster) and the reply must hand the passing ones back. Re-serialising thousands of parsed nodes
costs about as much as parsing them, so the parser records where each node's JSON text sits in
the body and the reply is assembled from those original slices: byte-for-byte the objects the
scheduler sent, for the price of a memory copy.

Memory stays near twice the body (the bytes and their text): each node is parsed, reduced to
the facts the extender uses (archway.cluster.nodes.NodeFacts) and dropped, instead of keeping
every full Node object (about 4.5 times the body for 5,000 nodes).
"""
import json
import json.decoder
import json.scanner
import re
from dataclasses import dataclass, field
from typing import cast

from archway.cluster.nodes import NodeFacts, node_facts
from archway.errors import ArchwayError

MAX_SCORE = 10          # extenderv1.MaxExtenderPriority: a HostPriority's score is 0..10
NEUTRAL_SCORE = 5       # no data: neither favour nor avoid the node

_WHITESPACE = re.compile(r"[ \t\n\r]*")
_scan_value = json.scanner.make_scanner(json.JSONDecoder())  # type: ignore[arg-type]  # json.loads' C scanner
_scan_string = json.decoder.scanstring  # type: ignore[attr-defined]
_encode_string = json.encoder.encode_basestring_ascii
_compact = json.JSONEncoder(separators=(",", ":")).encode


def _after_whitespace(text: str, idx: int) -> int:
    found = _WHITESPACE.match(text, idx)   # always matches (possibly nothing)
    return found.end() if found else idx


class MalformedExtenderArgs(ArchwayError, ValueError):
    """The body is not an ExtenderArgs document; the message says what is wrong."""


class TooManyNodes(ArchwayError, ValueError):
    """More candidate nodes than any cluster has (answered 413): parsing stops there."""


# Candidate nodes an ExtenderArgs may list, in either shape: more than any cluster has nodes
# (GKE's largest: 65,000). Without it a 64 MiB body of short names held 5 million strings
# (0.9 GB in a worker, issue 21).
MAX_CANDIDATE_NODES = 65_536


@dataclass
class ExtenderArgs:
    pod: dict
    nodes: list[NodeFacts] | None        # full mode: what the NodeList items tell
    node_names: list[str] | None         # nodeCacheCapable mode
    # Where things sit in the body, to echo nodes back without re-serialising them.
    _source: str | bytes = field(default="", repr=False)
    _spans: list[tuple[int, int]] = field(default_factory=list, repr=False)
    _list_members: list = field(default_factory=list, repr=False)  # raw "key":value or None for items

    @property
    def names(self) -> list[str]:
        """The candidate node names, in the order the scheduler sent them."""
        if self.node_names is not None:
            return self.node_names
        return [node.name for node in self.nodes or ()]

    def node_list_parts(self, keep: list[int]) -> list:
        """The NodeList as sent, with only the items at positions `keep` (input order kept), as
        pieces to join once: views into the body, never copies of it (a 60 MB reply was six
        copies of itself on its way out, 450 MB in a worker)."""
        source, spans = self._source, self._spans
        text = isinstance(source, str)
        view = source if isinstance(source, str) else memoryview(source)
        comma, opening, closing = (",", '"items":[', "]") if text else (b",", b'"items":[', b"]")
        parts: list = []
        for member in self._list_members:
            if parts:
                parts.append(comma)
            if member is not None:
                parts.append(member)
                continue
            parts.append(opening)
            for n, i in enumerate(keep):
                if n:
                    parts.append(comma)
                parts.append(view[spans[i][0]:spans[i][1]])
            parts.append(closing)
        return parts


def parse_extender_args(body: bytes) -> ExtenderArgs:
    """Parse an ExtenderArgs body; raise MalformedExtenderArgs with a readable reason."""
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as e:
        raise MalformedExtenderArgs(f"body is not UTF-8 (byte {e.start})") from None
    # Pure-ASCII bodies (the usual case) have byte offsets equal to character offsets, so the
    # reply can be cut straight out of the received bytes with no re-encoding.
    source = body if body.isascii() else text
    try:
        return _Parser(text, source).parse()
    except json.JSONDecodeError as e:
        raise MalformedExtenderArgs(f"body is not valid JSON: {e.msg} at offset {e.pos}") from None
    except StopIteration as e:
        raise MalformedExtenderArgs(f"body is not valid JSON: expected a value at offset {e.value}") from None
    except RecursionError:
        raise MalformedExtenderArgs("body nests too deeply") from None
    except (MalformedExtenderArgs, TooManyNodes):
        raise
    except ValueError as e:  # an integer over 4,300 digits (Python's int parsing limit)
        raise MalformedExtenderArgs(f"body holds a value archway cannot read: {e}") from None


class _Parser:
    """A hand-written walk of the two outer levels; every value inside goes to the C scanner."""

    def __init__(self, text: str, source):
        self.text = text
        self.source = source

    def _skip(self, idx: int) -> int:
        return _after_whitespace(self.text, idx)

    def _expect(self, idx: int, char: str, what: str) -> int:
        idx = self._skip(idx)
        if self.text[idx:idx + 1] != char:
            found = self.text[idx:idx + 1] or "end of body"
            raise MalformedExtenderArgs(f"expected {char!r} {what} at offset {idx}, found {found!r}")
        return idx + 1

    def _object(self, idx: int, what: str, on_member) -> int:
        """Walk the object opening at `idx`, calling on_member(key, key_start, value_start),
        which returns where the value ends; return where the object ends."""
        idx = self._skip(self._expect(idx, "{", f"to open {what}"))
        if self.text[idx:idx + 1] == "}":
            return idx + 1
        while True:
            key_start = self._skip(idx)
            idx = self._expect(key_start, '"', f"(a member name) in {what}")
            key, idx = _scan_string(self.text, idx)
            idx = self._skip(self._expect(idx, ":", f"after {key!r} in {what}"))
            idx = self._skip(on_member(key, key_start, idx))
            char = self.text[idx:idx + 1]
            if char == "}":
                return idx + 1
            if char != ",":
                raise MalformedExtenderArgs(f"expected ',' or '}}' in {what} at offset {idx}")
            idx += 1

    def parse(self) -> ExtenderArgs:
        found: dict[str, object] = {}

        def member(key, key_start, at):
            name = key.lower()  # Go's encoding/json matches field names case-insensitively
            if name == "nodes":
                value, end = self._node_list(at)
            elif name == "nodenames":
                value, end = self._node_names(at)
            else:
                value, end = _scan_value(self.text, at)
            found[name] = value  # a repeated name: the last one wins, as in Go
            return end

        end = self._skip(self._object(0, "the ExtenderArgs object", member))
        if end != len(self.text):
            raise MalformedExtenderArgs(f"unexpected data after the JSON object at offset {end}")

        pod = found.get("pod")
        if not isinstance(pod, dict):
            raise MalformedExtenderArgs("ExtenderArgs.Pod is missing or not an object")
        names = cast("list[str] | None", found.get("nodenames"))   # _node_names made it
        node_list = found.get("nodes")
        if node_list is None and names is None:
            raise MalformedExtenderArgs("ExtenderArgs has neither Nodes nor NodeNames")
        if node_list is None:
            return ExtenderArgs(pod=pod, nodes=None, node_names=names)
        items, spans, members = cast(tuple, node_list)
        # With both present the scheduler is not nodeCacheCapable: Nodes is what it reads back.
        return ExtenderArgs(pod=pod, nodes=items, node_names=None, _source=self.source,
                            _spans=spans, _list_members=members)

    def _node_names(self, at: int) -> tuple[list[str] | None, int]:
        """NodeNames (or null): a list of node names, at most MAX_CANDIDATE_NODES of them."""
        text = self.text
        if text.startswith("null", at):
            return None, at + 4
        wrong = MalformedExtenderArgs("ExtenderArgs.NodeNames must be a list of node names")
        if text[at:at + 1] != "[":
            raise wrong
        if text.count(",", at) < MAX_CANDIDATE_NODES:
            # Fewer commas in the rest of the body than the limit: whatever is there makes fewer
            # objects than that, so the C scanner reads it at once.
            value, end = _scan_value(text, at)
            # At C speed: a Python step per name cost 0.2-0.5 ms of a 5,000-name call.
            if not (isinstance(value, list) and set(map(type, value)) <= {str} and "" not in value):
                raise wrong
            return value, end
        # Near or past the limit: one by one, counting, so that millions are never made.
        names: list[str] = []
        idx = self._skip(at + 1)
        if text[idx:idx + 1] == "]":
            return names, idx + 1
        while True:
            if text[idx:idx + 1] != '"':
                if text[idx:idx + 1] in ("]", ""):   # a trailing comma
                    raise MalformedExtenderArgs(f"body is not valid JSON: expected a value at "
                                                f"offset {idx}")
                raise wrong
            name, idx = _scan_string(text, idx + 1)
            if not name:
                raise wrong
            if len(names) == MAX_CANDIDATE_NODES:
                raise TooManyNodes(f"ExtenderArgs.NodeNames lists more than "
                                   f"{MAX_CANDIDATE_NODES} nodes")
            names.append(name)
            idx = self._skip(idx)
            char = text[idx:idx + 1]
            if char == "]":
                return names, idx + 1
            if char != ",":
                raise MalformedExtenderArgs(f"expected ',' or ']' in NodeNames at offset {idx}")
            idx = self._skip(idx + 1)

    def _node_list(self, at: int):
        """Parse a v1 NodeList (or null), remembering each item's span in the body."""
        if self.text.startswith("null", at):
            return None, at + 4
        items, spans = [], []
        members: list = []  # raw `"key":value` texts, None where the items array goes

        def member(key, key_start, value_at):
            nonlocal items, spans, members
            if key.lower() == "items":
                items, spans, end = self._items(value_at)
                members = [m for m in members if m is not None] + [None]
                return end
            _, end = _scan_value(self.text, value_at)
            members.append(self.source[key_start:end])
            return end

        end = self._object(at, "ExtenderArgs.Nodes", member)
        if None not in members:
            members.append(None)  # a NodeList without items: echo an empty items list
        return (items, spans, members), end

    def _items(self, at: int):
        text = self.text
        if text.startswith("null", at):
            return [], [], at + 4
        idx = self._skip(self._expect(at, "[", "to open Nodes.items"))
        items: list[NodeFacts] = []
        spans: list[tuple[int, int]] = []
        if text[idx:idx + 1] == "]":
            return items, spans, idx + 1
        while True:
            if len(items) == MAX_CANDIDATE_NODES:
                raise TooManyNodes(f"ExtenderArgs.Nodes lists more than {MAX_CANDIDATE_NODES} "
                                   f"nodes")
            item, end = _scan_value(text, idx)
            if not isinstance(item, dict):
                raise MalformedExtenderArgs(f"Nodes.items[{len(items)}] is not an object")
            facts = node_facts(item)
            if facts is None:
                raise MalformedExtenderArgs(f"Nodes.items[{len(items)}] has no metadata.name")
            items.append(facts)
            spans.append((idx, end))
            idx = _after_whitespace(text, end)
            char = text[idx:idx + 1]
            if char == "]":
                return items, spans, idx + 1
            if char != ",":
                raise MalformedExtenderArgs(f"expected ',' or ']' in Nodes.items at offset {idx}")
            idx = _after_whitespace(text, idx + 1)


def filter_result_json(args: ExtenderArgs, keep: list[int], failed: dict[str, str],
                       unresolvable: dict[str, str]) -> bytes:
    """ExtenderFilterResult: `Nodes` in full mode, `NodeNames` in nodeCacheCapable mode."""
    tail = (',"FailedNodes":' + _compact(failed) + ',"FailedAndUnresolvableNodes":'
            + _compact(unresolvable) + ',"Error":""}')
    if args.nodes is None:
        names = args.node_names or []
        return ('{"Nodes":null,"NodeNames":' + _compact([names[i] for i in keep]) + tail).encode()
    parts = args.node_list_parts(keep)
    if isinstance(args._source, str):
        return "".join(['{"Nodes":{', *parts, '},"NodeNames":null', tail]).encode()
    return b"".join([b'{"Nodes":{', *parts, b'},"NodeNames":null', tail.encode()])


def host_priority_entry(name: str, score: int) -> str:
    """One HostPriority, pre-serialised so a 5,000-node reply is a string join."""
    return host_priority_head(name) + str(int(score)) + "}"


def host_priority_head(name: str) -> str:
    """A HostPriority up to its score: kept per node, so a new sample's entries are joins."""
    return '{"Host":' + _encode_string(name) + ',"Score":'


# The rest of an entry, per score 0..MAX_SCORE.
SCORE_TAILS = [f"{score}}}" for score in range(MAX_SCORE + 1)]


def host_priority_list_json(entries: list[str]) -> bytes:
    return ("[" + ",".join(entries) + "]").encode()
