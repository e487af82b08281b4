"""archway/deadline.py: when an admission's answer is due, from the request's arrival and the
apiserver's `?timeout=`. Pure: no clock, no I/O."""
import pytest
from hypothesis import given
from hypothesis import strategies as st

from archway.deadline import (
    CALLER_MARGIN_SECONDS,
    answer_by,
    caller_timeout,
    parse_go_duration,
    share_of,
)

NOW = 1000.0


@pytest.mark.parametrize("text, seconds", [
    ("5s", 5.0), ("10s", 10.0), ("1m0s", 60.0), ("1m30s", 90.0), ("1h", 3600.0),
    ("1.5s", 1.5), (".5s", 0.5), ("1.s", 1.0), ("250ms", 0.25), ("2us", 2e-6),
    ("2\u00b5s", 2e-6), ("2\u03bcs", 2e-6), ("7ns", 7e-9), ("1m0.5s", 60.5), ("0s", 0.0),
])
def test_go_durations_as_time_duration_writes_them(text, seconds):
    assert parse_go_duration(text) == pytest.approx(seconds)


@pytest.mark.parametrize("text", [
    "", "5", "s", "-5s", "+5s", "5S", "5 s", " 5s", "5s ", "5x", "1e3s", "inf", "nans", "5s5",
    "\u0665s",            # an Arabic-Indic five: a digit to Python, not to Go
    "1" * 70 + "s",       # longer than any duration the apiserver writes
    "5s;rm", "5..5s", "ms",
])
def test_anything_else_is_no_duration(text):
    assert parse_go_duration(text) is None


@pytest.mark.parametrize("query, seconds", [
    ("timeout=5s", 5.0),
    ("dryRun=All&timeout=10s", 10.0),
    ("timeout=%35s", 5.0),                  # percent-encoded
    ("timeout=5s&timeout=2s", 2.0),         # several: the shortest
    ("timeout=bogus&timeout=3s", 3.0),      # the bad one is ignored
    ("", None), ("timeout", None), ("timeout=", None), ("timeout=bogus", None),
    ("timeout=0s", None), ("timeout=-1s", None), ("xtimeout=5s", None), ("timeout=5", None),
    ("timeout=%ff%fe", None), ("&&&=&timeout&=", None),
])
def test_the_callers_timeout_from_the_query_string(query, seconds):
    assert caller_timeout(query) == (pytest.approx(seconds) if seconds is not None else None)


def test_a_request_taken_at_once_gets_archways_own_deadline():
    assert answer_by(NOW, NOW, 3.0, None) == NOW + 3.0
    assert answer_by(NOW, NOW, 3.0, 10.0) == NOW + 3.0       # the apiserver waits longer


def test_a_request_that_waited_gets_what_is_left():
    assert answer_by(NOW, NOW - 2.0, 3.0, 5.0) == NOW + 1.0


def test_a_request_that_waited_past_its_deadline_is_due_now_or_earlier():
    assert answer_by(NOW, NOW - 4.0, 3.0, 5.0) <= NOW


def test_the_apiservers_timeout_less_the_margin_bounds_it():
    assert answer_by(NOW, NOW, 3.0, 2.0) == NOW + 2.0 - 0.5      # a quarter of a short one
    assert answer_by(NOW, NOW, 10.0, 5.0) == NOW + 5.0 - CALLER_MARGIN_SECONDS
    assert answer_by(NOW, NOW - 3.5, 10.0, 5.0) == NOW + 0.5


def test_an_arrival_not_on_this_clock_counts_from_now():
    assert answer_by(NOW, None, 3.0, None) == NOW + 3.0
    assert answer_by(NOW, NOW + 50.0, 3.0, None) == NOW + 3.0


@given(waited=st.floats(0, 100), deadline=st.floats(0.1, 30), timeout=st.floats(0.001, 60))
def test_the_answer_is_never_due_after_either_bound(waited, deadline, timeout):
    arrived = NOW - waited
    due = answer_by(NOW, arrived, deadline, timeout)
    assert arrived <= due <= arrived + deadline + 1e-9
    assert due < arrived + timeout    # the margin is kept from the apiserver's timeout


def test_a_share_of_the_time_left():
    assert share_of(NOW, NOW + 2.0, 0.4) == pytest.approx(NOW + 0.8)
    assert share_of(NOW, NOW - 1.0, 0.4) == NOW         # none left: nothing to share
