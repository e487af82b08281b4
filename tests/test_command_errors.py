"""The `archway` command fails with one line naming the cause and a documented exit status
(docs/commands.md: 2 for an error, 141 when the reader of its output went away), never a traceback or a
server that half-starts (issue 21, items 4 and 8). Real processes: `archway serve`, the CLI, a
stand-in API server on a closed port."""
import os
import socket
import subprocess
import sys
import time

import pytest
import yaml

from lab.procs import REPO, Server, free_port, wait_for_port
from lab.servers.apiserver import FakeApiServer

pytestmark = pytest.mark.slow


def archway(*args, env=None, timeout=60, config=None) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "archway.main.cli"]
    if config is not None:
        command += ["--config", str(config)]
    return subprocess.run(command + list(args), capture_output=True, text=True, timeout=timeout,
                          env=env, cwd=REPO, check=False)


def one_line_error(done: subprocess.CompletedProcess, status: int = 2) -> str:
    assert done.returncode == status, (done.returncode, done.stdout, done.stderr)
    assert "Traceback" not in done.stderr, done.stderr
    lines = [line for line in done.stderr.splitlines() if line.startswith("archway:")]
    assert len(lines) == 1, done.stderr
    return lines[0]


def serve_config(tmp_path, name: str):
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump({"server": {"state_dir": str(tmp_path / name), "workers": 1,
                                               "threads": 2},
                                    "kubernetes": {"enabled": "off"}}))
    return path


# --- item 4: one server per address --------------------------------------------------------------

def test_a_second_archway_on_a_served_address_exits_at_once_naming_it(tmp_path):
    port = free_port()
    first = Server([sys.executable, "-m", "archway.main.cli", "--config",
                    str(serve_config(tmp_path, "first")), "serve", "--bind", f"127.0.0.1:{port}"],
                   port=port, log_path=str(tmp_path / "first.log"), cwd=REPO, ready_timeout=30)
    try:
        start = time.monotonic()
        second = archway("serve", "--bind", f"127.0.0.1:{port}", timeout=30,
                         config=serve_config(tmp_path, "second"))
        assert time.monotonic() - start < 15
        line = one_line_error(second)
        assert line == (f"archway: --bind 127.0.0.1:{port} is already in use by another archway "
                        f"server (it answers /healthz): stop it, or serve on another address")
        assert "serving" not in second.stdout
        # the first one did not lose its address
        assert first.proc.poll() is None
        wait_for_port(port)
    finally:
        first.stop()


@pytest.mark.parametrize("reuse_port", [False, True], ids=["plain", "so_reuseport"])
def test_a_port_held_by_another_program_exits_at_once_naming_it(tmp_path, reuse_port):
    holder = socket.socket()
    if reuse_port:   # the same user's program sharing as gunicorn does: a plain bind lets it in
        holder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    holder.bind(("127.0.0.1", 0))
    holder.listen()
    port = holder.getsockname()[1]
    try:
        start = time.monotonic()
        done = archway("serve", "--bind", f"127.0.0.1:{port}", timeout=30,
                       config=serve_config(tmp_path, "s"))
        assert time.monotonic() - start < 15
        assert one_line_error(done) == (
            f"archway: --bind 127.0.0.1:{port} is already in use by another program: stop it, "
            f"or serve on another address")
        assert "serving" not in done.stdout
    finally:
        holder.close()


def test_the_metrics_address_is_checked_too(tmp_path):
    holder = socket.create_server(("127.0.0.1", 0))
    port = holder.getsockname()[1]
    config = tmp_path / "m.yaml"
    config.write_text(yaml.safe_dump({"server": {"state_dir": str(tmp_path / "m"),
                                                 "metrics_bind": f"127.0.0.1:{port}"},
                                      "kubernetes": {"enabled": "off"}}))
    try:
        done = archway("serve", "--bind", f"127.0.0.1:{free_port()}", config=config)
        assert f"server.metrics_bind 127.0.0.1:{port} is already in use" in one_line_error(done)
    finally:
        holder.close()


# --- item 8: one line, a documented exit status --------------------------------------------------

@pytest.fixture
def closed_api(tmp_path):
    """A kubeconfig naming an API server whose port refuses connections."""
    api = FakeApiServer()
    path = api.kubeconfig(str(tmp_path))
    api.stop()
    return path, api.url


