"""The traffic poller in a process of its own, kept running by `archway serve`.

A refresh reads ~1-2 MB from Prometheus at 5,000 nodes and parses it with one json.loads, a C
call that holds the GIL for 5-75 ms on a loaded machine, then splits it: done in a worker, every
prioritize call landing meanwhile waited for it (issue 28, figure 7). Here the query and its
parse run where no request is answered; the workers only follow the snapshot file it writes
(prometheus.py's SharedSnapshot: a quarter of the size, each series' score already worked out)
and never query themselves while this process exists (POLLER_PROCESS_ENV).

`archway serve` starts it as `python -P -m archway.extender.pollerprocess`, its config
and directory pickled on stdin (archway.server.supervisor). Its health, for the workers'
/healthz (main/probes.py), as the gate controller's: archway serve's supervisor writes STATUS_FILE
(died, restarting, a crash loop), and the process itself touches HEARTBEAT_FILE at every turn of
its loop, so one that is alive but stuck (it stopped producing) is seen too (`stall_problem`,
pure).
"""
import logging
import os
import threading

from archway.background import supervised_child

from .prometheus import FOLLOW_SECONDS, TrafficPoller

log = logging.getLogger("archway.traffic")

# Set by `archway serve` for its workers when this process polls for them.
POLLER_PROCESS_ENV = "ARCHWAY_TRAFFIC_POLLER_PROCESS"
# In the shared traffic directory: the supervisor's status, and the process's own heartbeat.
STATUS_FILE = "poller-status.json"
HEARTBEAT_FILE = "poller.heartbeat"
STALL_FLOOR_SECONDS = 15.0


def poller_process_runs() -> bool:
    """Whether this server's traffic poller is a process of its own (the workers only follow)."""
    return os.environ.get(POLLER_PROCESS_ENV) == "1"


def stall_limit(settings) -> float:
    """Seconds without a turn of the loop after which the process counts as stuck: a turn is a
    query or two bounded by timeout_seconds each (twice that at worst), its parse, and the
    wait; three turns missed, never under STALL_FLOOR_SECONDS."""
    turn = 4 * settings.timeout_seconds + min(settings.refresh_seconds, FOLLOW_SECONDS)
    return max(STALL_FLOOR_SECONDS, 3 * turn)


def stall_problem(status: dict | None, heartbeat: float | None, now: float,
                  settings) -> str | None:
    """Why /healthz fails although the process runs: no turn of its loop for stall_limit.
    `status`: the supervisor's (archway.server.supervisor.read_status); `heartbeat`: the wall
    time of the last turn (HEARTBEAT_FILE's mtime), None before the first. A process is given
    the limit from its own start: a heartbeat left by one before it does not count."""
    if status is None or status.get("state") != "running":
        return None
    last = max(float(status.get("since") or now), heartbeat or 0.0)
    silent = now - last
    if silent <= stall_limit(settings):
        return None
    return (f"the traffic poller process (pid {status.get('pid')}) has not finished a turn of "
            f"its loop for {silent:.0f} s")


def _beat(path: str) -> None:
    try:
        with open(path, "a"):
            os.utime(path)
    except OSError as e:
        log.warning("cannot touch the traffic poller's heartbeat %s: %s", path, e)


def run(settings, shared_dir: str, stop: threading.Event) -> None:
    """Poll until `stop`: the one poller of the server's shared directory."""
    poller = TrafficPoller(settings, shared_dir=shared_dir)
    heartbeat = os.path.join(shared_dir, HEARTBEAT_FILE)
    try:
        while not stop.is_set():
            try:
                poller.tick()
            except Exception:  # a bug must not silently end the loop and freeze the scores
                log.exception("unexpected error in the traffic poller")
            _beat(heartbeat)
            stop.wait(min(settings.refresh_seconds, FOLLOW_SECONDS))
    finally:
        poller.stop()


def _main() -> None:
    from archway import logs
    (config, shared_dir), stop = supervised_child("traffic poller")
    logs.configure(logging.INFO, config.server.log_format)   # as `archway serve` logs
    run(config.prometheus, shared_dir, stop)


if __name__ == "__main__":
    _main()
