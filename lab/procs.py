"""Start and stop the real servers the tests use: free ports, readiness, clean shutdown by PID."""
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Next to the repository; a checkout elsewhere (a git worktree) names it in ARCHWAY_TESTDATA.
SHARED_TESTDATA = (os.environ.get("ARCHWAY_TESTDATA")
                   or os.path.join(os.path.dirname(REPO), "shared", "testdata"))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for_port(port: int, host: str = "127.0.0.1", timeout: float = 15.0, proc=None) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"process {proc.args!r} exited with {proc.returncode} before listening")
        try:
            with socket.create_connection((host, port), timeout=0.2):
                return
        except OSError:
            time.sleep(0.02)
    raise TimeoutError(f"nothing listening on {host}:{port} after {timeout} s")


class MissingTool(RuntimeError):
    """A binary the lab starts is not installed: an install error, never a reason to skip."""


def require_binary(name: str) -> str:
    """Path of a binary the lab needs; a missing one is an install error, so fail loudly."""
    path = shutil.which(name) or (f"/usr/sbin/{name}" if os.path.exists(f"/usr/sbin/{name}") else None)
    if not path:
        raise MissingTool(f"{name} is not installed: run scripts/setup.sh --test first")
    return path


class Server:
    """A child process started with Popen (never through a shell) and stopped by its own PID."""

    def __init__(self, args, *, port: int, log_path: str, env=None, cwd=None, ready_timeout=15.0,
                 host: str = "127.0.0.1"):
        self.port = port
        self.log_path = log_path
        self._log = open(log_path, "ab")
        self.proc = subprocess.Popen(args, stdout=self._log, stderr=subprocess.STDOUT, env=env,
                                     cwd=cwd, start_new_session=True)
        try:
            wait_for_port(port, host=host, timeout=ready_timeout, proc=self.proc)
        except Exception:
            self.stop()
            raise RuntimeError(f"{args[0]} did not start; log:\n{self.log()}") from None

    def log(self) -> str:
        with open(self.log_path, "rb") as f:
            return f.read().decode("utf-8", "replace")[-4000:]

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(5)
        self._log.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()


def cmdline(pid) -> str:
    """A process's command line, words joined by spaces ("" once it is gone)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def children(pid: int) -> list[int]:
    """The direct children of process `pid`, of every thread of it ([] once it is gone)."""
    found: list[int] = []
    try:
        for task in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{task}/children") as f:
                found += [int(p) for p in f.read().split()]
    except OSError:
        pass
    return sorted(set(found))


def serve_extender(directory, *, workers: int, prometheus: dict) -> Server:
    """`archway serve --product extender` on a free port, plain HTTP, with no cluster and no node
    cache: its workers and its traffic poller process, `prometheus` that section of its
    configuration (written, with the log serve.log, into `directory`)."""
    port = free_port()
    config_path = os.path.join(directory, "archway.yaml")
    with open(config_path, "w") as f:
        json.dump({"server": {"tls": False, "workers": workers, "threads": 2,
                              "state_dir": str(directory)},
                   "kubernetes": {"enabled": "off"}, "extender": {"node_cache": False},
                   "prometheus": prometheus}, f)
    env = {k: v for k, v in os.environ.items() if k != "PROMETHEUS_MULTIPROC_DIR"}
    return Server([sys.executable, "-m", "archway.main.cli", "--config", config_path, "serve",
                   "--product", "extender", "--bind", f"127.0.0.1:{port}"], port=port,
                  log_path=os.path.join(directory, "serve.log"), env={**env, "PYTHONPATH": REPO},
                  cwd=REPO, ready_timeout=30)


def wait_until(condition, timeout=10.0, what="the condition"):
    """condition()'s first true value, asked every 20 ms; AssertionError after `timeout` s."""
    end = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > end:
            raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")
        time.sleep(0.02)


def poll(fn, done, timeout=25.0, interval=0.2):
    """fn() again and again until done(its value) or `timeout`; the last value either way."""
    end = time.monotonic() + timeout
    while True:
        value = fn()
        if done(value) or time.monotonic() > end:
            return value
        time.sleep(interval)
