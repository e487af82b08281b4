"""A scheduler's rate from its own /metrics: kube-scheduler counts what it scheduled.

`scheduler_schedule_attempts_total{result="scheduled"}` counts each pod the scheduling cycle placed
(per profile: the schedulerName), and `scheduler_scheduling_attempt_duration_seconds` times each
attempt (the algorithm, the extender's calls included, and binding). A rate taken from the
counter's delta between two scrapes needs no listing of the pods, and counts what the scheduler
did rather than when a poller saw it.

The scheduler's secure port authenticates and authorizes through the apiserver (the lab starts it
with --authentication-kubeconfig/--authorization-kubeconfig, as in a pod): the lab's admin token
is allowed /metrics. Its serving certificate is self-signed, made at start in --cert-dir; the
scrape goes to 127.0.0.1 only, bounded in time and size.
"""
import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass

import requests
from urllib3.exceptions import InsecureRequestWarning

from bench.common.stats import bucket_difference, histogram_buckets, histogram_quantile, parse_metrics

ATTEMPTS = "scheduler_schedule_attempts_total"
ATTEMPT_SECONDS = "scheduler_scheduling_attempt_duration_seconds"
# The scheduling algorithm alone (filters, scores and the extender's calls, not binding): the
# same kube-scheduler with two extenders differs there by what one extender's calls cost more.
ALGORITHM_SECONDS = "scheduler_scheduling_algorithm_duration_seconds"
MAX_BYTES = 16 * 1024 * 1024
TIMEOUT = 10.0


def scheduled_total(text: str, profile: str | None = None) -> float:
    """Pods the scheduler scheduled so far (every profile's, or `profile`'s)."""
    lines = "\n".join(line for line in text.splitlines() if line.startswith(ATTEMPTS + "{"))
    return sum(value for name, labels, value in parse_metrics(lines)
               if name == ATTEMPTS and labels.get("result") == "scheduled"
               and (profile is None or labels.get("profile") == profile))


def attempt_buckets(text: str) -> dict[float, float]:
    """The cumulative buckets of the scheduled attempts' durations (every profile's)."""
    return histogram_buckets(text, ATTEMPT_SECONDS, result="scheduled")


def histogram_total(text: str, name: str) -> tuple[float, float]:
    """(sum, count) of histogram `name` over all its series."""
    total = count = 0.0
    for sample, _, value in parse_metrics("\n".join(
            line for line in text.splitlines() if line.startswith(name + "_"))):
        if sample == name + "_sum":
            total += value
        elif sample == name + "_count":
            count += value
    return total, count


def crossing(samples: Sequence[tuple[float, float]], count: float) -> float | None:
    """When a growing count reached `count`, interpolated between the two samples (time,
    count) around it; None if no sample reached it or the first already had."""
    for (t0, c0), (t1, c1) in zip(samples, samples[1:]):
        if c0 < count <= c1:
            return t0 + (t1 - t0) * (count - c0) / (c1 - c0)
    return None


def window_rate(samples: Sequence[tuple[float, float]], low: float, high: float) -> float:
    """Per second between the count's crossings of `low` and `high`; when the first sample is
    already past `low` (the scheduler was quicker than the first look), from that sample."""
    if not samples:
        raise ValueError("no samples")
    start = crossing(samples, low)
    start_count = low
    if start is None and samples[0][1] >= low:
        start, start_count = samples[0]
    end = crossing(samples, high)
    if start is None or end is None or end <= start:
        raise ValueError(f"the count did not go from {low:g} to {high:g} in the samples")
    return (high - start_count) / (end - start)


@dataclass(frozen=True)
class Scrape:
    at: float        # time.monotonic() when the answer was in
    text: str


@dataclass(frozen=True)
class MetricsRate:
    """What a scheduler's /metrics said of a race: pods scheduled per second in its window and
    the scheduled attempts' p50/p99 and the scheduling algorithm's mean over the whole race."""
    rate: float
    attempt_p50_ms: float
    attempt_p99_ms: float
    attempts: float
    algorithm_mean_ms: float = float("nan")


def race_rate(scrapes: list[Scrape], low: float, high: float,
              profile: str | None = None) -> MetricsRate:
    """The scheduled-pods rate between `low` and `high` scheduled (counts), as figure 19 takes
    its 10 %-90 % window, and the attempts' duration from the first scrape to the last."""
    samples = [(s.at, scheduled_total(s.text, profile)) for s in scrapes]
    attempts = bucket_difference(attempt_buckets(scrapes[-1].text), attempt_buckets(scrapes[0].text))
    total = attempts.get(float("inf"), 0.0)
    p50, p99 = ((histogram_quantile(attempts, q) * 1000 if total else float("nan"))
                for q in (0.5, 0.99))
    (after_sum, after_count), (before_sum, before_count) = (
        histogram_total(s.text, ALGORITHM_SECONDS) for s in (scrapes[-1], scrapes[0]))
    runs = after_count - before_count
    algorithm = 1000 * (after_sum - before_sum) / runs if runs else float("nan")
    return MetricsRate(window_rate(samples, low, high), p50, p99, total, algorithm)


class MetricsScraper:
    """GETs https://127.0.0.1:`port`/metrics of a kube-scheduler with a bearer token."""

    def __init__(self, port: int, token: str):
        self.url = f"https://127.0.0.1:{port}/metrics"
        self.session = requests.Session()
        self.session.headers["Authorization"] = f"Bearer {token}"
        self.session.verify = False      # its self-signed serving certificate; loopback only
        self.session.trust_env = False

    def scrape(self) -> Scrape:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", InsecureRequestWarning)
            with self.session.get(self.url, timeout=TIMEOUT, stream=True) as response:
                response.raise_for_status()
                body = response.raw.read(MAX_BYTES + 1, decode_content=True)
        if len(body) > MAX_BYTES:
            raise RuntimeError(f"{self.url}: more than {MAX_BYTES} bytes of metrics")
        return Scrape(time.monotonic(), body.decode())

    def close(self) -> None:
        self.session.close()
