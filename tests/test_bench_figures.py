"""The bench's steady figures (bench/common/rounds.py: interleaved rounds, median, spread, NOISY),
its scheduler rates from kube-scheduler's own /metrics (bench/common/scheduler_metrics.py) and
its plots (bench/common/plots.py, optional matplotlib). The bench itself is not a test: these
check the machinery, never a speed."""
import importlib
import math
import os
import sys
import time
import types
import xml.etree.ElementTree as ET

import pytest
import requests
import yaml

from bench.common import plots
from bench.common.passall import PassAllExtender, extender_url, point_extender
from bench.common.report import Figure, summary
from bench.common.rounds import blocks, interleaved, noise_bound, ratios, rounds, steady
from bench.common.scheduler_metrics import (
    MetricsScraper,
    Scrape,
    crossing,
    race_rate,
    scheduled_total,
    window_rate,
)
from lab.kube import pod_path

# --- rounds, median, spread, NOISY ----------------------------------------------------------------

def test_interleaved_rounds_take_turns_and_each_side_goes_first_in_turn():
    calls = []

    def side(name, value):
        def measure():
            calls.append(name)
            return value
        return measure
    values = interleaved({"a": side("a", 1.0), "b": side("b", 2.0)}, 3)
    assert calls == ["a", "b", "b", "a", "a", "b"]
    assert values == {"a": [1.0, 1.0, 1.0], "b": [2.0, 2.0, 2.0]}


def test_steady_median_spread_is_the_iqr_so_one_outlier_round_does_not_make_noise():
    s = steady([0.80, 0.90, 0.85, 0.88, 0.50])
    assert s.median == pytest.approx(0.85)
    assert s.spread == pytest.approx((0.88 - 0.80) / 0.85)     # 2nd to 4th of 5
    assert s.range == pytest.approx((0.90 - 0.50) / 0.85)
    assert not s.noisy(0.15) and s.noisy(0.05)
    assert steady([0.7, 0.9, 1.0]).spread == pytest.approx(0.3 / 0.9)   # 3 rounds: the range
    assert s.describe() == "0.85 ±9% (5 rounds: 0.50 to 0.90)"
    assert s.describe("{:.1f}", "x") == "0.8x ±9% (5 rounds: 0.5x to 0.9x)"
    assert steady([3.0]).spread == 0.0 and steady([3.0]).describe("{:+.1f}", " ms") == "+3.0 ms (1 round)"
    assert steady([-1.0, 1.0]).spread == math.inf      # a median of 0 with rounds apart


def test_ratios_are_taken_round_by_round():
    s = ratios([2.0, 3.0, 4.0], [1.0, 3.0, 0.0])
    assert s.values == (2.0, 1.0, math.inf)
    with pytest.raises(ValueError):
        ratios([1.0], [1.0, 2.0])


def test_blocks_cut_interleaved_samples_into_rounds():
    assert blocks(list(range(10)), 3) == [[0, 1, 2], [3, 4, 5], [6, 7, 8, 9]]
    assert blocks([1, 2], 5) == [[1], [2]]


def test_rounds_and_noise_bound_come_from_the_environment(monkeypatch):
    monkeypatch.delenv("BENCH_ROUNDS", raising=False)
    monkeypatch.delenv("BENCH_NOISE_BOUND", raising=False)
    assert rounds() == 5 and rounds(3) == 3 and noise_bound() == 0.15
    monkeypatch.setenv("BENCH_ROUNDS", "7")
    monkeypatch.setenv("BENCH_NOISE_BOUND", "0.3")
    assert rounds(3) == 7 and noise_bound() == 0.3


