"""Events (`events.k8s.io/v1`) that tell a human what archway did to a pod or its owner.

`event` builds the object the apiserver's strict events.k8s.io/v1 validation accepts (eventTime,
reportingController, reportingInstance, action, reason, type; note at most 1 kB, its control
characters escaped as a log line's are: a reference may hold CR/LF); `EventSink`
posts them from a background thread through a bounded queue, so neither an admission nor a
release ever waits on it, and a flood of them drops the excess instead of growing memory. The
same note about the same object is sent once per few minutes: a controller retrying 100
replicas does not make 100 Events.

An Event about a pod at its admission cannot name the pod's uid: the apiserver gives it one
only when it stores the pod, after every webhook has answered. `kubectl describe pod` selects
Events by the uid, so the sink waits (a few seconds at most, off the admission's path) for the
pod to be stored and names its uid; a pod that never appears (its creation failed later) gets
the Event without one, as before.
"""
import logging
import queue
import time

from archway.background import ProcessThread
from archway.kubeapi import ApiError, KubeApi
from archway.lease import micro_time, parse_time
from archway.logsafe import escape
from archway.podview import PodView
from archway.registry.cache import TTLCache

log = logging.getLogger("archway.events")

REPORTING_CONTROLLER = "archway.dev/archway"   # the webhook and the gate controller alike
REASON_UNSCHEDULABLE = "ArchwayUnschedulable"
NOTE_LIMIT = 1024
_REPEAT_AFTER_SECONDS = 300.0
_FIELD_LIMIT = 128
UID_WAIT_SECONDS = 5.0        # how long an Event about a pod being created waits for it to exist
_FIRST_LOOK_SECONDS = 0.1     # the admission's answer and the store come first
_OLDER_POD_SECONDS = 60.0     # a pod of that name made this much earlier is another one


def event(*, regarding: dict, event_type: str, reason: str, action: str, note: str,
          instance: str, now: float) -> dict:
    """An events.k8s.io/v1 Event about `regarding` (an ObjectReference with namespace)."""
    name = regarding.get("name") or "object"
    note = escape(note)   # `kubectl describe` prints it as it is: no line of the pod's choosing
    if len(note.encode()) > NOTE_LIMIT:   # the apiserver counts bytes
        note = note.encode()[:NOTE_LIMIT - 3].decode(errors="ignore") + "..."
    return {
        "apiVersion": "events.k8s.io/v1", "kind": "Event",
        # client-go's naming: the object's name and a nanosecond stamp, unique per object.
        "metadata": {"name": f"{name[:200]}.{int(now * 1e9):x}",
                     "namespace": regarding.get("namespace") or "default"},
        "eventTime": micro_time(now),
        "reportingController": REPORTING_CONTROLLER,
        "reportingInstance": instance[:_FIELD_LIMIT],
        "action": action[:_FIELD_LIMIT], "reason": reason[:_FIELD_LIMIT],
        "type": event_type, "note": note,
        "regarding": {k: v for k, v in regarding.items() if v},
    }


def owner_reference(pod: PodView) -> dict | None:
    """The pod's controller (ReplicaSet, Job...) as an ObjectReference, if it has one."""
    owner = next((o for o in pod.owner_references if o.controller), None)
    if owner is None:
        return None
    return {"apiVersion": owner.api_version, "kind": owner.kind, "name": owner.name,
            "uid": owner.uid, "namespace": pod.namespace}


def pod_or_owner(pod: PodView) -> dict:
    """What an Event about a pod at admission is about. A pod a controller creates has no name
    yet (generateName): its controller is, where `kubectl describe` of the workload shows it."""
    owner = owner_reference(pod) if not pod.name else None
    return owner or {"apiVersion": "v1", "kind": "Pod", "namespace": pod.namespace,
                     "name": pod.name or pod.generate_name}


def pod_reference(pod: dict) -> dict:
    meta = pod.get("metadata") or {}
    return {"apiVersion": "v1", "kind": "Pod", "namespace": meta.get("namespace"),
            "name": meta.get("name"), "uid": meta.get("uid"),
            "resourceVersion": meta.get("resourceVersion")}


