"""The admission webhook end to end: fixtures posted over real TLS to a real `archway serve`
(gunicorn, 2 workers), real Debian registries and an HTTPS file server behind it, the real
kube-apiserver (tests/conftest.py's control plane) for ServiceAccounts and Secrets, read as a
ServiceAccount whose RBAC the test sets. Patches are applied with jsonpatch and the
resulting pods validated against the Kubernetes schema (strict, 1.30 and 1.33)."""
import base64
import json
import logging
import os
import re
import socket
import statistics
import subprocess
import sys
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import jsonpatch
import kubernetes_validate
import pytest
import requests
import yaml

from lab.httpd import BackgroundHTTPServer
from lab.procs import REPO, Server, free_port
from lab.servers.fileserver import FileServer
from lab.servers.proxy import DelayProxy
from lab.servers.registry import RegistryServer
from lab.tls import session_ca
from tests.infra import sifbuild
from tests.infra.fixtures import LOOPBACK_HOSTS
from tests.infra.siteclient import SiteClient

# Starts real servers (registries, archway serve, helm...): outside the fast inner loop.
pytestmark = pytest.mark.slow

FIXTURES = os.path.join(REPO, "tests", "fixtures", "admission")
DEADLINE = 1.5            # admission.deadline_seconds of the server under test
ARCH = "kubernetes.io/arch"
RESPONSE_KEYS = {"uid", "allowed", "patchType", "patch", "warnings", "status", "auditAnnotations"}
QUALIFIED_NAME = re.compile(r"^[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$")
NS = "team-a"
# What the chart's webhook ClusterRoles grant, but the secrets (granted per namespace here).
WEBHOOK_RULES = [
    {"apiGroups": [""], "resources": ["serviceaccounts"], "verbs": ["get", "list", "watch"]},
    {"apiGroups": [""], "resources": ["namespaces", "nodes"], "verbs": ["list", "watch"]},
    {"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch", "update"]},
    {"apiGroups": ["apps"], "resources": ["deployments", "statefulsets", "daemonsets", "replicasets"],
     "verbs": ["list"]},
    {"apiGroups": ["batch"], "resources": ["jobs", "cronjobs"], "verbs": ["list"]},
    {"apiGroups": ["events.k8s.io"], "resources": ["events"], "verbs": ["create", "patch"]},
    {"apiGroups": ["coordination.k8s.io"], "resources": ["leases"],
     "verbs": ["create", "get", "update"]},
]


# --- small fault-injection servers (the registries themselves are real) ----------------------

class _Canned:
    """Answers every request with one canned HTTP response."""

    def __init__(self, status: int, body: bytes, content_type: str):
        canned = (status, body, content_type)

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_GET(self):
                status, body, content_type = canned
                self.send_response(status)
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            do_HEAD = do_GET

        self._server = BackgroundHTTPServer(Handler)
        self.port = self._server.port
        self.host = f"127.0.0.1:{self.port}"

    def stop(self):
        self._server.stop()


class _Garbage:
    """Not HTTP at all: writes random-looking bytes and hangs up."""

    def __init__(self):
        self.port = free_port()
        self._listener = socket.create_server(("127.0.0.1", self.port))
        self.host = f"127.0.0.1:{self.port}"
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self):
        while True:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return
            try:
                conn.sendall(b"\x00\xffSSH-2.0-nonsense\r\n\x13\x37" * 64)
            except OSError:
                pass
            conn.close()

    def stop(self):
        self._listener.close()


# --- the world the webhook runs in -----------------------------------------------------------

