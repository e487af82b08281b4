"""Registry push events (issue 46) against real parts: Debian's docker-registry (distribution
2.8) with `notifications` pointing at a real `archway serve`, whose tag TTL is an hour.

A tag re-pushed from amd64 to arm64 is answered arm64 within 2 s by the server that listens,
and still amd64 by one that does not; events for a tag that did not move or that no pod uses
cost at most one HEAD, and none; the listener's hostile cases (a wrong token, a large body, a
malformed envelope, a flood from one address, a burst for one tag) are refused or coalesced.
"""
import base64
import json
import os
import sys
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests
import yaml

from lab.procs import REPO, Server, free_port
from lab.servers.registry import RegistryServer

FIXTURES = os.path.join(REPO, "tests", "fixtures")
TOKEN = "s3cret-" + uuid.uuid4().hex
REPO_NAME = "events/app"
ANSWER_WITHIN = 2.0


class Archway:
    """One `archway serve` (one worker; plain HTTP unless `tls`) and, when `events_port`, its
    listener (TLS when both `tls` and `events_tls`)."""

    def __init__(self, workdir, registry: RegistryServer, events_port: int | None = None, *,
                 tls: bool = False, events_tls: bool = False, **events):
        config = {
            "server": {"state_dir": str(workdir / "state"), "workers": 1, "threads": 4,
                       "tls": tls},
            "registry": {"insecure_hosts": [registry.host],
                         "cache": {"tag_ttl_seconds": 3600}},
            "kubernetes": {"enabled": "off"},
            "extender": {"node_cache": False},
        }
        if events_port:
            token_file = workdir / "token"
            token_file.write_text(TOKEN + "\n")
            config["registry"]["events"] = {"listen": f"127.0.0.1:{events_port}",
                                            "token_file": str(token_file), "tls": events_tls,
                                            **events}
        (workdir / "archway.yaml").write_text(yaml.safe_dump(config))
        self.port = free_port()
        self.url = f"{'https' if tls else 'http'}://127.0.0.1:{self.port}"
        scheme = "https" if tls and events_tls else "http"
        self.events_url = f"{scheme}://127.0.0.1:{events_port}/registry-events" if events_port \
            else None
        self.registry = registry
        env = {k: v for k, v in os.environ.items() if k != "PROMETHEUS_MULTIPROC_DIR"}
        self.proc = Server([sys.executable, "-m", "archway.main.cli", "--config",
                            str(workdir / "archway.yaml"), "serve", "--bind",
                            f"127.0.0.1:{self.port}"], port=self.port,
                           log_path=str(workdir / "serve.log"), cwd=REPO, env=env, ready_timeout=30)
        self.http = requests.Session()
        self.http.trust_env = False
        self.http.verify = str(workdir / "state" / "tls" / "ca.crt") if tls else True
        end = time.monotonic() + 30
        while self.http.get(self.url + "/readyz", timeout=5).status_code != 200:
            assert time.monotonic() < end, self.log()
            time.sleep(0.05)

    def architectures(self, image: str) -> set[str]:
        """What a pod of `image` is pinned to, from the admission's patch."""
        with open(os.path.join(FIXTURES, "admission", "v1-pod-multiarch.json")) as f:
            review = json.loads(f.read().replace("REGISTRY/archway/multi:1.0", image))
        review["request"]["uid"] = str(uuid.uuid4())
        r = self.http.post(self.url + "/mutate", json=review, timeout=15)
        assert r.status_code == 200, r.text
        patch = base64.b64decode(r.json()["response"].get("patch") or b"").decode()
        return {arch for arch in ("amd64", "arm64", "s390x") if f'"{arch}"' in patch}

    def post(self, body, *, token: str | None = TOKEN, headers: dict | None = None,
             content_type="application/vnd.docker.distribution.events.v1+json", fresh=False):
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        sent = {"Content-Type": content_type, **(headers or {})}
        if token is not None:
            sent["Authorization"] = f"Bearer {token}"
        if not fresh:
            return self.http.post(self.events_url, data=data, headers=sent, timeout=10)
        with requests.Session() as own:     # a connection of its own (threads post at once)
            own.trust_env, own.verify = False, self.http.verify
            return own.post(self.events_url, data=data, headers=sent, timeout=10)

    def metrics(self) -> str:
        return self.http.get(self.url + "/metrics", timeout=10).text

    def log(self) -> str:
        with open(self.proc.log_path, encoding="utf-8", errors="replace") as f:
            return f.read()

    def stop(self):
        self.http.close()
        self.proc.stop()


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    events_port = free_port()
    registry = RegistryServer(tmp_path_factory.mktemp("registry"), notify=(
        f"http://127.0.0.1:{events_port}/registry-events", TOKEN))
    parts = [registry]
    try:
        listening = Archway(tmp_path_factory.mktemp("listening"), registry, events_port,
                            per_source_per_second=50)
        parts.append(listening)
        deaf = Archway(tmp_path_factory.mktemp("deaf"), registry)
        parts.append(deaf)
        yield registry, listening, deaf
    finally:
        for part in reversed(parts):
            part.stop()


