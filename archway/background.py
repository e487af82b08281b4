"""A daemon thread per process, started on first use.

Threads do not survive fork, and gunicorn forks its workers after the app is built: a thread
started in the master would be missing in every worker. Each process starts its own instead.
"""
import os
import threading


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