@pytest.fixture(scope="module")
def world(control_plane, tmp_path_factory):
    ca = session_ca(tmp_path_factory)
    stack = []
    try:
        registry = RegistryServer(tmp_path_factory.mktemp("registry"))
        stack.append(registry)
        registry.push_index("archway/multi", "1.0", ["linux/amd64", "linux/arm64", "linux/arm/v7"])
        registry.push_image("archway/amd64only", "1.0", "linux/amd64")
        registry.push_image("archway/arm64only", "1.0", "linux/arm64")
        # SIF images siftool builds (the fixtures name them busybox, like the real ones)
        sifs = sifbuild.generated_corpus(str(tmp_path_factory.mktemp("sif")))
        with open(sifs["siftool-arm64.sif"], "rb") as f:
            registry.push_sif("archway/sif-busybox", "arm64", f.read())

        auth_registry = RegistryServer(tmp_path_factory.mktemp("auth-registry"), ca=ca,
                                       auth="htpasswd")
        stack.append(auth_registry)
        auth_registry.push_image("archway/private", "1.0", "linux/s390x")

        files = FileServer(ca, {"/images/busybox_ppc64le.sif":
                                sifs["siftool-ppc64le-aligned.sif"]})
        stack.append(files)

        # The real apiserver; archway reads it as a ServiceAccount that may read the secrets of
        # team-a and team-b only (team-c: the real authorizer refuses).
        kube = control_plane.kube
        for namespace in (NS, "team-b"):
            if not kube.exists(f"/api/v1/namespaces/{namespace}"):
                control_plane.new_namespace(namespace)
        base = f"/api/v1/namespaces/{NS}"
        secret = {"type": "kubernetes.io/dockerconfigjson", "metadata": {"name": "regcred"},
                  "data": {".dockerconfigjson": base64.b64encode(
                      auth_registry.dockerconfigjson()).decode()}}
        other = dict(secret, metadata={"name": "other-registry"}, data={
            ".dockerconfigjson": base64.b64encode(
                auth_registry.dockerconfigjson(key="elsewhere.example")).decode()})
        for body in (secret, other):
            kube.create(f"{base}/secrets", body)
        kube.create(f"{base}/serviceaccounts", {"metadata": {"name": "builder"},
                                                "imagePullSecrets": [{"name": "regcred"}]})
        read_secrets = [{"apiGroups": [""], "resources": ["secrets"], "verbs": ["get"]}]
        kubeconfig = control_plane.identity(NS, "admission-test", cluster_rules=WEBHOOK_RULES,
                                            namespace_rules={NS: read_secrets,
                                                             "team-b": read_secrets})

        hang = DelayProxy(registry.port, hang=True)
        stack.append(SimpleStop(hang.stop))
        err500 = _Canned(500, b'{"errors":[{"code":"UNKNOWN","message":"boom"}]}', "application/json")
        stack.append(err500)
        junk_json = _Canned(200, b"<html>this is not a manifest</html>",
                            "application/vnd.oci.image.index.v1+json")
        stack.append(junk_json)
        garbage = _Garbage()
        stack.append(garbage)

        workdir = tmp_path_factory.mktemp("archway")
        config = {
            "server": {"state_dir": str(workdir / "state"), "workers": 2, "threads": 8,
                       "log_every_admission": True,
                       "max_body_bytes": 256 * 1024},
            "admission": {"deadline_seconds": DEADLINE},
            "registry": {"insecure_hosts": [registry.host, hang.host, err500.host,
                                            junk_json.host, garbage.host],
                         "allow_hosts": list(LOOPBACK_HOSTS),
                         "ca_file": ca.cert_path, "timeout_seconds": 5},
            "kubernetes": {"kubeconfig": kubeconfig, "namespace": NS},
        }
        config_path = workdir / "archway.yaml"
        config_path.write_text(yaml.safe_dump(config))
        port = free_port()
        # serve.py makes its per-run metrics directory inside this one: the test can look in.
        env = dict(os.environ, PROMETHEUS_MULTIPROC_DIR=str(workdir / "metrics"))
        server = Server([sys.executable, "-m", "archway.main.cli", "--config", str(config_path),
                         "serve", "--bind", f"127.0.0.1:{port}"], port=port,
                        log_path=str(workdir / "serve.log"), cwd=REPO, env=env, ready_timeout=30)
        stack.append(server)
        w = World(server=server, port=port, cacert=str(workdir / "state" / "tls" / "ca.crt"),
                  registry=registry, auth_registry=auth_registry, files=files,
                  hang=hang, err500=err500, junk_json=junk_json, garbage=garbage,
                  metrics_parent=str(workdir / "metrics"))
        w.wait_ready()
        yield w
        errors = [line for line in w.full_log().splitlines()
                  if "Error handling request" in line or "unhandled error" in line
                  or "Traceback" in line]
        assert not errors, "archway logged errors:\n" + w.full_log()[-6000:]
    finally:
        for item in reversed(stack):
            item.stop()
        _remove_api_objects(control_plane.kube)


def _remove_api_objects(kube) -> None:
    """What the world made in the session's apiserver, so another module's world (the debug
    containers' tests use this fixture too) can make them again."""
    rbac, bound = "/apis/rbac.authorization.k8s.io/v1", f"{NS}-admission-test"
    for path in (f"/api/v1/namespaces/{NS}/secrets/regcred",
                 f"/api/v1/namespaces/{NS}/secrets/other-registry",
                 f"/api/v1/namespaces/{NS}/serviceaccounts/builder",
                 f"/api/v1/namespaces/{NS}/serviceaccounts/admission-test",
                 f"{rbac}/clusterroles/{bound}", f"{rbac}/clusterrolebindings/{bound}",
                 *(f"{rbac}/namespaces/{where}/{kind}/{bound}" for where in (NS, "team-b")
                   for kind in ("roles", "rolebindings"))):
        kube.delete(path)


class SimpleStop:
    def __init__(self, stop):
        self.stop = stop


class World:
    def __init__(self, **parts):
        self.__dict__.update(parts)
        self.url = f"https://127.0.0.1:{self.port}"
        self.session = self.new_session()

    def new_session(self):
        session = requests.Session()
        session.trust_env = False  # REQUESTS_CA_BUNDLE must not replace our CA
        session.verify = self.cacert
        return session

    def wait_ready(self, timeout=30.0):
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            try:
                if self.session.get(self.url + "/readyz", timeout=2).status_code == 200:
                    return
            except requests.RequestException:
                pass
            time.sleep(0.05)
        raise RuntimeError("archway serve never became ready:\n" + self.server.log())

    def substitute(self, text: str, **extra) -> str:
        # AUTH_REGISTRY first: it contains the word REGISTRY.
        text = text.replace("AUTH_REGISTRY", self.auth_registry.host)
        text = text.replace("REGISTRY", self.registry.host).replace("FILESERVER", self.files.host)
        for word, value in extra.items():
            text = text.replace(word, value)
        return text

    def load(self, name: str, **extra) -> dict:
        with open(os.path.join(FIXTURES, name + ".json")) as f:
            review = json.loads(self.substitute(f.read(), **extra))
        review["request"]["uid"] = str(uuid.uuid4())  # one log line per post, findable
        return review

    def post(self, review, session=None):
        body = review if isinstance(review, (bytes, str)) else json.dumps(review)
        return (session or self.session).post(self.url + "/mutate", data=body, timeout=10,
                                              headers={"Content-Type": "application/json"})

    def admit(self, review) -> dict:
        r = self.post(review)
        assert r.status_code == 200, r.text
        reply = r.json()
        check_apiserver_accepts(review, reply)
        return reply["response"]

    def full_log(self) -> str:
        with open(self.server.log_path, encoding="utf-8", errors="replace") as f:
            return f.read()

    def server_ms(self, uid: str) -> float:
        for line in reversed(self.full_log().splitlines()):
            if f"uid={uid} " in line:
                return float(re.search(r" ([0-9.]+) ms", line).group(1))
        raise AssertionError(f"no log line for {uid}")