def test_a_figure_whose_rounds_spread_past_the_bound_is_noisy_not_pass_or_miss(monkeypatch):
    monkeypatch.delenv("BENCH_NOISE_BOUND", raising=False)
    tight = Figure("1", "t", "x", ">= 0.85", True, rounds=steady([0.88, 0.90, 0.86]))
    loose_pass = Figure("14", "l", "x", ">= 0.9", True, rounds=steady([0.70, 0.95, 1.10]))
    loose_miss = Figure("19", "m", "x", ">= 0.5", False, rounds=steady([0.2, 0.4, 0.6]))
    missed = Figure("18", "s", "x", "<= 3 ms", False, rounds=steady([5.0, 5.1, 5.2]))
    context = Figure("19b", "c", "x", "context", None, rounds=steady([0.1, 0.9]))
    figures = [tight, loose_pass, loose_miss, missed, context]
    assert [f.verdict for f in figures] == ["PASS", "NOISY", "NOISY", "MISS", "info"]
    assert [f.missed for f in figures] == [False, False, False, True, False]
    assert summary(figures) == "1/4 targets met; missed: 18; too noisy to judge: 14, 19"
    assert any(n.startswith("rounds: per round 0.70, 0.95, 1.10; median 0.95, spread (IQR/median) "
                            "42%") for n in loose_pass.notes)
    monkeypatch.setenv("BENCH_NOISE_BOUND", "0.5")      # a looser bound judges them again
    assert [f.verdict for f in figures] == ["PASS", "PASS", "NOISY", "MISS", "info"]


# --- kube-scheduler's own metrics ---------------------------------------------------------------

# The shape of kube-scheduler v1.37's /metrics (names, labels, histogram) for a scheduler with one
# profile, as scraped from the lab's control plane (test_the_real_kube_scheduler_... below; the
# histogram and the counter's series appear only once a pod was scheduled), buckets cut short.
SCHEDULER_METRICS = """# HELP scheduler_schedule_attempts_total [STABLE] Number of attempts to schedule pods, by the result. 'unschedulable' means a pod could not be scheduled, while 'error' means an internal scheduler problem.
# TYPE scheduler_schedule_attempts_total counter
scheduler_schedule_attempts_total{{profile="default-scheduler",result="error"}} 0
scheduler_schedule_attempts_total{{profile="default-scheduler",result="scheduled"}} {scheduled}
scheduler_schedule_attempts_total{{profile="default-scheduler",result="unschedulable"}} 2
# HELP scheduler_scheduling_attempt_duration_seconds [STABLE] Scheduling attempt latency in seconds (scheduling algorithm + binding)
# TYPE scheduler_scheduling_attempt_duration_seconds histogram
scheduler_scheduling_attempt_duration_seconds_bucket{{profile="default-scheduler",result="scheduled",le="0.001"}} {fast}
scheduler_scheduling_attempt_duration_seconds_bucket{{profile="default-scheduler",result="scheduled",le="0.002"}} {scheduled}
scheduler_scheduling_attempt_duration_seconds_bucket{{profile="default-scheduler",result="scheduled",le="+Inf"}} {scheduled}
scheduler_scheduling_attempt_duration_seconds_sum{{profile="default-scheduler",result="scheduled"}} 0.5
scheduler_scheduling_attempt_duration_seconds_count{{profile="default-scheduler",result="scheduled"}} {scheduled}
# HELP scheduler_scheduling_algorithm_duration_seconds Scheduling algorithm latency in seconds
# TYPE scheduler_scheduling_algorithm_duration_seconds histogram
scheduler_scheduling_algorithm_duration_seconds_bucket{{le="0.001"}} {fast}
scheduler_scheduling_algorithm_duration_seconds_bucket{{le="+Inf"}} {scheduled}
scheduler_scheduling_algorithm_duration_seconds_sum {algorithm}
scheduler_scheduling_algorithm_duration_seconds_count {scheduled}
scheduler_schedule_attempts_totally_other_metric 99
"""


def _scrape(at: float, scheduled: int, fast: int = 0) -> Scrape:
    return Scrape(at, SCHEDULER_METRICS.format(scheduled=scheduled, fast=fast,
                                               algorithm=scheduled * 0.002))


