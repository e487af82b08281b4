"""The servers under measurement: `archway serve` and the bench's own gunicorn apps, each a child
process started with Popen of the Python binary (lab.procs.Server) and stopped by PID.

    server = GunicornServer.archway(directory, config_dict)      # python3 -m archway.main.cli serve
    server = GunicornServer.module(directory, "bench.apps.echo_app", config_dict)
    server.post("/mutate", body); server.metrics(); server.worker_pids(); server.log_since(mark)
"""
import json
import os
import re
import sys
import time

import requests

from lab.procs import REPO, Server, children, free_port

# `admission <ns/name> uid=... images=N ... warnings=W 0.4 ms` (webhook/service.py, one per admission)
ADMISSION_LINE = re.compile(r"archway\.admission: admission .* (?P<ms>\d+(?:\.\d+)?) ms(?: dry-run)?$")
# `filter <ns/name>: archs=... (12.3 ms)` (extender/routes.py, one per filter call)
FILTER_LINE = re.compile(r"archway\.extender: filter .*\((?P<ms>\d+(?:\.\d+)?) ms\)$")


class GunicornServer:
    """One gunicorn master (and its workers) serving on 127.0.0.1:<free port>."""

    def __init__(self, directory: str, name: str, module_args: list[str], config: dict, *,
                 tls_ca: str | None, repo: str = REPO):
        os.makedirs(directory, exist_ok=True)
        self.directory = directory
        self.name = name
        self.port = free_port()
        self.config_path = os.path.join(directory, f"{name}.yaml")
        with open(self.config_path, "w") as f:
            json.dump(config, f, indent=1)  # JSON is YAML
        self.scheme = "https" if tls_ca else "http"
        self.ca = tls_ca
        # `repo`: another checkout's code (a bench's baseline of an earlier commit).
        env = dict(os.environ, PYTHONPATH=repo + os.pathsep + os.environ.get("PYTHONPATH", ""))
        env.pop("PROMETHEUS_MULTIPROC_DIR", None)   # serve makes its own per run
        args = [sys.executable, "-m", *module_args, "--config", self.config_path,
                "serve", "--bind", f"127.0.0.1:{self.port}"]
        self.server = Server(args, port=self.port, log_path=os.path.join(directory, f"{name}.log"),
                             env=env, cwd=repo, ready_timeout=30)
        self.session = requests.Session()
        self.session.trust_env = False   # REQUESTS_CA_BUNDLE must not replace our CA
        self.session.verify = tls_ca if tls_ca else True
        self._wait_ready()

    @classmethod
    def archway(cls, directory: str, config: dict, *, tls_ca: str | None, name: str = "archway"):
        """`python3 -m archway.main.cli --config FILE serve --bind 127.0.0.1:PORT`, unchanged."""
        return cls(directory, name, ["archway.main.cli"], config, tls_ca=tls_ca)

    @classmethod
    def module(cls, directory: str, module: str, config: dict, *, tls_ca: str | None, name: str):
        """A bench entry point that takes the same `--config FILE serve --bind` arguments."""
        return cls(directory, name, [module], config, tls_ca=tls_ca)

    # --- addresses and requests
    def url(self, path: str = "") -> str:
        return f"{self.scheme}://127.0.0.1:{self.port}{path}"

    def post(self, path: str, body: bytes, timeout: float = 30.0) -> requests.Response:
        return self.session.post(self.url(path), data=body, timeout=timeout,
                                 headers={"Content-Type": "application/json"})

    def metrics(self) -> str:
        r = self.session.get(self.url("/metrics"), timeout=10)
        r.raise_for_status()
        return r.text

    def _wait_ready(self, timeout: float = 30.0) -> None:
        """The master listens before its workers have imported the app: wait for an answer."""
        end = time.monotonic() + timeout
        last = None
        while time.monotonic() < end:
            if self.server.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited; log:\n{self.server.log()}")
            try:
                if self.session.get(self.url("/healthz"), timeout=2).status_code == 200:
                    return
            except requests.RequestException as e:
                last = e
            time.sleep(0.05)
        raise RuntimeError(f"{self.name} never answered /healthz ({last}); log:\n{self.server.log()}")

    # --- processes
    @property
    def serve_pid(self) -> int:
        """`archway serve` itself: the root of every process the server runs."""
        return self.server.proc.pid

    @property
    def master_pid(self) -> int:
        """gunicorn's master: the served process itself, or, when `archway serve` keeps other
        processes running beside it (archway.server.supervisor), its fork of itself."""
        return gunicorn_master(self.server.proc.pid)

    def worker_pids(self) -> list[int]:
        """gunicorn's workers."""
        return children(self.master_pid)

    def controller_pids(self) -> list[int]:
        """The gate controller's process (archway serve with a Kubernetes API configured)."""
        return [pid for pid in children(self.server.proc.pid) if is_gate_controller(pid)]

    def wait_workers(self, count: int, timeout: float = 30.0) -> list[int]:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            pids = self.worker_pids()
            if len(pids) >= count:
                return pids
            time.sleep(0.05)
        raise RuntimeError(f"{self.name}: {count} workers did not start")

    # --- its log
    def log_mark(self) -> int:
        return os.path.getsize(self.server.log_path)

    def log_since(self, mark: int) -> str:
        with open(self.server.log_path, "rb") as f:
            f.seek(mark)
            return f.read().decode("utf-8", "replace")

    def admission_times_ms(self, mark: int) -> list[float]:
        """The handler times archway logged for each admission since `mark`."""
        return [float(m["ms"]) for m in map(ADMISSION_LINE.search, self.log_since(mark).splitlines())
                if m]

    def filter_times_ms(self, mark: int) -> list[float]:
        return [float(m["ms"]) for m in map(FILTER_LINE.search, self.log_since(mark).splitlines())
                if m]

    def stop(self) -> None:
        self.session.close()
        self.server.stop()


def gunicorn_master(serve_pid: int) -> int:
    """The gunicorn master of the `archway serve` at `serve_pid`: its child with its own command
    line (a fork) that has children of its own (the workers; a worker has none), else itself."""
    own = cmdline_of(serve_pid)
    return next((pid for pid in children(serve_pid) if cmdline_of(pid) == own and children(pid)),
                serve_pid)


def cmdline_of(pid: int) -> bytes:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read()
    except OSError:
        return b""


def runs(pid: int, module: bytes) -> bool:
    """Whether process `pid`'s command line names `module` (False once it is gone)."""
    return module in cmdline_of(pid)


def is_gate_controller(pid: int) -> bool:
    return runs(pid, b"archway.gate.process")


def rss_bytes(pid: int) -> int:
    """VmRSS of a process, from /proc/PID/status."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for process {pid}")


def cpu_seconds(pid: int) -> float:
    """User + system CPU time a process has used so far."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    ticks = os.sysconf("SC_CLK_TCK")
    return (int(fields[11]) + int(fields[12])) / ticks