def uid_of_stored(pod: dict, recorded_at: float) -> str | None:
    """The uid of `pod` (as the API stored it) if it is the pod an Event recorded at
    `recorded_at` (wall clock) is about, not an older one of the same name."""
    meta = pod.get("metadata") or {}
    created = parse_time(meta.get("creationTimestamp"))
    if created is not None and created < recorded_at - _OLDER_POD_SECONDS:
        return None
    return meta.get("uid") or None


class EventSink:
    def __init__(self, api: KubeApi, *, instance: str, max_queued: int = 1000,
                 wall=time.time, uid_wait_seconds: float = UID_WAIT_SECONDS):
        self.api = api
        self.instance = instance
        self._wall = wall
        self._uid_wait = uid_wait_seconds
        self._queue: queue.Queue = queue.Queue(max_queued)
        self._runner = ProcessThread(self._run, "archway-events")
        self._recent = TTLCache(1000, time.monotonic)

    def record(self, regarding: dict, event_type: str, reason: str, action: str,
               note: str, *, being_created: bool = False) -> None:
        """Queue an Event; never blocks. `being_created`: `regarding` is a pod in admission (it
        has its name, not yet its uid)."""
        repeat = (regarding.get("namespace"), regarding.get("name"), reason, note)
        if self._recent.get(repeat) is not None:
            return
        self._recent.put(repeat, True, _REPEAT_AFTER_SECONDS)
        self._runner.start_once()
        now = self._wall()
        body = event(regarding=regarding, event_type=event_type, reason=reason, action=action,
                     note=note, instance=self.instance, now=now)
        try:
            self._queue.put_nowait((body, being_created, time.monotonic(), now))
        except queue.Full:
            pass   # a full queue of Events still to send: this one is not worth blocking for

    def flush(self, timeout: float) -> None:
        """Wait until every queued Event was sent (tests, a graceful stop)."""
        end = time.monotonic() + timeout
        while self._queue.unfinished_tasks and time.monotonic() < end:
            time.sleep(0.01)

    def _stored_uid(self, regarding: dict, queued_at: float, recorded_at: float) -> str | None:
        """The uid the apiserver gave the pod once stored; None when it did not appear in time
        (its creation failed after admission) or cannot be read."""
        path = f"/api/v1/namespaces/{regarding['namespace']}/pods/{regarding['name']}"
        due = queued_at + self._uid_wait
        pause = _FIRST_LOOK_SECONDS
        time.sleep(max(0.0, queued_at + pause - time.monotonic()))
        while True:
            try:
                return uid_of_stored(self.api.request("GET", path, timeout=5), recorded_at)
            except ApiError as e:
                if e.status != 404:
                    log.debug("could not read pod %s for its Event: %s", regarding["name"], e)
                    return None
            if time.monotonic() + pause > due:
                return None
            time.sleep(pause)
            pause = min(1.0, pause * 2)

    def _run(self) -> None:
        while True:
            body, being_created, queued_at, recorded_at = self._queue.get()
            try:
                regarding = body["regarding"]
                if being_created and regarding.get("kind") == "Pod" and not regarding.get("uid"):
                    uid = self._stored_uid(regarding, queued_at, recorded_at)
                    if uid:
                        regarding["uid"] = uid
                namespace = body["metadata"]["namespace"]
                self.api.request("POST", f"/apis/events.k8s.io/v1/namespaces/{namespace}/events",
                                 body=body, timeout=5)
            except ApiError as e:
                # A namespace being deleted takes no new object: the Event has nobody to tell.
                gone = e.status == 403 and "being terminated" in e.message
                (log.debug if gone else log.warning)(
                    "could not record Event %s on %s: %s", body["reason"],
                    body["regarding"].get("name"), e)
            except Exception:
                log.exception("could not record an Event")
            finally:
                self._queue.task_done()
