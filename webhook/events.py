"""Kubernetes Events from the webhook: "this pod can run on no node of the cluster", said where
`kubectl describe` and `kubectl get events` show it, instead of a silent Pending.

Sent from one background thread through a bounded queue, so an admission never waits for the
API; the same message about the same object is sent once per few minutes, so a controller
retrying 100 replicas does not make 100 Events. A full queue or a failed write costs only the
Event (a debug line), never an admission.
"""
import datetime as dt
import logging
import os
import queue
import secrets
import socket
import time

from archway.background import ProcessThread
from archway.podview import PodView
from archway.registry.cache import TTLCache

log = logging.getLogger("archway.events")

COMPONENT = "archway"
REASON_UNSCHEDULABLE = "ArchwayUnschedulable"
_QUEUE_SIZE = 100
_REPEAT_AFTER_SECONDS = 300.0
_WRITE_TIMEOUT_SECONDS = 5.0
_MAX_MESSAGE_CHARS = 1024   # the apiserver refuses Event messages over 1 KiB


def involved_object(pod: PodView) -> dict:
    """The object the Event is about. A pod created by a controller has no name yet at
    admission (generateName), so the Event goes to its controller (ReplicaSet, Job...), where
    `kubectl describe` of the workload shows it."""
    if not pod.name:
        owner = next((o for o in pod.owner_references if o.controller), None)
        if owner is not None:
            return {"apiVersion": owner.api_version, "kind": owner.kind,
                    "namespace": pod.namespace, "name": owner.name, "uid": owner.uid}
    return {"apiVersion": "v1", "kind": "Pod", "namespace": pod.namespace,
            "name": pod.name or pod.generate_name}


def event_body(pod: PodView, reason: str, message: str, *, now: dt.datetime,
               instance: str) -> dict:
    involved = involved_object(pod)
    stamp = now.strftime("%Y-%m-%dT%H:%M:%SZ")
    # client-go's naming: <object>.<16 hex digits>
    name = f"{involved['name'] or 'pod'}.{secrets.token_hex(8)}"
    return {"apiVersion": "v1", "kind": "Event",
            "metadata": {"name": name, "namespace": pod.namespace},
            "involvedObject": involved, "reason": reason, "type": "Warning",
            "message": message[:_MAX_MESSAGE_CHARS], "count": 1,
            "firstTimestamp": stamp, "lastTimestamp": stamp,
            "source": {"component": COMPONENT}, "reportingComponent": COMPONENT,
            "reportingInstance": instance}


class EventRecorder:
    def __init__(self, api_client_factory):
        self._api_client_factory = api_client_factory
        self._queue: queue.Queue = queue.Queue(_QUEUE_SIZE)
        self._recent = TTLCache(1000, time.monotonic)
        self._runner = ProcessThread(self._run, "archway-events")
        self.instance = f"{socket.gethostname()}-{os.getpid()}"
        self.sent = 0

    def warn(self, pod: PodView, reason: str, message: str) -> None:
        """Queue a Warning Event about `pod`; never blocks."""
        key = (pod.namespace, involved_object(pod)["name"], reason, message)
        if self._recent.get(key) is not None:
            return
        self._recent.put(key, True, _REPEAT_AFTER_SECONDS)
        self._runner.start_once()
        try:
            self._queue.put_nowait(event_body(pod, reason, message,
                                              now=dt.datetime.now(dt.UTC),
                                              instance=self.instance))
        except queue.Full:
            log.debug("event queue full: dropped %s about %s", reason, pod.display_name)

    def _run(self) -> None:
        try:
            api_client = self._api_client_factory()
        except Exception as e:
            log.warning("Events disabled: cannot build a Kubernetes client: %s", e)
            api_client = None
        from kubernetes import client
        api = client.CoreV1Api(api_client) if api_client is not None else None
        while True:
            body = self._queue.get()
            if api is None:
                continue
            try:
                api.create_namespaced_event(body["metadata"]["namespace"], body,
                                            _request_timeout=_WRITE_TIMEOUT_SECONDS,
                                            _preload_content=False)
                self.sent += 1
            except Exception as e:  # an Event is best effort
                log.debug("could not write Event %s: %s", body["reason"], type(e).__name__)
