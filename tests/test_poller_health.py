"""The extender's traffic poller process (extender/pollerprocess.py) in /healthz and /readyz, as
the gate controller's process is (main/probes.py, archway.server.supervisor): a poller that keeps
dying, or that is alive and stopped producing, fails /healthz so the kubelet restarts the pod;
one being brought back does not."""
import json
import os
import signal
import subprocess
import sys
import time

import requests

from archway.config import config_from_dict
from archway.extender import pollerprocess
from archway.main.worker import build_worker
from archway.server import supervisor
from lab.procs import children, cmdline, free_port, serve_extender, wait_until
from tests.infra.siteclient import SiteClient


def _poller_pid(serve: int) -> int | None:
    found = [p for p in children(serve) if "archway.extender.pollerprocess" in cmdline(p)]
    return found[0] if len(found) == 1 else None


def test_a_stuck_poller_process_fails_healthz_and_one_brought_back_does_not(tmp_path):
    """Nothing answers at the Prometheus address (a closed port on this machine): the poller's
    loop still turns, and that is what /healthz asks. SIGSTOP: alive, producing nothing."""
    serve = serve_extender(tmp_path, workers=1, prometheus={
        "url": f"http://127.0.0.1:{free_port()}", "refresh_seconds": 0.3, "timeout_seconds": 0.5})
    session = requests.Session()
    session.trust_env = False
    url = f"http://127.0.0.1:{serve.port}"

    def health() -> tuple[int, dict]:
        answer = session.get(f"{url}/healthz", timeout=10)
        return answer.status_code, answer.json()

    def fact() -> str:
        return session.get(f"{url}/readyz", timeout=10).json()["traffic_poller_process"]

    poller = None
    try:
        poller = wait_until(lambda: _poller_pid(serve.proc.pid), 30, "the poller process")
        wait_until(lambda: fact().startswith(f"running (pid {poller},"), 30, "its fact")
        assert health()[0] == 200
        os.kill(poller, signal.SIGSTOP)
        stopped = time.monotonic()
        limit = pollerprocess.stall_limit(config_from_dict(
            {"prometheus": {"refresh_seconds": 0.3, "timeout_seconds": 0.5}}).prometheus)
        code, body = wait_until(lambda: (h := health())[0] == 503 and h, limit + 30,
                                "/healthz to fail with the poller stuck")
        assert time.monotonic() - stopped >= limit - 1   # not before its limit
        assert "traffic poller process (pid" in body["problems"]["traffic_poller"]
        os.kill(poller, signal.SIGCONT)
        wait_until(lambda: health()[0] == 200, 30, "/healthz to pass once it turns again")
        # Killed: the master starts another one; being brought back is no failure.
        os.kill(poller, signal.SIGKILL)
        wait_until(lambda: "restarted 1 time)" in fact(), 30, "the poller restarted")
        assert health()[0] == 200
    finally:
        if poller is not None:
            try:
                os.kill(poller, signal.SIGCONT)
            except ProcessLookupError:
                pass
        serve.stop()


def test_a_poller_dying_at_every_launch_fails_healthz_after_the_limit(tmp_path, quick_supervisor):
    """As the gate controller's crash loop (tests/test_gate_lifecycle.py), limits shrunk."""
    status = str(tmp_path / pollerprocess.STATUS_FILE)
    config = config_from_dict({"server": {"state_dir": str(tmp_path / "state")},
                               "kubernetes": {"enabled": "off"}, "extender": {"node_cache": False},
                               "prometheus": {"url": f"http://127.0.0.1:{free_port()}"}})
    client = SiteClient(build_worker(config, product="extender", poller_status=status))
    program = ["false"]                               # dies at once, every time
    keeper = supervisor.Supervisor(lambda: subprocess.Popen(program), status, what="traffic poller")

    def healthz(code: int):
        keeper.tick()                                 # the master's loop
        answer = client.get("/healthz")
        return answer.status_code == code and answer.get_json()

    try:
        assert healthz(200)
        failing = wait_until(lambda: healthz(503), 30, "/healthz to fail in the crash loop")
        assert "no traffic poller has stayed up for" in failing["problems"]["traffic_poller"]
        program[:] = ["sleep", "60"]                  # one that stays up ends it
        wait_until(lambda: healthz(200), 30, "/healthz to pass once a poller stayed up")
    finally:
        keeper.stop()


def test_when_a_running_poller_counts_as_stuck():
    settings = config_from_dict({"prometheus": {"url": "http://prometheus.invalid",
                                                "refresh_seconds": 15, "timeout_seconds": 5}}).prometheus
    limit = pollerprocess.stall_limit(settings)
    assert limit == 3 * (4 * 5 + 1)      # a turn: two queries of twice their timeout, the wait
    now = 10_000.0
    running = {"state": "running", "pid": 7, "since": now - 1000}
    assert pollerprocess.stall_problem(running, now - limit + 1, now, settings) is None
    assert "(pid 7) has not finished a turn of its loop for 64 s" in pollerprocess.stall_problem(
        running, now - limit - 1, now, settings)
    # A heartbeat left by the process before this one: the new one has the limit from its start.
    fresh = dict(running, since=now - 5)
    assert pollerprocess.stall_problem(fresh, now - 1000, now, settings) is None
    assert pollerprocess.stall_problem(dict(running, state="restarting"), None, now, settings) is None
    assert pollerprocess.stall_problem(None, None, now, settings) is None