def check_apiserver_accepts(review: dict, reply: dict) -> None:
    """What kube-apiserver checks of a webhook's reply before using it."""
    assert reply["apiVersion"] == review["apiVersion"] and reply["kind"] == "AdmissionReview"
    response = reply["response"]
    assert set(response) <= RESPONSE_KEYS, set(response) - RESPONSE_KEYS
    assert response["uid"] == review["request"]["uid"]
    assert isinstance(response["allowed"], bool)
    assert ("patch" in response) == ("patchType" in response)
    if "patch" in response:
        assert response["patchType"] == "JSONPatch" and response["allowed"]
        assert isinstance(json.loads(base64.b64decode(response["patch"])), list)
    if not response["allowed"]:
        assert response["status"]["code"] == 403 and response["status"]["message"]
    else:
        assert "status" not in response
    for warning in response.get("warnings", []):
        assert isinstance(warning, str) and len(warning) <= 120 and warning.isprintable()
    for key, value in response.get("auditAnnotations", {}).items():
        assert QUALIFIED_NAME.match(key) and isinstance(value, str)


def patched_pod(review: dict, response: dict) -> dict:
    pod = review["request"]["object"]
    if "patch" not in response:
        return pod
    patch = json.loads(base64.b64decode(response["patch"]))
    result = jsonpatch.apply_patch(pod, patch)
    for version in ("1.30.0", "1.33.0"):
        kubernetes_validate.validate(result, version, strict=True)
    return result


def required_terms(pod):
    return (pod["spec"].get("affinity", {}).get("nodeAffinity", {})
            .get("requiredDuringSchedulingIgnoredDuringExecution", {}).get("nodeSelectorTerms"))


# --- placements ------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["v1-pod-multiarch", "v1beta1-pod-multiarch"])
def test_multi_arch_image_gets_required_affinity(world, name):
    review = world.load(name)
    response = world.admit(review)
    assert response["allowed"] and "warnings" not in response
    pod = patched_pod(review, response)
    assert required_terms(pod) == [{"matchExpressions": [
        {"key": ARCH, "operator": "In", "values": ["amd64", "arm", "arm64"]}]}]
    assert pod["metadata"]["annotations"]["archway.dev/architectures"] == "amd64,arm,arm64"
    assert response["auditAnnotations"] == {"outcome": "mutated", "architectures": "amd64,arm,arm64"}


@pytest.mark.parametrize("name, arch", [
    ("v1-pod-single-arch", "arm64"),
    ("v1-pod-init-containers", "amd64"),
    ("v1-pod-sif-oras", "arm64"),
    ("v1-pod-sif-https", "ppc64le"),
])
def test_single_architecture_becomes_a_node_selector(world, name, arch):
    review = world.load(name)
    response = world.admit(review)
    assert response["allowed"] and "warnings" not in response, response
    pod = patched_pod(review, response)
    assert pod["spec"]["nodeSelector"] == {ARCH: arch}
    assert "affinity" not in pod["spec"]


def test_existing_node_selector_is_not_overridden(world):
    review = world.load("v1-pod-existing-nodeselector")
    response = world.admit(review)
    pod = patched_pod(review, response)
    assert pod["spec"]["nodeSelector"] == {ARCH: "arm64", "disktype": "ssd"}
    (only,) = json.loads(base64.b64decode(response["patch"]))   # annotations, nothing else
    assert only["op"] == "add" and only["path"] == "/metadata/annotations"
    assert only["value"]["archway.dev/architectures"] == "amd64,arm,arm64"
    (image,) = json.loads(only["value"]["archway.dev/images"])
    assert image["architectures"] == ["amd64", "arm", "arm64"] and image["source"] == "oci-index"


def test_two_affinity_terms_both_gain_the_arch_requirement(world):
    review = world.load("v1-pod-affinity-two-terms")
    before = review["request"]["object"]["spec"]["affinity"]["nodeAffinity"]
    response = world.admit(review)
    pod = patched_pod(review, response)
    terms = required_terms(pod)
    assert len(terms) == 2
    arch = {"key": ARCH, "operator": "In", "values": ["amd64", "arm", "arm64"]}
    for old, new in zip(before["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"],
                        terms):
        assert new["matchExpressions"] == old["matchExpressions"] + [arch]
    assert (pod["spec"]["affinity"]["nodeAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"]
            == before["preferredDuringSchedulingIgnoredDuringExecution"])


def test_conflicting_images_are_denied_with_each_image_listed(world):
    review = world.load("v1-pod-conflicting-images")
    response = world.admit(review)
    assert response["allowed"] is False
    message = response["status"]["message"]
    assert f"{world.registry.host}/archway/amd64only:1.0 (amd64)" in message
    assert f"{world.registry.host}/archway/arm64only:1.0 (arm64)" in message


@pytest.mark.parametrize("name", ["v1-pod-opted-out", "v1-pod-bound-to-node",
                                  "v1-configmap-create", "v1-pod-update"])
