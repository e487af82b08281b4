"""Steady figures: a comparison taken over several interleaved rounds, told as a median and a spread.

One round of a ratio figure measures both sides (A then B, the next round B then A), so that a
change in the machine's load during the run hits both alike; each round gives one ratio. The
figure is the median of the rounds' ratios, and its spread is how far the rounds fell apart:
their interquartile range over the median (with 3 rounds or fewer, their whole range). Past
`noise_bound()` the figure says NOISY instead of PASS or MISS: the run cannot tell whether the
target was met.

    BENCH_ROUNDS       rounds per ratio figure (default 5; `python3 -m bench --rounds`)
    BENCH_NOISE_BOUND  the spread past which a figure is NOISY (default 0.15 = 15 %; --noise-bound)
"""
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TypeVar

from bench.common.stats import median, percentile

T = TypeVar("T")
DEFAULT_ROUNDS = 5
DEFAULT_NOISE_BOUND = 0.15


def rounds(default: int = DEFAULT_ROUNDS) -> int:
    """The number of rounds a ratio figure takes (BENCH_ROUNDS, at least 1)."""
    value = os.environ.get("BENCH_ROUNDS", "")
    return max(1, int(value)) if value.strip() else default


def noise_bound() -> float:
    """The spread (relative to the median) past which a figure is NOISY (BENCH_NOISE_BOUND)."""
    value = os.environ.get("BENCH_NOISE_BOUND", "")
    return float(value) if value.strip() else DEFAULT_NOISE_BOUND


def interleaved(sides: Mapping[str, Callable[[], float]], count: int) -> dict[str, list[float]]:
    """Each side's value per round, the sides taking turns and each going first in turn
    (A B, B A, A B...): what a round measures, each side measured alike."""
    names = list(sides)
    values: dict[str, list[float]] = {name: [] for name in names}
    for i in range(count):
        for k in range(len(names)):
            name = names[(i + k) % len(names)]
            values[name].append(sides[name]())
    return values


@dataclass(frozen=True)
class Steady:
    """The rounds of one figure: their values, median and spread."""
    values: tuple[float, ...]

    @property
    def median(self) -> float:
        return median(self.values)

    @property
    def spread(self) -> float:
        """The interquartile range (nearest rank) relative to |median|: with up to 3 rounds
        their whole range, with 5 the 2nd to the 4th value, so that one round caught by a
        burst of load elsewhere does not alone make a figure NOISY. 0 for one round; inf when
        the median is 0 and the rounds differ."""
        mid = abs(self.median)
        width = percentile(self.values, 75) - percentile(self.values, 25)
        if not width:
            return 0.0
        return width / mid if mid else float("inf")

    @property
    def range(self) -> float:
        """(max - min) / |median|, for the notes."""
        mid, width = abs(self.median), max(self.values) - min(self.values)
        return width / mid if mid else (0.0 if not width else float("inf"))

    def noisy(self, bound: float | None = None) -> bool:
        return len(self.values) > 1 and self.spread > (noise_bound() if bound is None else bound)

    @property
    def spread_text(self) -> str:
        """'6%', or 'inf' when the median is 0."""
        return "inf" if self.spread == float("inf") else f"{self.spread:.0%}"

    def describe(self, fmt: str = "{:.2f}", unit: str = "") -> str:
        """'0.88x ±6% (5 rounds: 0.85x-0.90x)': the median, the spread, the range."""
        def value(v: float) -> str:
            return fmt.format(v) + unit
        if len(self.values) == 1:
            return f"{value(self.values[0])} (1 round)"
        return (f"{value(self.median)} ±{self.spread_text} ({len(self.values)} rounds: "
                f"{value(min(self.values))} to {value(max(self.values))})")

    def rounds_note(self, fmt: str = "{:.2f}") -> str:
        return (f"per round {', '.join(fmt.format(v) for v in self.values)}; median "
                f"{fmt.format(self.median)}, spread (IQR/median) {self.spread:.0%}, range/median "
                f"{self.range:.0%}; NOISY past {noise_bound():.0%}")


def blocks(samples: Sequence[T], count: int) -> list[list[T]]:
    """`samples` taken in turns with another side's, cut into `count` consecutive rounds of
    equal size (the last keeps the remainder): samples interleaved one by one already are
    rounds, only too small to tell a tail; blocks of them are rounds that can."""
    count = max(1, min(count, len(samples)))
    size = len(samples) // count
    return [list(samples[i * size:(i + 1) * size if i < count - 1 else len(samples)])
            for i in range(count)]


def steady(values: Sequence[float]) -> Steady:
    if not values:
        raise ValueError("no rounds")
    return Steady(tuple(float(v) for v in values))


def ratios(numerators: Sequence[float], denominators: Sequence[float]) -> Steady:
    """Round by round numerator / denominator (a round whose denominator is 0 gives inf)."""
    if len(numerators) != len(denominators):
        raise ValueError("rounds differ in number")
    return steady([n / d if d else float("inf") for n, d in zip(numerators, denominators)])
