"""The figures table and the machine it was measured on: pure formatting plus a few reads of /proc.

A `Figure` is one row: what was measured, the value as text, the target as text, and whether the
target was met (None: informational, no target). A figure taken over rounds carries them
(`rounds`, bench/common/rounds.py): when they spread past the noise bound its verdict is NOISY,
neither PASS nor MISS. `data` holds what the plots draw (bench/common/plots.py), if anything. The table is the same on the terminal and in
bench/results/latest.md, so what a run printed and what it wrote can be compared line by line.
"""
import datetime
import os
import platform
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from importlib import metadata

from bench.common.rounds import Steady


@dataclass
class Figure:
    number: str            # "1", "2", "3a"... as in docs/benchmarks.md
    name: str
    measured: str
    target: str
    passed: bool | None    # None: context only, no target of its own
    notes: list[str] = field(default_factory=list)   # how it was measured, in a few words
    rounds: Steady | None = None   # the rounds of a figure taken several times
    data: dict = field(default_factory=dict, repr=False)   # series for the plots

    def __post_init__(self) -> None:
        if self.rounds is not None and len(self.rounds.values) > 1:
            self.notes = [*self.notes, f"rounds: {self.rounds.rounds_note()}"]

    @property
    def noisy(self) -> bool:
        """A judged figure whose rounds spread past the noise bound: the run cannot tell."""
        return self.passed is not None and self.rounds is not None and self.rounds.noisy()

    @property
    def verdict(self) -> str:
        if self.noisy:
            return "NOISY"
        return {True: "PASS", False: "MISS", None: "info"}[self.passed]

    @property
    def missed(self) -> bool:
        return self.verdict == "MISS"


def failed_figure(number: str, name: str, target: str, error: BaseException) -> Figure:
    """A benchmark that could not run is a MISS with its reason, never a silent gap."""
    reason = f"{type(error).__name__}: {str(error).splitlines()[0][:160] if str(error) else ''}"
    return Figure(number, name, f"not measured ({reason})", target, False)


def table(figures: list[Figure]) -> str:
    """A Markdown table (readable as plain text too)."""
    rows = [("#", "figure", "measured", "target", "result")]
    rows += [(f.number, f.name, f.measured, f.target, f.verdict) for f in figures]
    widths = [max(len(row[i]) for row in rows) for i in range(5)]

    def line(cells):
        return "| " + " | ".join(c.ljust(w) for c, w in zip(cells, widths)) + " |"

    out = [line(rows[0]), "|" + "|".join("-" * (w + 2) for w in widths) + "|"]
    out += [line(row) for row in rows[1:]]
    return "\n".join(out)


def notes(figures: list[Figure]) -> str:
    lines = []
    for f in figures:
        for note in f.notes:
            lines.append(f"- {f.number}: {note}")
    return "\n".join(lines)


def summary(figures: list[Figure]) -> str:
    judged = [f for f in figures if f.passed is not None]
    met = [f.number for f in judged if f.verdict == "PASS"]
    missed = [f.number for f in judged if f.missed]
    noisy = [f.number for f in judged if f.noisy]
    text = f"{len(met)}/{len(judged)} targets met"
    text += f"; missed: {', '.join(missed)}" if missed else ""
    return text + (f"; too noisy to judge: {', '.join(noisy)}" if noisy else "")


# --- the machine --------------------------------------------------------------------------------

def _first_line(path: str, prefix: str) -> str:
    try:
        with open(path) as f:
            for line in f:
                if line.startswith(prefix):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"


def _version(package: str) -> str:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return "not installed"


def _tool_version(args: list[str]) -> str:
    if not shutil.which(args[0]):
        return "not installed"
    try:
        out = subprocess.run(args, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    text = (out.stdout or out.stderr).strip().splitlines()
    return text[0].split(" Copyright")[0][:80] if text else "unknown"


def load_average() -> str:
    try:
        with open("/proc/loadavg") as f:
            return " ".join(f.read().split()[:3])
    except OSError:
        return "unknown"


def machine() -> dict[str, str]:
    mem_kib = _first_line("/proc/meminfo", "MemTotal").split()[0]
    memory = f"{int(mem_kib) / 1024 / 1024:.1f} GiB" if mem_kib.isdigit() else "unknown"
    return {
        "date (UTC)": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M"),
        "CPU": _first_line("/proc/cpuinfo", "model name"),
        "cores": str(os.cpu_count()),
        "RAM": memory,
        "OS": _os_release(),
        "kernel": platform.release(),
        "Python": sys.version.split()[0],
        "gunicorn": _version("gunicorn"),
        "Flask": _version("flask"),
        "Werkzeug": _version("werkzeug"),
        "requests": _version("requests"),
        "wrk": _tool_version(["wrk", "-v"]),
        "docker-registry": _tool_version(["docker-registry", "--version"]),
        "prometheus": _tool_version(["prometheus", "--version"]),
        "load average at start": load_average(),
    }


def _os_release() -> str:
    try:
        with open("/etc/os-release") as f:
            for line in f:
                if line.startswith("PRETTY_NAME="):
                    return line.split("=", 1)[1].strip().strip('"')
    except OSError:
        pass
    return platform.platform()


def markdown(figures: list[Figure], machine_info: dict[str, str], *, seconds: float,
             load_at_end: str) -> str:
    described = "\n".join(f"- {k}: {v}" for k, v in machine_info.items())
    return (f"# archway benchmark results\n\n{table(figures)}\n\n{summary(figures)}; "
            f"whole run {seconds:.0f} s.\n\n## How each figure was measured\n\n{notes(figures)}\n\n"
            f"## Machine\n\n{described}\n- load average at end: {load_at_end}\n")
