"""One pod watch in a process of its own, for figure 22: its CPU time and memory read from /proc
by the parent while a real apiserver streams it the cluster's pods.

    python3 -m bench.apps.podwatch_worker KUBECONFIG archway      the leader's FailingPods, as is
    python3 -m bench.apps.podwatch_worker KUBECONFIG parse-only   the same list + watch keeping
                                                                  nothing: what any watch costs

Prints `synced N BYTES` once the first list is in (N pods kept, holding BYTES: the deep size
of what is kept), then `seen N` for every 500th watch event it has handled, on stdout, one line
each. Both kinds hand the heap's free pages back (malloc_trim) before saying `synced`, so their
RSS compares what they hold, not what the list left in the allocator.
"""
import ctypes
import gc
import sys
import threading

from archway.gate.remediation import FailingPods
from archway.kubeclient import build_api_client
from archway.listwatch import ListWatch


class Kept:
    """Stands in for the leader's Remediation: remembers what the watch hands it."""

    def __init__(self):
        self.kept: dict[str, object] = {}
        self.events = 0
        self._lock = threading.Lock()

    def found(self, pods: list) -> None:
        self.kept = {p.uid: p for p in pods}
        gc.collect()
        ctypes.CDLL("libc.so.6").malloc_trim(0)
        print(f"synced {len(pods)} {deep_size(self.kept)}", flush=True)


    def counted(self) -> None:
        with self._lock:
            self.events += 1
            if self.events % 500 == 0:
                print(f"seen {self.events}", flush=True)


def deep_size(value, seen=None) -> int:
    """Bytes held by `value` and everything it refers to (each object once)."""
    seen = set() if seen is None else seen
    if id(value) in seen:
        return 0
    seen.add(id(value))
    size = sys.getsizeof(value)
    if isinstance(value, dict):
        size += sum(deep_size(k, seen) + deep_size(v, seen) for k, v in value.items())
    elif isinstance(value, (list, tuple, set, frozenset)):
        size += sum(deep_size(item, seen) for item in value)
    elif hasattr(value, "__dataclass_fields__"):
        size += sum(deep_size(getattr(value, name), seen) for name in value.__dataclass_fields__)
    return size


class CountingFailingPods(FailingPods):
    def _on_event(self, kind: str, obj: dict) -> None:
        super()._on_event(kind, obj)
        self.remediation.counted()


class ArchwaySink(Kept):
    def failing(self, pod) -> None:
        self.kept[pod.uid] = pod

    def gone(self, uid: str) -> None:
        self.kept.pop(uid, None)


class ParseOnly(ListWatch):
    """The same paged list and watch, keeping nothing: the cost archway's check adds to."""
    what = "parse-only watch"
    path = "/api/v1/pods"
    page_size = 500

    def __init__(self, sink: Kept, factory):
        super().__init__(factory, thread_name="bench-parse-only", watch_timeout_seconds=3600,
                         request_timeout_seconds=60)
        self.sink = sink

    def _slim(self, obj: dict):
        return None

    def _on_list(self, items: list) -> None:
        self.sink.found(items)

    def _on_event(self, kind: str, obj: dict) -> None:
        self.sink.counted()


def main() -> None:
    kubeconfig, mode = sys.argv[1], sys.argv[2]
    from archway.config import KubernetesSettings
    settings = KubernetesSettings(kubeconfig=kubeconfig)

    def factory():
        return build_api_client(settings)[0]

    if mode == "archway":
        sink: Kept = ArchwaySink()
        watch: ListWatch = CountingFailingPods(sink, factory, 3600)   # type: ignore[arg-type]
    else:
        sink = Kept()
        watch = ParseOnly(sink, factory)
    watch.ensure_started()
    sys.stdin.read()   # until the parent closes it
    watch.stop()


if __name__ == "__main__":
    main()