def wait_for(predicate, timeout: float):
    """The first truthy value of `predicate()` within `timeout` s, polled; None after."""
    end = time.monotonic() + timeout
    while True:
        value = predicate()
        if value or time.monotonic() >= end:
            return value
        time.sleep(0.02)


def settled(registry: RegistryServer, quiet: float = 0.4, timeout: float = 10.0) -> None:
    """Once the registry's log has taken no new request for `quiet` s: what a push's own event
    or a check set off is over (its HEAD, its pulls' events ignored), by `timeout`."""
    end = time.monotonic() + timeout
    count, since = len(registry.access_log()), time.monotonic()
    while time.monotonic() - since < quiet:
        assert time.monotonic() < end, "the registry kept being asked"
        time.sleep(0.05)
        now = len(registry.access_log())
        if now != count:
            count, since = now, time.monotonic()


def heads(registry: RegistryServer, mark: int, repo: str, tag: str) -> int:
    return sum(1 for e in registry.requests_since(mark)
               if e.method == "HEAD" and e.path == f"/v2/{repo}/manifests/{tag}")


def event(registry: RegistryServer, repo: str, tag: str, action="push",
          media_type="application/vnd.oci.image.manifest.v1+json") -> dict:
    return {"id": str(uuid.uuid4()), "action": action,
            "target": {"mediaType": media_type, "repository": repo, "tag": tag,
                       "digest": "sha256:" + "0" * 64},
            "request": {"method": "PUT", "host": registry.host}}


def test_a_re_pushed_tag_is_answered_by_its_new_digest_within_2_s_only_with_events(stack):
    registry, listening, deaf = stack
    image = registry.ref(REPO_NAME, "moving")
    registry.push_image(REPO_NAME, "moving", "linux/amd64")
    assert listening.architectures(image) == {"amd64"} == deaf.architectures(image)
    registry.push_image(REPO_NAME, "moving", "linux/arm64")
    pushed = time.monotonic()
    answered = wait_for(lambda: listening.architectures(image) == {"arm64"}, ANSWER_WITHIN)
    took = time.monotonic() - pushed
    assert answered, f"still not arm64 {took:.2f} s after the push:\n" + listening.log()[-3000:]
    # The same push, no listener: the answer cached for an hour stands.
    assert deaf.architectures(image) == {"amd64"}
    assert 'archway_registry_events_total{outcome="queued",source="distribution"}' in \
        listening.metrics()


def test_an_event_for_a_tag_that_did_not_move_costs_at_most_one_head(stack):
    registry, listening, _ = stack
    image = registry.ref(REPO_NAME, "still")
    registry.push_image(REPO_NAME, "still", "linux/amd64")
    assert listening.architectures(image) == {"amd64"}
    settled(registry)   # the push's own event may have found it cached: its HEAD before the mark
    mark = registry.mark()
    forged = event(registry, REPO_NAME, "still")
    forged["target"]["digest"] = "sha256:" + "f" * 64   # never believed
    assert listening.post({"events": [forged]}).status_code == 202
    assert wait_for(lambda: heads(registry, mark, REPO_NAME, "still") == 1, 3)
    settled(registry)    # a second HEAD or a GET would be in the log by now
    requests_made = [(e.method, e.path) for e in registry.requests_since(mark)
                     if e.path.startswith(f"/v2/{REPO_NAME}/")]
    assert requests_made == [("HEAD", f"/v2/{REPO_NAME}/manifests/still")]
    assert listening.architectures(image) == {"amd64"}


def test_events_for_images_no_pod_uses_and_pulls_cost_no_request(stack):
    registry, listening, _ = stack
    registry.push_image("events/unused", "v1", "linux/arm64")
    image = registry.ref(REPO_NAME, "pulled")
    registry.push_image(REPO_NAME, "pulled", "linux/amd64")
    assert listening.architectures(image) == {"amd64"}
    settled(registry)
    mark = registry.mark()
    envelope = {"events": [event(registry, "events/unused", "v1"),
                           event(registry, REPO_NAME, "pulled", action="pull"),
                           event(registry, REPO_NAME, "pulled",
                                 media_type="application/octet-stream")]}
    r = listening.post(envelope)
    assert r.status_code == 202 and r.json() == {"pushes": 1, "ignored": 2}
    settled(registry)
    assert [e for e in registry.requests_since(mark) if e.path.startswith("/v2/events/")] == []


