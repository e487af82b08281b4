"""Where a missed target's time goes: py-spy samples archway's gunicorn workers under load.

    python3 -m bench.profile admission [--seconds 8]

Starts the servers of figure 1 (bench.sections.admission.admission_servers), drives archway with wrk
and records every worker with py-spy (non-blocking, so the profile does not slow what it
measures). Prints the functions with the most samples, inclusive and self, and writes the
collapsed stacks (flamegraph input) to bench/results/profile-<pid>.txt.
"""
import argparse
import collections
import os
import shutil
import subprocess
import sys
import threading

from bench.common.lab import Lab
from bench.common.loadgen import run_wrk
from bench.sections.admission import CONNECTIONS, admission_servers

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def _frame(text: str) -> str:
    """`handle (gunicorn/workers/gthread.py:279)` -> `handle (gthread.py)`: one entry per function."""
    name, _, where = text.partition(" (")
    return f"{name} ({where.rsplit(':', 1)[0].split('/')[-1]})" if where else name


def summarize(collapsed: str, top: int = 30) -> str:
    """Top functions by inclusive and self samples from py-spy's raw (collapsed) output."""
    inclusive, own = collections.Counter(), collections.Counter()
    total = 0
    for line in collapsed.splitlines():
        stack, _, count = line.rpartition(" ")
        if not count.isdigit():
            continue
        n = int(count)
        total += n
        frames = [_frame(f) for f in stack.split(";")]
        for frame in set(frames):
            inclusive[frame] += n
        own[frames[-1]] += n
    out = [f"{total} samples"]
    for title, counter in (("inclusive", inclusive), ("self", own)):
        out.append(f"--- top {top} {title}")
        out += [f"{n / total:6.1%}  {frame}" for frame, n in counter.most_common(top)]
    return "\n".join(out)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="bench.profile")
    parser.add_argument("target", choices=["admission"])
    parser.add_argument("--seconds", type=float, default=8)
    parser.add_argument("--rate", type=int, default=250, help="samples per second")
    args = parser.parse_args(argv)
    py_spy = shutil.which("py-spy")
    if not py_spy:
        print("py-spy is not installed: pip install -r bench/requirements.txt", file=sys.stderr)
        return 2
    os.makedirs(RESULTS, exist_ok=True)
    lab = Lab()
    try:
        with admission_servers(lab) as (archway, _echo, body):
            load = threading.Thread(target=run_wrk, args=(archway.url("/mutate"), body),
                                    kwargs=dict(seconds=args.seconds + 2, connections=CONNECTIONS))
            load.start()
            recorders = []
            for pid in archway.worker_pids():
                path = os.path.join(RESULTS, f"profile-{pid}.txt")
                recorders.append((pid, path, subprocess.Popen(
                    [py_spy, "record", "--pid", str(pid), "--nonblocking", "--gil", "--format", "raw",
                     "--duration", str(int(args.seconds)), "--rate", str(args.rate), "--output", path],
                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)))
            for _, _, proc in recorders:
                proc.wait(timeout=args.seconds + 60)
            load.join()
        for pid, path, _ in recorders:
            with open(path) as f:
                print(f"=== worker {pid} ({path})\n{summarize(f.read())}\n")
    finally:
        lab.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