def test_left_alone(world, name):
    review = world.load(name)
    assert world.admit(review) == {"uid": review["request"]["uid"], "allowed": True}


def test_excluded_namespace_is_left_alone(world):
    review = world.load("v1-pod-single-arch")
    review["request"]["namespace"] = "kube-system"
    review["request"]["object"]["metadata"]["namespace"] = "kube-system"
    assert world.admit(review) == {"uid": review["request"]["uid"], "allowed": True}


# --- pull secrets through the real apiserver -------------------------------------------------

@pytest.mark.parametrize("name", ["v1-pod-private-pull-secret", "v1-pod-private-service-account"])
def test_private_image_resolves_through_a_pull_secret(world, name):
    review = world.load(name)
    response = world.admit(review)
    # The cluster has no s390x node: that, and nothing about reading the image, is said.
    assert response.get("warnings") == [
        "images are s390x-only; nodes: amd64, arm64, ppc64le; the pod would stay Pending"], response
    assert patched_pod(review, response)["spec"]["nodeSelector"] == {ARCH: "s390x"}


def test_credentials_never_reach_the_log(world):
    for name in ("v1-pod-private-pull-secret", "v1-pod-private-service-account"):
        world.admit(world.load(name))
    log_text = world.full_log()
    assert "s390x" in log_text  # the admissions were logged...
    for user, password in world.auth_registry.users.items():
        basic = base64.b64encode(f"{user}:{password}".encode()).decode()
        assert password not in log_text and basic not in log_text  # ...without their secrets


def test_private_image_without_credentials_fails_open_with_a_warning(world):
    review = world.load("v1-pod-private-pull-secret")
    review["request"]["namespace"] = "team-b"
    review["request"]["object"]["metadata"]["namespace"] = "team-b"  # no secrets there
    response = world.admit(review)
    assert response["allowed"] and "patch" not in response
    assert response["warnings"] == [  # the one the user can act on first
        "pull secret team-b/regcred: not found",
        f"could not inspect {world.auth_registry.host}/archway/private:1.0 (credentials "
        "required; none sent); it does not restrict placement"]


def test_forbidden_secret_read_degrades_with_a_warning(world):
    review = world.load("v1-pod-private-pull-secret")
    review["request"]["namespace"] = "team-c"
    review["request"]["object"]["metadata"]["namespace"] = "team-c"
    response = world.admit(review)
    assert response["allowed"] and "patch" not in response
    assert "pull secret team-c/regcred: archway may not read it (HTTP 403; check its RBAC)" in \
        response["warnings"]


# --- faults ----------------------------------------------------------------------------------

def _single_image_review(world, image):
    review = world.load("v1-pod-single-arch")
    review["request"]["object"]["spec"]["containers"][0]["image"] = image
    return review


def test_registry_that_never_answers_is_cut_off_at_the_deadline(world):
    review = _single_image_review(world, f"{world.hang.host}/archway/multi:1.0")
    start = time.monotonic()
    response = world.admit(review)
    elapsed = time.monotonic() - start
    print(f"\nhanging registry: answered in {elapsed * 1000:.0f} ms (deadline {DEADLINE} s)")
    assert DEADLINE * 0.8 < elapsed < DEADLINE + 0.5
    assert response["allowed"] and "patch" not in response
    assert response["warnings"] == [f"could not inspect {world.hang.host}/archway/multi:1.0 "
                                    "(registry unreachable); it does not restrict placement"]
    assert response["auditAnnotations"] == {"outcome": "fail_open"}


@pytest.mark.parametrize("server, words", [
    ("err500", "registry answered HTTP 500"),
    ("junk_json", None),
    ("garbage", None),
])
def test_broken_registries_fail_open_with_a_warning(world, server, words):
    host = getattr(world, server).host
    review = _single_image_review(world, f"{host}/archway/app:1.0")
    response = world.admit(review)
    assert response["allowed"] and "patch" not in response
    [warning] = response["warnings"]
    assert warning.startswith(f"could not inspect {host}/archway/app:1.0 (")
    if words:
        assert f"({words})" in warning


def test_one_slow_image_does_not_lose_the_others(world):
    review = world.load("v1-pod-single-arch")
    containers = review["request"]["object"]["spec"]["containers"]
    containers.append(dict(containers[0], name="sidecar", image=f"{world.hang.host}/x/y:2"))
    response = world.admit(review)
    assert patched_pod(review, response)["spec"]["nodeSelector"] == {ARCH: "arm64"}
    assert len(response["warnings"]) == 1 and "(registry unreachable)" in response["warnings"][0]


# --- the deadline: from the request's arrival, within the apiserver's timeout -----------------

def _never_seen(world) -> str:
    """An image on the registry that never answers, of a name no earlier lookup failed on (a
    failure is cached for a while and would be answered at once)."""
    return f"{world.hang.host}/archway/never-{uuid.uuid4().hex[:12]}:1"


def _post_in_two_parts(world, review, pause: float) -> tuple[float, float, dict]:
    """POST /mutate on a new TLS connection, its body's last byte `pause` seconds after the
    rest: (seconds from connecting to the answer, seconds from the last byte, the answer)."""
    import ssl
    body = json.dumps(review).encode()
    context = ssl.create_default_context(cafile=world.cacert)
    started = time.monotonic()
    with context.wrap_socket(socket.create_connection(("127.0.0.1", world.port), timeout=10),
                             server_hostname="127.0.0.1") as s:
        s.sendall(b"POST /mutate HTTP/1.1\r\nHost: archway\r\nContent-Type: application/json\r\n"
                  b"Content-Length: %d\r\n\r\n" % len(body) + body[:-1])
        time.sleep(pause)
        s.sendall(body[-1:])
        sent = time.monotonic()
        reply = b""
        while b"\r\n\r\n" not in reply or len(reply.partition(b"\r\n\r\n")[2]) < int(
                re.search(rb"(?i)content-length: *(\d+)", reply).group(1)):
            chunk = s.recv(65536)
            assert chunk, f"the server closed the connection: {reply!r}"
            reply += chunk
    answered = time.monotonic()
    assert reply.startswith(b"HTTP/1.1 200"), reply[:200]
    return answered - started, answered - sent, json.loads(reply.partition(b"\r\n\r\n")[2])


