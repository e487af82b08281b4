"""The bench's plots: SVG curves beside the tables, drawn from what the sections measured.

A section puts what a plot draws in its figure's `data["plots"]` with `plot(...)`: the plot's file
name, its axes and its series. Series of the same plot from several figures are drawn together
(figure 19's rates and 25g's on one chart). Drawing needs matplotlib, an optional bench
dependency (bench/requirements.txt, or the `bench` extra): without it the run prints and writes
its tables all the same and says the plots were skipped.

The SVGs keep their text as text (no embedded fonts, no glyph outlines) and carry no date, so
they stay a few tens of KB and a re-run with the same figures changes no byte.
"""
import json
import math
import os
import textwrap
from collections.abc import Iterable, Sequence

KINDS = ("line", "step", "bar")
SKIPPED = "plots skipped: matplotlib is not installed (pip install -r bench/requirements.txt)"


def plot(name: str, title: str, x: str, y: str, series: dict[str, dict], *, kind: str = "line",
         log_x: bool = False) -> dict:
    """{name: spec} for a figure's data["plots"]. `series`: label -> {"x": [...], "y": [...]},
    optionally "low"/"high" (the rounds' range, drawn as error bars); a bar plot's x are
    category names."""
    if kind not in KINDS:
        raise ValueError(f"kind {kind!r} is not one of {KINDS}")
    for label, values in series.items():
        if len(values["x"]) != len(values["y"]):
            raise ValueError(f"series {label!r}: {len(values['x'])} x for {len(values['y'])} y")
    return {name: {"title": title, "x": x, "y": y, "kind": kind, "log_x": log_x,
                   "series": {label: {k: list(v) for k, v in values.items()}
                              for label, values in series.items()}}}


def collect(figures: Iterable) -> dict[str, dict]:
    """Every plot the figures carry, series of the same plot from several figures merged."""
    plots: dict[str, dict] = {}
    for figure in figures:
        for name, spec in (figure.data.get("plots") or {}).items():
            if name not in plots:
                plots[name] = {**spec, "series": {}}
            for label, values in spec["series"].items():
                merged = plots[name]["series"].setdefault(label, {k: [] for k in values})
                for key, column in values.items():
                    merged.setdefault(key, []).extend(column)
    return plots


def write(figures: Iterable, directory: str, *, note: str = "") -> tuple[list[str], str]:
    """(paths written, what to tell the reader): one SVG per plot into `directory`."""
    plots = collect(figures)
    if not plots:
        return [], "no plots: no section that was run measures what they draw"
    try:
        import matplotlib
    except ImportError:
        return [], SKIPPED
    os.makedirs(directory, exist_ok=True)
    paths = []
    with matplotlib.rc_context({"svg.fonttype": "none", "svg.hashsalt": "archway-bench",
                                "font.size": 9, "axes.spines.top": False,
                                "axes.spines.right": False}):
        for name, spec in sorted(plots.items()):
            path = os.path.join(directory, f"{name}.svg")
            spec, told = _with_earlier_bars(os.path.join(directory, f"{name}.json"), spec, note)
            _draw(spec, told).savefig(path, format="svg", metadata={"Date": None})
            paths.append(path)
    return paths, f"{len(paths)} plots written to {directory}"


def _with_earlier_bars(record: str, spec: dict, note: str) -> tuple[dict, str]:
    """A bar plot gathers figures of several sections (19 and 19b in `kube`, 25g in `scale`),
    which runs of single sections measure apart: the bars this run did not measure are kept
    from the last run that did (NAME.json beside the SVG), and the note says so. A curve is
    always this run's alone."""
    earlier = {}
    if spec["kind"] == "bar" and os.path.exists(record):
        with open(record) as f:
            earlier = json.load(f)
    measured = {c for values in spec["series"].values() for c in values["x"]}
    kept = [c for c in dict.fromkeys(c for values in earlier.get("series", {}).values()
                                     for c in values["x"]) if c not in measured]
    if kept:
        series = {}
        for label in dict.fromkeys([*earlier["series"], *spec["series"]]):
            old = earlier["series"].get(label, {"x": []})
            new = spec["series"].get(label, {"x": []})
            rows = [(old, i) for i, c in enumerate(old["x"]) if c in kept]
            rows += [(new, i) for i in range(len(new["x"]))]
            keys = [k for k in ("x", "y", "low", "high")
                    if all(k in values for values, _ in rows)]
            series[label] = {k: [values[k][i] for values, i in rows] for k in keys}
        spec = {**spec, "series": series}
        note += f"; {', '.join(kept)} from an earlier run"
    if spec["kind"] == "bar":
        with open(record, "w") as f:
            json.dump(spec, f, indent=1)
    return spec, note


