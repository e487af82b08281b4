"""One gate controller among the replicas: a `coordination.k8s.io/v1` Lease.

The elector follows client-go's leader election: a holder renews the Lease every third of its
duration; another replica takes it over once it has seen no renewal for a whole duration,
measured on its OWN clock from when it last saw the Lease change (clocks of different machines
are never compared). Every write carries the resourceVersion read, so two candidates can never
both win: the loser gets 409 Conflict. A holder that stops releases the Lease at once.

`lead_while_elected` is the candidate's loop around the elector: whoever leads (the gate
controller's process) hands it what to do while it holds the Lease.

The observer is what the webhook asks before gating a pod: is some controller alive to remove
the gate? It re-reads the Lease in the background, so admission never waits on the API.
"""
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable
from datetime import UTC, datetime

from archway.background import ProcessThread
from archway.kubeapi import ApiError, KubeApi
from archway.kubeclient import in_cluster_namespace

log = logging.getLogger("archway.lease")

LEASE_NAME = "archway-gate-controller"
EAGER_SECONDS = 0.25   # how often an observer without a fresh leader reads, for a duration


def lease_namespace(configured: str | None) -> str:
    """kubernetes.namespace, else the namespace archway's pod runs in, else default."""
    return configured or in_cluster_namespace() or os.environ.get("POD_NAMESPACE") or "default"


def new_identity() -> str:
    return f"{socket.gethostname()[:60]}_{os.getpid()}_{uuid.uuid4().hex[:8]}"


