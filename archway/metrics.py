"""Prometheus metrics that stay right under gunicorn's several worker processes.

`archway serve` points PROMETHEUS_MULTIPROC_DIR at a fresh per-run directory before any worker
starts: each process then writes its samples to files there, and /metrics aggregates them all
(MultiProcessCollector), whichever worker answers the scrape. Without that variable (tests, a
plain Flask run) the default in-process registry is used.

Other modules (the scheduler extender) get their metrics through `counter`, `gauge` and
`histogram` below: created on first use, once per process, so importing a module never fixes
the storage mode before serve.py had a chance to set the directory.
"""
import os
import threading

from prometheus_client import (CONTENT_TYPE_LATEST, REGISTRY, CollectorRegistry, Counter, Gauge,
                               Histogram, generate_latest, multiprocess, values)

MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"
# Warm admissions take well under a millisecond: fine buckets there, coarse ones up to the deadline.
LATENCY_BUCKETS = (0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 3.0, 5.0, 10.0)

_metrics: dict = {}
_lock = threading.Lock()


def multiprocess_dir() -> str | None:
    return os.environ.get(MULTIPROC_ENV) or None


def _get(cls, name: str, documentation: str, labelnames=(), **kwargs):
    with _lock:
        metric = _metrics.get(name)
        if metric is None:
            # prometheus_client picks its value storage when it is first imported; serve.py may
            # set the directory later (the CLI imports everything up front), so pick it again.
            if multiprocess_dir() and values.ValueClass is values.MutexValue:
                values.ValueClass = values.get_value_class()
            metric = _metrics[name] = cls(name, documentation, labelnames=tuple(labelnames),
                                          **kwargs)
        return metric


def counter(name: str, documentation: str, labelnames=()) -> Counter:
    return _get(Counter, name, documentation, labelnames)


def gauge(name: str, documentation: str, labelnames=(), multiprocess_mode: str = "livesum") -> Gauge:
    """`multiprocess_mode` says how the workers' values combine (livesum, max, mostrecent...)."""
    return _get(Gauge, name, documentation, labelnames, multiprocess_mode=multiprocess_mode)


def histogram(name: str, documentation: str, labelnames=(), buckets=LATENCY_BUCKETS) -> Histogram:
    return _get(Histogram, name, documentation, labelnames, buckets=buckets)


def render() -> tuple[bytes, str]:
    """The /metrics body and its content type, aggregated over every worker process."""
    if multiprocess_dir():
        registry = CollectorRegistry()
        multiprocess.MultiProcessCollector(registry)
    else:
        registry = REGISTRY
    return generate_latest(registry), CONTENT_TYPE_LATEST


def mark_process_dead(pid: int) -> None:
    """For gunicorn's child_exit hook: drop a dead worker's live gauges."""
    if multiprocess_dir():
        multiprocess.mark_process_dead(pid)


# --- archway's admission metrics ------------------------------------------------------------

ADMISSION_OUTCOMES = ("mutated", "unchanged", "denied", "fail_open", "error")


def admission_finished(outcome: str, seconds: float, warnings: int) -> None:
    counter("archway_admissions_total", "Admission requests answered, by outcome",
            ["outcome"]).labels(outcome).inc()
    histogram("archway_admission_duration_seconds",
              "Time to answer an admission request, server side").observe(seconds)
    if warnings:
        counter("archway_admission_warnings_total",
                "Warnings returned to clients in admission responses").inc(warnings)


def image_resolved(source: str, result: str) -> None:
    """One image's resolution: `source` is where the answer came from (oci-index, sif-https...)
    or the reference scheme when it failed; `result` is resolved, no_arch or an error kind."""
    counter("archway_image_resolutions_total", "Image resolutions during admission",
            ["source", "result"]).labels(source, result).inc()


def bad_request(status: int) -> None:
    counter("archway_bad_requests_total", "Requests rejected as malformed, by HTTP status",
            ["code"]).labels(str(status)).inc()
