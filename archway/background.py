"""A daemon thread per process, started on first use; and how a child process that `archway
serve` supervises begins.

Threads do not survive fork, and gunicorn forks its workers after their parts are built: a
thread started before the fork would be missing in every worker. Each process starts its own.
"""
import logging
import os
import pickle
import signal
import sys
import threading
from typing import Any

# The environment variable that names the process which started a supervised child: the child
# stops when its parent is no longer that one.
SUPERVISOR_ENV = "ARCHWAY_SUPERVISOR_PID"


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
    """(its arguments, its stop event) for a process `archway serve` starts and supervises (the
    gate controller, the traffic poller): the arguments come pickled on stdin; SIGTERM and
    SIGINT set the event, and so does the end of `archway serve` (SIGKILL leaves it no time to
    stop its children: one nobody supervises must not go on, a controller must not keep leading)."""
    parent = int(os.environ.get(SUPERVISOR_ENV) or os.getppid())
    arguments = pickle.loads(sys.stdin.buffer.read())
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())

    def orphaned() -> None:
        while True:
            if os.getppid() != parent:
                logging.getLogger(__name__).warning("%s: archway serve (pid %d) is gone; stopping",
                                                    what, parent)
                stop.set()
            if stop.wait(1.0):
                return

    threading.Thread(target=orphaned, name=f"archway-{what.replace(' ', '-')}-parent",
                     daemon=True).start()
    return arguments, stop