def test_the_deadline_counts_from_the_requests_arrival_not_from_its_thread(world):
    """The worker reads a request before a thread takes it; the time that took (here the
    client's pause, as a queue's wait would) counts against the deadline."""
    review = _single_image_review(world, _never_seen(world))
    total, after_last_byte, reply = _post_in_two_parts(world, review, pause=1.2)
    print(f"\nanswered {total:.2f} s after connecting, {after_last_byte:.2f} s after the body")
    assert after_last_byte < DEADLINE - 0.5      # 0.3 s were left, not a whole deadline
    assert total >= DEADLINE * 0.8
    assert "(registry unreachable)" in reply["response"]["warnings"][0]


@pytest.mark.parametrize("query, budget", [
    ("?timeout=1s", 0.75),             # the apiserver's 1 s, less a quarter kept back
    ("?timeout=30s", DEADLINE),        # longer than archway's own deadline
    ("?timeout=soon", DEADLINE),       # not a Go duration: ignored
    ("?timeout=-5s&timeout=%00", DEADLINE),
])
def test_the_apiservers_timeout_bounds_the_deadline(world, query, budget):
    review = _single_image_review(world, _never_seen(world))
    start = time.monotonic()
    r = world.session.post(world.url + "/mutate" + query, data=json.dumps(review), timeout=10,
                           headers={"Content-Type": "application/json"})
    elapsed = time.monotonic() - start
    assert r.status_code == 200, r.text
    assert "(registry unreachable)" in r.json()["response"]["warnings"][0]
    assert budget * 0.8 < elapsed < budget + 0.4


