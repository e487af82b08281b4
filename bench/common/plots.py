"""The bench's plots: SVG curves beside the tables, drawn from what the sections measured.

A section puts what a plot draws in its figure's `data["plots"]` with `plot(...)`: the plot's file
name, its axes and its series. Series of the same plot from several figures are drawn together
(figure 19's rates and 25g's on one chart). Drawing needs matplotlib, an optional bench
dependency (bench/requirements.txt, or the `bench` extra): without it the run prints and writes
its tables all the same and says the plots were skipped.

The SVGs keep their text as text (no embedded fonts, no glyph outlines) and carry no date, so
they stay a few tens of KB and a re-run with the same figures changes no byte. They are for a
reader of the docs: series and categories named in words (a bare figure id is refused), titles
and footers wrapped to the canvas, legends outside the axes, a CDF's axis ending where its data
does, and the spread a section measured (`low`/`high`) drawn as whiskers. Each SVG's spec and
footer are kept as NAME.json beside it: `python3 -m bench.common.plots [DIRECTORY]` draws them
again (after a change to the drawing) without a bench run.
"""
import json
import math
import os
import re
import sys
import textwrap
from collections.abc import Iterable, Sequence

KINDS = ("line", "step", "bar")
SKIPPED = "plots skipped: matplotlib is not installed (pip install -r bench/requirements.txt)"
WIDTH, HEIGHT = 6.4, 3.6          # inches: the canvas, 460 x 260 pt
BARE_ID = re.compile(r"^\d+[a-z]?(:|$)")   # "25g: 1,000 Nodes", "19b": a figure id as a name
# DejaVu Sans averages ~0.55 em a character: at 0.6 a wrapped line fits with room to spare.
EM_PER_CHAR = 0.6
MARKERS = ("o", "s", "^", "D")    # and sizes falling: a series drawn over another shows it


