"""One skeleton for every section: start what it measures, measure, stop what it started.

    def run(lab):
        def measure(started):
            registry = started(RegistryServer(lab.path("registry")))   # stopped at the end
            started.callback(install.stop_processes)                  # any callable, likewise
            return [Figure(...), ...]
        return measured(SPECS, measure)

Whatever `measure` started is stopped when it ends, last started first, whether it returned or
raised. When it raises, every figure of `specs` is a MISS with the reason: one broken benchmark
must not hide the others. A part's own failure to stop is not a measurement's and is raised.
"""
from collections.abc import Callable, Iterable
from contextlib import ExitStack
from typing import Protocol, TypeVar

from bench.common.report import Figure, failed_figure

Spec = tuple[str, str, str]     # a figure's number, name and target, as its MISS shows them


class Stoppable(Protocol):
    def stop(self) -> object: ...


Part = TypeVar("Part", bound=Stoppable)


class Started(ExitStack):
    """The servers and processes a section started; `started(part)` returns the part."""

    def __call__(self, part: Part) -> Part:
        self.callback(part.stop)
        return part


def measured(specs: Iterable[Spec], measure: Callable[[Started], list[Figure]]) -> list[Figure]:
    """`measure`'s figures, or a MISS for each of `specs` if it raised; what it started, stopped."""
    with Started() as started:
        try:
            return measure(started)
        except Exception as e:
            return [failed_figure(number, name, target, e) for number, name, target in specs]
