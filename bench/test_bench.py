"""Checks of the bench's own pure helpers (statistics, table, profile summary, log parsing).

Not part of archway's test suite and not timed: `python3 -m pytest bench/test_bench.py -q`.
"""
import math

import pytest

from bench.profile import summarize
from bench.report import Figure, failed_figure, summary, table
from bench.stats import (
    bucket_difference,
    histogram_buckets,
    histogram_quantile,
    median,
    parse_metrics,
    percentile,
    share_at_most,
)

EXPOSITION = """# HELP archway_admission_duration_seconds Time to answer
# TYPE archway_admission_duration_seconds histogram
archway_admission_duration_seconds_bucket{le="0.005"} 90.0
archway_admission_duration_seconds_bucket{le="0.01"} 99.0
archway_admission_duration_seconds_bucket{le="+Inf"} 100.0
archway_admission_duration_seconds_count 100.0
archway_extender_duration_seconds_bucket{le="0.005",verb="filter"} 1.0
archway_extender_duration_seconds_bucket{le="+Inf",verb="filter"} 2.0
archway_admissions_total{outcome="mutated"} 7.0
"""


def test_percentile_is_an_observed_value_by_nearest_rank():
    samples = [5, 1, 4, 2, 3, 10, 9, 8, 7, 6]
    assert percentile(samples, 50) == 5
    assert percentile(samples, 99) == 10
    assert percentile(samples, 10) == 1
    with pytest.raises(ValueError):
        percentile([], 50)


def test_median_of_odd_and_even_counts():
    assert median([3, 1, 2]) == 2
    assert median([4, 1, 3, 2]) == 2.5


def test_parse_metrics_reads_labels_and_values():
    samples = parse_metrics(EXPOSITION)
    assert ("archway_admissions_total", {"outcome": "mutated"}, 7.0) in samples
    assert all(not name.startswith("#") for name, _, _ in samples)


def test_histogram_buckets_filter_by_label_and_share_at_most():
    buckets = histogram_buckets(EXPOSITION, "archway_admission_duration_seconds")
    assert buckets == {0.005: 90.0, 0.01: 99.0, math.inf: 100.0}
    assert share_at_most(buckets, 0.005) == 0.9
    extender = histogram_buckets(EXPOSITION, "archway_extender_duration_seconds", verb="filter")
    assert extender == {0.005: 1.0, math.inf: 2.0}
    assert histogram_buckets(EXPOSITION, "archway_extender_duration_seconds", verb="x") == {}


def test_bucket_difference_keeps_only_new_observations():
    before = {0.005: 10.0, math.inf: 10.0}
    after = {0.005: 15.0, math.inf: 20.0}
    assert bucket_difference(after, before) == {0.005: 5.0, math.inf: 10.0}


def test_histogram_quantile_interpolates_like_prometheus():
    buckets = {0.005: 90.0, 0.01: 99.0, math.inf: 100.0}
    assert histogram_quantile(buckets, 0.5) == pytest.approx(0.005 * 50 / 90)
    assert histogram_quantile(buckets, 0.95) == pytest.approx(0.005 + 0.005 * 5 / 9)
    assert histogram_quantile(buckets, 0.999) == 0.01   # in +Inf: the highest finite bound
    assert math.isnan(histogram_quantile({math.inf: 0.0}, 0.5))


def test_table_and_summary_show_every_verdict():
    figures = [Figure("1", "speed", "0.9", ">= 0.85", True),
               Figure("1b", "context", "x", "-", None),
               failed_figure("2", "latency", "< 5 ms", RuntimeError("server exited\nlog..."))]
    text = table(figures)
    assert text.splitlines()[0].startswith("| # ")
    assert "PASS" in text and "info" in text and "MISS" in text
    assert "not measured (RuntimeError: server exited)" in text
    assert summary(figures) == "1/2 targets met; missed: 2"


