"""The lab's processes (the control plane's components, KWOK, Karpenter, archway serve, the
real node's daemons): each in a session of its own, with its log in the state folder, recorded
by PID so that one process starts it (scripts/cluster.sh up) and another stops it (down).

    process = start_process("kwok", [binary, ...], plane.state_dir)   # Process(name, pid, log)
    wait_answering("kwok", process, probe, timeout=30)   # ControlPlaneError with its log's end
    stop_process(process)                                 # SIGTERM to its session, then SIGKILL
"""
import os
import signal
import subprocess
import time
import warnings
from dataclasses import dataclass

import requests
import urllib3

from lab.kube import KubeError


class ControlPlaneError(RuntimeError):
    """A step that failed: which one, and the log that says why."""


@dataclass
class Process:
    name: str
    pid: int
    log: str


def clean_env() -> dict:
    # A proxy from the environment would carry the apiserver's calls to the webhook elsewhere.
    return {k: v for k, v in os.environ.items() if k.lower() not in
            ("http_proxy", "https_proxy", "all_proxy", "no_proxy", "kubeconfig")}


def start_process(name: str, args: list[str], state_dir: str, env: dict | None = None) -> Process:
    log = os.path.join(state_dir, "logs", f"{name}.log")
    os.makedirs(os.path.dirname(log), exist_ok=True)
    with open(log, "ab") as out:
        proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env=env or clean_env(), start_new_session=True, cwd=state_dir)
    return Process(name, proc.pid, log)


def stop_process(process: Process, timeout: float = 10.0) -> None:
    """SIGTERM to the process's session, SIGKILL after `timeout`; reaps it when it is a child."""
    try:
        os.killpg(process.pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if not pid_alive(process.pid):
            return
        time.sleep(0.05)
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    pid_alive(process.pid)


def pid_alive(pid: int) -> bool:
    try:
        waited, _ = os.waitpid(pid, os.WNOHANG)   # reap our own children
        if waited == pid:
            return False
    except ChildProcessError:
        pass                                       # not our child: ask the kernel
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:     # a zombie of another parent is gone too
            return f.read().split(b") ", 1)[1][:1] != b"Z"
    except FileNotFoundError:                          # gone since the signal
        return False


def healthz(port: int) -> bool:
    # The components' secure ports serve a certificate they made for themselves at start.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", urllib3.exceptions.InsecureRequestWarning)
        return requests.get(f"https://127.0.0.1:{port}/healthz", verify=False, timeout=2).text == "ok"


def wait_answering(what: str, process: Process, answers, *, timeout: float,
                   interval: float = 0.2) -> None:
    """Until `answers()` (a probe of a process just started; an error reaching it counts as
    not yet) is true; ControlPlaneError with the end of the process's log when it exits first or
    `timeout` passes."""
    end = time.monotonic() + timeout
    while True:
        if not pid_alive(process.pid):
            raise ControlPlaneError(f"{what} exited at start; its log {process.log} ends:\n"
                                    f"{tail(process.log)}")
        try:
            if answers():
                return
        except (KubeError, OSError):   # requests' errors are OSErrors
            pass
        if time.monotonic() > end:
            raise ControlPlaneError(f"{what} not ready after {timeout:g} s; its log "
                                    f"{process.log} ends:\n{tail(process.log)}")
        time.sleep(interval)


def tail(path: str, lines: int = 30) -> str:
    try:
        with open(path, "rb") as f:
            return b"\n".join(f.read().splitlines()[-lines:]).decode("utf-8", "replace")
    except OSError:
        return "(no log)"