def test_scheduled_total_reads_the_scheduled_result_only_per_profile():
    text = SCHEDULER_METRICS.format(scheduled=250, fast=0, algorithm=0.5)
    assert scheduled_total(text) == 250
    assert scheduled_total(text, "default-scheduler") == 250
    assert scheduled_total(text, "archway") == 0


def test_crossings_are_interpolated_between_samples_and_the_window_rate():
    samples = [(0.0, 0.0), (1.0, 50.0), (2.0, 150.0), (3.0, 950.0), (4.0, 1000.0)]
    assert crossing(samples, 100.0) == pytest.approx(1.5)
    assert crossing(samples, 900.0) == pytest.approx(2.9375)
    assert window_rate(samples, 100.0, 900.0) == pytest.approx(800 / 1.4375)
    # The first look already past 10 %: from that look.
    assert window_rate([(0.0, 200.0), (1.0, 1000.0)], 100.0, 900.0) == pytest.approx(700 / 0.875)
    with pytest.raises(ValueError):
        window_rate([(0.0, 0.0), (1.0, 500.0)], 100.0, 900.0)


def test_race_rate_from_scrapes_counts_and_attempt_quantiles():
    scrapes = [_scrape(0.0, 0), _scrape(1.0, 100, 100), _scrape(2.0, 900, 500),
               _scrape(3.0, 1000, 600)]
    rate = race_rate(scrapes, 100, 900)
    assert rate.rate == pytest.approx(800.0)
    assert rate.attempts == 1000
    assert rate.attempt_p50_ms == pytest.approx(500 / 600)   # inside the first bucket, as Prometheus
    assert 1.0 < rate.attempt_p99_ms <= 2.0
    assert rate.algorithm_mean_ms == pytest.approx(2.0)     # the algorithm's sum / count delta


def test_the_real_kube_scheduler_counts_a_scheduled_pod_in_its_metrics(control_plane):
    """kube-scheduler v1.37 as the lab starts it (secure port, delegated authn/z): the admin
    token may read /metrics, the names are those above, and a bound pod counts."""
    kube = control_plane.kube
    scraper = MetricsScraper(control_plane.ports["scheduler"], kube.token)
    node = "bench-metrics-1"
    try:
        before = scraper.scrape()
        ns = control_plane.new_namespace("bench-metrics")
        # The session's control plane may still run an archway that would gate a pod whose
        # image it cannot read (x/y:1 is on no registry here), and other tests' Nodes may be
        # full or tainted: the pod is skipped by archway and goes to a Node of its own.
        if not kube.exists(f"/api/v1/nodes/{node}"):
            control_plane.add_node(node, "amd64", address="10.244.9.2")
        kube.create(pod_path(ns), {"apiVersion": "v1", "kind": "Pod", "metadata": {
            "name": "p", "annotations": {"archway.dev/skip": "true"}},
            "spec": {"containers": [{"name": "c", "image": "x/y:1"}],
                     "nodeSelector": {"kubernetes.io/hostname": node},
                     "tolerations": [{"operator": "Exists"}]}})
        end = time.monotonic() + 60
        while scheduled_total(scraper.scrape().text) < scheduled_total(before.text) + 1:
            assert time.monotonic() < end, "the scheduled pod never counted"
            time.sleep(0.2)
        assert kube.get(pod_path(ns, "p"))["spec"].get("nodeName")
        after = scraper.scrape()
        assert 'scheduler_scheduling_attempt_duration_seconds_bucket{' in after.text
        rate = race_rate([before, after], scheduled_total(before.text), scheduled_total(after.text))
        assert rate.attempts >= 1
        assert rate.algorithm_mean_ms > 0     # the algorithm's histogram (figure 19c's notes)
    finally:
        scraper.close()
        kube.delete(f"/api/v1/nodes/{node}")   # the later tests' Nodes are theirs alone


# --- the Go pass-all extender (figures 19c, 25j) -------------------------------------------------

