"""Small statistics the figures need: percentiles of samples and of Prometheus histograms."""
import math
import re


def percentile(samples, q: float) -> float:
    """The q-th percentile (0..100) by the nearest-rank method: a value that was observed."""
    ordered = sorted(samples)
    if not ordered:
        raise ValueError("no samples")
    rank = max(1, math.ceil(q / 100 * len(ordered)))
    return ordered[rank - 1]


def median(samples) -> float:
    ordered = sorted(samples)
    if not ordered:
        raise ValueError("no samples")
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2


_SAMPLE = re.compile(r'^(?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(?P<labels>[^}]*)\})?\s+(?P<value>\S+)')
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def parse_metrics(text: str) -> list[tuple[str, dict, float]]:
    """(name, labels, value) for every sample of a Prometheus text exposition."""
    samples = []
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = _SAMPLE.match(line)
        if m:
            labels = dict(_LABEL.findall(m["labels"] or ""))
            samples.append((m["name"], labels, float(m["value"])))
    return samples


def histogram_buckets(text: str, name: str, **match) -> dict[float, float]:
    """upper bound -> cumulative count of histogram `name` (labels must include `match`)."""
    buckets: dict[float, float] = {}
    for sample, labels, value in parse_metrics(text):
        if sample != name + "_bucket" or any(labels.get(k) != v for k, v in match.items()):
            continue
        bound = float("inf") if labels["le"] == "+Inf" else float(labels["le"])
        buckets[bound] = buckets.get(bound, 0.0) + value
    return buckets


def bucket_difference(after: dict, before: dict) -> dict:
    """The observations made between two scrapes of one histogram."""
    return {le: count - before.get(le, 0.0) for le, count in after.items()}


def share_at_most(buckets: dict, bound: float) -> float:
    """The share of observations <= `bound` (which must be a bucket bound)."""
    total = buckets.get(float("inf"), 0.0)
    return buckets[bound] / total if total else float("nan")


def histogram_quantile(buckets: dict, q: float) -> float:
    """Prometheus' histogram_quantile(): linear interpolation inside the bucket holding q."""
    bounds = sorted(buckets)
    total = buckets[float("inf")]
    if not total:
        return float("nan")
    rank = q * total
    lower_bound, lower_count = 0.0, 0.0
    for bound in bounds:
        count = buckets[bound]
        if count >= rank:
            if math.isinf(bound):
                return lower_bound
            if count == lower_count:
                return bound
            return lower_bound + (bound - lower_bound) * (rank - lower_count) / (count - lower_count)
        lower_bound, lower_count = bound, count
    return bounds[-2] if len(bounds) > 1 else float("nan")
