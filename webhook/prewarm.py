"""Pre-warming: after a start or a rollout, read the images the cluster already runs.

Without it every replica starts cold: the first pod of every workload pays a registry round
trip, and during a registry outage it cannot be placed at all. So each serving process lists the
pod templates of Deployments, StatefulSets, DaemonSets, ReplicaSets, Jobs and CronJobs and the
pods themselves (paged), and resolves their images in the background with each pod's pull
secrets, paced per registry host (`registry.prewarm.requests_per_second` lookups, each one
manifest request). /readyz does not wait for it. The processes of one server share their lookups
(registry/sharedlookups.py), so the registry sees each image about once per server.

With the cluster's image records (imagerecords.py, listed before pre-warming starts) an image
another replica already read is answered from its record: a rollout of archway asks the
registries nothing for the images the cluster knows; only images without a record are read.
"""
import logging
import time

from archway import metrics
from archway.background import ProcessThread
from archway.cluster.workloads import TEMPLATE_PATHS, Wanted, wanted_images
from archway.podview import PodView
from archway.registry.model import ImageInfo
from archway.registry.pacing import image_host, paced

log = logging.getLogger("archway.prewarm")

# How long pre-warming waits for its last lookups before counting what it got.
_SETTLE_SECONDS = 60.0


class Prewarmer:
    def __init__(self, reader_factory, resolver, pull_secrets, *, per_second: float,
                 exclude_namespaces=(), clock=time.monotonic, sleep=time.sleep):
        self._reader_factory = reader_factory   # -> webhook.cluster.ClusterReader
        self.resolver = resolver
        self.pull_secrets = pull_secrets
        self.per_second = per_second
        self.exclude_namespaces = tuple(exclude_namespaces)
        self._clock, self._sleep = clock, sleep
        self._runner = ProcessThread(self._run, "archway-prewarm")
        self.outcome: dict[str, int] = {}

    def start(self) -> None:
        self._runner.start_once()

    def _run(self) -> None:
        try:
            self.run_once()
        except Exception as e:  # pre-warming is an optimisation: never the worker's end
            log.warning("pre-warming stopped: %s", e)

    def run_once(self) -> dict[str, int]:
        """List, resolve, count; returns {"images", "resolved", "failed"}."""
        reader = self._reader_factory()
        objects = [obj for kind in TEMPLATE_PATHS for obj in reader.workloads(kind)]
        wanted = wanted_images(objects, self.exclude_namespaces)
        metrics.PREWARM_IMAGES.labels("found").set(len(wanted))
        log.info("pre-warming %d images of %d workloads and pods", len(wanted), len(objects))
        begin = self._clock()
        schedule = paced(wanted, self.per_second, lambda w: image_host(w.image))
        for started, (offset, item) in enumerate(schedule, 1):
            wait = begin + offset - self._clock()
            if wait > 0:
                self._sleep(wait)
            # timeout 0: start the lookup and go on; it fills the cache in the background.
            self.resolver.resolve_many([item.image], keyring=self._keyring(item.pod), timeout=0,
                                       scope=item.pod.namespace)
            metrics.PREWARM_IMAGES.labels("started").set(started)
        self.outcome = self._count(wanted)
        for state in ("resolved", "failed"):
            metrics.PREWARM_IMAGES.labels(state).set(self.outcome[state])
        log.info("pre-warming done: %(resolved)d of %(images)d images resolved, %(failed)d "
                 "failed", self.outcome)
        return self.outcome

    def _keyring(self, pod: PodView):
        return self.pull_secrets.credentials_for(pod, self._clock() + 5.0).keyring

    def _count(self, wanted: list[Wanted]) -> dict[str, int]:
        """What the lookups gave (a cache hit, or the lookup still running, joined)."""
        end = self._clock() + _SETTLE_SECONDS
        resolved = 0
        for item in wanted:
            answer = self.resolver.resolve_many([item.image], keyring=self._keyring(item.pod),
                                                timeout=max(0.0, end - self._clock()),
                                                scope=item.pod.namespace)[item.image]
            resolved += isinstance(answer, ImageInfo)
        return {"images": len(wanted), "resolved": resolved, "failed": len(wanted) - resolved}