def _draw(spec: dict, note: str):
    from matplotlib.figure import Figure  # no pyplot: no global state, no GUI backend

    canvas = Figure(figsize=(6.4, 3.6))
    # Room below the axes for the note on the run (which constrained layout does not place).
    canvas.set_layout_engine("constrained", rect=(0, 0.05 if note else 0, 1, 0.95 if note else 1))
    ax = canvas.add_subplot()
    if spec["kind"] == "bar":
        _bars(ax, spec["series"])
    else:
        for label, values in spec["series"].items():
            _curve(ax, spec["kind"], label, values)
    if spec.get("log_x"):   # the measured sizes as plain numbers, not powers of ten
        from matplotlib.ticker import FixedLocator, NullFormatter
        ax.set_xscale("log")
        sizes = sorted({x for values in spec["series"].values() for x in values["x"]})
        if len(sizes) <= 8:
            ax.xaxis.set_major_locator(FixedLocator(sizes))
            ax.set_xticks(sizes, [f"{x:,.{0 if float(x).is_integer() else 2}f}" for x in sizes])
            ax.xaxis.set_minor_formatter(NullFormatter())
    ax.set_xlabel(spec["x"])
    ax.set_ylabel(spec["y"])
    ax.set_title(spec["title"], fontsize=10)
    ax.grid(True, alpha=0.3)
    if spec["series"]:
        ax.legend(fontsize=8, frameon=False)
    if note:
        canvas.text(0.01, 0.005, note, fontsize=7, color="0.4", ha="left", va="bottom")
    return canvas


def _errors(values: dict) -> list[list[float]] | None:
    if not values.get("low") or not values.get("high"):
        return None
    return [[max(0.0, y - lo) for y, lo in zip(values["y"], values["low"])],
            [max(0.0, hi - y) for y, hi in zip(values["y"], values["high"])]]


def _curve(ax, kind: str, label: str, values: dict) -> None:
    if kind == "step":
        ax.step(values["x"], values["y"], where="post", label=label)
        return
    errors = _errors(values)
    if errors:
        ax.errorbar(values["x"], values["y"], yerr=errors, marker="o", capsize=3, label=label)
    else:
        ax.plot(values["x"], values["y"], marker="o", label=label)


def _bars(ax, series: dict[str, dict]) -> None:
    """Grouped bars: one group per category (x), one bar per series."""
    categories: list[str] = []
    for values in series.values():
        categories += [c for c in values["x"] if c not in categories]
    width = 0.8 / max(1, len(series))
    for i, (label, values) in enumerate(series.items()):
        by_category = dict(zip(values["x"], values["y"]))
        heights = [by_category.get(c, math.nan) for c in categories]
        offsets = [k + (i - (len(series) - 1) / 2) * width for k in range(len(categories))]
        errors = _errors(values)
        if errors:   # error bars follow the series' own categories
            where = {c: k for k, c in enumerate(values["x"])}
            errors = [[e[where[c]] if c in where else 0.0 for c in categories] for e in errors]
        ax.bar(offsets, heights, width, label=label, yerr=errors, capsize=3 if errors else 0)
    # Wrapped: four or more categories' names would run into each other on one line.
    ax.set_xticks(range(len(categories)), [textwrap.fill(c, 16) for c in categories])


def cumulative(bounds_and_counts: dict[float, float]) -> tuple[Sequence[float], Sequence[float]]:
    """(bounds, share of observations <= bound) of a Prometheus histogram's cumulative
    buckets, +Inf left out: a CDF to draw as steps."""
    total = bounds_and_counts.get(math.inf, 0.0)
    bounds = sorted(b for b in bounds_and_counts if not math.isinf(b))
    if not total:
        return [], []
    return bounds, [bounds_and_counts[b] / total for b in bounds]