def plot(name: str, title: str, x: str, y: str, series: dict[str, dict], *, kind: str = "line",
         log_x: bool = False, whiskers: str = "") -> dict:
    """{name: spec} for a figure's data["plots"]. `series`: label -> {"x": [...], "y": [...]},
    optionally "low"/"high" (a spread, drawn as whiskers; `whiskers` says what they span, in
    the title when drawn); a bar plot's x are category names. Labels and categories are words,
    the figure's number beside them ("1,000 Nodes (fig. 25g)"): a reader of the docs does not
    know "25g"."""
    if kind not in KINDS:
        raise ValueError(f"kind {kind!r} is not one of {KINDS}")
    for label, values in series.items():
        if len(values["x"]) != len(values["y"]):
            raise ValueError(f"series {label!r}: {len(values['x'])} x for {len(values['y'])} y")
        names = [label, *(values["x"] if kind == "bar" else [])]
        if bare := [n for n in names if BARE_ID.match(str(n))]:
            raise ValueError(f"series {label!r}: {bare[0]!r} starts with a figure id; name it "
                             "in words, the figure beside (\"... (fig. 19b)\")")
    return {name: {"title": title, "x": x, "y": y, "kind": kind, "log_x": log_x,
                   "whiskers": whiskers,
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
    for name, spec in sorted(plots.items()):
        record = os.path.join(directory, f"{name}.json")
        spec, told = _with_earlier_bars(record, spec, note)
        with open(record, "w") as f:
            json.dump({**spec, "note": told}, f, indent=1)
        paths.append(_save(matplotlib, spec, told, os.path.join(directory, f"{name}.svg")))
    return paths, f"{len(paths)} plots written to {directory}"


def redraw(directory: str) -> list[str]:
    """Every NAME.json of `directory` drawn again as NAME.svg, with the footer of its run."""
    import matplotlib
    paths = []
    for name in sorted(n for n in os.listdir(directory) if n.endswith(".json")):
        with open(os.path.join(directory, name)) as f:
            spec = json.load(f)
        note = spec.pop("note", "")
        paths.append(_save(matplotlib, spec, note,
                           os.path.join(directory, name.removesuffix(".json") + ".svg")))
    return paths


def _save(matplotlib, spec: dict, note: str, path: str) -> str:
    with matplotlib.rc_context({"svg.fonttype": "none", "svg.hashsalt": "archway-bench",
                                "font.size": 9, "axes.spines.top": False,
                                "axes.spines.right": False,
                                # opaque: readable on GitHub's dark theme too
                                "figure.facecolor": "white", "savefig.facecolor": "white",
                                "savefig.transparent": False}):
        _draw(spec, note).savefig(path, format="svg", metadata={"Date": None})
    return path


def _with_earlier_bars(record: str, spec: dict, note: str) -> tuple[dict, str]:
    """A bar plot gathers figures of several sections (19 and 19b in `kube`, 25g in `scale`),
    which runs of single sections measure apart: the bars this run did not measure are kept
    from the last run that did (NAME.json beside the SVG), and the note says so. A curve is
    always this run's alone (its NAME.json only lets it be drawn again)."""
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
        note += f"; from an earlier run: {'; '.join(kept)}"   # names hold commas
    return spec, note


def _fill(text: str, fontsize: float, width_pt: float) -> str:
    """`text` wrapped to lines that fit `width_pt` at `fontsize`."""
    return textwrap.fill(text, max(8, int(width_pt / (fontsize * EM_PER_CHAR))))


def _draw(spec: dict, note: str):
    from matplotlib.figure import Figure  # no pyplot: no global state, no GUI backend

    width_pt = WIDTH * 72
    note = _fill(note, 7, width_pt - 10)
    # The footer on the run in a strip of its own, as high as it wraps to: the layout puts a
    # figure's legend at its bottom edge, where a footer in the same figure would lie.
    footer = (note.count("\n") + 1) * 7 * 1.25 / 72 + 0.04 if note else 0.0
    canvas = Figure(figsize=(WIDTH, HEIGHT + footer), layout="constrained")
    chart, strip = canvas.subfigures(2, 1, height_ratios=[HEIGHT, footer or 1e-9])
    ax = chart.add_subplot()
    if spec["kind"] == "bar":
        _bars(ax, spec["series"], width_pt)
    else:
        # Whiskers of several series at the same x drawn a little apart, or they hide each other.
        whiskered = [label for label, values in spec["series"].items() if _errors(values)]
        for i, (label, values) in enumerate(spec["series"].items()):
            k = whiskered.index(label) - (len(whiskered) - 1) / 2 if label in whiskered else 0
            _curve(ax, spec["kind"], i, label, values, 1.03 ** k if spec.get("log_x") else 1.0)
    if spec.get("log_x"):
        _log_axis(ax, spec)
    ax.set_xlabel(_fill(spec["x"], 9, width_pt - 60))
    ax.set_ylabel(_fill(spec["y"], 9, HEIGHT * 72 - 60))
    title = spec["title"]
    if spec.get("whiskers") and any(_errors(values) for values in spec["series"].values()):
        title += f"; whiskers: {spec['whiskers']}"
    ax.set_title(_fill(title, 10, width_pt - 20), fontsize=10)
    ax.grid(True, alpha=0.3)
    if spec["series"]:   # outside the axes: a legend covers no data; in the series' order
        handles, labels = ax.get_legend_handles_labels()
        by_label = dict(zip(labels, handles))
        chart.legend([by_label[label] for label in spec["series"]], list(spec["series"]),
                     loc="outside lower center", fontsize=8, frameon=False,
                     ncols=min(len(spec["series"]), 2 if spec["kind"] == "bar" else 3))
    if note:
        strip.text(0.01, 0.5, note, fontsize=7, color="0.4", ha="left", va="center")
    return canvas


def _log_axis(ax, spec: dict) -> None:
    """The measured sizes (or bucket bounds) as plain numbers, not powers of ten; a CDF's
    axis ends one bound after the last where an observation was still coming in."""
    from matplotlib.ticker import FixedLocator, NullFormatter
    ax.set_xscale("log")
    sizes = sorted({x for values in spec["series"].values() for x in values["x"]})
    if spec["kind"] == "step" and sizes:
        end = cdf_end(spec["series"])
        sizes = [x for x in sizes if x <= end]
        ax.set_xlim(sizes[0] / 1.3, end)
    if len(sizes) <= 10:
        ax.xaxis.set_major_locator(FixedLocator(sizes))
        ax.set_xticks(sizes, [f"{x:,.0f}" if float(x).is_integer() else f"{x:g}" for x in sizes])
        ax.xaxis.set_minor_formatter(NullFormatter())


def cdf_end(series: dict[str, dict]) -> float:
    """Where a CDF's axis ends: the bound after the first one by which every series had all its
    observations (its last share), so the plateau shows and no empty decade follows."""
    bounds = sorted({x for values in series.values() for x in values["x"]})
    reached = max(next(x for x, y in zip(values["x"], values["y"]) if y >= values["y"][-1])
                  for values in series.values() if values["x"])
    later = [b for b in bounds if b > reached]
    return later[0] if later else reached


def _errors(values: dict) -> list[list[float]] | None:
    if not values.get("low") or not values.get("high"):
        return None
    return [[max(0.0, y - lo) for y, lo in zip(values["y"], values["low"])],
            [max(0.0, hi - y) for y, hi in zip(values["y"], values["high"])]]


def _curve(ax, kind: str, i: int, label: str, values: dict, dodge: float) -> None:
    if kind == "step":
        ax.step(values["x"], values["y"], where="post", label=label,
                linestyle=("-", "--", ":")[i % 3])
        return
    style = {"marker": MARKERS[i % len(MARKERS)], "markersize": max(3, 6 - 1.5 * i), "label": label}
    errors = _errors(values)
    if errors:   # dodged on a log axis only: x * dodge (ticks stay at the measured x)
        ax.errorbar([x * dodge for x in values["x"]], values["y"], yerr=errors, capsize=3, **style)
    else:
        ax.plot(values["x"], values["y"], **style)


def _bars(ax, series: dict[str, dict], width_pt: float) -> None:
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
    ax.set_xticks(range(len(categories)), [_fill(c, 9, (width_pt - 80) / max(1, len(categories)))
                                           for c in categories])


def cumulative(bounds_and_counts: dict[float, float]) -> tuple[Sequence[float], Sequence[float]]:
    """(bounds, share of observations <= bound) of a Prometheus histogram's cumulative
    buckets, +Inf left out: a CDF to draw as steps."""
    total = bounds_and_counts.get(math.inf, 0.0)
    bounds = sorted(b for b in bounds_and_counts if not math.isinf(b))
    if not total:
        return [], []
    return bounds, [bounds_and_counts[b] / total for b in bounds]


if __name__ == "__main__":
    for written in redraw(sys.argv[1] if len(sys.argv) > 1 else os.path.join(
            os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "results", "plots")):
        print(written)
