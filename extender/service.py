"""The scheduler extender's service, plain Python without HTTP: filter and prioritize on parsed
ExtenderArgs (wire.py), answering the reply bytes; routes.py is its HTTP side.

Filter keeps a pod off nodes its images cannot run on (archfilter.py's decision) and, with
extender.max_utilisation, off nodes whose link is too busy (ceiling.py). Prioritize answers the
score signals' combination (signals.py), built from the config in `score_signals`. The extender
is configured `ignorable: true`, so unknown things pass instead of blocking.
"""
import logging
import os
import time

from archway import metrics
from archway.cluster.nodes import NodeCache
from archway.kubeclient import api_client_factory
from archway.podview import PodShapeError, PodView

from .archfilter import annotated_architectures, filter_by_arch, shared_architectures
from .ceiling import Ceiling
from .pollerprocess import poller_process_runs
from .prometheus import TrafficPoller
from .signals import Prioritizer, ScoreSignal
from .trafficscore import TrafficScore
from .wire import ExtenderArgs, MalformedExtenderArgs, filter_result_json

log = logging.getLogger("archway.extender")

# Kept back from extender.deadline_seconds to build and send the answer.
ANSWER_MARGIN_SECONDS = 0.1


def score_signals(config, traffic: TrafficScore) -> list[ScoreSignal]:
    """prioritize's signals, from the config: the one place a new signal is registered.
    Traffic (built by the Extender, since the utilisation ceiling reads it too) is always one:
    without a Prometheus sample it has no opinion."""
    signals: list[ScoreSignal] = [traffic]
    return signals


