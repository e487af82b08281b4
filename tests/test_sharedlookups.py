"""Lookups shared between worker processes: one fetch for a burst across processes."""
import multiprocessing
import os
import time

from archway.registry import sharedlookups
from archway.registry.model import ImageInfo
from archway.registry.platforms import normalize
from archway.registry.sharedlookups import SharedLookups

INFO = ImageInfo("reg.example/app:1", frozenset({normalize("linux", "arm64"),
                                                   normalize("linux", "arm", "v7")}),
                 "sha256:" + "a" * 64, "oci-index")


def _worker(directory, counter, key, results):
    def fetch():
        with open(counter, "a") as f:
            f.write("x")
        time.sleep(0.3)  # long enough for the other process to queue behind the lock
        return INFO
    info = SharedLookups(directory).run(key, fetch, ttl=60, deadline=time.monotonic() + 5)
    results.put((info.platforms, info.digest, info.source))


def test_two_processes_asking_at_once_fetch_once(tmp_path):
    counter = str(tmp_path / "fetches")
    ctx = multiprocessing.get_context("fork")
    results = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(str(tmp_path), counter, ("k",), results))
             for _ in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(10)
    assert open(counter).read() == "x"
    answers = [results.get(timeout=1) for _ in procs]
    assert answers[0] == answers[1] == (INFO.platforms, INFO.digest, INFO.source)


def test_expired_and_other_keys_in_the_same_slot_fetch_again(tmp_path, monkeypatch):
    monkeypatch.setattr(sharedlookups, "SLOTS", 1)  # every key shares one slot file
    now = [1000.0]
    shared = SharedLookups(str(tmp_path), clock=lambda: now[0])
    calls = []

    def fetch(tag):
        calls.append(tag)
        return ImageInfo(f"reg.example/app:{tag}", frozenset({normalize("linux", tag)}), None, "x")

    deadline = time.monotonic() + 5
    assert shared.run(("a",), lambda: fetch("amd64"), 10, deadline).architectures == {"amd64"}
    assert shared.run(("a",), lambda: fetch("never"), 10, deadline).architectures == {"amd64"}
    assert shared.run(("b",), lambda: fetch("s390x"), 10, deadline).architectures == {"s390x"}
    assert shared.run(("a",), lambda: fetch("arm64"), 10, deadline).architectures == {"arm64"}
    now[0] += 11
    assert shared.run(("a",), lambda: fetch("riscv64"), 10, deadline).architectures == {"riscv64"}
    assert calls == ["amd64", "s390x", "arm64", "riscv64"]
    assert len(os.listdir(tmp_path)) == 1


def test_a_held_lock_never_holds_a_caller_past_its_deadline(tmp_path):
    holder = SharedLookups(str(tmp_path))
    key = ("slow",)

    def slow_fetch():
        # While this process holds the slot, another caller with a short deadline fetches itself.
        other = os.fork()
        if other == 0:
            start = time.monotonic()
            SharedLookups(str(tmp_path)).run(key, lambda: INFO, 60, time.monotonic() + 0.2)
            os._exit(0 if time.monotonic() - start < 1.0 else 1)
        _, status = os.waitpid(other, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        return INFO

    assert holder.run(key, slow_fetch, 60, time.monotonic() + 5) == INFO