def test_the_go_passall_extender_passes_every_node_and_the_scheduler_config_is_repointed(tmp_path):
    """The yardstick's answers as kube-scheduler reads them (nodeCacheCapable: names in, the
    same names out, nothing failed; prioritize: no scores), and the Go arm's configuration
    differs from archway's in its extender's urlPrefix only."""
    go = PassAllExtender(str(tmp_path / "go"))
    try:
        pod = {"metadata": {"name": "p", "namespace": "default"}, "spec": {}}
        names = [f"node-{i:03d}" for i in range(100)]
        with requests.Session() as http:
            http.trust_env = False
            answer = http.post(go.url + "/filter", json={"Pod": pod, "NodeNames": names},
                               timeout=10)
            assert answer.status_code == 200
            assert answer.json() == {"Nodes": None, "NodeNames": names, "FailedNodes": {},
                                     "FailedAndUnresolvableNodes": {}, "Error": ""}
            scores = http.post(go.url + "/prioritize", json={"Pod": pod, "NodeNames": names},
                               timeout=10)
            assert scores.status_code == 200 and scores.json() == []
            assert http.post(go.url + "/filter", data=b"{", timeout=10).status_code == 400
    finally:
        go.stop()

    class Plane:
        def path(self, *parts):
            return str(tmp_path.joinpath(*parts))
    config = {"profiles": [{"schedulerName": "archway-scheduler"}], "extenders": [
        {"urlPrefix": "http://127.0.0.1:8090/scheduler", "filterVerb": "filter",
         "nodeCacheCapable": True, "ignorable": True, "httpTimeout": "5s"}]}
    (tmp_path / "archway-scheduler.config.yaml").write_text(yaml.safe_dump(config))
    point_extender(Plane(), "archway-scheduler", go.url)
    assert extender_url(Plane(), "archway-scheduler") == go.url
    repointed = yaml.safe_load((tmp_path / "archway-scheduler.config.yaml").read_text())
    config["extenders"][0]["urlPrefix"] = go.url
    assert repointed == config


# --- plots --------------------------------------------------------------------------------------

LIFTED, LARGEST = "100 Nodes, client limits lifted (fig. 19b)", "5,000 Nodes, client limits lifted (fig. 25g)"


def _figures_with_plots() -> list[Figure]:
    rate = plots.plot("scheduling-rate", "pods scheduled per second", "", "pods/s", {
        "kube-scheduler": {"x": [LIFTED], "y": [800.0], "low": [700.0], "high": [900.0]},
        "archway": {"x": [LIFTED], "y": [300.0], "low": [250.0], "high": [320.0]}}, kind="bar",
        whiskers="the rounds' range")
    more = plots.plot("scheduling-rate", "", "", "", {
        "kube-scheduler": {"x": [LARGEST], "y": [70.0], "low": [60.0], "high": [75.0]},
        "archway": {"x": [LARGEST], "y": [30.0], "low": [29.0], "high": [33.0]}}, kind="bar")
    cdf_x, cdf_y = plots.cumulative({0.001: 50.0, 0.005: 99.0, 0.01: 100.0, 0.1: 100.0,
                                     10.0: 100.0, math.inf: 100.0})
    latency = plots.plot("admission-latency", "CDF", "ms", "share",
                         {"2 connections": {"x": [x * 1000 for x in cdf_x], "y": cdf_y}},
                         kind="step", log_x=True)
    memory = plots.plot("scale-memory", "RSS", "Nodes", "MB", {
        "webhook worker": {"x": [100, 1000, 5000], "y": [60.0, 64.0, 80.0],
                           "low": [58.0, 63.0, 79.0], "high": [60.0, 64.0, 80.0]},
        "extender worker": {"x": [100, 1000, 5000], "y": [50.0, 55.0, 70.0]}}, log_x=True,
        whiskers="down to the smallest")
    return [Figure("19b", "r", "x", "t", None, data={"plots": rate}),
            Figure("25g", "r", "x", "t", None, data={"plots": more}),
            Figure("2", "l", "x", "t", True, data={"plots": {**latency, **memory}}),
            Figure("3", "none", "x", "t", True)]