class Extender:
    """Holds what the two endpoints share: the resolver, the node cache (built once per process
    by archway.main.app and handed in; None: no cluster access or extender.node_cache off), the
    traffic poller and the score signals."""

    def __init__(self, config, resolver, *, node_cache: NodeCache | None = None,
                 traffic: TrafficPoller | None = None):
        self.config = config
        self.resolver = resolver       # None: pods are filtered by their annotation only
        self.node_cache = node_cache
        self.traffic = traffic or TrafficPoller(config.prometheus, shared_dir=traffic_dir(),
                                                follow_only=poller_process_runs())
        self.traffic_score = TrafficScore(config, self.traffic, node_cache,
                                          api_client_factory(config.kubernetes))
        self.herd, self.pod_watch = self.traffic_score.herd, self.traffic_score.pod_watch
        self.signals = score_signals(config, self.traffic_score)
        self.prioritizer = Prioritizer(self.signals)
        self._no_cache_logged = False
        limit = config.extender.max_utilisation
        self.ceiling = Ceiling(limit, self.traffic, config.prometheus) if limit else None

    def start(self) -> None:
        """Read traffic from the worker's boot on: a worker that has served no call yet must not
        answer the scheduler's first prioritize without the sample its peers already have."""
        self.traffic_score.start()

    def stop(self) -> None:
        """Stop the background parts: the traffic poller, the node cache and the signals'."""
        for part in (self.traffic, self.node_cache, *self.signals):
            if part is not None:
                part.stop()

    # --- filter ------------------------------------------------------------------------------
    def pod_architectures(self, pod: PodView,
                          deadline: float) -> tuple[frozenset[str] | None, str, str]:
        """(S or None, where it came from, explanation used when S is empty)."""
        archs = annotated_architectures(pod)
        if archs is not None:
            return archs, "annotation", ""
        images = pod.images
        resolver = self.resolver
        if not images or resolver is None:
            return None, "none", ""
        results = resolver.resolve_many(images, timeout=deadline - time.monotonic())
        archs, detail = shared_architectures(results, pod.os)
        return archs, "resolver", detail

    def filter(self, args: ExtenderArgs, started: float | None = None, *,
               wait: bool = True) -> tuple[bytes, str] | None:
        """(ExtenderFilterResult JSON, a summary for the log line). `started`: time.monotonic()
        when the request arrived; the answer is due within extender.deadline_seconds of it.
        `wait` False: None instead of an answer that would wait (see answers_at_once)."""
        deadline = ((started or time.monotonic()) + self.config.extender.deadline_seconds
                    - ANSWER_MARGIN_SECONDS)
        try:
            pod = PodView.of(args.pod)
        except PodShapeError as e:
            raise MalformedExtenderArgs(f"ExtenderArgs.Pod: {e}") from None
        if not wait and not self.answers_at_once(pod, args):
            return None
        pod_archs, source, detail = self.pod_architectures(pod, deadline)
        if args.nodes is not None:
            facts: list = list(args.nodes) if pod_archs else []
            names = [node.name for node in args.nodes]
        else:
            names = args.names
            facts = self._cached_facts(names, deadline) if pod_archs else []
        outcome = filter_by_arch(pod_archs, [getattr(f, "arch", None) for f in facts], names,
                                 why_none=detail, pod_os=pod.os,
                                 node_oses=[getattr(f, "os", pod.os) for f in facts])
        keep, lifted = outcome.keep, ""
        busy: dict[str, str] = {}
        if self.ceiling is not None and keep:
            keep, busy, lifted = self.ceiling.apply(args, names, keep,
                                                    lambda s: self.traffic_score.book(s).loads)
        # A wrong architecture is unresolvable; a busy link (FailedNodes) is load, which passes.
        body = filter_result_json(args, keep, busy, outcome.unresolvable)
        summary = (f"{pod.display_name}: "
                   f"archs={','.join(sorted(pod_archs)) if pod_archs is not None else 'unknown'} "
                   f"from {source}, {len(keep)}/{len(names)} nodes pass"
                   + (f", {len(busy)} above extender.max_utilisation" if busy else "") + lifted)
        return body, summary

    def answers_at_once(self, pod: PodView, args: ExtenderArgs) -> bool:
        """Whether filtering this pod waits for nothing: its architectures are in its
        annotation (or nothing can be looked up), and the names' Nodes are in the node cache
        (or come in the call)."""
        if (self.resolver is not None and pod.images
                and annotated_architectures(pod) is None):
            return False   # a registry lookup
        cache = self.node_cache
        return args.nodes is not None or cache is None or cache.settled

    def _cached_facts(self, names: list[str], deadline: float) -> list:
        """NodeFacts (arch, OS) per name from the node cache, None for a name it lacks. A name
        the cache does not hold is treated as a node of unknown arch and of the pod's OS, so
        it passes: the cache trails the scheduler's own informer by a watch event at most (a
        node that just joined), or there is no cluster access at all; refusing would stall
        scheduling on archway's blind spot, while the pod's kubernetes.io/arch selector that the
        webhook set still guards the node."""
        cache = self.node_cache
        # The first call in a worker may arrive before the first list is in: wait for it
        # within the extender's deadline rather than answer blind.
        if cache is None or not cache.wait_synced(deadline - time.monotonic()):
            if not self._no_cache_logged:
                self._no_cache_logged = True
                log.warning("NodeNames filter without a node cache (extender.node_cache off, no "
                            "cluster access, or the first list is not done): every node passes")
            return [None] * len(names)
        nodes = cache.nodes
        return [nodes.get(name) for name in names]

    # --- prioritize --------------------------------------------------------------------------
    def prioritize(self, args: ExtenderArgs) -> bytes:
        """HostPriorityList JSON: the signals' combined score of each candidate."""
        return self.prioritizer.answer(args)


def traffic_dir() -> str | None:
    """Where the workers of one `archway serve` share the traffic snapshot: inside the per-run
    directory serve.py makes for their metrics (PROMETHEUS_MULTIPROC_DIR). None outside it."""
    directory = metrics.multiprocess_dir()
    return os.path.join(directory, "traffic") if directory else None
