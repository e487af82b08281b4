"""The server CPU one call costs, two servers side by side (figures 1d and 8b: archway beside a
minimal Go server doing the same call's bare work).

Each server is called over one keep-alive connection (a `Caller`), in blocks of calls, the servers
taking turns (bench/common/rounds.py), each block with the server it measures alone on one CPU
when there are 2 or more (bench/common/pinning.py). A block's figure is the server's CPU time over
the block, read from its processes' CPU clocks (every thread's sum_exec_runtime, to the
nanosecond), divided by its calls.

    callers = {"archway": Caller("archway", port, root, pids, path="/mutate", ca=ca_file),
               "go": Caller("Go", go_port, go_pid, [go_pid], path="/mutate", ca=ca_file)}
    per_call = cpu_blocks(callers, body, calls=200, blocks=10, split=split)   # name -> Steady, ms
"""
import http.client
import ssl
import time
from collections.abc import Mapping

from bench.common.pinning import CpuSplit, cpu_ns, unpinned_note
from bench.common.rounds import Steady, interleaved, rounds, steady
from bench.common.servers import cpu_seconds
from bench.common.stats import percentile


class Caller:
    """One server under measurement: a keep-alive connection to `path` (HTTPS trusting `ca` when
    given), the processes whose CPU counts (`pids`; `root`: the process tree pinned while it is
    measured), and every call's client-side latency."""

    def __init__(self, name: str, port: int, root: int, pids: list[int], *, path: str,
                 ca: str | None = None):
        self.name, self.root, self.pids, self.path = name, root, pids, path
        if ca:
            self.connection: http.client.HTTPConnection = http.client.HTTPSConnection(
                "127.0.0.1", port, timeout=10, context=ssl.create_default_context(cafile=ca))
        else:
            self.connection = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        self.latencies_ms: list[float] = []
        self.calls = 0
        self.connects = 0      # http.client opens a new connection by itself when one closed
        self.cpu_ticks = 0.0   # the coarse cross-check, from the first block on

    def call(self, body: bytes) -> bytes:
        if self.connection.sock is None:
            self.connects += 1
        self.connection.request("POST", self.path, body, {"Content-Type": "application/json"})
        answer = self.connection.getresponse()
        data = answer.read()
        if answer.status != 200:
            raise RuntimeError(f"{self.name}: {self.path} answered {answer.status}: {data[:200]!r}")
        return data

    def block(self, body: bytes, calls: int) -> float:
        """Server CPU per call over `calls` calls, in ms."""
        if not self.calls:
            self.cpu_ticks = sum(cpu_seconds(pid) for pid in self.pids)
        before = sum(cpu_ns(pid) for pid in self.pids)
        for _ in range(calls):
            started = time.perf_counter()
            self.call(body)
            self.latencies_ms.append((time.perf_counter() - started) * 1000)
        self.calls += calls
        return (sum(cpu_ns(pid) for pid in self.pids) - before) / calls / 1e6

    def ticks_per_call_ms(self) -> float:
        spent = sum(cpu_seconds(pid) for pid in self.pids) - self.cpu_ticks
        return spent / self.calls * 1000

    def stop(self) -> None:
        self.connection.close()


def cpu_blocks(callers: Mapping[str, Caller], body: bytes, *, calls: int, blocks: int,
               split: CpuSplit | None) -> dict[str, Steady]:
    """Each server's CPU per call (ms) by block: `rounds(blocks)` blocks of `calls` calls each,
    the servers taking turns; with `split`, the server measured alone on its CPU, the other
    servers on the bench's."""

    def side(name: str):
        def block() -> float:
            if split:
                split.measure(callers[name].root,
                              others=[c.root for k, c in callers.items() if k != name])
            return callers[name].block(body, calls)
        return block

    return {k: steady(v) for k, v in interleaved(
        {name: side(name) for name in callers}, rounds(blocks)).items()}


def idle_ms_per_s(callers: Mapping[str, Caller], seconds: float = 1.0) -> dict[str, float]:
    """Each server's CPU (ms) per second of answering nothing, over the same `seconds`: its own
    upkeep (timers, caches), which the blocks count too."""
    before = {k: sum(cpu_ns(pid) for pid in c.pids) for k, c in callers.items()}
    time.sleep(seconds)
    return {k: (sum(cpu_ns(pid) for pid in c.pids) - before[k]) / 1e6 / seconds
            for k, c in callers.items()}


def upkeep_note(callers: Mapping[str, Caller], idle: Mapping[str, float]) -> str:
    """What `idle` (idle_ms_per_s) comes to per call at the pace the blocks' calls went."""
    def per_call(k: str) -> float:
        latencies = callers[k].latencies_ms
        return idle[k] * sum(latencies) / len(latencies) / 1000
    return ("idle before the blocks (their own upkeep, which the blocks count too): " + ", ".join(
        f"{c.name} {idle[k]:.1f} ms of CPU per s (~{per_call(k):.4f} ms per call at the blocks' "
        f"pace)" for k, c in callers.items()))


def client_latency(callers: Mapping[str, Caller]) -> str:
    """'client p50 / p99 archway 0.31 / 0.52 ms, Go 0.09 / 0.15 ms', over every block's calls."""
    return "client p50 / p99 " + ", ".join(
        f"{c.name} {percentile(c.latencies_ms, 50):.2f} / {percentile(c.latencies_ms, 99):.2f} ms"
        for c in callers.values())


def ticks_note(callers: Mapping[str, Caller]) -> str:
    return ("cross-check over all blocks from /proc/PID/stat utime+stime (10 ms ticks): "
            + ", ".join(f"{c.name} {c.ticks_per_call_ms():.3f} ms" for c in callers.values())
            + " per call")


def pinning_note(split: CpuSplit | None, go: str, archway: str) -> str:
    """How the block's server was placed; `go`, `archway`: who answers each server's calls."""
    if not split:
        return unpinned_note()
    return (f"{split.describe()}; {go} started on the bench's CPU(s), so its runtime sized "
            f"GOMAXPROCS to {len(split.others)} ({archway})")
