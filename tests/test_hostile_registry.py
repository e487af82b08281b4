"""Hostile registries: slow drips, black holes, redirects that leak, spellings that dodge the
deny list, answers that crash parsers. Every peer here is a real socket on loopback
(tests/infra/faults.py); the real docker-registry stands in wherever a well-behaved one is needed.
"""
import base64
import json
import os
import subprocess
import sys
import threading
import time

import pytest
import yaml

from archway.config import RegistrySettings
from archway.errors import DeadlineExceeded
from archway.registry.credentials import Keyring
from archway.registry.http import HttpClient
from archway.registry.oci import RegistryClient
from archway.registry.reference import parse_reference
from tests.infra.faults import BlackHole, DripServer, ScriptedServer
from tests.infra.procs import REPO

# Slack past a deadline: the watchdog acts at once, this only absorbs a loaded test machine.
SLACK = 3.0


def run_with_limit(fn, limit: float):
    """fn() in a thread; (finished, its exception or result). A thread still running after
    `limit` is what the drip defect looked like: a lookup thread pinned past every deadline."""
    outcome: dict = {}

    def target():
        try:
            outcome["value"] = fn()
        except Exception as e:   # noqa: BLE001 - handed to the test to assert on
            outcome["value"] = e
    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(limit)
    return not thread.is_alive(), outcome.get("value")


def client_for(**settings_kw) -> RegistryClient:
    settings = RegistrySettings(**settings_kw)
    return RegistryClient(HttpClient(settings), settings)


@pytest.fixture
def servers():
    started = []

    def start(server):
        started.append(server)
        return server
    yield start
    for server in started:
        server.stop()


# -- 1. the deadline holds on the socket ----------------------------------------------------------

@pytest.mark.parametrize("peer, scheme", [("headers", "http"), ("body", "http"),
                                          ("handshake", "https"), ("black-hole", "http")])
def test_a_hostile_peer_is_cut_off_at_the_deadline(servers, peer, scheme):
    """1 byte a second satisfies every per-read timeout (5 s here): only a deadline enforced on
    the socket ends the request. The peer sees its connection closed: no thread stays on it."""
    server = servers(BlackHole() if peer == "black-hole" else DripServer(peer, interval=1.0))
    http = HttpClient(RegistrySettings(insecure_hosts=(server.host,), timeout_seconds=5))
    budget = 1.5
    finished, answer = run_with_limit(
        lambda: http.get(f"{scheme}://{server.host}/v2/", deadline=time.monotonic() + budget,
                         max_bytes=4 << 20), budget + SLACK)
    assert finished, f"the request to a {peer} peer outlived its deadline"
    assert isinstance(answer, DeadlineExceeded), answer
    assert server.accepted == 1 and server.wait_closed(1, timeout=SLACK)


def test_a_dripping_token_service_and_redirect_target_end_at_the_deadline(servers):
    drip = servers(DripServer("headers", interval=1.0))
    realm = f"http://{drip.host}/token"

    def respond(request):
        if "/blobs/" in request.path:
            return 307, {"Location": f"http://{drip.host}/blob"}, b""
        return 401, {"WWW-Authenticate": f'Bearer realm="{realm}",service="s"'}, b""
    registry = servers(ScriptedServer(respond))
    client = client_for(insecure_hosts=(registry.host, drip.host), timeout_seconds=5)
    ref = parse_reference(f"{registry.host}/team/app:v1")
    finished, answer = run_with_limit(
        lambda: client.resolve(ref, Keyring.empty(), time.monotonic() + 1.5), 1.5 + SLACK)
    assert finished and isinstance(answer, DeadlineExceeded), answer
    finished, answer = run_with_limit(
        lambda: client.read_blob_range(ref, "sha256:" + "0" * 64, 0, 100, Keyring.empty(),
                                       time.monotonic() + 1.5), 1.5 + SLACK)
    assert finished and isinstance(answer, DeadlineExceeded), answer
    assert drip.wait_closed(2, timeout=SLACK)


def test_a_request_without_a_deadline_still_ends(servers):
    drip = servers(DripServer("headers", interval=0.2))
    http = HttpClient(RegistrySettings(insecure_hosts=(drip.host,), timeout_seconds=0.5))
    finished, answer = run_with_limit(
        lambda: http.get(f"http://{drip.host}/v2/", max_bytes=1024), 3 * 0.5 + SLACK)
    assert finished and isinstance(answer, DeadlineExceeded), answer


def test_a_connection_reused_from_the_pool_is_watched_too(servers):
    """The first answer is quick and keeps the connection alive; the second drips on it."""
    drip = servers(DripServer("headers", interval=1.0, quick_answers=1))
    http = HttpClient(RegistrySettings(insecure_hosts=(drip.host,), timeout_seconds=5))
    assert http.get(f"http://{drip.host}/a", max_bytes=64, deadline=time.monotonic() + 5).body == b"{}"
    finished, answer = run_with_limit(
        lambda: http.get(f"http://{drip.host}/b", max_bytes=64, deadline=time.monotonic() + 1.5),
        1.5 + SLACK)
    assert finished and isinstance(answer, DeadlineExceeded), answer
    assert drip.accepted == 1 and drip.wait_closed(1, timeout=SLACK)


def test_inspect_exits_at_its_timeout_against_a_dripping_registry(servers, tmp_path):
    drip = servers(DripServer("headers", interval=1.0))
    config = tmp_path / "archway.yaml"
    config.write_text(yaml.safe_dump({"registry": {"insecure_hosts": [drip.host]}}))
    timeout = 2.0
    start = time.monotonic()
    process = subprocess.Popen([sys.executable, "-m", "archway.cli", "inspect", "--json",
                                "--timeout", str(timeout), "--config", str(config),
                                f"{drip.host}/team/app:v1"], cwd=REPO, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
    try:
        out, err = process.communicate(timeout=timeout + 5 + SLACK)   # + interpreter start-up
    except subprocess.TimeoutExpired:
        process.kill()
        process.communicate()
        pytest.fail(f"archway inspect --timeout {timeout} still running after "
                    f"{time.monotonic() - start:.1f} s")
    assert process.returncode == 1, err
    (row,) = json.loads(out)
    assert row["architectures"] == [] and row["error"]
    assert drip.wait_closed(1, timeout=SLACK)