def test_a_burst_for_one_tag_is_one_revalidation(stack):
    registry, listening, _ = stack
    image = registry.ref(REPO_NAME, "burst")
    registry.push_image(REPO_NAME, "burst", "linux/amd64")
    assert listening.architectures(image) == {"amd64"}
    settled(registry)
    one = event(registry, REPO_NAME, "burst")
    # 1,000 events in one envelope; then 10 envelopes of 100 at once, from 10 connections.
    mark = registry.mark()
    assert listening.post({"events": [one] * 1000}).status_code == 202
    assert wait_for(lambda: heads(registry, mark, REPO_NAME, "burst") >= 1, 3)
    settled(registry)
    assert heads(registry, mark, REPO_NAME, "burst") == 1
    mark = registry.mark()
    with ThreadPoolExecutor(10) as pool:
        sent = list(pool.map(lambda _: listening.post({"events": [one] * 100}, fresh=True), range(10)))
    assert [r.status_code for r in sent] == [202] * 10
    assert wait_for(lambda: heads(registry, mark, REPO_NAME, "burst") >= 1, 3)
    settled(registry)
    # One; two when the machine spread the envelopes past the 250 ms a check waits for the
    # rest of a burst: an event that arrives while a check runs is checked once more after it
    # (its push may have come after the HEAD), by design.
    assert heads(registry, mark, REPO_NAME, "burst") in (1, 2)


def test_hostile_requests_are_refused_with_a_reason(stack):
    registry, listening, _ = stack
    good = {"events": [event(registry, REPO_NAME, "hostile")]}
    for token in (None, "wrong", TOKEN + "x", ""):
        r = listening.post(good, token=token)
        assert r.status_code == 401 and "registry.events.token_file" in r.json()["error"]
    r = listening.post(good, token=None, headers={"Authorization": f"Basic {TOKEN}"})
    assert r.status_code == 401
    r = listening.post(b"{" + b" " * (1024 * 1024 + 10) + b"}")
    assert r.status_code == 413 and "registry.events.max_body_bytes" in r.json()["error"]
    for body, why in ((b"not json", "not JSON"), ({"events": "x"}, "events"),
                      ({"hello": 1}, "not an event envelope"),
                      ({"events": [1]}, "not a JSON object")):
        r = listening.post(body, content_type="application/json")
        assert r.status_code == 400 and why in r.json()["error"], r.text
    r = listening.http.get(listening.events_url, timeout=5)
    assert r.status_code == 405
    r = listening.http.post(listening.events_url.replace("/registry-events", "/mutate"), timeout=5)
    assert r.status_code == 404 and "only POST /registry-events" in r.json()["error"]
    assert TOKEN not in listening.log()


def test_a_flood_from_one_address_is_rate_limited(stack, tmp_path):
    registry = stack[0]
    # One request a second (bursts of 2): a flood at any speed this machine has meets it.
    server = Archway(tmp_path, registry, free_port(), per_source_per_second=1)
    try:
        good = {"events": [event(registry, REPO_NAME, "flood")]}
        statuses = [server.post(good) for _ in range(5)]
        assert [r.status_code for r in statuses[:2]] == [202, 202]
        refused = [r for r in statuses if r.status_code == 429]
        assert refused and refused[0].headers["Retry-After"] == "1"
        assert "registry.events.per_source_per_second" in refused[0].json()["error"]
        assert wait_for(lambda: server.post(good).status_code == 202, 3)   # the bucket refills
    finally:
        server.stop()


@pytest.mark.parametrize("events_tls", [True, False])
def test_the_listener_speaks_tls_with_archways_certificate_or_plain_http(stack, tmp_path,
                                                                        events_tls):
    registry = stack[0]
    server = Archway(tmp_path, registry, free_port(), tls=True, events_tls=events_tls)
    try:
        assert server.post({"events": []}).json() == {"pushes": 0, "ignored": 0}
        other = server.events_url.replace(*(("https:", "http:") if events_tls else
                                            ("http:", "https:")))
        with pytest.raises(requests.RequestException):   # the other scheme is not served
            server.http.post(other, json={"events": []}, timeout=5,
                             headers={"Authorization": f"Bearer {TOKEN}"}).raise_for_status()
    finally:
        server.stop()