def clean_env(tmp_path, **variables) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("KUBECONFIG", "ARCHWAY_CONFIG")}
    return dict(env, HOME=str(tmp_path), **variables)   # no ~/.kube/config of the machine


def test_release_all_with_an_unreachable_api(tmp_path, closed_api):
    kubeconfig, url = closed_api
    done = archway("gate", "release-all", env=clean_env(tmp_path, KUBECONFIG=kubeconfig))
    assert one_line_error(done) == (f"archway: cannot list the pods: Kubernetes API {url} "
                                    f"unreachable: Connection refused")


def test_certs_bootstrap_with_an_unreachable_api(tmp_path, closed_api):
    kubeconfig, url = closed_api
    done = archway("certs", "bootstrap", "--service", "archway", "--namespace", "archway",
                   "--secret", "archway-tls", "--kubeconfig", kubeconfig,
                   env=clean_env(tmp_path))
    assert one_line_error(done) == f"archway: Kubernetes API {url} unreachable: Connection refused"
    assert "Retrying" not in done.stderr


def test_report_with_a_malformed_kubeconfig(tmp_path):
    broken = tmp_path / "kubeconfig"
    broken.write_text("clusters: [unclosed\n")
    done = archway("report", env=clean_env(tmp_path, KUBECONFIG=str(broken)))
    line = one_line_error(done)
    assert line.startswith(f"archway: no Kubernetes API: kubeconfig {broken} is not usable: "
                           f"while parsing a flow sequence"), line
    config = tmp_path / "archway.yaml"
    config.write_text(f"kubernetes: {{kubeconfig: {broken}}}\n")
    done = archway("report", config=config, env=clean_env(tmp_path))
    assert one_line_error(done).startswith(f"archway: kubeconfig {broken} is not usable: ")


def test_report_with_kubeconfig_naming_a_file_that_does_not_exist(tmp_path):
    done = archway("report", env=clean_env(tmp_path, KUBECONFIG="/nonexistent"))
    assert one_line_error(done) == (
        "archway: no Kubernetes API: KUBECONFIG names /nonexistent, which does not exist")


BOOTSTRAP = ("certs", "bootstrap", "--service", "archway", "--namespace", "archway", "--secret",
             "archway-tls")


@pytest.mark.parametrize("command", [("report",), ("gate", "release-all"), BOOTSTRAP],
                         ids=["report", "release-all", "certs-bootstrap"])
@pytest.mark.parametrize("kubeconfig, words", [
    ("/nonexistent", "no Kubernetes API: KUBECONFIG names /nonexistent, which does not exist"),
    (None, "no Kubernetes API configured: set KUBECONFIG, or "),
], ids=["missing", "none"])
def test_every_command_finds_the_api_the_same_way(tmp_path, command, kubeconfig, words):
    """One precedence for every command (archway.kubeclient, issue 23): `certs bootstrap` had
    its own, and said `no Kubernetes credentials: Invalid kube-config file...`."""
    env = clean_env(tmp_path, **({"KUBECONFIG": kubeconfig} if kubeconfig else {}))
    env.pop("KUBERNETES_SERVICE_HOST", None)
    line = one_line_error(archway(*command, env=env))
    assert line.startswith(f"archway: {words}"), line
    if kubeconfig is None:   # where this command takes a kubeconfig
        option = "--kubeconfig" if command == BOOTSTRAP else "kubernetes.kubeconfig in the config file"
        assert line.endswith(option), line


def test_inspect_into_a_closed_pipe_exits_141_quietly(tmp_path):
    """`archway inspect ... | head -1`: the reader is gone before archway writes."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    images = [f"127.0.0.1:{free_port()}/app/{n}:1" for n in "abc"]
    try:
        done = subprocess.run([sys.executable, "-m", "archway.main.cli", "inspect", "--timeout", "5",
                               *images], stdout=write_end, stderr=subprocess.PIPE, text=True,
                              timeout=60, cwd=REPO, env=clean_env(tmp_path), check=False)
    finally:
        os.close(write_end)
    assert done.returncode == 141, done.stderr
    assert "Traceback" not in done.stderr and "BrokenPipe" not in done.stderr, done.stderr