def test_profile_summary_counts_inclusive_and_self_samples():
    collapsed = ("main (app.py:1);handle (w.py:5);decide (placement.py:9) 30\n"
                 "main (app.py:1);handle (w.py:5) 10\n"
                 "main (app.py:1);log (logging/__init__.py:3) 60\n")
    text = summarize(collapsed, top=3)
    assert "100 samples" in text
    assert "100.0%  main (app.py)" in text           # inclusive: on every stack
    assert " 60.0%  log (__init__.py)" in text      # self: top of 60 samples
    assert " 40.0%  handle (w.py)" in text


def test_log_line_patterns_match_what_archway_logs():
    from bench.servers import _ADMISSION_LINE, _FILTER_LINE
    admission = ("2026-11-22 07:45:00,520 INFO archway.admission: admission shop/web-7d9c5b8f6d-* "
                 "uid=0d6b images=1 archs=amd64,arm,arm64 outcome=mutated (required node affinity "
                 "kubernetes.io/arch In amd64, arm, arm64) warnings=0 0.4 ms")
    assert _ADMISSION_LINE.search(admission)["ms"] == "0.4"
    assert _ADMISSION_LINE.search(admission + " dry-run")["ms"] == "0.4"
    assert _ADMISSION_LINE.search("INFO archway.admission: rejected a malformed request") is None
    extender = ("2026-11-22 08:00:00,000 INFO archway.extender: filter shop/web-x: archs=amd64 "
                "from annotation, 2500/5000 nodes pass (741.2 ms)")
    assert _FILTER_LINE.search(extender)["ms"] == "741.2"


APISERVER = """apiserver_request_duration_seconds_bucket{resource="pods",subresource="",verb="POST",le="0.025"} 3
apiserver_request_duration_seconds_bucket{resource="pods",subresource="",verb="POST",le="0.1"} 9
apiserver_request_duration_seconds_bucket{resource="pods",subresource="",verb="POST",le="+Inf"} 10
apiserver_request_duration_seconds_sum{resource="pods",subresource="",verb="POST"} 0.5
apiserver_request_duration_seconds_count{resource="pods",subresource="",verb="POST"} 10
apiserver_request_duration_seconds_bucket{resource="pods",subresource="binding",verb="POST",le="+Inf"} 99
apiserver_request_duration_seconds_count{resource="pods",subresource="binding",verb="POST"} 99
"""


def test_the_scale_sections_apiserver_histograms_and_its_figures_at_one_size():
    from bench import scale, scale_figures
    from bench.scale_load import POST_PODS, bucket_quantile, delta, histogram, summary
    h = histogram(APISERVER, "apiserver_request_duration_seconds", **POST_PODS)
    assert h == {"buckets": {0.025: 3, 0.1: 9, float("inf"): 10}, "sum": 0.5, "count": 10}
    assert bucket_quantile(h, 0.5) == 0.1 and bucket_quantile(h, 0.99) == float("inf")
    assert delta(h, h)["count"] == 0 and summary(delta(h, h)) == "no calls"
    # One size (ARCHWAY_SCALE_SIZES=300) formats without dividing by the sizes' span.
    kinds = ("webhook", "controller", "extender", "masters")
    size = {"nodes": 300, "ready_s": 10, "rss": {k: [60e6] for k in kinds}, "burst_s": 5,
            "cpu_rest": dict.fromkeys(kinds, 0.0), "cpu_burst": dict.fromkeys(kinds, 0.1),
            "rest_load": "1 1 1", "requests": {}, "at_rest": {"per_minute": 78.0, "by_kind": {}},
            "startup": {"admitted": {"p50": 1, "p99": 2.5, "create_p99": 0.1},
                        "skipped": {"p50": 1, "p99": 2.0, "create_p99": 0.1}, "load": "1 1 1"},
            "apiserver": {"skipped": h, "admitted": h, "webhook": h, "load": "1 1 1"},
            "events": {"relist": {"error": "RuntimeError: x"}}}
    figures = [scale._memory_figure([size]), scale._requests_figure([size]),
               *scale_figures.figures([size])]
    verdicts = {f.number: f.verdict for f in figures}
    assert verdicts["25b"] == "MISS" and verdicts["25"] == "PASS"    # p99 ratio 1.25
    assert verdicts["25e"] == "MISS" and "RuntimeError: x" in figures[5].measured
