"""The exit-status table of docs/commands.md and what the commands return, held together (issue 47):
every status the table lists is produced here by a case of its own, and every status the CLI
names (archway.main.cli's EXIT_*) is in the table. `archway serve`'s own (130 on SIGINT, 0 on
SIGTERM) are tests/test_serve_messages.py's.

Real parts: the command line in-process or as a process, a real closed port for an API that
refuses, a peer that accepts and never answers for a command to interrupt."""
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from archway.main import cli
from lab.procs import REPO, free_port
from lab.servers.faults import BlackHole


def documented() -> dict[int, str]:
    """status -> its row's meaning, from the table under "## Exit status" in docs/commands.md."""
    with open(os.path.join(REPO, "docs", "commands.md"), encoding="utf-8") as f:
        text = f.read()
    section = text.split("## Exit status", 1)[1].split("\n## ", 1)[0]
    rows = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("|") and cells[0].isdigit():
            rows[int(cells[0])] = cells[1]
    return rows


def _kubeconfig(tmp_path, server: str) -> str:
    path = tmp_path / "kubeconfig"
    path.write_text(f"""apiVersion: v1
kind: Config
clusters: [{{name: c, cluster: {{server: "{server}"}}}}]
users: [{{name: u, user: {{token: not-a-secret}}}}]
contexts: [{{name: x, context: {{cluster: c, user: u}}}}]
current-context: x
""")
    return str(path)


@pytest.fixture
def no_config(monkeypatch, tmp_path):
    monkeypatch.delenv("ARCHWAY_CONFIG", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.chdir(tmp_path)


def done(tmp_path, capsys) -> int:
    return cli.main(["scheduler-config"])


def something_failed(tmp_path, capsys) -> int:
    status = cli.main(["inspect", "./missing.sif"])
    assert "no such file: ./missing.sif" in capsys.readouterr().out
    return status


def could_not(tmp_path, capsys) -> int:
    """`archway report` with an API that refuses every connection: one line, and 2."""
    os.environ["KUBECONFIG"] = _kubeconfig(tmp_path, f"https://127.0.0.1:{free_port()}")
    try:
        status = cli.main(["report"])
    finally:
        del os.environ["KUBECONFIG"]
    err = capsys.readouterr().err
    assert err.splitlines() == [err.strip()] and err.startswith(
        "archway: could not list any workload: Kubernetes API https://127.0.0.1:"), err
    assert err.rstrip().endswith("unreachable: Connection refused"), err
    return status


def interrupted(tmp_path, capsys) -> int:
    """Ctrl-C of a command waiting on a registry that never answers."""
    hole = BlackHole()
    try:
        process = subprocess.Popen(
            [sys.executable, "-m", "archway.main.cli", "inspect", f"{hole.host}/team/app:1"],
            cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            env={**os.environ, "HOME": str(tmp_path)},
            # Ctrl-C as a terminal delivers it: a run started in the background (`cmd &`) has
            # SIGINT ignored, and a child keeps that.
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
        deadline = time.monotonic() + 30
        while hole.accepted == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert hole.accepted, process.communicate(timeout=30)
        process.send_signal(signal.SIGINT)
        process.communicate(timeout=30)
        return process.returncode
    finally:
        hole.stop()


def reader_gone(tmp_path, capsys) -> int:
    """The reader of stdout closed before the command wrote (`... | head -0`)."""
    process = subprocess.Popen([sys.executable, "-m", "archway.main.cli", "completion", "bash"],
                               cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert process.stdout is not None
    process.stdout.close()
    _, err = process.communicate(timeout=30)
    assert b"Traceback" not in err, err
    return process.returncode


CASES = {0: done, 1: something_failed, 2: could_not, 130: interrupted, 141: reader_gone}


def test_the_table_lists_every_status_the_cli_names():
    rows = documented()
    assert set(rows) == set(CASES), rows
    named = {getattr(cli, name) for name in dir(cli) if name.startswith("EXIT_")}
    assert named <= set(rows), named


@pytest.mark.parametrize("status", sorted(CASES))
def test_each_documented_status_is_what_its_case_returns(status, tmp_path, capsys, no_config):
    assert status in documented()
    assert CASES[status](tmp_path, capsys) == status


def test_report_skips_a_refused_kind_says_it_once_and_exits_1(tmp_path, capsys, no_config):
    """One kind refused (RBAC), the others listed: a line for it, the rest reported, 1."""

    def answer(request):
        if "/deployments" in request.path:
            return 403, {"Content-Type": "application/json"}, (
                b'{"kind":"Status","status":"Failure","reason":"Forbidden","code":403,'
                b'"message":"deployments.apps is forbidden"}')
        return 200, {"Content-Type": "application/json"}, b'{"items":[],"metadata":{}}'

    status, _ = _report_against(tmp_path, answer)
    err = capsys.readouterr().err
    skipped = [line for line in err.splitlines() if "skipped" in line]
    assert status == 1, err
    assert skipped == ["archway report: skipped Deployments: Kubernetes API: list Deployments in "
                       "all namespaces: 403 Forbidden: deployments.apps is forbidden"], err


def test_report_whose_credentials_are_refused_says_one_line(tmp_path, capsys, no_config):
    status, api = _report_against(tmp_path, lambda request: (401, {"Content-Type": "application/json"}, (
        b'{"kind":"Status","status":"Failure","reason":"Unauthorized","code":401,'
        b'"message":"Unauthorized"}')))
    err = capsys.readouterr().err
    assert status == 2 and len(err.splitlines()) == 1, err
    assert re.match(r"archway: could not list any workload: .*401 Unauthorized", err), err
    assert len(api.requests) == 1   # the other kinds are not asked: they would fail alike


def _report_against(tmp_path, answer):
    """(`archway report`'s exit status, the stopped API with its requests) against an API that
    answers every request with `answer`."""
    from lab.servers.faults import ScriptedServer
    api = ScriptedServer(answer)
    try:
        os.environ["KUBECONFIG"] = _kubeconfig(tmp_path, f"http://{api.host}")
        try:
            return cli.main(["report"]), api
        finally:
            del os.environ["KUBECONFIG"]
    finally:
        api.stop()
