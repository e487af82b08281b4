"""Lookups shared between worker processes: one fetch for a burst across processes, a lock per
image key (an unrelated image never waits), failures shared as values."""
import multiprocessing
import os
import time

from archway.errors import NotFound
from archway.registry import sharedlookups
from archway.registry.cache import Failure
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
        return INFO, 60
    info, _ = SharedLookups(directory).run(key, fetch, deadline=time.monotonic() + 5)
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


def test_an_unrelated_image_never_waits_for_another_ones_fetch(tmp_path, monkeypatch):
    """Both keys share one record file; only the key's own lock is held during a fetch."""
    monkeypatch.setattr(sharedlookups, "RECORD_FILES", 1)
    holder = SharedLookups(str(tmp_path))

    def slow_fetch():
        # While this process holds key a's lock, another process looks key b up. It must not
        # wait for us: we wait for it (up to 5 s) before our fetch ends.
        done = str(tmp_path / "b-done")
        other = os.fork()
        if other == 0:
            def fetch_b():
                return ImageInfo("reg.example/b:1", frozenset(), None, "x"), 60
            SharedLookups(str(tmp_path)).run(("b",), fetch_b, time.monotonic() + 30)
            open(done, "w").close()
            os._exit(0)
        end = time.monotonic() + 5
        while not os.path.exists(done) and time.monotonic() < end:
            time.sleep(0.01)
        assert os.path.exists(done), "key b waited on key a's lock"
        os.waitpid(other, 0)
        return INFO, 60

    assert holder.run(("a",), slow_fetch, time.monotonic() + 30)[0] == INFO


def test_expired_answers_and_other_keys_in_the_same_record_file_fetch_again(tmp_path, monkeypatch):
    monkeypatch.setattr(sharedlookups, "RECORD_FILES", 1)
    now = [1000.0]
    shared = SharedLookups(str(tmp_path), clock=lambda: now[0])
    calls = []

    def fetch(tag):
        calls.append(tag)
        return ImageInfo(f"reg.example/app:{tag}", frozenset({normalize("linux", tag)}), None, "x"), 10

    deadline = time.monotonic() + 5
    assert shared.run(("a",), lambda: fetch("amd64"), deadline)[0].architectures == {"amd64"}
    answer, left = shared.run(("a",), lambda: fetch("never"), deadline)
    assert answer.architectures == {"amd64"} and left == 10
    assert shared.run(("b",), lambda: fetch("s390x"), deadline)[0].architectures == {"s390x"}
    assert shared.run(("a",), lambda: fetch("arm64"), deadline)[0].architectures == {"arm64"}
    now[0] += 11
    assert shared.run(("a",), lambda: fetch("riscv64"), deadline)[0].architectures == {"riscv64"}
    assert calls == ["amd64", "s390x", "arm64", "riscv64"]


def test_failures_are_shared_as_typed_values_and_answers_kept_0_s_are_not(tmp_path):
    first, second = SharedLookups(str(tmp_path)), SharedLookups(str(tmp_path))
    deadline = time.monotonic() + 5
    missing = NotFound("reg.example/app:1: manifest unknown", host="reg.example", status=404)
    first.run(("gone",), lambda: (Failure.of(missing), 30), deadline)
    answer, _ = second.run(("gone",), lambda: (INFO, 60), deadline)
    assert isinstance(answer, Failure) and isinstance(answer.error, NotFound)
    assert str(answer.error) == str(missing) and answer.error.status == 404
    first.run(("late",), lambda: (Failure.of(NotFound("x")), 0), deadline)
    assert second.run(("late",), lambda: (INFO, 60), deadline)[0] == INFO


def test_a_held_lock_never_holds_a_caller_past_its_deadline(tmp_path):
    holder = SharedLookups(str(tmp_path))
    key = ("slow",)

    def slow_fetch():
        # While this process holds the key, another caller with a short deadline fetches itself.
        other = os.fork()
        if other == 0:
            start = time.monotonic()
            SharedLookups(str(tmp_path)).run(key, lambda: (INFO, 60), time.monotonic() + 0.2)
            os._exit(0 if time.monotonic() - start < 1.0 else 1)
        _, status = os.waitpid(other, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        return INFO, 60

    assert holder.run(key, slow_fetch, time.monotonic() + 5)[0] == INFO