def test_plot_series_of_one_plot_from_several_figures_are_merged():
    collected = plots.collect(_figures_with_plots())
    assert sorted(collected) == ["admission-latency", "scale-memory", "scheduling-rate"]
    assert collected["scheduling-rate"]["series"]["archway"]["x"] == [LIFTED, LARGEST]
    assert collected["scheduling-rate"]["title"] == "pods scheduled per second"
    assert plots.cumulative({0.001: 1.0, math.inf: 4.0}) == ([0.001], [0.25])
    with pytest.raises(ValueError):
        plots.plot("p", "t", "x", "y", {"s": {"x": [1, 2], "y": [1]}})


@pytest.mark.parametrize("label, category", [("archway", "19b"), ("archway", "25g: 5,000 Nodes"),
                                             ("19: archway", "100 Nodes (fig. 19)")])
def test_a_plot_refuses_a_bare_figure_id_as_a_name(label, category):
    """A reader of the docs does not know "25g": a bar's category and a series are named in
    words, the figure beside."""
    with pytest.raises(ValueError, match="figure id"):
        plots.plot("p", "t", "x", "y", {label: {"x": [category], "y": [1.0]}}, kind="bar")
    plots.plot("p", "t", "x", "y", {"archway": {"x": ["1,000 Nodes (fig. 25g)"], "y": [1.0]}},
               kind="bar")


def test_the_sections_name_their_bars_in_words_with_the_figure_beside():
    from bench.sections.scale import figures as scale_figures
    found = {"rates": {"kube-scheduler": [100.0, 90.0], "archway-scheduler": [80.0, 85.0]},
             "details": "d", "load": "1 1 1"}
    figure = scale_figures._at_largest("25g", 5000, found, scale_figures._schedule)
    bars = figure.data["plots"]["scheduling-rate"]["series"]["kube-scheduler + archway's extender"]
    assert bars == {"x": [LARGEST], "y": [82.5], "low": [80.0], "high": [85.0]}


def test_the_scale_curves_carry_the_spread_their_section_measured():
    import bench.sections.scale as scale
    from bench.sections.scale import figures as scale_figures
    startup = {"p50": 0.1, "p99": 0.5, "create_p99": 0.1, "p99_blocks": [0.4, 0.5, 0.7]}
    sizes = [{"nodes": 100, "startup": {"admitted": startup, "skipped": startup},
              "rss": {"webhook": [68e6, 70e6], "controller": [61e6], "extender": [63e6]}}]
    curve = scale_figures.startup_plot(sizes)["scale-startup"]["series"]["pods archway admits"]
    assert (curve["y"], curve["low"], curve["high"]) == ([0.5], [0.4], [0.7])
    del startup["p99_blocks"]                   # a run before the blocks: no whiskers claimed
    assert "low" not in scale_figures.startup_plot(sizes)["scale-startup"]["series"][
        "pods archway admits"]
    rss = scale.memory_plot(sizes)["scale-memory"]["series"]["webhook worker"]
    assert (rss["y"], rss["low"], rss["high"]) == ([70.0], [68.0], [70.0])


def _drawn(spec_name: str):
    """A plot of the fixtures drawn and laid out, and its axes."""
    canvas = plots._draw(plots.collect(_figures_with_plots())[spec_name], "bench run, load 9")
    canvas.draw_without_rendering()
    return canvas, canvas.axes[0]


