"""The threads that run registry lookups: fair to hosts, bounded in queue, never holding exit.

A host that hangs or drips bytes must not take every lookup thread: at most `per_host` lookups
of one host run at once; the host's other lookups wait in its own line, holding no thread, while
lookups of other hosts go on. At most `max_queued` lookups wait in all; past that a submit fails
at once (Overloaded), so a flood of images costs memory and time in proportion to the bound, not
to the flood. Threads are daemons, started on demand: a command whose caller gave up
(`archway inspect --timeout`) exits at once instead of waiting for a stuck registry.
"""
import threading
from collections import Counter, deque
from collections.abc import Callable
from concurrent.futures import Future

from archway.errors import Overloaded


class LookupPool:
    def __init__(self, threads: int, per_host: int, max_queued: int, name: str = "resolve"):
        self.threads = threads
        self.per_host = per_host
        self.max_queued = max_queued
        self._name = name
        self._ready: deque[tuple[str, Callable, Future]] = deque()
        self._waiting: dict[str, deque[tuple[str, Callable, Future]]] = {}
        self._admitted: Counter[str] = Counter()   # per host: ready or running
        self._queued = 0                            # ready or waiting (not running)
        self._idle = 0
        self._started = 0
        self._cv = threading.Condition()

    def submit(self, host: str, fn: Callable[[], object]) -> Future:
        future: Future = Future()
        with self._cv:
            if self._queued >= self.max_queued:
                raise Overloaded(f"{self._queued} image lookups are already waiting; archway "
                                 f"takes no more until some finish")
            item = (host, fn, future)
            self._queued += 1
            if self._admitted[host] < self.per_host:
                self._admitted[host] += 1
                self._ready.append(item)
                self._wake_or_start()
            else:
                self._waiting.setdefault(host, deque()).append(item)
        return future

    def _wake_or_start(self) -> None:
        if self._idle:
            # Claimed now: until it runs, the woken thread still looks idle, and counting on it
            # again would hand a whole burst to that one thread (one lookup after another).
            self._idle -= 1
            self._cv.notify()
        elif self._started < self.threads:
            self._started += 1
            threading.Thread(target=self._work, name=f"{self._name}-{self._started}",
                             daemon=True).start()

    def _work(self) -> None:
        while True:
            with self._cv:
                while not self._ready:
                    self._idle += 1
                    self._cv.wait()   # only notify() ends it, having taken it off _idle
                host, fn, future = self._ready.popleft()
                self._queued -= 1
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn())
                except BaseException as e:  # handed to whoever waits on the future
                    future.set_exception(e)
            with self._cv:
                line = self._waiting.get(host)
                if line:
                    self._ready.append(line.popleft())   # the host's slot passes to its next lookup
                    if not line:
                        del self._waiting[host]
                    self._wake_or_start()
                else:
                    self._admitted[host] -= 1
                    if not self._admitted[host]:
                        del self._admitted[host]
