"""Dropped architectures raise the alarm before a reschedule breaks: every
registry.cache.tag_ttl_seconds the leading gate controller checks the tag of every image in the
cluster's workload templates at its registry (a HEAD; paced per registry host as pre-warming
is), with the template's pull credentials.

    the resolver's revalidation finds a tag naming another digest (Resolver.tag_moved), or
    the cluster's image record of a tag names another digest (a replica's check after a
    registry push event, webhook/registryevents.py: ImageRecords.moves), or
    the round finds it naming another digest than the cluster's pods were admitted with
    (their archway.dev/images: a baseline that outlives the leader and its cache)
      -> it lacks an architecture the previous digest had
      -> Warning Event ArchitecturesDropped on every workload whose template uses the tag,
         archway_image_architectures_dropped_total (the chart's ArchwayImageDroppedArchitecture)

The same round removes learned exclusions whose evidence no longer holds (learning.py:
the failing image left the template or names another digest), with a Normal Event
FailedArchitecturesReset. Runs beside remediation.py in the same leadership.
"""
import dataclasses
import logging
import threading
import time
from collections.abc import Callable

from archway import metrics
from archway.cluster.events import EventSink
from archway.cluster.workloadcache import WorkloadFacts, workload_facts, workload_path, workload_reference
from archway.errors import ArchwayError
from archway.kubeapi import LIST_PAGE_SIZE, ApiError, KubeApi
from archway.placement.learning import Learned, learned_from, reset_reason, short_digest
from archway.podview import PodView
from archway.registry.imageref import ImageReference
from archway.registry.model import ImageInfo
from archway.registry.pacing import image_host, paced
from archway.registry.records import ImageRecord
from archway.registry.reference import KINDS, parse_reference
from archway.vocabulary import ANNOTATION_EVIDENCE, ANNOTATION_FAILED, join_architectures

from .leaderloop import KeptChanging, LeaderLoop
from .podstatus import admitted_digests

log = logging.getLogger("archway.remediation")

MIN_ROUND_SECONDS = 1.0
REASON_DROPPED = "ArchitecturesDropped"
REASON_RESET = "FailedArchitecturesReset"