def test_a_burst_larger_than_the_thread_pool_is_answered_within_one_deadline(world):
    """64 admissions at once on a registry that never answers, 16 threads: the first 16 wait
    out the deadline; the rest, queued as long, have nothing left and are answered at once
    instead of waiting a deadline each (4 x 1.5 s, past the apiserver's 5 s)."""
    image = _never_seen(world)
    took: list[float] = []
    outcomes: list[str] = []

    def admit():
        session = world.new_session()
        start = time.monotonic()
        reply = world.post(_single_image_review(world, image), session=session).json()
        took.append(time.monotonic() - start)
        outcomes.append(reply["response"]["auditAnnotations"]["outcome"])

    threads = [threading.Thread(target=admit) for _ in range(64)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert len(took) == 64 and set(outcomes) == {"fail_open"}   # admission.unresolved: admit
    print(f"\n64 at once: slowest answer {max(took):.2f} s (deadline {DEADLINE} s)")
    assert max(took) < DEADLINE + 2.0


# --- malformed input -------------------------------------------------------------------------

def _fixture_with(path, value):
    with open(os.path.join(FIXTURES, "v1-pod-single-arch.json")) as f:
        review = json.load(f)
    target = review
    for key in path[:-1]:
        target = target[key]
    if value is KeyError:
        del target[path[-1]]
    else:
        target[path[-1]] = value
    return json.dumps(review)


MALFORMED_BODIES = {
    "empty": "", "not-json": "not json", "list": "[]", "null": "null", "string": '"x"',
    "empty-object": "{}", "no-kind": '{"apiVersion": "admission.k8s.io/v1"}',
    "no-request": _fixture_with(["request"], KeyError),
    "no-uid": _fixture_with(["request", "uid"], KeyError),
    "numeric-uid": _fixture_with(["request", "uid"], 12),
    "null-operation": _fixture_with(["request", "operation"], None),
    "object-is-list": _fixture_with(["request", "object"], []),
    "containers-is-string": _fixture_with(["request", "object", "spec", "containers"], "nginx"),
    "affinity-is-string": _fixture_with(["request", "object", "spec", "affinity"], "everywhere"),
    "nodeselector-is-list": _fixture_with(["request", "object", "spec", "nodeSelector"],
                                          ["kubernetes.io/arch=arm64"]),
    "not-utf8": b"\xff\xfe\xfd",
}


@pytest.mark.parametrize("body", MALFORMED_BODIES.values(), ids=MALFORMED_BODIES.keys())
def test_malformed_bodies_are_json_400s(world, body):
    r = world.post(body)
    assert r.status_code == 400, r.text
    assert r.headers["Content-Type"].startswith("application/json")
    assert isinstance(r.json()["error"], str) and r.json()["error"]


def test_body_over_the_limit_is_a_json_413(world):
    review = world.load("v1-pod-single-arch")
    review["request"]["object"]["metadata"]["annotations"] = {"filler": "x" * (300 * 1024)}
    r = world.post(review)
    assert r.status_code == 413 and "exceeds server.max_body_bytes" in r.json()["error"]


def test_chunked_body_over_the_limit_is_refused(world):
    review = world.load("v1-pod-single-arch")
    review["request"]["object"]["metadata"]["annotations"] = {"filler": "x" * (300 * 1024)}
    data = json.dumps(review).encode()
    chunks = (data[i:i + 8192] for i in range(0, len(data), 8192))  # no Content-Length
    try:
        r = world.session.post(world.url + "/mutate", data=chunks, timeout=10)
    except requests.ConnectionError:
        return  # hung up mid-upload without reading the rest: refused as well
    assert r.status_code == 413 and "error" in r.json()


@pytest.mark.parametrize("method, path, status", [
    ("GET", "/mutate", 405), ("POST", "/mutate-pods", 404), ("GET", "/", 404),
])
def test_other_routes_answer_json(world, method, path, status):
    r = world.session.request(method, world.url + path, timeout=5)
    assert r.status_code == status and "error" in r.json()


def test_the_default_server_is_webhook_and_extender(world):
    """`archway serve` with no product set answers the extender routes next to /mutate."""
    with open(os.path.join(REPO, "tests", "fixtures", "extender", "filter-nodenames.json"),
              "rb") as f:
        r = world.session.post(world.url + "/scheduler/prioritize", data=f.read(), timeout=5)
    assert r.status_code == 200 and all("Host" in entry for entry in r.json())
    r = world.session.get(world.url + "/no-such-route", timeout=5)
    assert "POST /mutate" in r.json()["error"] and "POST /scheduler/filter" in r.json()["error"]


def test_health_and_readiness(world):
    assert world.session.get(world.url + "/healthz", timeout=5).json() == {"status": "ok"}
    ready = world.session.get(world.url + "/readyz", timeout=5).json()
    # Where the API was found, never the kubeconfig's path (issue 30): no path at all.
    assert ready["ready"] is True and ready["kubernetes_api"] == "kubeconfig"
    assert "/" not in json.dumps(ready), ready


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # asking for TLS 1.0/1.1 on purpose
def test_tls_is_1_2_or_newer(world):
    import ssl
    context = ssl.create_default_context(cafile=world.cacert)
    context.maximum_version = ssl.TLSVersion.TLSv1_1
    context.minimum_version = ssl.TLSVersion.TLSv1
    with pytest.raises((ssl.SSLError, OSError)):
        with socket.create_connection(("127.0.0.1", world.port), timeout=5) as raw:
            with context.wrap_socket(raw, server_hostname="127.0.0.1"):
                pass


# --- metrics and latency ---------------------------------------------------------------------

def _metric(text: str, name: str, labels: str = "") -> float:
    pattern = re.escape(name) + (r"\{" + re.escape(labels) + r"\}" if labels else "") + r" ([0-9.e+]+)"
    found = re.search(pattern, text)
    return float(found.group(1)) if found else 0.0


def _scrape(world) -> str:
    # A fresh connection each time, so scrapes land on either worker.
    with world.new_session() as s:
        return s.get(world.url + "/metrics", timeout=5, headers={"Connection": "close"}).text


def _admissions_by_worker(world) -> dict[str, float]:
    """Each worker's own admission count, read from its file in the multiprocess directory."""
    from prometheus_client.multiprocess import MultiProcessCollector
    [run_dir] = os.listdir(world.metrics_parent)
    counts = {}
    for name in os.listdir(os.path.join(world.metrics_parent, run_dir)):
        if name.startswith("counter_"):
            path = os.path.join(world.metrics_parent, run_dir, name)
            counts[name] = sum(sample.value for metric in MultiProcessCollector.merge([path])
                               for sample in metric.samples
                               if sample.name == "archway_admissions_total")
    return {name: count for name, count in counts.items() if count}


def test_metrics_add_up_across_workers(world):
    before = _metric(_scrape(world), "archway_admissions_total", 'outcome="mutated"')
    posted = 0
    # Fresh connections until both workers have answered admissions (each has its own file).
    while posted < 6 or (len(_admissions_by_worker(world)) < 2 and posted < 200):
        with world.new_session() as s:
            r = world.post(world.load("v1-pod-multiarch"), session=s)
            assert r.status_code == 200, r.text
        posted += 1
    by_worker = _admissions_by_worker(world)
    assert len(by_worker) == 2, by_worker
    print(f"\nadmissions per worker after {posted} posts: {sorted(by_worker.values())}")
    for _ in range(4):  # whichever worker answers the scrape, it reports both workers' counts
        text = _scrape(world)
        assert _metric(text, "archway_admissions_total", 'outcome="mutated"') == before + posted, \
            (before, posted, by_worker, text)
        assert sum(_metric(text, "archway_admissions_total", f'outcome="{o}"') for o in
                   ("mutated", "unchanged", "denied", "fail_open", "error")) == sum(by_worker.values())
        assert _metric(text, "archway_admission_duration_seconds_count") >= posted
        assert _metric(text, "archway_image_resolutions_total",
                       'result="resolved",source="oci-index"') >= posted


def test_a_worker_restart_keeps_metrics_and_admissions_working(world):
    """gunicorn replaces a worker that dies; the replacement and its sibling keep counting."""
    booted = re.findall(r"Booting worker with pid: (\d+)", world.full_log())
    victim = int(booted[-1])
    before = _metric(_scrape(world), "archway_admissions_total", 'outcome="mutated"')
    os.kill(victim, 15)
    deadline = time.monotonic() + 15
    while len(re.findall(r"Booting worker with pid", world.full_log())) == len(booted):
        assert time.monotonic() < deadline, world.full_log()[-3000:]
        time.sleep(0.05)
    world.wait_ready()
    for _ in range(8):
        with world.new_session() as s:
            r = world.post(world.load("v1-pod-multiarch"), session=s)
            assert r.status_code == 200, r.text
    [run_dir] = os.listdir(world.metrics_parent)
    assert os.path.isdir(os.path.join(world.metrics_parent, run_dir))
    # the dead worker's counts are kept: nothing counted is lost with the process
    assert _metric(_scrape(world), "archway_admissions_total", 'outcome="mutated"') == before + 8


def test_admission_latency_cold_and_warm(world):
    """Cold: first pod naming an image no worker has seen. Warm: the same image again, same
    connection (so the same worker and its cache)."""
    tag = uuid.uuid4().hex[:8]
    world.registry.push_index("archway/latency", tag, ["linux/amd64", "linux/arm64"])
    image = f"{world.registry.host}/archway/latency:{tag}"
    session = world.new_session()
    world.post(world.load("v1-configmap-create"), session=session)  # connection + TLS up front
    client_ms, server_ms = [], []
    for _ in range(21):
        review = _single_image_review(world, image)
        start = time.perf_counter()
        r = world.post(review, session=session)
        client_ms.append((time.perf_counter() - start) * 1000)
        assert r.status_code == 200, r.text
        assert r.json()["response"]["allowed"]
        server_ms.append(world.server_ms(review["request"]["uid"]))
    session.close()
    cold_client, cold_server = client_ms[0], server_ms[0]
    warm_client, warm_server = statistics.median(client_ms[1:]), statistics.median(server_ms[1:])
    print(f"\nadmission latency cold: client {cold_client:.1f} ms, server {cold_server:.1f} ms; "
          f"warm (median of 20): client {warm_client:.1f} ms, server {warm_server:.1f} ms")
    assert warm_server < cold_server
    assert warm_client < 250 and cold_client < DEADLINE * 1000


# --- the embedded default and shutdown -------------------------------------------------------

@pytest.fixture(scope="module")
def default_serve(tmp_path_factory):
    """`archway serve` exactly as a newcomer runs it: no config, only --bind (HOME is a temp
    dir so the generated certificate lands there, not in the real home)."""
    yield from _serve(tmp_path_factory)


@pytest.fixture
def loopback_serve(tmp_path_factory):
    """The same with a config listing loopback in registry.allow_hosts (a hanging registry)."""
    config = tmp_path_factory.mktemp("config") / "archway.yaml"
    config.write_text(yaml.safe_dump({"registry": {"allow_hosts": list(LOOPBACK_HOSTS)}}))
    yield from _serve(tmp_path_factory, "--config", str(config))


def _serve(tmp_path_factory, *options: str):
    home = tmp_path_factory.mktemp("home")
    port = free_port()
    env = {k: v for k, v in os.environ.items()
           if k not in ("ARCHWAY_CONFIG", "PROMETHEUS_MULTIPROC_DIR", "KUBECONFIG")}
    env["HOME"] = str(home)
    server = Server([sys.executable, "-m", "archway.main.cli", *options, "serve",
                     "--bind", f"127.0.0.1:{port}"],
                    port=port, log_path=str(home / "serve.log"), cwd=REPO, env=env,
                    ready_timeout=30)
    try:
        yield server, home, port
    finally:
        server.stop()


def test_embedded_default_serves_a_fixture_as_is(default_serve):
    server, home, port = default_serve
    cacert = home / ".local" / "state" / "archway" / "tls" / "ca.crt"
    deadline = time.monotonic() + 20
    while "curl --cacert" not in server.log() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert f"curl --cacert {cacert}" in server.log()
    with open(os.path.join(FIXTURES, "v1-pod-unreachable-image.json"), "rb") as f:
        review = json.load(f)
    session = requests.Session()
    session.trust_env = False
    r = session.post(f"https://127.0.0.1:{port}/mutate", json=review, verify=str(cacert),
                     timeout=10)
    assert r.status_code == 200
    check_apiserver_accepts(review, r.json())
    response = r.json()["response"]
    assert response["allowed"] and "patch" not in response
    assert response["warnings"] == [
        "could not inspect 127.0.0.1:9/team/app:1.0 (refused by policy: loopback); it does not "
        "restrict placement",
        "archway contacts a loopback address only when registry.allow_hosts lists its host"]


def test_the_line_serve_prints_to_try_it_works_outside_the_checkout(default_serve, tmp_path):
    """Issue 34, finding 7: the line told a user to post tests/fixtures/..., which neither the
    image nor a pip install has. The line `archway serve` prints, run as printed by a shell in
    a directory that is not the checkout, gets the webhook's answer."""
    server, home, port = default_serve
    deadline = time.monotonic() + 20
    while "archway: try  " not in server.log() and time.monotonic() < deadline:
        time.sleep(0.05)
    line = server.log().split("archway: try  ", 1)[1].splitlines()[0]
    assert "tests/" not in line and line.endswith(f"https://127.0.0.1:{port}/mutate"), line
    env = {k: v for k, v in os.environ.items() if "proxy" not in k.lower()}
    env["HOME"] = str(home)
    done = subprocess.run(["bash", "-c", f"set -o pipefail; {line}"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    answer = json.loads(done.stdout)
    assert answer["kind"] == "AdmissionReview" and answer["response"]["allowed"], answer
    # Loopback is refused by the host policy, not unreachable: the warning says so (issue 47).
    assert answer["response"]["warnings"] == [
        "could not inspect 127.0.0.1:9/team/app:1.0 (refused by policy: loopback); it does not "
        "restrict placement",
        "archway contacts a loopback address only when registry.allow_hosts lists its host"]


def test_sigterm_lets_an_admission_in_flight_finish(loopback_serve, tmp_path):
    server, home, port = loopback_serve
    cacert = str(home / ".local" / "state" / "archway" / "tls" / "ca.crt")
    hang = DelayProxy(free_port(), hang=True)   # default deadline: 3 s
    try:
        review = _single_image_review_from_file(f"{hang.host}/archway/slow:1.0")
        result = {}

        def post():
            session = requests.Session()
            session.trust_env = False
            start = time.monotonic()
            r = session.post(f"https://127.0.0.1:{port}/mutate", json=review, verify=cacert,
                             timeout=15)
            result.update(status=r.status_code, body=r.json(), seconds=time.monotonic() - start)

        thread = threading.Thread(target=post)
        thread.start()
        while hang.connections == 0 and thread.is_alive():
            time.sleep(0.02)
        os.kill(server.proc.pid, 15)   # SIGTERM to gunicorn's master, as kubelet does
        thread.join(15)
        assert server.proc.wait(15) == 0
    finally:
        hang.stop()
    assert result["status"] == 200, (result, server.log())
    assert result["body"]["response"]["allowed"]
    assert "(registry unreachable)" in result["body"]["response"]["warnings"][0]
    assert 2.5 < result["seconds"] < 4.0


def _single_image_review_from_file(image):
    with open(os.path.join(FIXTURES, "v1-pod-single-arch.json")) as f:
        review = json.load(f)
    review["request"]["object"]["spec"]["containers"][0]["image"] = image
    return review


# --- in-process: the worker's routes without a server (fault injection into the resolver) -------

def _app(tmp_path, resolver, **server):
    from archway.cluster.pullsecrets import PullSecrets
    from archway.config import config_from_dict
    from archway.main.worker import build_worker
    config = config_from_dict({"server": {"state_dir": str(tmp_path / "state"), **server},
                               "kubernetes": {"enabled": "off"}})
    return SiteClient(build_worker(config, resolver=resolver,
                                   pull_secrets=PullSecrets(None, source="disabled")))


class _ExplodingResolver:
    cache_size = 0

    def resolve_many(self, images, **kwargs):
        raise RuntimeError("bug in the resolver")


def test_a_bug_during_admission_fails_open_and_is_never_a_500(tmp_path):
    client = _app(tmp_path, _ExplodingResolver())
    with open(os.path.join(FIXTURES, "v1-pod-multiarch.json")) as f:
        review = json.load(f)
    r = client.post("/mutate", json=review)
    assert r.status_code == 200
    check_apiserver_accepts(review, r.get_json())
    response = r.get_json()["response"]
    assert response["allowed"] and response["auditAnnotations"] == {"outcome": "error"}
    assert response["warnings"] == [
        "archway failed to decide (internal error); pod admitted unchanged"]


def test_readyz_fails_when_the_serving_certificate_expired(tmp_path):
    import datetime as dt

    from archway.certs.x509 import issue_ca, issue_serving_cert
    past = dt.datetime.now(dt.UTC) - dt.timedelta(days=10)
    ca = issue_ca("expired test CA", days=30, now=past)
    leaf = issue_serving_cert(ca, ["127.0.0.1"], days=1, now=past)
    (tmp_path / "tls.crt").write_bytes(leaf.cert_pem)
    (tmp_path / "tls.key").write_bytes(leaf.key_pem)
    client = _app(tmp_path, _ExplodingResolver(), cert_file=str(tmp_path / "tls.crt"),
                  key_file=str(tmp_path / "tls.key"))
    r = client.get("/readyz")
    assert r.status_code == 503
    assert "expired" in r.get_json()["problems"]["serving_certificate"]
    assert client.get("/healthz").status_code == 200  # alive, just not ready


def test_a_burst_of_pods_with_one_new_image_costs_one_manifest_fetch(world):
    """50 concurrent admissions, on new connections so both gunicorn workers take some."""
    world.registry.push_index("archway/burst", "1.0", ["linux/amd64", "linux/s390x"])
    image = f"{world.registry.host}/archway/burst:1.0"
    mark = world.registry.mark()
    replies = []

    def admit():
        review = _single_image_review(world, image)
        replies.append(world.post(review, session=world.new_session()).json()["response"])

    threads = [threading.Thread(target=admit) for _ in range(50)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert len(replies) == 50
    assert all(r.get("patch") and not r.get("warnings") for r in replies)
    assert len(world.registry.manifest_gets(mark, "archway/burst")) == 1


class _FixedResolver:
    cache_size = 0

    def __init__(self, answers):
        self.answers = answers

    def resolve_many(self, images, **kwargs):
        return {image: self.answers[image] for image in images}


def test_by_default_only_admissions_that_need_a_look_are_logged(tmp_path, caplog):
    from archway.errors import TransportError
    from archway.registry.model import ImageInfo
    from archway.registry.platforms import normalize
    good, down = "reg.example/app:1", "down.example/app:1"
    resolver = _FixedResolver({good: ImageInfo(good, frozenset({normalize("linux", "arm64")}),
                                               None, "oci-manifest"),
                               down: TransportError("cannot reach down.example")})
    for every, expected in ((False, ["fail_open"]), (True, ["mutated", "fail_open"])):
        client = _app(tmp_path, resolver, log_every_admission=every)
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="archway.admission"):
            for image in (good, down):
                assert client.post("/mutate", json=_single_image_review_from_file(image)).status_code == 200
        logged = [re.search(r"outcome=(\w+)", r.getMessage()).group(1) for r in caplog.records]
        assert logged == expected
