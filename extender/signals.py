"""prioritize's seam: what a score signal is, and how the signals' scores combine into the answer.

A signal is one reason to prefer a node: network traffic today (trafficscore.py, incl. its herd
control and link capacity). For the candidates of one pod each signal gives a score 0..MAX_SCORE
per node, or no opinion at all; prioritize answers each node's weighted mean of the signals that
have one, rounded half up. Adding a signal is a module with a class shaped like `ScoreSignal` and
one line in `score_signals` (service.py), the one place the list is built from the config.
"""
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from functools import cached_property
from typing import Protocol

from .wire import (
    MAX_SCORE,
    NEUTRAL_SCORE,
    ExtenderArgs,
    host_priority_entry,
    host_priority_list_json,
)


class ScoreTable:
    """node -> score, with the wire form of each pair made once: a signal keeps one table per
    sample and hands it out pod after pod, so a 5,000-node answer is dictionary lookups and a
    join (the table's `entries` may be made ahead, off the request path)."""

    def __init__(self, scores: Mapping[str, int], entries: dict[str, str] | None = None):
        self.scores = scores
        if entries is not None:   # made by its maker already (trafficscore.ScoreBook.matched)
            self.__dict__["entries"] = entries

    @cached_property
    def entries(self) -> dict[str, str]:
        return {name: host_priority_entry(name, score) for name, score in self.scores.items()}


@dataclass(frozen=True)
class SignalScores:
    """A signal's scores for the candidates of one pod: the table it keeps between pods, and
    this pod's own corrections on top of it. A candidate in neither scores NEUTRAL_SCORE."""
    kept: ScoreTable
    changed: Mapping[str, int] = field(default_factory=dict)

    def of(self, name: str) -> int:
        score = self.changed.get(name)
        return score if score is not None else self.kept.scores.get(name, NEUTRAL_SCORE)


class ScoreSignal(Protocol):
    weight: float   # its share in the mean, > 0

    def scores(self, args: ExtenderArgs) -> SignalScores | None:
        """The scores of `args`' candidates, or None: no opinion about this pod (no data)."""

    def stop(self) -> None:
        """Stop what the signal runs in the background."""


def combined_score(weighted: Iterable[tuple[float, int]]) -> int:
    """THE combination: the weighted mean of (weight, score) pairs, rounded half up."""
    pairs = list(weighted)
    total = sum(weight for weight, _ in pairs)
    if total <= 0:
        return NEUTRAL_SCORE
    mean = sum(weight * score for weight, score in pairs) / total
    return max(0, min(MAX_SCORE, math.floor(mean + 0.5)))


def combined(answers: list[tuple[float, SignalScores]], names: Iterable[str]) -> dict[str, int]:
    """node -> combined_score of every answer's score for it, for `names`."""
    return {name: combined_score((weight, answer.of(name)) for weight, answer in answers)
            for name in names}


class Prioritizer:
    """The prioritize answer (HostPriorityList JSON) from the signals' scores. One signal's kept
    table is answered as it is; the combination of several is kept while their tables are the
    same objects."""

    def __init__(self, signals: list[ScoreSignal]):
        self.signals = signals
        self._last: tuple[tuple, ScoreTable | None] = ((), None)   # replaced as a whole

    def answer(self, args: ExtenderArgs) -> bytes:
        names = args.names
        answers = [(signal.weight, scores) for signal in self.signals
                   if (scores := signal.scores(args)) is not None]
        if not answers:
            return host_priority_list_json([host_priority_entry(n, NEUTRAL_SCORE) for n in names])
        if len(answers) == 1:
            table, changed = answers[0][1].kept, answers[0][1].changed
        else:
            table = self._combined_table(answers)
            touched = set().union(*(scores.changed for _, scores in answers))
            changed = combined(answers, touched)
        entries = table.entries
        if changed:   # copies at C speed beat a Python test per name
            entries = {**entries, **{n: host_priority_entry(n, s) for n, s in changed.items()}}
        try:
            return host_priority_list_json(list(map(entries.__getitem__, names)))
        except KeyError:   # a candidate no table holds
            return host_priority_list_json([entries.get(n) or host_priority_entry(n, NEUTRAL_SCORE)
                                            for n in names])

    def _combined_table(self, answers: list[tuple[float, SignalScores]]) -> ScoreTable:
        tables = tuple(scores.kept for _, scores in answers)
        last_tables, table = self._last
        if table is None or len(last_tables) != len(tables) or \
                any(a is not b for a, b in zip(last_tables, tables)):
            kept = [(weight, SignalScores(scores.kept)) for weight, scores in answers]
            names = set().union(*(t.scores for t in tables))
            table = ScoreTable(combined(kept, names))
            self._last = (tables, table)
        return table
