"""prioritize's seam of score signals (extender/signals.py): the combination is the weighted mean,
rounded half up, of the signals that have an opinion; a second signal, defined here and
registered in the one place (service.score_signals), composes with traffic (incl. its herd
control) without touching either. No I/O: a traffic sample is handed in as the poller would."""
import copy
import json
import os
import time

import pytest
from hypothesis import given
from hypothesis import strategies as st

from archway.config import config_from_dict
from archway.extender import service
from archway.extender.prometheus import TrafficSnapshot
from archway.extender.signals import (
    Prioritizer,
    ScoreTable,
    SignalScores,
    combined,
    combined_score,
)
from archway.extender.wire import MAX_SCORE, NEUTRAL_SCORE, ExtenderArgs, parse_extender_args
from tests.test_traffic import node_scores

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures", "extender")
NAMES = ["node-a", "node-b", "node-c", "node-d"]       # node-d: no traffic series
TRAFFIC = {"node-a": 1e3, "node-b": 2e6, "node-c": 4e7}
CAPACITY = {name: 1.25e8 for name in TRAFFIC}           # 1 Gbit/s links


class Sample:
    """The traffic poller's face to the extender, holding one fresh sample."""

    def __init__(self):
        self.snapshot = TrafficSnapshot(TRAFFIC, time.monotonic(), 1, CAPACITY, time.time() - 1)
        self.listeners: list = []

    def ensure_started(self):
        pass

    def fresh_snapshot(self):
        return self.snapshot

    def stop(self):
        pass


class Fixed:
    """A second signal, not shipped: a fixed score per node, corrections per pod uid."""

    def __init__(self, scores, weight=1.0, changed=None, opinion=True):
        self.table = ScoreTable(scores)
        self.weight = weight
        self.changed = changed or {}
        self.opinion = opinion
        self.stopped = False

    def scores(self, args: ExtenderArgs) -> SignalScores | None:
        if not self.opinion:
            return None
        return SignalScores(self.table, self.changed.get(args.pod["metadata"]["uid"], {}))

    def stop(self):
        self.stopped = True


def args_for(uid: str, names=NAMES) -> ExtenderArgs:
    with open(os.path.join(FIXTURES, "filter-nodenames.json")) as f:
        pod = copy.deepcopy(json.load(f)["Pod"])
    pod["metadata"]["uid"] = uid
    return parse_extender_args(json.dumps({"Pod": pod, "NodeNames": names}).encode())


def answer(prioritizer_or_extender, args) -> dict[str, int]:
    body = (prioritizer_or_extender.prioritize(args) if hasattr(prioritizer_or_extender, "prioritize")
            else prioritizer_or_extender.answer(args))
    reply = json.loads(body)
    assert [entry["Host"] for entry in reply] == args.names
    return {entry["Host"]: entry["Score"] for entry in reply}


def extender(monkeypatch, *extra, herd=False, **settings):
    """An Extender whose signals are traffic plus `extra`, registered where a shipped signal
    would be: in service.score_signals."""
    registered = service.score_signals
    monkeypatch.setattr(service, "score_signals",
                        lambda config, traffic: [*registered(config, traffic), *extra])
    config = config_from_dict({"kubernetes": {"enabled": "off"},
                               "extender": {"node_cache": False, "herd_control": herd, **settings}})
    return service.Extender(config, None, traffic=Sample())


# --- the combination, pure ---------------------------------------------------------------------

@pytest.mark.parametrize("weighted, score", [
    ([(1, 10)], 10), ([(1, 10), (1, 0)], 5), ([(1, 10), (3, 0)], 3),   # 2.5 rounds up
    ([(1, 7), (1, 8)], 8), ([(2, 7), (1, 8)], 7), ([(0.5, 4), (0.5, 5)], 5), ([], NEUTRAL_SCORE),
])
def test_the_combined_score_is_the_weighted_mean_rounded_half_up(weighted, score):
    assert combined_score(weighted) == score


@given(st.lists(st.tuples(st.floats(0.01, 100), st.integers(0, MAX_SCORE)), min_size=1))
def test_the_combined_score_lies_between_the_lowest_and_the_highest(weighted):
    scores = [score for _, score in weighted]
    assert min(scores) <= combined_score(weighted) <= max(scores)


