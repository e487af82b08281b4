"""Run every archway benchmark side by side and print one table of figures with their targets.

    python3 -m bench                       # everything (bench/run.sh does setup first)
    python3 -m bench --only admission,extender
    python3 -m bench --rounds 7 --noise-bound 0.1

Ratio figures are taken over interleaved rounds (bench/common/rounds.py) and told as median and
spread; a figure whose rounds spread past the noise bound is NOISY, neither PASS nor MISS.

Figures 7, 8b and 1d measure a server's own work: on 2 CPUs or more the server measured runs
alone on one, the bench and everything else it started on the others (bench/common/pinning.py);
BENCH_PIN=0 leaves every process on every CPU.

To measure a proposed fix, copy the checkout, patch the copy and run `python3 -m bench` inside
it: the servers and the in-process parts then all run the copy's code.

Writes the same table, with notes on how each figure was measured and the machine's
description, to bench/results/latest.md (gitignored). Exit status 0 when every target is met,
1 when one is missed.
"""
import argparse
import importlib
import os
import sys
import time

from bench.common import plots, rounds
from bench.common.lab import Lab
from bench.common.report import load_average, machine, markdown, summary, table

# Cheap first; the extender late, since its Prometheus scrapes 5,000 series while it runs, and
# the real control plane last (autoscale: with Karpenter's KWOK provider beside it).
SECTIONS = {           # name -> module of bench/sections/ whose run(lab) returns its figures
    "policy": "policy",
    "ranges": "ranges",        # the refused cluster addresses at 5,000 Nodes (issue 48)
    "registry": "registry_costs",
    "cache": "cache",
    "drip": "drip",
    "dns": "dns",
    "uncached": "uncached",
    "admission": "admission",
    "slowclients": "slowclients",
    "memory": "memory",
    "gate": "gate",
    "bodies": "bodies",
    "extender": "extender",
    "burst": "burst",
    "records": "records",      # the image records on a real apiserver (issue 35)
    "events": "events",        # registry push events, two replicas on a real apiserver (issue 46)
    "kube": "kube",
    "loop": "loop",
    "scale": "scale",          # a package: the section and its load, events and figures
    "autoscale": "autoscale",  # a package: the section and its Karpenter provisioning
    "realnode": "realnode",    # root and the real node: archway in-cluster
    "vmnode": "vmnode",        # root, the real node and the arm64 VM node: archway on both
}
RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def _order(figure) -> tuple:
    digits = "".join(c for c in figure.number if c.isdigit())
    return (int(digits) if digits else 99, figure.number)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python3 -m bench", description=__doc__.split("\n")[0])
    parser.add_argument("--only", help=f"comma-separated sections: {', '.join(SECTIONS)}")
    parser.add_argument("--keep", action="store_true", help="keep the scratch directory (logs)")
    parser.add_argument("--output", default=os.path.join(RESULTS, "latest.md"))
    parser.add_argument("--plots", default=os.path.join(RESULTS, "plots"),
                        help="directory of the SVG plots (needs matplotlib)")
    parser.add_argument("--rounds", type=int, help=f"interleaved rounds per ratio figure "
                        f"(BENCH_ROUNDS, default {rounds.DEFAULT_ROUNDS})")
    parser.add_argument("--noise-bound", type=float, help=f"spread past which a figure is NOISY "
                        f"(BENCH_NOISE_BOUND, default {rounds.DEFAULT_NOISE_BOUND})")
    args = parser.parse_args(argv)
    if args.rounds is not None:
        os.environ["BENCH_ROUNDS"] = str(args.rounds)
    if args.noise_bound is not None:
        os.environ["BENCH_NOISE_BOUND"] = str(args.noise_bound)
    wanted = args.only.split(",") if args.only else list(SECTIONS)
    unknown = set(wanted) - set(SECTIONS)
    if unknown:
        parser.error(f"unknown section(s): {', '.join(sorted(unknown))}")

    started = time.monotonic()
    described = machine()
    lab = Lab(keep=args.keep)
    figures = []
    try:
        for name in wanted:
            section_start = time.monotonic()
            print(f"bench: {name}...", file=sys.stderr, flush=True)
            module = importlib.import_module(f"bench.sections.{SECTIONS[name]}")
            figures += module.run(lab)
            print(f"bench: {name} done in {time.monotonic() - section_start:.0f} s",
                  file=sys.stderr, flush=True)
    finally:
        lab.cleanup()
    figures.sort(key=_order)
    seconds = time.monotonic() - started
    print(table(figures))
    print(f"\n{summary(figures)}; whole run {seconds:.0f} s")
    os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)
    with open(args.output, "w") as f:
        f.write(markdown(figures, described, seconds=seconds, load_at_end=load_average()))
    print(f"written to {args.output}" + (f"; scratch kept in {lab.directory}" if args.keep else ""))
    _, told = plots.write(figures, args.plots, note=plot_note(described))
    print(told)
    return 1 if any(f.missed for f in figures) else 0


def plot_note(described: dict[str, str]) -> str:
    """The run a plot comes from, and whether the machine was loaded (load > cores)."""
    load, cores = load_average(), os.cpu_count() or 1
    try:
        loaded = float(load.split()[0]) > cores
    except (ValueError, IndexError):
        loaded = False
    return (f"bench run {described['date (UTC)']} UTC, {cores} cores, load average {load}"
            + (": a loaded machine, figures noisy" if loaded else ""))


if __name__ == "__main__":
    sys.exit(main())
