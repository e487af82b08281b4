"""Figure 17: what a deadline on name lookups costs a new registry connection.

A registry connection's name lookup runs on a thread of its own, so that a resolver that stops
answering cannot hold the lookup past its deadline (registry/dns.py). Measured side by side in
one run, interleaved: socket.getaddrinfo("localhost") called directly (as urllib3 did) against
the same lookup through archway's NameLookups with a deadline. Pooled connections skip both.
"""
import socket
import time

from archway.registry.dns import NameLookups
from bench.common.lab import Lab
from bench.common.report import Figure
from bench.common.section import measured
from bench.common.stats import percentile

ROUNDS = 2000
ADDED_TARGET_MS = 0.5


SPEC = ("17", "DNS lookup of a new connection: bounded vs direct (p50 added)",
        f"< {ADDED_TARGET_MS} ms added")


def run(lab: Lab) -> list[Figure]:
    return measured([SPEC], lambda started: [_measure()])


def _measure() -> Figure:
    number, name, target = SPEC
    lookups = NameLookups()
    args = ("localhost", 443, 0, socket.SOCK_STREAM)
    direct, bounded = [], []
    for _ in range(ROUNDS):
        start = time.perf_counter()
        socket.getaddrinfo(*args)
        direct.append((time.perf_counter() - start) * 1000)
        start = time.perf_counter()
        lookups.getaddrinfo(*args, deadline=time.monotonic() + 5)
        bounded.append((time.perf_counter() - start) * 1000)
    added = percentile(bounded, 50) - percentile(direct, 50)
    return Figure(number, name,
                  f"{added:.3f} ms (p50 {percentile(bounded, 50):.3f} vs "
                  f"{percentile(direct, 50):.3f} ms; p99 {percentile(bounded, 99):.3f} vs "
                  f"{percentile(direct, 99):.3f} ms)",
                  target, added < ADDED_TARGET_MS,
                  [f"{ROUNDS} lookups of localhost each way, interleaved, in one process"])
