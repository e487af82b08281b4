"""The traffic poller in a process of its own, kept running by `archway serve`'s master.

A refresh reads ~1-2 MB from Prometheus at 5,000 nodes and parses it with one json.loads, a C
call that holds the GIL for 5-75 ms on a loaded machine, then splits it: done in a worker, every
prioritize call landing meanwhile waited for it (issue 28, figure 7). Here the query and its
parse run where no request is answered; the workers only follow the snapshot file it writes
(prometheus.py's SharedSnapshot: a quarter of the size, each series' score already worked out)
and never query themselves while this process exists (POLLER_PROCESS_ENV).
"""
import logging
import os
import pickle
import subprocess
import sys
import threading

from archway.background import supervised_child

from .prometheus import FOLLOW_SECONDS, TrafficPoller

log = logging.getLogger("archway.traffic")

# Set by `archway serve` for its workers when this process polls for them.
POLLER_PROCESS_ENV = "ARCHWAY_TRAFFIC_POLLER_PROCESS"


def poller_process_runs() -> bool:
    """Whether this server's traffic poller is a process of its own (the workers only follow)."""
    return os.environ.get(POLLER_PROCESS_ENV) == "1"


def start_process(config, shared_dir: str) -> subprocess.Popen:
    """The poller in a fresh interpreter (`-P`, as the gate controller: nothing inherited from
    gunicorn's master); its config and directory travel pickled on stdin."""
    process = subprocess.Popen([sys.executable, "-P", "-m", "archway.extender.pollerprocess"],
                               stdin=subprocess.PIPE)
    assert process.stdin is not None
    try:
        process.stdin.write(pickle.dumps((config, shared_dir)))
        process.stdin.close()
    except OSError:   # it died at once: the supervisor sees it exit
        pass
    return process


def run(settings, shared_dir: str, stop: threading.Event) -> None:
    """Poll until `stop`: the one poller of the server's shared directory."""
    poller = TrafficPoller(settings, shared_dir=shared_dir)
    try:
        while not stop.is_set():
            try:
                poller.tick()
            except Exception:  # a bug must not silently end the loop and freeze the scores
                log.exception("unexpected error in the traffic poller")
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