def test_a_node_a_signal_leaves_out_is_neutral_to_that_signal_and_a_correction_wins():
    answers = [(1.0, SignalScores(ScoreTable({"a": 10, "b": 0}))),
               (1.0, SignalScores(ScoreTable({"a": 10}), {"b": 10}))]
    assert combined(answers, ["a", "b", "c"]) == {"a": 10, "b": 5, "c": NEUTRAL_SCORE}


# --- the seam: signals composed by prioritize ----------------------------------------------------

def test_with_traffic_alone_prioritize_answers_traffic_s_own_scores(monkeypatch):
    ext = extender(monkeypatch)
    assert len(ext.signals) == 1
    assert answer(ext, args_for("p")) == dict(zip(NAMES, node_scores(TRAFFIC, NAMES,
                                                                     capacity=CAPACITY)))


def test_a_second_signal_combines_with_traffic_by_weight(monkeypatch):
    second = Fixed({"node-a": 0, "node-b": 10, "node-c": 10}, weight=3.0)
    ext = extender(monkeypatch, second)
    traffic = dict(zip(NAMES, node_scores(TRAFFIC, NAMES, capacity=CAPACITY)))
    expected = {n: combined_score([(1.0, traffic[n]), (3.0, second.table.scores.get(n, 5))])
                for n in NAMES}
    assert answer(ext, args_for("p")) == expected
    assert expected != traffic   # the second signal changed the answer
    assert answer(ext, args_for("q")) == expected   # the kept combination, answered again
    ext.stop()
    assert second.stopped


def test_a_signal_without_an_opinion_is_left_out_of_the_mean(monkeypatch):
    ext = extender(monkeypatch, Fixed({"node-a": 10, "node-b": 10}, weight=5.0, opinion=False))
    assert answer(ext, args_for("p")) == dict(zip(NAMES, node_scores(TRAFFIC, NAMES,
                                                                     capacity=CAPACITY)))


def test_without_any_opinion_every_candidate_is_neutral():
    prioritizer = Prioritizer([Fixed({}, opinion=False)])
    assert answer(prioritizer, args_for("p")) == {n: NEUTRAL_SCORE for n in NAMES}


def test_a_candidate_no_signal_knows_is_neutral():
    prioritizer = Prioritizer([Fixed({"node-a": 9}), Fixed({"node-a": 10, "node-b": 0})])
    assert answer(prioritizer, args_for("p", ["node-a", "node-b", "elsewhere"])) == {
        "node-a": 10, "node-b": 3, "elsewhere": NEUTRAL_SCORE}   # 9.5 up, 2.5 up


def test_one_pod_s_corrections_apply_to_that_pod_only():
    prioritizer = Prioritizer([Fixed({"node-a": 10, "node-b": 10}),
                               Fixed({"node-a": 10, "node-b": 10}, changed={"p": {"node-b": 0}})])
    assert answer(prioritizer, args_for("p", ["node-a", "node-b"])) == {"node-a": 10, "node-b": 5}
    assert answer(prioritizer, args_for("q", ["node-a", "node-b"])) == {"node-a": 10, "node-b": 10}


def test_herd_control_s_corrections_flow_through_the_combination(monkeypatch):
    """A burst of pods inside one sample: traffic lowers the score of each node it guesses a
    pod went to; with a second signal, every answer is the combination of what traffic alone
    answers at that point (the two extenders see the same pods, so their herds move alike)."""
    settings = {"default_pod_bytes_per_second": 2e7}
    alone = extender(monkeypatch, herd=True, **settings)
    second = Fixed({"node-a": 2, "node-b": 8, "node-c": 10, "node-d": 0}, weight=2.0)
    monkeypatch.undo()
    both = extender(monkeypatch, second, herd=True, **settings)
    answers = []
    for k in range(8):
        traffic = answer(alone, args_for(f"pod-{k}"))
        answers.append(traffic)
        assert answer(both, args_for(f"pod-{k}")) == {
            n: combined_score([(1.0, traffic[n]), (2.0, second.table.scores[n])]) for n in NAMES}
    assert answers[-1] != answers[0]   # herd control did correct traffic's scores