class TagWatch(LeaderLoop):
    def __init__(self, *, api: KubeApi, settings, policy, events: EventSink | None,
                 workloads, resolver, pull_secrets, namespaces=None, exclude_namespaces=(), in_force=None,
                 records=None,
                 round_seconds: float = 300.0, resolve_timeout: float = 10.0,
                 per_second: float = 5.0, clock: Callable[[], float] = time.monotonic):
        super().__init__(api=api, settings=settings, policy=policy, events=events,
                         workloads=workloads, namespaces=namespaces,
                         exclude_namespaces=exclude_namespaces, in_force=in_force)
        self.resolver = resolver
        self.pull_secrets = pull_secrets
        self.records = records     # the cluster's image records (objects/imagerecords.py) or None
        self.round_seconds = max(MIN_ROUND_SECONDS, round_seconds)
        self.resolve_timeout = resolve_timeout
        self.per_second = per_second       # tag checks per registry host and second
        self.rounds = 0
        self._clock = clock
        self._by_reference: dict[str, list[tuple[WorkloadFacts, str]]] = {}
        self._keyrings: dict[tuple, object] = {}
        self._alarmed: set[tuple[str, str, str]] = set()   # (tag, old digest, new digest)
        self._alarm_lock = threading.Lock()   # the resolver's threads alarm too (tag_moved)

    def lead(self, stop: threading.Event) -> None:
        """Rounds until `stop`; the resolver and the image records tell of moved tags
        meanwhile."""
        self.resolver.tag_moved = self.tag_moved
        if self.records is not None:
            self.records.moves.append(self.record_moved)
        try:
            self._rounds(stop)
        finally:
            self.resolver.tag_moved = None
            if self.records is not None:
                self.records.moves.remove(self.record_moved)

    def _rounds(self, stop: threading.Event) -> None:
        began = self._clock()
        while not stop.wait(0 if self.rounds == 0 else
                            max(0.0, began + self.round_seconds - self._clock())):
            began = self._clock()
            try:
                self.review(stop)
            except Exception:
                log.exception("reviewing the workloads' tags failed")

    def review(self, stop: threading.Event | None = None) -> None:
        """One round: the tags of every workload checked at their registry, then the learned
        exclusions whose evidence no longer holds removed."""
        self.workloads.wait_synced(30.0)
        tops = [t for t in self.workloads.tops() if self.mode_of(t.namespace, dict(t.labels)) != "off"]
        results: dict[str, object] = {}
        self._keyrings = {}     # credentials are read again each round
        if self.settings.watch_tags:
            results = self._check_tags(tops, stop)
            if self.api is not None:
                self._compare_with_admitted(results)
        self.rounds += 1
        if self.settings.learn_failed_architectures:
            for top in tops:
                learned = top.learned
                if learned is None or self.mode_of(top.namespace, dict(top.labels)) != "enforce":
                    continue
                why = reset_reason(learned, top.images, results)
                if why:
                    self.reset(top, why, results)

    def _check_tags(self, tops: list[WorkloadFacts], stop) -> dict[str, object]:
        """Each tag checked at its registry once (per set of credentials), paced as
        pre-warming is: at most `per_second` checks a second per registry host. Returns what
        the cache holds for them afterwards (a check still running leaves the answer before)."""
        by_reference: dict[str, list[tuple[WorkloadFacts, str]]] = {}
        wanted: dict[tuple, tuple[str, PodView]] = {}
        for top in tops:
            view = None
            for image in top.images:
                key = tag_key(image)
                if key is None:
                    continue
                by_reference.setdefault(key, []).append((top, image))
                view = view or top.template_view()
                wanted.setdefault((image, top.namespace, top.service_account, top.pull_secrets),
                                  (image, view))
        self._by_reference = by_reference   # read by tag_moved, in the resolver's threads
        stop = stop or threading.Event()
        begin = self._clock()
        for offset, (image, pod) in paced(list(wanted.values()), self.per_second,
                                          lambda item: image_host(item[0])):
            if stop.wait(max(0.0, begin + offset - self._clock())):
                break
            if self._confirmed_lately(image, pod):
                continue    # a process checked it within half a round: its record says so
            # timeout 0: the check starts and goes on; the observer hears of a move.
            self.resolver.resolve_many([image], keyring=self._keyring(pod), timeout=0,
                                       revalidate=frozenset([image]), scope=pod.namespace)
        results: dict[str, object] = {}
        for image, pod in wanted.values():
            results.update(self.resolver.resolve_many([image], keyring=self._keyring(pod),
                                                      timeout=self.resolve_timeout,
                                                      scope=pod.namespace))
        return results

    def _confirmed_lately(self, image: str, pod: PodView) -> bool:
        """The cluster's record of `image` was confirmed at its registry within half a round
        (a new leader's first round after an archway rollout sends no HEAD for it)."""
        try:
            confirmed = self.resolver.confirmed_at(image, self._keyring(pod), pod.namespace)
        except ArchwayError:   # a reference the resolver cannot read: checked as before
            return False
        return confirmed is not None and 0 <= time.time() - confirmed < self.round_seconds / 2

    def _keyring(self, pod: PodView):
        group = (pod.namespace, pod.service_account, pod.pull_secret_names)
        if group not in self._keyrings:
            self._keyrings[group] = self.pull_secrets.credentials_for(
                pod, time.monotonic() + self.resolve_timeout / 2).keyring
        return self._keyrings[group]

    def admitted(self) -> dict[tuple[str, str], set[str]]:
        """(namespace, image) -> the digests the cluster's pods were admitted with (their
        archway.dev/images), listed a page at a time."""
        found: dict[tuple[str, str], set[str]] = {}
        for page in self.api.pages("/api/v1/pods", LIST_PAGE_SIZE):
            for obj in page.get("items") or ():
                meta = obj.get("metadata") if isinstance(obj, dict) else None
                if not isinstance(meta, dict) or meta.get("deletionTimestamp"):
                    continue
                annotations = meta.get("annotations")
                for image, digest in admitted_digests(annotations if isinstance(
                        annotations, dict) else {}).items():
                    found.setdefault((str(meta.get("namespace") or ""), image), set()).add(digest)
        return found

    def _compare_with_admitted(self, results: dict[str, object]) -> None:
        """A tag naming another digest than pods of the workloads using it were admitted with:
        the same alarm as a move the resolver saw, whatever this leader saw before (a re-push
        before its first round, or before it led)."""
        admitted = self.admitted()
        for key, users in self._by_reference.items():
            for top, image in users:
                new = results.get(image)
                if not isinstance(new, ImageInfo) or not new.digest:
                    continue
                for digest in sorted(admitted.get((top.namespace, image), set()) - {new.digest}):
                    old = self._content_of(image, digest, top.template_view())
                    if old is not None:
                        self._alarm(key, old, new)

    def _content_of(self, image: str, digest: str, pod: PodView) -> ImageInfo | None:
        """What `image` at `digest` holds (a digest reference: read once, cached for good)."""
        try:
            pinned = str(dataclasses.replace(parse_reference(image), tag=None, digest=digest))
        except (ArchwayError, ValueError):
            return None
        answer = self.resolver.resolve_many([pinned], keyring=self._keyring(pod),
                                            timeout=self.resolve_timeout,
                                            scope=pod.namespace)[pinned]
        return answer if isinstance(answer, ImageInfo) else None

    def tag_moved(self, ref: ImageReference, old, new) -> None:
        """The resolver found `ref` naming another digest (the resolver.tag_moved observer)."""
        self._alarm(str(ref), old, new)

    def record_moved(self, before: ImageRecord, after: ImageRecord) -> None:
        """A record of a tag the workloads use names another digest (ImageRecords.moves)."""
        if after.reference in self._by_reference:
            self._alarm(after.reference, before.info, after.info)

    def _alarm(self, ref: str, old: ImageInfo, new: ImageInfo) -> None:
        """ArchitecturesDropped when `new` lacks an architecture `old` had: once per move."""
        lost = dropped_architectures(old, new)
        if not lost or not new.platforms:
            return   # nothing dropped, or the new content records no platform: unknown
        move = (ref, old.digest or "", new.digest or "")
        with self._alarm_lock:
            if move in self._alarmed:
                return
            self._alarmed.add(move)
        concerned = [(top, image) for top, image in self._by_reference.get(ref, [])
                     if self.mode_of(top.namespace, dict(top.labels)) != "off"]
        untold = [(top, image) for top, image in concerned if not self._told_before(top, new)]
        if concerned and not untold:
            log.info("tag %s moved to %s: its workloads were told by a leader before", ref,
                     short_digest(new.digest or "?"))
            return     # one alarm per re-push, whichever replica leads now
        for arch in sorted(lost):
            metrics.ARCHITECTURES_DROPPED.labels(arch).inc()
        log.warning("tag %s moved from %s (%s) to %s (%s): %s dropped; %d workload(s) use it",
                    ref, short_digest(old.digest or "?"), join_architectures(offered(old)),
                    short_digest(new.digest or "?"), join_architectures(offered(new)), join_architectures(lost),
                    len(concerned))
        for top, image in untold:
            self.event(workload_reference(top), "Warning", REASON_DROPPED, "Revalidate",
                       f"tag {image} now names {short_digest(new.digest or '?')} "
                       f"({join_architectures(offered(new))}), which lacks {join_architectures(lost)} that "
                       f"{short_digest(old.digest or '?')} had: its pods rescheduled onto "
                       f"{join_architectures(lost)} nodes will not start there (archway report lists the "
                       f"workloads running on an architecture their tag no longer offers)")

    def _told_before(self, top: WorkloadFacts, new: ImageInfo) -> bool:
        """Whether an ArchitecturesDropped Event about `top` names `new`'s digest already: a
        leader before this one raised it (Events are the memory every leader shares; the
        apiserver keeps them an hour by default)."""
        if self.api is None or not top.uid or not new.digest:
            return False
        try:
            listed = self.api.request("GET", f"/api/v1/namespaces/{top.namespace}/events", query={
                "fieldSelector": f"involvedObject.uid={top.uid},reason={REASON_DROPPED}"})
        except ApiError as e:
            log.info("the Events of %s could not be read (%s): the alarm is raised", top.display_name, e)
            return False
        digest = f"now names {short_digest(new.digest)} "
        return any(digest in str(e.get("message") or "") for e in listed.get("items") or [])

    def reset(self, top: WorkloadFacts, why: str, results: dict) -> bool:
        """Remove a learned exclusion whose evidence no longer holds (read again first: it may
        have been learned anew meanwhile)."""
        path = workload_path(top.kind, top.namespace, top.object_name)
        removed: Learned | None = None

        def remove(obj: dict) -> dict | None:
            nonlocal removed
            meta = obj.get("metadata") or {}
            current = workload_facts(top.kind)(obj)
            removed = learned_from(meta.get("annotations") or {}, top.display_name)
            if current is None or removed is None or not reset_reason(removed, current.images,
                                                                      results):
                return None
            return {ANNOTATION_FAILED: None, ANNOTATION_EVIDENCE: None}

        try:
            if self.patch_annotations(path, remove, gone_is_nothing=True) is None:
                return False
        except KeptChanging:
            return False
        assert removed is not None
        log.info("%s %s/%s: learned exclusion of %s removed: %s", top.kind, top.namespace,
                 top.object_name, join_architectures(removed.architectures), why)
        self.event(workload_reference(top), "Normal", REASON_RESET, "Reset",
                   f"archway no longer keeps its pods off "
                   f"{join_architectures(removed.architectures)}: {why}")
        return True


def offered(info: ImageInfo) -> frozenset[str]:
    """What an image runs on, per OS: `arm64` for a Linux platform (as a node's
    kubernetes.io/arch says it), `windows/amd64` for another OS's (a Windows workload's)."""
    return frozenset(arch if os == "linux" else f"{os}/{arch}"
                     for os in info.operating_systems for arch in info.architectures_for(os))


def dropped_architectures(old: ImageInfo, new: ImageInfo) -> frozenset[str]:
    """What `new` lacks that `old` had (see `offered`)."""
    return offered(old) - offered(new)


def tag_key(image: str) -> str | None:
    """How a tag is named in the resolver's observer (str of its reference); None for what
    cannot move under a running workload: a digest, or a kind with no digest to check."""
    try:
        ref = parse_reference(image)
    except ArchwayError:
        return None
    if ref.digest or KINDS[ref.scheme].head_digest is None:
        return None
    return str(ref)
