"""Which gated pods the controller tries next: fair to registry hosts and namespaces. Pure.

Each of the controller's threads waits on one pod's lookups, up to registry.timeout_seconds.
Tried in arrival order, 100 pods on a registry that hangs held every thread for minutes while
the pods of registries that answer waited behind them (issue 30: 48 s instead of 0.4 s). So a
pod starts only when a thread is free to take it, and:

- a pod past admission.gate_max_seconds goes first and is never held back: its try waits on no
  registry, and it must be released now;
- at most `per_host` pods of one registry host are tried at once, `per_failing_host` of a host
  whose last lookups got no answer (a pod counts against each host its images come from): a host
  that hangs holds only those threads;
- pods whose hosts answer go before pods of hosts that got no answer;
- then the namespace with the fewest pods being tried (one tenant's backlog never sits ahead of
  another's), then the pod due the longest.
"""
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from archway.errors import ArchwayError, DeadlineExceeded, RegistryError, TransportError
from archway.podview import PodShapeError, PodView
from archway.registry.model import ImageInfo
from archway.registry.reference import parse_reference


@dataclass(frozen=True)
class Candidate:
    key: str                  # the pod's uid
    namespace: str
    hosts: frozenset[str]     # the registry hosts its images come from
    due: tuple = ()           # sorts the longest-due first (when it became due, then created)
    expired: bool = False     # past admission.gate_max_seconds


@dataclass(frozen=True)
class Limits:
    per_host: int
    per_failing_host: int

    @classmethod
    def for_threads(cls, threads: int) -> "Limits":
        """Half the threads for one host, a quarter for one that gives no answer: a busy
        registry still gets several lookups at once, two hung ones leave half the threads."""
        return cls(per_host=max(1, threads // 2), per_failing_host=max(1, threads // 4))


def choose(candidates: Iterable[Candidate], *, slots: int, limits: Limits,
           running_hosts: Counter, running_namespaces: Counter,
           failing: frozenset[str] | set[str]) -> list[Candidate]:
    """The pods to start now, in order: at most `slots`. `running_hosts` and
    `running_namespaces`: how many pods being tried right now count against each."""
    hosts, namespaces = Counter(running_hosts), Counter(running_namespaces)
    # The order that does not change while choosing; the namespaces' counts do.
    waiting = sorted(candidates, key=lambda c: (not c.expired, bool(c.hosts & failing), c.due,
                                                c.key))
    chosen: list[Candidate] = []
    while waiting and len(chosen) < slots:
        allowed = [c for c in waiting if c.expired or all(
            hosts[h] < (limits.per_failing_host if h in failing else limits.per_host)
            for h in c.hosts)]
        if not allowed:
            break
        # Stable: among the fewest-running namespace's pods, the first in the order above.
        best = min(allowed, key=lambda c: (not c.expired, bool(c.hosts & failing),
                                           namespaces[c.namespace]))
        chosen.append(best)
        waiting.remove(best)
        hosts.update(best.hosts)
        namespaces[best.namespace] += 1
    return chosen


class FairShare:
    """The controller's threads as fairqueue sees them: which pods run against which hosts and
    namespaces, and which hosts gave no answer last. Not thread-safe: the controller calls it
    under its lock."""

    def __init__(self, threads: int):
        self.threads = threads
        self.limits = Limits.for_threads(threads)
        self.running = 0
        self.hosts: Counter[str] = Counter()
        self.namespaces: Counter[str] = Counter()
        self.silent: set[str] = set()

    def start(self, candidates: Iterable[Candidate]) -> list[Candidate]:
        """The pods to start now (as many as threads are free), counted as running."""
        chosen = choose(candidates, slots=self.threads - self.running, limits=self.limits,
                        running_hosts=self.hosts, running_namespaces=self.namespaces,
                        failing=self.silent) if self.running < self.threads else []
        for c in chosen:
            self.running += 1
            self.hosts.update(c.hosts)
            self.namespaces[c.namespace] += 1
        return chosen

    def finish(self, hosts: frozenset[str], namespace: str) -> None:
        self.running -= 1
        self.hosts -= Counter(hosts)            # -= drops the counts that reach 0
        self.namespaces -= Counter([namespace])

    def heard(self, results: dict, live: Callable[[], set[str]]) -> frozenset[str]:
        """Note which hosts answered a try's `results` and which did not; returns the hosts
        that are back (gave no answer before, answer now). `live`: the hosts pods still wait
        on, to forget the others once the set of silent hosts grows."""
        answered, silent = heard(results)
        back = frozenset(answered & self.silent)
        self.silent = (self.silent - answered) | silent
        if len(self.silent) > 64:
            self.silent &= live()
        return back


def pod_hosts(pod: dict) -> frozenset[str]:
    """The registry hosts of a pod's images (none for a malformed pod)."""
    try:
        return hosts_of(PodView.of(pod).images)
    except PodShapeError:
        return frozenset()


def hosts_of(images: Iterable[str]) -> frozenset[str]:
    """The registry hosts of `images` (an unparseable reference has none)."""
    hosts = set()
    for image in images:
        try:
            hosts.add(parse_reference(image).host)
        except ArchwayError:
            continue
    return frozenset(hosts)


def heard(results: dict) -> tuple[frozenset[str], frozenset[str]]:
    """The hosts that answered (an image read, or a registry's own refusal such as 404) and
    those that gave no answer (timed out, unreachable) in one pod's `results`."""
    answered: set[str] = set()
    silent: set[str] = set()
    for image, result in results.items():
        if isinstance(result, ImageInfo) or (isinstance(result, RegistryError)
                                             and not isinstance(result, TransportError)):
            answered |= hosts_of([image])
        elif result is None or isinstance(result, (DeadlineExceeded, TransportError)):
            silent |= hosts_of([image])
    return frozenset(answered), frozenset(silent - answered)
