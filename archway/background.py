"""A daemon thread per process, started on first use; and how a child process that `archway
serve`'s master supervises begins.

Threads do not survive fork, and gunicorn forks its workers after the app is built: a thread
started in the master would be missing in every worker. Each process starts its own instead.
"""
import logging
import os
import pickle
import signal
import sys
import threading
from typing import Any


class ProcessThread:
    def __init__(self, target, name: str):
        self._target = target
        self._name = name
        self._lock = threading.Lock()
        self._pid: int | None = None
        self.thread: threading.Thread | None = None

    def start_once(self, before_start=None) -> None:
        """Start the thread unless this process already did; `before_start` resets shared state."""
        if self._pid == os.getpid():
            return
        with self._lock:
            if self._pid == os.getpid():
                return
            if before_start is not None:
                before_start()
            self.thread = threading.Thread(target=self._target, name=self._name, daemon=True)
            self.thread.start()
            self._pid = os.getpid()

    def join(self, timeout: float) -> None:
        if self.thread is not None:
            self.thread.join(timeout)


def supervised_child(what: str) -> tuple[Any, threading.Event]:
    """(its arguments, its stop event) for a process `archway serve`'s master starts and
    supervises (the gate controller, the traffic poller): the arguments come pickled on stdin;
    SIGTERM and SIGINT set the event, and so does the master's end (SIGKILL leaves it no time to
    stop its children: one nobody supervises must not go on, a controller must not keep leading)."""
    parent = os.getppid()
    arguments = pickle.loads(sys.stdin.buffer.read())
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())

    def orphaned() -> None:
        while not stop.wait(1.0):
            if os.getppid() != parent:
                logging.getLogger(__name__).warning("%s: archway serve (pid %d) is gone; stopping",
                                                    what, parent)
                stop.set()

    threading.Thread(target=orphaned, name=f"archway-{what.replace(' ', '-')}-parent",
                     daemon=True).start()
    return arguments, stop
