"""The processes `archway serve` keeps running beside gunicorn's master (the gate controller,
the extender's traffic poller), one Supervisor each, looked after apart from gunicorn
(`serve_beside`): `archway serve` forks gunicorn's master and watches it and them.

    start (a fresh interpreter, `-P`: no working directory can shadow the installed package)
      -> `archway serve` looks at it every turn of its loop (at least once a second)
      -> died: restarted after 1 s, 2 s, 4 s ... RESTART_MAX_SECONDS (back to 1 s once it has
         run STABLE_SECONDS), each restart counted (`on_restart`)
      -> the server stops: SIGTERM (the process winds down: a leader gives its Lease up),
         SIGKILL after a grace

What it is doing goes into a small JSON file in the server's run directory, its mtime touched at
every turn: the workers read it for /readyz (a fact) and /healthz (failing when nobody brings
the process back: `archway serve` stopped turning, or none has stayed up (run STABLE_SECONDS) for
DOWN_LIMIT_SECONDS, across restarts: a crash loop counts as down, so the kubelet restarts the
pod). `process_problem` and `process_fact` decide that, without I/O.
"""
import ctypes
import json
import logging
import os
import pickle
import select
import signal
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Sequence

from archway.background import SUPERVISOR_ENV
from archway.statusfile import write_status

log = logging.getLogger("archway.server")

RESTART_MIN_SECONDS = 1.0
RESTART_MAX_SECONDS = 30.0
STABLE_SECONDS = 60.0         # a process that ran this long starts the back-off afresh
DOWN_LIMIT_SECONDS = 90.0     # none stayed up this long (restarts failed): /healthz fails
HEARTBEAT_LIMIT_SECONDS = 15.0  # `archway serve` has not looked for this long: /healthz fails
# What `archway serve` passes on to gunicorn's master (its graceful stop, quick stop, reload,
# more or fewer workers, reopened logs); the first three also stop the supervised processes.
FORWARDED_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGQUIT, signal.SIGHUP, signal.SIGTTIN,
                     signal.SIGTTOU, signal.SIGUSR1, signal.SIGWINCH)
STOPPING_SIGNALS = frozenset({signal.SIGTERM, signal.SIGINT, signal.SIGQUIT})
_PR_SET_PDEATHSIG = 1


def start_process(module: str, payload) -> subprocess.Popen:
    """`python -P -m <module>` in a fresh process of its own: nothing inherited from `archway
    serve` (its signal handlers, what it imported), and nothing gunicorn's workers would
    inherit. `-P`: the working directory is not put on sys.path, so a folder named `archway`
    there (a checkout) cannot replace the installed package; PYTHONPATH still counts (the image
    sets it). `payload` travels pickled on stdin (archway.background.supervised_child reads it:
    the server's own config, already checked, and what else the process needs), and who started
    it in the environment (it stops when that process is gone, even before it looked)."""
    process = subprocess.Popen([sys.executable, "-P", "-m", module], stdin=subprocess.PIPE,
                               env={**os.environ, SUPERVISOR_ENV: str(os.getpid())})
    assert process.stdin is not None
    try:
        process.stdin.write(pickle.dumps(payload))
        process.stdin.close()
    except OSError:   # it died at once: the supervisor sees it exit
        pass
    return process


