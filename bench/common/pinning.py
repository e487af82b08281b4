"""A measured server's own work, apart from the bench's (figures 1d, 7, 8b): CPU pinning and CPU
time per call.

On a 2-core machine the bench's own processes (its client, the API stand-in and exporter
threads, Prometheus) take about a core; a server measured on the same cores waits for a CPU at
each wake-up and its tail is theirs. `CpuSplit` gives the measured server one CPU and
everything else the other:

    split = CpuSplit.of_machine()          # None on a 1-core machine: nothing to split
    split.pin_bench()                      # this process's threads; its children inherit it
    split.measure(server_pid, others=[...])   # that process tree alone on the server's CPU
    split.restore()

Affinity is per thread on Linux (sched_setaffinity(0) sets the calling thread's only), so a
process is pinned task by task (/proc/PID/task), its descendants too; threads and processes it
starts later inherit it from their parent.

`cpu_ns(pid)` is a process's CPU time so far in nanoseconds, read from its process CPU clock
(the scheduler's sum_exec_runtime over all its threads, those that ended included; what
clock_gettime(clock_getcpuclockid(pid)) reads): utime + stime in /proc/PID/stat count clock
ticks (10 ms), too coarse for blocks of calls costing 0.1-0.5 ms each.
"""
import os
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field

from bench.common.servers import children


def process_tree(pid: int) -> list[int]:
    """`pid` and its descendants (Linux /proc)."""
    tree, todo = [], [pid]
    while todo:
        one = todo.pop()
        tree.append(one)
        todo += children(one)
    return tree


def tasks(pid: int) -> list[int]:
    """The thread ids of a process (empty once it is gone)."""
    try:
        return [int(t) for t in os.listdir(f"/proc/{pid}/task")]
    except OSError:
        return []


def pin(pid: int, cpus: set[int]) -> None:
    """Every thread of `pid` and of its descendants on `cpus`; checked by reading it back."""
    for process in process_tree(pid):
        for task in tasks(process):
            try:
                os.sched_setaffinity(task, cpus)
                pinned = os.sched_getaffinity(task)
            except ProcessLookupError:   # a thread that ended meanwhile, even between the two
                continue
            if pinned != cpus:
                raise RuntimeError(f"task {task} of {process}: affinity {pinned}, not {cpus}")


def affinity(pid: int) -> set[int]:
    """The CPUs a process's main thread may run on (what `taskset -p PID` prints)."""
    return os.sched_getaffinity(pid)


def affinities(pids: Iterable[int]) -> str:
    """'CPU 1: 123, 124; CPU 0: 99': every listed process's threads by the CPUs they may use
    (what `taskset -p` prints per thread), to show in a note that pinning held."""
    by_cpus: dict[str, list[int]] = {}
    for pid in pids:
        for cpus in {_cpus(os.sched_getaffinity(task)) for task in tasks(pid)}:
            by_cpus.setdefault(cpus, []).append(pid)
    return "; ".join(f"CPU {cpus}: {', '.join(map(str, pids))}" for cpus, pids in by_cpus.items())


def cpu_ns(pid: int) -> int:
    """CPU time used so far by process `pid` (every thread, ended ones included), in ns: its
    process CPU clock, the clockid glibc's clock_getcpuclockid(pid) makes (CPUCLOCK_SCHED)."""
    return time.clock_gettime_ns(((~pid) << 3) | 2)


def tree_cpu_ns(pids: Iterable[int]) -> int:
    return sum(cpu_ns(pid) for pid in pids)


@dataclass
class CpuSplit:
    """One CPU for the server being measured, the other(s) for everything else."""
    server: set[int]
    others: set[int]
    saved: set[int] = field(default_factory=set)

    @classmethod
    def of_machine(cls) -> "CpuSplit | None":
        """The last usable CPU for the server, the rest for the bench; None with one CPU (or
        when BENCH_PIN=0): nothing to pin then, and the figures say so."""
        usable = sorted(os.sched_getaffinity(0))
        if len(usable) < 2 or os.environ.get("BENCH_PIN", "1") == "0":
            return None
        return cls({usable[-1]}, set(usable[:-1]))

    def pin_bench(self) -> None:
        """This process (every thread) on the others' CPUs; remembers its affinity first."""
        self.saved = self.saved or os.sched_getaffinity(0)
        pin(os.getpid(), self.others)

    def measure(self, server: int, others: Iterable[int] = ()) -> None:
        """`server`'s process tree alone on the server CPU; `others` (process trees) away."""
        for pid in others:
            pin(pid, self.others)
        pin(server, self.server)

    def restore(self) -> None:
        if self.saved:
            pin(os.getpid(), self.saved)

    @contextmanager
    def released(self) -> Iterator[None]:
        """Every CPU back for a while: for what the bench times in its own process."""
        self.restore()
        try:
            yield
        finally:
            self.pin_bench()

    def describe(self) -> str:
        return (f"pinned: the measured server on CPU {_cpus(self.server)}, the bench's client, "
                f"API stand-in, exporter, Prometheus and the servers not being measured on CPU "
                f"{_cpus(self.others)}")


def _cpus(cpus: set[int]) -> str:
    return ",".join(map(str, sorted(cpus)))


def released(split: "CpuSplit | None"):
    """`split.released()`, or nothing to release."""
    return split.released() if split else nullcontext()


UNPINNED = ("not pinned: {why}; the server shares the cores with the bench's client, API "
            "stand-in, exporter and Prometheus")


def unpinned_note() -> str:
    why = ("BENCH_PIN=0" if os.environ.get("BENCH_PIN") == "0"
           else f"{len(os.sched_getaffinity(0))} CPU usable")
    return UNPINNED.format(why=why)