def test_a_cdf_axis_ends_where_its_data_does_not_at_the_last_bucket():
    pytest.importorskip("matplotlib", reason="matplotlib is an optional bench dependency")
    series = plots.collect(_figures_with_plots())["admission-latency"]["series"]
    # all in by 10 ms; the bounds 100 ms and 10 s held nothing more: the axis ends at 100
    assert plots.cdf_end(series) == 100.0
    _, ax = _drawn("admission-latency")
    assert ax.get_xlim()[1] == 100.0 and ax.get_xscale() == "log"
    assert [t.get_text() for t in ax.get_xticklabels()] == ["1", "5", "10", "100"]


def test_spread_is_drawn_as_whiskers_where_a_series_has_it_and_named_in_the_title():
    pytest.importorskip("matplotlib", reason="matplotlib is an optional bench dependency")
    from matplotlib.container import BarContainer, ErrorbarContainer
    canvas, ax = _drawn("scale-memory")
    whiskered = [c.get_label() for c in ax.containers if isinstance(c, ErrorbarContainer)]
    assert whiskered == ["webhook worker"]      # the extender's curve has no low/high
    assert ax.get_title().replace("\n", " ") == "RSS; whiskers: down to the smallest"
    legend = canvas.subfigs[0].legends[0]
    assert [t.get_text() for t in legend.get_texts()] == ["webhook worker", "extender worker"]
    # two series with whiskers at the same sizes: drawn a little apart, the ticks where measured
    spec = plots.collect(_figures_with_plots())["scale-memory"]
    spec["series"]["extender worker"] |= {"low": [49.0, 54.0, 69.0], "high": [51.0, 56.0, 71.0]}
    ax = plots._draw(spec, "").axes[0]
    webhook, extender = (list(c.lines[0].get_xdata()) for c in ax.containers)
    assert webhook[0] < 100 < extender[0] and list(ax.get_xticks()) == [100, 1000, 5000]
    _, ax = _drawn("scheduling-rate")
    bars = [c for c in ax.containers if isinstance(c, BarContainer)]
    assert len(bars) == 2 and all(b.errorbar is not None for b in bars)
    plain = plots._draw({**plots.collect(_figures_with_plots())["admission-latency"],
                         "whiskers": "never drawn"}, "")
    assert "whiskers" not in plain.axes[0].get_title()     # no series has a spread


def test_long_titles_footers_and_names_wrap_and_nothing_leaves_the_canvas():
    pytest.importorskip("matplotlib", reason="matplotlib is an optional bench dependency")
    long = "pods scheduled per second with and without archway's extender, " * 4
    spec = {**plots.collect(_figures_with_plots())["scheduling-rate"], "title": long,
            "x": "cluster size and client limits " * 3, "y": "pods scheduled per second " * 3}
    canvas = plots._draw(spec, "bench run 2026-11-29 04:57 UTC, 2 cores, load average 3.98: a "
                         "loaded machine, figures noisy; from an earlier run: " + LIFTED * 3)
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    renderer = FigureCanvasAgg(canvas).get_renderer()
    canvas.draw(renderer)
    frame = canvas.bbox
    texts = [t for t in canvas.findobj(lambda a: hasattr(a, "get_text")) if t.get_text().strip()]
    assert canvas.axes[0].get_title().count("\n") >= 2
    assert len(texts) > 10
    for text in texts:
        box = text.get_window_extent(renderer)
        assert (box.x0 >= frame.x0 - 0.5 and box.x1 <= frame.x1 + 0.5 and box.y0 >= frame.y0 - 0.5
                and box.y1 <= frame.y1 + 0.5), f"{text.get_text()!r} leaves the canvas: {box}"
    # and the legend, outside the axes, covers none of them
    legend = canvas.subfigs[0].legends[0].get_window_extent(renderer)
    assert not legend.overlaps(canvas.axes[0].get_window_extent(renderer))