def micro_time(epoch: float) -> str:
    """metav1.MicroTime as the API writes it."""
    return datetime.fromtimestamp(epoch, UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def lease_path(namespace: str, name: str = LEASE_NAME) -> str:
    return f"/apis/coordination.k8s.io/v1/namespaces/{namespace}/leases/{name}"


class LeaderElector:
    def __init__(self, api: KubeApi, namespace: str, *, identity: str, duration_seconds: float,
                 clock=time.monotonic, wall=time.time):
        self.api = api
        self.namespace = namespace
        self.identity = identity
        self.duration = duration_seconds
        self._clock = clock
        self._wall = wall
        self._seen_version: str | None = None
        self._seen_at = 0.0

    @property
    def renew_every(self) -> float:
        return self.duration / 3

    def try_acquire_or_renew(self) -> bool:
        """True when this replica holds the Lease after the call."""
        path = lease_path(self.namespace)
        try:
            lease = self.api.request("GET", path, timeout=self.renew_every)
        except ApiError as e:
            if e.status != 404:
                log.warning("cannot read Lease %s/%s: %s", self.namespace, LEASE_NAME, e)
                return False
            return self._create()
        spec = lease.get("spec") or {}
        version = (lease.get("metadata") or {}).get("resourceVersion")
        now = self._clock()
        if version != self._seen_version:
            self._seen_version, self._seen_at = version, now
        holder = spec.get("holderIdentity") or ""
        duration = float(spec.get("leaseDurationSeconds") or self.duration)
        if holder and holder != self.identity and now - self._seen_at < duration:
            return False  # someone else holds a Lease we saw renewed less than a duration ago
        renewed = dict(spec, holderIdentity=self.identity, renewTime=micro_time(self._wall()),
                       leaseDurationSeconds=int(max(1, round(self.duration))))
        if holder != self.identity:
            renewed["acquireTime"] = renewed["renewTime"]
            renewed["leaseTransitions"] = int(spec.get("leaseTransitions") or 0) + (1 if holder else 0)
        lease = dict(lease, spec=renewed)
        try:
            stored = self.api.request("PUT", path, body=lease, timeout=self.renew_every)
        except ApiError as e:
            if e.status != 409:
                log.warning("cannot renew Lease %s/%s: %s", self.namespace, LEASE_NAME, e)
            return False
        self._seen_version, self._seen_at = stored["metadata"].get("resourceVersion"), now
        return True

    def release(self) -> None:
        """Give the Lease up so another replica takes over at once (on a graceful stop)."""
        path = lease_path(self.namespace)
        try:
            lease = self.api.request("GET", path, timeout=2)
            spec = lease.get("spec") or {}
            if spec.get("holderIdentity") != self.identity:
                return
            lease["spec"] = dict(spec, holderIdentity="", leaseDurationSeconds=1,
                                 renewTime=micro_time(self._wall()))
            self.api.request("PUT", path, body=lease, timeout=2)
        except ApiError as e:
            log.info("could not release the Lease (it will expire instead): %s", e)

    def _create(self) -> bool:
        now = micro_time(self._wall())
        body = {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
                "metadata": {"name": LEASE_NAME, "namespace": self.namespace},
                "spec": {"holderIdentity": self.identity,
                         "leaseDurationSeconds": int(max(1, round(self.duration))),
                         "acquireTime": now, "renewTime": now, "leaseTransitions": 0}}
        try:
            stored = self.api.request(
                "POST", f"/apis/coordination.k8s.io/v1/namespaces/{self.namespace}/leases",
                body=body, timeout=self.renew_every)
        except ApiError as e:
            if e.status != 409:
                log.warning("cannot create Lease %s/%s: %s", self.namespace, LEASE_NAME, e)
            return False
        self._seen_version, self._seen_at = stored["metadata"].get("resourceVersion"), self._clock()
        return True


def lead_while_elected(elector: LeaderElector, lead: Callable[[threading.Event], None],
                       stop: threading.Event, *, what: str, thread_name: str,
                       logger: logging.Logger = log) -> None:
    """Be a candidate until `stop`: while this replica holds the Lease, `lead(leading)` runs in a
    thread of its own (`thread_name`), and `leading` is set once the Lease is lost (not renewed
    for two thirds of a duration: another replica may take it at a whole one) or on `stop`,
    when the Lease is given up. `what` and `logger` name the leader in the log."""
    leading: threading.Event | None = None
    leader_thread: threading.Thread | None = None
    last_renewed = 0.0
    try:
        while not stop.is_set():
            held = elector.try_acquire_or_renew()
            now = time.monotonic()
            if held:
                last_renewed = now
                if leading is None:
                    logger.info("%s %s: leading", what, elector.identity)
                    leading = threading.Event()
                    leader_thread = threading.Thread(target=lead, args=(leading,),
                                                     name=thread_name, daemon=True)
                    leader_thread.start()
            elif leading is not None and now - last_renewed > elector.duration * 2 / 3:
                logger.warning("%s %s: lost the Lease; stopping", what, elector.identity)
                leading.set()
                leader_thread.join(10)  # type: ignore[union-attr]
                leading = None
            stop.wait(elector.renew_every if leading is not None else
                      max(0.2, elector.duration / 5))
    finally:
        if leading is not None:
            leading.set()
            leader_thread.join(3)  # type: ignore[union-attr]
            elector.release()


class LeaseObserver:
    """Is a gate controller alive? Read in the background.

    Fresh means: a holder is named, and the Lease changed less than its duration ago on this
    process's clock; the very first read trusts renewTime instead (nothing was seen change yet).

    While a leader is fresh the Lease is read every third of its duration. Without one it is
    read every EAGER_SECONDS for up to `eager_seconds` (a duration unless told: a controller
    starting, or taking over, is seen at once), then every third again (a controller that cannot
    lead must not make every worker poll the API fast for ever). Asked with a deadline while
    eager, `leader_fresh` waits for a read that starts after the question: an admission right
    after a controller took the Lease sees it, whatever this worker read before.
    """

    def __init__(self, api: KubeApi, namespace: str, *, duration_seconds: float,
                 eager_seconds: float | None = None, clock=time.monotonic, wall=time.time):
        self.api = api
        self.namespace = namespace
        self.path = lease_path(namespace)
        self.duration = duration_seconds
        self.eager_seconds = duration_seconds if eager_seconds is None else eager_seconds
        self._clock = clock
        self._wall = wall
        self._holder = ""
        self._version: str | None = None
        self._fresh_until = 0.0
        self.last_error: str | None = None      # why the last read failed, None: it did not
        self._leaderless_since: float | None = None
        self._reads_started = 0
        self._reads_done = 0
        self._wanted = False                    # someone waits for a read: start it now
        self._changed = threading.Condition()
        self._runner = ProcessThread(self._loop, "archway-lease-observer")

    def leader_fresh(self, deadline: float | None = None) -> bool:
        """Whether a controller holds a fresh Lease. `deadline` (time.monotonic()): when no
        leader is known and the observer is eager, wait until then for a read that starts
        after this call."""
        if self._fresh():
            return True
        if deadline is None or not self.eager:
            return False
        self.start()
        with self._changed:
            wanted = self._reads_started + 1
            self._wanted = True
            self._changed.notify_all()
            while self._reads_done < wanted:
                remaining = deadline - time.monotonic()
                if remaining <= 0 or not self._changed.wait(remaining):
                    break
        return self._fresh()

    @property
    def has_read(self) -> bool:
        """Whether a first read (successful or not) is done."""
        return self._reads_done > 0

    @property
    def eager(self) -> bool:
        """No fresh leader, and none for less than `eager_seconds` (or nothing read yet)."""
        if self._fresh():
            return False
        since = self._leaderless_since
        return since is None or self._clock() - since < self.eager_seconds

    def refresh(self) -> None:
        try:
            lease = self.api.request("GET", self.path, timeout=max(1.0, self.duration / 3))
        except ApiError as e:
            if e.status == 404:
                self._holder, self.last_error = "", None
            else:
                self.last_error = f"Lease {self.namespace}/{LEASE_NAME} unreadable: {e}"
            self._note_leader()
            return  # unreadable: what was known simply ages out
        self.last_error = None
        spec = lease.get("spec") or {}
        version = (lease.get("metadata") or {}).get("resourceVersion")
        duration = float(spec.get("leaseDurationSeconds") or self.duration)
        now = self._clock()
        if self._version is None:
            renewed = parse_time(spec.get("renewTime"))
            age = self._wall() - renewed if renewed is not None else duration
            self._fresh_until = now + duration - max(0.0, age)
        elif version != self._version:
            self._fresh_until = now + duration
        self._version = version
        self._holder = spec.get("holderIdentity") or ""
        self._note_leader()

    def start(self) -> None:
        """Start reading in the background (in the process that serves: threads do not fork)."""
        self._runner.start_once()

    def _fresh(self) -> bool:
        return bool(self._holder) and self._clock() < self._fresh_until

    def _note_leader(self) -> None:
        if self._fresh():
            self._leaderless_since = None
        elif self._leaderless_since is None:
            self._leaderless_since = self._clock()

    def _loop(self) -> None:
        while True:
            with self._changed:
                self._reads_started += 1
                self._wanted = False
            try:
                self.refresh()
            except Exception:  # never let the observer die: a dead one says "no leader" forever
                log.exception("Lease observer failed")
            with self._changed:
                self._reads_done += 1
                self._changed.notify_all()
                interval = EAGER_SECONDS if self.eager else max(0.5, self.duration / 3)
                self._changed.wait_for(lambda: self._wanted, interval)


def parse_time(value) -> float | None:
    if not isinstance(value, str):
        return None
    for fmt in ("%Y-%m-%dT%H:%M:%S.%fZ", "%Y-%m-%dT%H:%M:%SZ"):
        try:
            return datetime.strptime(value, fmt).replace(tzinfo=UTC).timestamp()
        except ValueError:
            continue
    return None