def stop_process(process: subprocess.Popen | None, timeout: float = 10.0) -> None:
    if process is None or process.poll() is not None:
        return
    process.terminate()   # SIGTERM: it winds down (a leader gives its Lease up) and exits
    try:
        process.wait(timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait(5)


def describe_exit(code: int | None) -> str:
    if code is None:
        return "running"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exited with status {code}"


class Supervisor:
    """Keeps one process running; `tick()` is called by `archway serve`'s loop. `what` names the
    process in the log and in /healthz's words."""

    def __init__(self, start, status_path: str | None, *, what: str, clock=time.monotonic,
                 wall=time.time, on_exit=None, on_restart=None):
        self._start = start            # () -> subprocess.Popen
        self.what = what
        self._on_restart = on_restart  # () -> None, at each restart (a counter's inc)
        self.status_path = status_path
        self._clock = clock
        self._wall = wall
        self._on_exit = on_exit        # (pid) -> None: a dead process's metrics files
        self.process: subprocess.Popen | None = None
        self.restarts = 0
        self._failures = 0             # deaths since it last ran STABLE_SECONDS
        self._started_at = 0.0
        self._next_start = 0.0
        self._since = wall()           # wall time of the last change of state
        # wall time since which no process has stayed up (run STABLE_SECONDS); None while
        # one has. Kept across restarts: a process dying at every launch stays down.
        self._down_since: float | None = wall()
        self._last_exit: str | None = None
        self._stopping = False

    def tick(self) -> None:
        """Start it the first time, look at it, start it again when due."""
        if self._stopping:
            return
        now = self._clock()
        if self.process is not None:
            code = self.process.poll()
            if code is None:
                if now - self._started_at >= STABLE_SECONDS:
                    self._failures = 0
                    if self._down_since is not None:
                        self._down_since = None
                        self._write("running")
                        return
                self._touch()
                return
            self._died(code, now)
        if now >= self._next_start:
            self._launch()
        else:
            self._touch()

    def stop_soon(self) -> None:
        """Ask it to wind down now (SIGTERM), beside gunicorn's own graceful stop."""
        self._stopping = True
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()

    def stop(self) -> None:
        self._stopping = True
        process, self.process = self.process, None
        stop_process(process)
        if process is not None and self._on_exit is not None:
            self._on_exit(process.pid)
        self._write("stopped")

    def _died(self, code: int, now: float) -> None:
        assert self.process is not None
        pid = self.process.pid
        self.process = None
        if self._on_exit is not None:
            self._on_exit(pid)
        self._last_exit = describe_exit(code)
        if self._down_since is None:
            self._down_since = self._wall()
        delay = min(RESTART_MAX_SECONDS, RESTART_MIN_SECONDS * 2 ** self._failures)
        self._failures += 1
        self._next_start = now + delay
        self._since = self._wall()
        log.error("%s (pid %d) %s; starting it again in %.0f s", self.what, pid,
                  self._last_exit, delay)
        self._write("restarting")

    def _launch(self) -> None:
        now = self._clock()
        restart = self._last_exit is not None
        try:
            self.process = self._start()
        except OSError as e:   # no memory, no file descriptors...: tried again after a pause
            delay = min(RESTART_MAX_SECONDS, RESTART_MIN_SECONDS * 2 ** self._failures)
            self._failures += 1
            self._next_start = now + delay
            self._last_exit = f"could not be started: {e.strerror or e}"
            log.error("%s %s; trying again in %.0f s", self.what, self._last_exit, delay)
            self._write("restarting")
            return
        self._started_at = now
        if restart:
            self.restarts += 1
            if self._on_restart is not None:
                self._on_restart()
            log.warning("%s started again (pid %d, restart %d)", self.what,
                        self.process.pid, self.restarts)
        self._since = self._wall()
        self._write("running")

    def _write(self, state: str) -> None:
        if self.status_path is None:
            return
        status = {"state": state, "pid": self.process.pid if self.process else None,
                  "since": self._since, "down_since": self._down_since,
                  "restarts": self.restarts, "last_exit": self._last_exit,
                  "next_start": (self._wall() + max(0.0, self._next_start - self._clock())
                                 if state == "restarting" else None)}
        try:
            write_status(self.status_path, status)
        except OSError as e:
            log.warning("cannot write the %s's status %s: %s", self.what, self.status_path, e)

    def _touch(self) -> None:
        if self.status_path is not None:
            try:
                os.utime(self.status_path)
            except OSError:
                self._write("running" if self.process is not None else "restarting")


# --- `archway serve`'s own loop ----------------------------------------------------------------

def serve_beside(run_master: Callable[[], int], children: Sequence[Supervisor]) -> int:
    """Run `run_master` (gunicorn's master: it returns the exit status) and keep `children`
    running beside it; returns the master's status once it has stopped, and the children with
    it. With no children the master is this very process. Otherwise it is a fork of it: this
    process turns the children's loop, passes the operator's signals on to the master, and ends
    them all when the master ends (a master that dies leaves nothing running)."""
    if not children:
        return run_master()
    wake_r, wake_w = os.pipe()
    for fd in (wake_r, wake_w):
        os.set_blocking(fd, False)
    received: list[int] = []
    previous = {sig: signal.signal(sig, lambda sig, _frame: received.append(sig))
                for sig in FORWARDED_SIGNALS}
    previous[signal.SIGCHLD] = signal.signal(signal.SIGCHLD, lambda *_: None)   # wakes the loop
    signal.set_wakeup_fd(wake_w)
    master = os.fork()
    if master == 0:   # gunicorn's master: archway serve's own handlers are not its
        signal.set_wakeup_fd(-1)
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        os.close(wake_r)
        os.close(wake_w)
        _run_and_exit(run_master)
    try:
        return _look_after(master, children, wake_r, received)
    finally:
        signal.set_wakeup_fd(-1)
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        os.close(wake_r)
        os.close(wake_w)


def exit_status(e: SystemExit) -> int:
    """The status a process ending by `e` exits with."""
    return e.code if isinstance(e.code, int) else (0 if e.code is None else 1)


def _run_and_exit(run_master: Callable[[], int]) -> None:
    code = 1
    try:
        _stop_with_parent()
        code = run_master()
    except SystemExit as e:
        code = exit_status(e)
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _stop_with_parent() -> None:
    """gunicorn's master stops gracefully (SIGTERM) when `archway serve` is gone, even killed:
    nothing runs unsupervised (Linux's PR_SET_PDEATHSIG)."""
    parent = os.getppid()
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    if os.getppid() != parent:   # gone already, before the wish was made
        os.kill(os.getpid(), signal.SIGTERM)


def _look_after(master: int, children: Sequence[Supervisor], wake_fd: int,
                received: list[int]) -> int:
    stopping = False
    while True:
        while received:
            sig = received.pop(0)
            try:
                os.kill(master, sig)
            except ProcessLookupError:
                pass
            if sig in STOPPING_SIGNALS and not stopping:
                stopping = True
                for child in children:
                    child.stop_soon()
        if not stopping:
            for child in children:
                child.tick()
        pid, status = os.waitpid(master, os.WNOHANG)
        if pid:
            code = os.waitstatus_to_exitcode(status)
            break
        select.select([wake_fd], [], [], 1.0)
        try:
            while os.read(wake_fd, 4096):
                pass
        except (BlockingIOError, InterruptedError):
            pass
    if not stopping:
        log.error("gunicorn's master (pid %d) %s; stopping %s", master, describe_exit(code),
                  " and ".join(child.what for child in children))
    for child in children:
        child.stop()
    return code if code >= 0 else 128 - code


# --- what the workers read -----------------------------------------------------------------------

def read_status(path: str | None) -> dict | None:
    """The supervisor's status with `heartbeat` (the file's mtime) added; None: this server
    runs no such process (or its status cannot be read yet)."""
    if not path:
        return None
    try:
        with open(path, encoding="utf-8") as f:
            status = json.loads(f.read(4096))
            status["heartbeat"] = os.fstat(f.fileno()).st_mtime
    except (OSError, ValueError):
        return None
    return status if isinstance(status, dict) else None


def is_up(status: dict | None) -> bool:
    """Whether the process is running, as far as its status file says (None: the file is not
    written yet, which a starting server counts as up)."""
    return status is None or status.get("state") == "running"


def process_fact(status: dict | None, now: float) -> str:
    """What /readyz says about a process this server keeps running."""
    if status is None:
        return "not run by this server"
    restarts = int(status.get("restarts") or 0)
    again = f", restarted {restarts} time{'s' if restarts != 1 else ''}" if restarts else ""
    state = status.get("state")
    if state == "running":
        return f"running (pid {status.get('pid')}, up {now - float(status['since']):.0f} s{again})"
    if state == "restarting":
        wait = max(0.0, float(status.get("next_start") or now) - now)
        return (f"not running: {status.get('last_exit')}; starting again in {wait:.0f} s"
                f"{again}")
    return str(state)


def process_problem(status: dict | None, now: float, what: str) -> str | None:
    """Why /healthz fails: the supervised process `what` is down and nothing brings it back.
    Down is since the last one that stayed up, whatever started and died since (a crash
    loop)."""
    if status is None or status.get("state") == "stopped":
        return None
    silent = now - float(status.get("heartbeat") or now)
    if silent > HEARTBEAT_LIMIT_SECONDS:
        return f"archway serve has not looked after the {what} for {silent:.0f} s"
    down_since = status.get("down_since")
    if down_since is not None:
        down = now - float(down_since)
        if down > DOWN_LIMIT_SECONDS:
            restarts = int(status.get("restarts") or 0)
            return (f"no {what} has stayed up for {down:.0f} s ({restarts} "
                    f"restart{'s' if restarts != 1 else ''}, last: {status.get('last_exit')})")
    return None