def test_the_plot_writer_makes_small_valid_svgs_with_the_series_and_no_fonts(tmp_path):
    pytest.importorskip("matplotlib", reason="matplotlib is an optional bench dependency "
                        "(~120 MB with numpy, pillow, fonttools): pip install -r bench/requirements.txt")
    paths, told = plots.write(_figures_with_plots(), str(tmp_path), note="bench run, load 9 on 2 cores")
    assert told == f"3 plots written to {tmp_path}"
    assert sorted(os.path.basename(p) for p in paths) == [
        "admission-latency.svg", "scale-memory.svg", "scheduling-rate.svg"]
    for path in paths:
        with open(path) as f:
            text = f.read()
        root = ET.fromstring(text)
        assert root.tag == "{http://www.w3.org/2000/svg}svg"
        assert len(text) < 60_000, f"{path}: {len(text)} bytes"
        assert "@font-face" not in text and "<font" not in text
        assert "bench run, load 9 on 2 cores" in text
        # an opaque white canvas first: readable on a dark page
        assert root.find("{*}g/{*}g/{*}path").get("style") == "fill: #ffffff"
    with open(tmp_path / "scheduling-rate.svg") as f:
        rate = f.read()
    for label in ("kube-scheduler", "archway", "(fig. 19b)", "(fig. 25g)"):
        assert f">{label}<" in rate or f" {label}<" in rate, label
    with open(tmp_path / "scale-memory.svg") as f:
        memory = f.read()
    assert ">webhook worker<" in memory and ">extender worker<" in memory
    # The same figures drawn again: the same bytes (no date, fixed ids).
    again, _ = plots.write(_figures_with_plots(), str(tmp_path / "again"), note="bench run, load 9 on 2 cores")
    with open(again[0]) as a, open(paths[0]) as b:
        assert a.read() == b.read()


def test_the_plots_are_drawn_again_from_their_records_without_a_run(tmp_path):
    pytest.importorskip("matplotlib", reason="matplotlib is an optional bench dependency")
    paths, _ = plots.write(_figures_with_plots(), str(tmp_path), note="bench run, load 9 on 2 cores")
    written = {p: open(p).read() for p in paths}
    for p in paths:
        os.remove(p)
    assert sorted(plots.redraw(str(tmp_path))) == sorted(paths)
    assert {p: open(p).read() for p in paths} == written


def test_a_bar_plot_keeps_the_bars_an_earlier_run_measured_and_this_one_did_not(tmp_path):
    pytest.importorskip("matplotlib", reason="matplotlib is an optional bench dependency")
    kube, scale, curves = _figures_with_plots()[:3]   # 19b (section kube), 25g (section scale)
    plots.write([kube], str(tmp_path), note="run 1")
    plots.write([scale], str(tmp_path), note="run 2")
    record = plots.json.loads((tmp_path / "scheduling-rate.json").read_text())
    assert record["series"]["archway"]["x"] == [LIFTED, LARGEST]
    assert record["note"] == f"run 2; from an earlier run: {LIFTED}"
    kube.data["plots"]["scheduling-rate"]["series"]["archway"]["y"] = [310.0]
    plots.write([kube], str(tmp_path), note="run 3")     # 19b measured again: this run's value
    record = (tmp_path / "scheduling-rate.json").read_text()
    merged = plots.json.loads(record)["series"]["archway"]
    assert merged["x"] == [LARGEST, LIFTED] and merged["y"] == [30.0, 310.0]
    plots.write([curves], str(tmp_path), note="run 4")
    curves.data["plots"]["scale-memory"]["series"].pop("extender worker")
    plots.write([curves], str(tmp_path), note="run 5")
    kept = plots.json.loads((tmp_path / "scale-memory.json").read_text())    # curves: this run's alone
    assert list(kept["series"]) == ["webhook worker"] and kept["note"] == "run 5"


