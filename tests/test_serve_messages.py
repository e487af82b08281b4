"""What `archway serve` says of itself as a newcomer starts and stops it (issue 47): the start-up
banner names every address it serves, a server with no cluster says so once, and Ctrl-C (SIGINT)
exits 130 as the exit-status table says.

Real servers: `archway serve` started as a user would, with HOME a temp dir and no cluster."""
import json
import os
import re
import signal
import sys
import time

import pytest
import yaml

from lab.procs import REPO, Server, free_port


def _env(home) -> dict:
    env = {k: v for k, v in os.environ.items()
           if k not in ("ARCHWAY_CONFIG", "PROMETHEUS_MULTIPROC_DIR", "KUBECONFIG")}
    env["HOME"] = str(home)
    return env


def _serve(home, config: dict) -> Server:
    (home / "archway.yaml").write_text(yaml.safe_dump(config))
    return Server([sys.executable, "-m", "archway.main.cli", "--config", str(home / "archway.yaml"),
                   "serve"], port=int(config["server"]["bind"].rsplit(":", 1)[1]),
                  log_path=str(home / "serve.log"), cwd=REPO, env=_env(home), ready_timeout=30)


def _log_once_booted(server: Server, workers: int) -> str:
    """The log once every worker has built its parts (their caches said what they say)."""
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        text = server.log()
        if text.count("Booting worker") >= workers:
            time.sleep(1.0)   # the workers' own start-up lines come right after
            return server.log()
        time.sleep(0.1)
    raise AssertionError(server.log())


@pytest.fixture(scope="module")
def no_cluster(tmp_path_factory):
    """`archway serve` with two workers and a metrics address, no Kubernetes API."""
    home = tmp_path_factory.mktemp("home")
    port, metrics = free_port(), free_port()
    server = _serve(home, {"server": {"bind": f"127.0.0.1:{port}", "workers": 2,
                                      "metrics_bind": f"127.0.0.1:{metrics}"}})
    try:
        yield server, port, metrics
    finally:
        server.stop()


def test_the_banner_names_every_address_served(no_cluster):
    server, port, metrics = no_cluster
    text = _log_once_booted(server, 2)
    lines = [line for line in text.splitlines() if "Listening at:" in line]
    assert len(lines) == 1, text
    assert re.search(rf"Listening at: https://127\.0\.0\.1:{port}, https://127\.0\.0\.1:{metrics} "
                     r"\(\d+\)$", lines[0]), lines[0]


def test_a_server_without_a_cluster_says_so_once(no_cluster):
    server, _, _ = no_cluster
    text = _log_once_booted(server, 2)
    said = [line for line in text.splitlines() if "no Kubernetes cluster configured" in line]
    assert len(said) == 1, "\n".join(said)
    assert said[0].endswith("no Kubernetes cluster configured (KUBECONFIG, kubernetes.kubeconfig, "
                            "in-cluster): namespaces, workloads and PlacementPolicies are not "
                            "read; the extender lists no nodes and estimates placements from its "
                            "own prioritize answers"), said[0]
    assert "stays empty" not in text


@pytest.mark.parametrize("log_format, poller", [("text", False), ("json", False), ("text", True)])
def test_ctrl_c_exits_130_and_sigterm_0(tmp_path, log_format, poller):
    """SIGINT, as a terminal's Ctrl-C sends it to the whole process group, ends the server with
    130 (the shell's 128 + SIGINT), as the exit-status table in docs/commands.md says; SIGTERM, the
    kubelet's graceful stop, with 0. `poller`: a traffic poller to keep, so `archway serve`
    forks gunicorn's master and passes the signal on (archway.server.supervisor)."""
    for sig, status in ((signal.SIGINT, 130), (signal.SIGTERM, 0)):
        home = tmp_path / f"{log_format}-{poller}-{sig.name}"
        home.mkdir()
        config: dict = {"server": {"bind": f"127.0.0.1:{free_port()}", "workers": 1,
                                   "log_format": log_format}}
        if poller:
            config["prometheus"] = {"url": f"http://127.0.0.1:{free_port()}"}
        server = _serve(home, config)
        try:
            _log_once_booted(server, 1)
            os.killpg(server.proc.pid, sig)
            assert server.proc.wait(20) == status, (sig, server.log())
        finally:
            server.stop()
        if log_format == "json":   # the line read for the signal is still logged, as JSON
            lines = [json.loads(line) for line in server.log().splitlines()
                     if line.startswith("{")]
            assert any(e.get("message", "").startswith("Handling signal") for e in lines), lines
