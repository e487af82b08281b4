"""`archway serve`'s processes, looked after apart from gunicorn (archway.server.supervisor):
with a process to keep running beside the server (here the extender's traffic poller), `archway
serve` forks gunicorn's master and watches both; signals reach the master; killed, it leaves
nothing running; a master that dies takes the rest with it."""
import os
import signal

import pytest
import requests

from lab.cluster.processes import pid_alive as alive
from lab.procs import children, cmdline, free_port, serve_extender, wait_until

pytestmark = pytest.mark.slow


class Served:
    """`archway serve --product extender` with a `prometheus.url`: the traffic poller beside."""

    def __init__(self, tmp_path):
        self.server = serve_extender(tmp_path, workers=2, prometheus={
            "url": f"http://127.0.0.1:{free_port()}"})
        self.pid = self.server.proc.pid

    def tree(self) -> tuple[int, list[int], int]:
        """(gunicorn's master, its workers, the traffic poller's process) once all are up."""
        def found():
            kids = children(self.pid)
            masters = [p for p in kids if cmdline(p) == cmdline(self.pid)]
            pollers = [p for p in kids if "archway.extender.pollerprocess" in cmdline(p)]
            if len(masters) == 1 and len(pollers) == 1 and len(children(masters[0])) == 2:
                return masters[0], children(masters[0]), pollers[0]
            return None
        return wait_until(found, 30, "archway serve's processes")

    def healthz(self) -> int:
        return requests.get(f"http://127.0.0.1:{self.server.port}/healthz", timeout=5).status_code

    def log(self) -> str:
        with open(self.server.log_path, encoding="utf-8", errors="replace") as f:
            return f.read()


def test_the_master_and_the_poller_are_archway_serves_children_and_stop_with_it(tmp_path):
    served = Served(tmp_path)
    try:
        master, workers, poller = served.tree()
        assert served.healthz() == 200
        assert not {master, poller} & set(workers)
        served.server.proc.send_signal(signal.SIGTERM)
        assert served.server.proc.wait(30) == 0
        wait_until(lambda: not any(map(alive, [master, poller, *workers])), 15,
                   "every process to stop")
    finally:
        served.server.stop()


def test_a_killed_archway_serve_leaves_nothing_running(tmp_path):
    served = Served(tmp_path)
    try:
        master, workers, poller = served.tree()
        os.kill(served.pid, signal.SIGKILL)
        served.server.proc.wait(10)
        # gunicorn's master gets SIGTERM from the kernel (PR_SET_PDEATHSIG) and stops its
        # workers; the poller sees its parent gone within a second.
        wait_until(lambda: not any(map(alive, [master, poller, *workers])), 20,
                   "the orphans to stop")
    finally:
        for pid in (served.pid, *children(served.pid)):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        served.server.stop()


def test_a_dead_master_ends_archway_serve_and_its_poller(tmp_path):
    served = Served(tmp_path)
    try:
        master, workers, poller = served.tree()
        os.kill(master, signal.SIGKILL)
        assert served.server.proc.wait(30) == 128 + signal.SIGKILL
        wait_until(lambda: not any(map(alive, [poller, *workers])), 20, "the rest to stop")
        assert "gunicorn's master (pid" in served.log()
    finally:
        served.server.stop()


def test_signals_reach_gunicorns_master_and_a_dead_poller_comes_back(tmp_path):
    served = Served(tmp_path)
    try:
        master, workers, poller = served.tree()
        os.kill(served.pid, signal.SIGHUP)    # gunicorn's reload: new workers, same master
        wait_until(lambda: len(children(master)) == 2 and not set(children(master)) & set(workers),
                   30, "gunicorn to replace its workers")
        os.kill(poller, signal.SIGKILL)
        wait_until(lambda: any("pollerprocess" in cmdline(p) and p != poller
                               for p in children(served.pid)), 15, "the poller to start again")
        assert served.healthz() == 200
        assert "traffic poller (pid" in served.log()
    finally:
        served.server.stop()