def test_without_matplotlib_the_run_prints_its_table_and_says_plots_were_skipped(
        tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)      # import matplotlib -> ImportError
    for name in ("BENCH_ROUNDS", "BENCH_NOISE_BOUND"):        # main sets them: restored after
        monkeypatch.delenv(name, raising=False)
    fake = types.ModuleType("bench.sections.fake")
    fake.run = lambda lab: _figures_with_plots()
    monkeypatch.setitem(sys.modules, "bench.sections.fake", fake)
    main = importlib.import_module("bench.__main__")
    monkeypatch.setattr(main, "SECTIONS", {"fake": "fake"})
    status = main.main(["--output", str(tmp_path / "latest.md"), "--plots", str(tmp_path / "plots"),
                        "--rounds", "3", "--noise-bound", "0.2"])
    out = capsys.readouterr().out
    assert status == 0
    assert "| 19b |" in out and "| 25g |" in out
    assert plots.SKIPPED in out
    assert not (tmp_path / "plots").exists()
    assert (tmp_path / "latest.md").read_text().startswith("# archway benchmark results")
    assert os.environ["BENCH_ROUNDS"] == "3" and os.environ["BENCH_NOISE_BOUND"] == "0.2"


# --- the extender's own work: CPU pinning and CPU per call (bench/common/pinning.py) -----------

SPINNER = """
import subprocess, sys, threading, time
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
def spin():
    end = time.thread_time() + float(sys.argv[1])
    while time.thread_time() < end:
        pass
    print("spun", flush=True)
threading.Thread(target=spin, daemon=True).start()
print(child.pid, flush=True)
sys.stdin.readline()                  # the test pins the tree, then asks for one more thread
threading.Thread(target=time.sleep, args=(30,), daemon=True).start()
print("started", flush=True)
time.sleep(60)
"""


@pytest.fixture
def spinner():
    """A process with a thread spinning 0.3 s of CPU, a child process, and one more thread on
    request."""
    import subprocess
    proc = subprocess.Popen([sys.executable, "-c", SPINNER, "0.3"], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    try:
        yield proc, int(proc.stdout.readline())
    finally:
        proc.kill()
        proc.wait(5)


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="one CPU: nothing to pin apart")
def test_pinning_puts_every_thread_of_a_process_tree_and_later_threads_on_its_cpus(spinner):
    import subprocess

    from bench.common.pinning import pin, process_tree, tasks
    proc, child = spinner
    cpu = max(os.sched_getaffinity(0))
    assert process_tree(proc.pid) == [proc.pid, child]
    pin(proc.pid, {cpu})
    proc.stdin.write("\n")
    proc.stdin.flush()
    while proc.stdout.readline().strip() != "started":
        pass
    threads = tasks(proc.pid)
    assert len(threads) >= 3   # main, spinner (or gone), the one started after pinning
    for pid in (proc.pid, child):
        for task in tasks(pid):
            assert os.sched_getaffinity(task) == {cpu}, (pid, task)
    shown = subprocess.run(["taskset", "-p", str(child)], capture_output=True, text=True,
                           check=True).stdout
    assert shown.strip().endswith(f"{1 << cpu:x}"), shown


def test_cpu_per_call_reads_a_process_cpu_to_the_nanosecond(spinner):
    from bench.common.pinning import cpu_ns
    from bench.common.servers import cpu_seconds
    proc, child = spinner
    while proc.stdout.readline().strip() != "spun":
        pass
    spent = cpu_ns(proc.pid) / 1e9
    assert 0.3 <= spent < 0.6, spent
    assert abs(spent - cpu_seconds(proc.pid)) < 0.05    # /proc/PID/stat's ticks agree
    assert cpu_ns(child) < 0.1e9                         # a sleeping process: next to nothing


def test_without_a_second_cpu_or_with_bench_pin_0_nothing_is_pinned(monkeypatch):
    from bench.common.pinning import CpuSplit
    monkeypatch.setenv("BENCH_PIN", "0")
    assert CpuSplit.of_machine() is None
    monkeypatch.setenv("BENCH_PIN", "1")
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0})
    assert CpuSplit.of_machine() is None
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    split = CpuSplit.of_machine()
    assert split is not None and (split.server, split.others) == ({1}, {0})
