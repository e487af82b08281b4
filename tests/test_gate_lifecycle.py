"""The gate controller's life beside the webhook (issue 21): gating from the first admission
/readyz lets in, a controller that dies is started again and shows on the health endpoints, and
it starts from any working directory. A real `archway serve` against the real control plane's
apiserver (its Lease in a namespace of each test's own); tests/e2e/test_lifecycle.py runs the
same through pods the apiserver admits.

The pods' images name a registry port nobody listens on: every lookup fails at once, so every
admission is a miss decided as soon as it arrives (the strictest case for the Lease's view)."""
import json
import os
import signal
import subprocess
import sys
import time
import uuid

import pytest
import requests
import yaml

from archway.config import config_from_dict
from archway.lease import lease_path
from archway.main.serve import GATE_CONTROLLER_MODULE
from archway.server import supervisor
from lab.clock import ManualClock
from lab.kube import KubeError
from lab.procs import REPO, Server, children, cmdline, free_port, wait_until
from lab.servers.apiserver import FakeApiServer

pytestmark = pytest.mark.slow

LEASE = 3.0
LEASE_NS = "archway"


def review(image: str) -> dict:
    name = f"p-{uuid.uuid4().hex[:8]}"
    return {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": {
        "uid": str(uuid.uuid4()), "kind": {"group": "", "version": "v1", "kind": "Pod"},
        "resource": {"group": "", "version": "v1", "resource": "pods"},
        "operation": "CREATE", "namespace": "team", "name": name,
        "object": {"apiVersion": "v1", "kind": "Pod",
                   "metadata": {"name": name, "namespace": "team"},
                   "spec": {"containers": [{"name": "c", "image": image}]}}}}


class Archway:
    def __init__(self, tmp_path, kubeconfig: str, lease_ns: str = LEASE_NS, *, cwd=REPO,
                 workers=2, env=None):
        self.port = free_port()
        self.down_registry = f"127.0.0.1:{free_port()}"   # refuses connections
        state = tmp_path / "state"
        config = {"server": {"state_dir": str(state), "workers": workers, "threads": 4},
                  "admission": {"deadline_seconds": 1.0, "unresolved": "gate",
                                "gate_max_seconds": 60, "gate_lease_seconds": LEASE},
                  "registry": {"insecure_hosts": [self.down_registry], "timeout_seconds": 1.0},
                  "kubernetes": {"kubeconfig": kubeconfig, "namespace": lease_ns}}
        path = tmp_path / "archway.yaml"
        path.write_text(yaml.safe_dump(config))
        self.log_path = str(tmp_path / "archway.log")
        env = dict(os.environ, PROMETHEUS_MULTIPROC_DIR=str(tmp_path / "metrics"), **(env or {}))
        self.server = Server([sys.executable, "-m", "archway.main.cli", "--config", str(path), "serve",
                              "--bind", f"127.0.0.1:{self.port}"], port=self.port,
                             log_path=self.log_path, cwd=cwd, env=env, ready_timeout=30)
        self.url = f"https://127.0.0.1:{self.port}"
        self.ca = str(state / "tls" / "ca.crt")

    def get(self, path: str) -> requests.Response:
        """On a connection of its own: whichever worker the kernel picks answers."""
        with requests.Session() as session:
            session.trust_env = False
            return session.get(self.url + path, verify=self.ca, timeout=10,
                               headers={"Connection": "close"})

    def admit_miss(self) -> dict:
        with requests.Session() as session:
            session.trust_env = False
            answer = session.post(self.url + "/mutate", verify=self.ca, timeout=10,
                                  json=review(f"{self.down_registry}/app/x:1"),
                                  headers={"Connection": "close"})
        assert answer.status_code == 200, answer.text
        return answer.json()["response"]

    def metric(self, name: str) -> float:
        for line in self.get("/metrics").text.splitlines():
            if line.startswith(name + " "):
                return float(line.split()[1])
        return 0.0

    def controller_pids(self) -> list[int]:
        return [p for p in children(self.server.proc.pid) if "archway.gate.process" in cmdline(p)]

    def log(self) -> str:
        with open(self.log_path, encoding="utf-8", errors="replace") as f:
            return f.read()

    def stop(self) -> None:
        self.server.stop()


def ready_facts(archway: Archway) -> dict | None:
    """/readyz's facts once several answers in a row (any worker) are ready, else None."""
    answers = [archway.get("/readyz") for _ in range(6)]
    return answers[-1].json() if all(a.status_code == 200 for a in answers) else None


@pytest.fixture
def api(control_plane):
    """The real apiserver: its admin's kubeconfig, and a namespace of the test's own for the
    Lease (a killed controller's Lease must not hold up the next test)."""
    namespace = control_plane.new_namespace(f"lease-{uuid.uuid4().hex[:8]}")
    yield RealApi(control_plane, namespace)
    control_plane.kube.delete(f"/api/v1/namespaces/{namespace}")


class RealApi:
    def __init__(self, plane, namespace: str):
        self.plane = plane
        self.namespace = namespace

    def kubeconfig(self, _directory: str) -> str:
        return self.plane.admin_kubeconfig

    def lease(self) -> dict | None:
        try:
            return self.plane.kube.get(lease_path(self.namespace))
        except KubeError as e:
            if e.status == 404:
                return None
            raise


def test_every_admission_after_readyz_is_gated_from_the_first(api, tmp_path):
    """Issue 21, item 1: /readyz answered 200 while the workers' Lease observers had not seen
    the controller take the Lease, and the first misses were admitted ungated."""
    archway = Archway(tmp_path, api.kubeconfig(str(tmp_path)), api.namespace)
    try:
        wait_until(lambda: archway.get("/readyz").status_code == 200, 30, "/readyz")
        # Straight away, each on a new connection (both workers), as the apiserver would.
        answers = [archway.admit_miss() for _ in range(8)]
        assert [a["auditAnnotations"]["outcome"] for a in answers] == ["gated"] * 8, answers
        assert api.lease()["spec"]["holderIdentity"]
        facts = archway.get("/readyz").json()
        assert facts["gate_controller"] == "leader alive"
        assert facts["gate_controller_process"].startswith("running (pid ")
    finally:
        archway.stop()
    assert "Traceback" not in archway.log()


def test_every_admission_after_readyz_is_gated_when_the_controller_starts_slower_than_a_lease(
        api, tmp_path):
    """Issue 30, finding 7: on a busy machine the controller took the Lease more than a Lease
    duration after the workers' first read. One worker saw it and said ready (the pod is ready
    when any worker is); the other had stopped reading eagerly and admitted misses ungated for
    up to a third of a duration. The busy machine, on cue: the controller's interpreter sleeps
    before it starts (a sitecustomize on PYTHONPATH, which `-P` keeps)."""
    hook = tmp_path / "slow-controller"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(
        "import time\n"
        "with open('/proc/self/cmdline', 'rb') as f:\n"
        "    if b'archway.gate.process' in f.read():\n"
        f"        time.sleep({LEASE + 1.5})\n")
    archway = Archway(tmp_path, api.kubeconfig(str(tmp_path)), api.namespace,
                      env={"PYTHONPATH": str(hook)})
    try:
        wait_until(lambda: archway.get("/readyz").status_code == 200, 30, "/readyz")
        answers = [archway.admit_miss() for _ in range(8)]
        assert [a["auditAnnotations"]["outcome"] for a in answers] == ["gated"] * 8, answers
        assert archway.get("/readyz").json()["gate_controller"] == "leader alive"
    finally:
        archway.stop()
    assert "Traceback" not in archway.log()


def test_readyz_does_not_wait_for_an_api_that_cannot_be_reached(tmp_path):
    """The Lease unreadable: ready after the bounded start-up wait, saying why nothing is gated
    (a webhook without endpoints would hold up every pod of the cluster)."""
    unreachable = FakeApiServer()     # the fault: an API address that refuses connections
    kubeconfig = unreachable.kubeconfig(str(tmp_path))
    unreachable.stop()
    archway = Archway(tmp_path, kubeconfig)
    try:
        start = time.monotonic()
        wait_until(lambda: archway.get("/readyz").status_code == 200, 30, "/readyz")
        assert time.monotonic() - start < 15
        # Each worker is ready on its own (a new connection reaches either): both within bounds.
        facts = wait_until(lambda: ready_facts(archway), 15, "every worker ready")
        assert facts["gate_controller"].startswith("no leader (Lease archway/")
        assert "unreadable" in facts["gate_controller"]
        answer = archway.admit_miss()
        assert answer["allowed"] and answer["auditAnnotations"]["outcome"] == "fail_open"
        assert "no archway gate controller is running" in " ".join(answer["warnings"])
        assert archway.get("/healthz").status_code == 200
    finally:
        archway.stop()


def test_a_killed_controller_is_started_again_counted_and_shown(api, tmp_path):
    """Issue 21, item 2: after SIGKILL the controller stayed dead, gating off until the pod
    restarted, and /readyz said nothing."""
    archway = Archway(tmp_path, api.kubeconfig(str(tmp_path)), api.namespace)
    try:
        wait_until(lambda: archway.get("/readyz").status_code == 200, 30, "/readyz")
        first, = archway.controller_pids()
        holder = api.lease()["spec"]["holderIdentity"]
        os.kill(first, signal.SIGKILL)
        second, = wait_until(lambda: [p for p in archway.controller_pids() if p != first], 10,
                             "the controller to be started again")
        # counted just after the start (the new pid can be seen a moment before)
        wait_until(lambda: archway.metric("archway_gate_controller_restarts_total") == 1, 5,
                   "the restart to be counted")
        assert f"gate controller (pid {first}) killed by SIGKILL" in archway.log()
        process = archway.get("/readyz").json()["gate_controller_process"]
        assert process.startswith(f"running (pid {second}") and "restarted 1 time" in process
        assert archway.get("/healthz").json() == {"status": "ok"}
        # The new process takes the Lease over once the dead one's has expired: gating again.
        wait_until(lambda: api.lease()["spec"]["holderIdentity"] != holder,
                   LEASE + 10, "the takeover")
        wait_until(lambda: archway.admit_miss()["auditAnnotations"]["outcome"] == "gated", 10,
                   "gating again")
    finally:
        archway.stop()
    assert not [p for p in (first, second) if cmdline(p)], "a controller outlived the server"


def test_the_controller_starts_from_a_directory_holding_an_archway_folder(api, tmp_path,
                                                                         monkeypatch):
    """Issue 21, item 3: the controller's process (`python -m archway.gate.controller` then, now
    archway.gate.process) from a checkout imported the checkout's archway/ and died (No module
    named 'archway.webhook'); gating was off."""
    shadow = tmp_path / "checkout"
    (shadow / "archway").mkdir(parents=True)
    (shadow / "archway" / "__init__.py").write_text("raise SystemExit('the shadow was imported')\n")
    monkeypatch.chdir(shadow)
    config = config_from_dict({
        "admission": {"unresolved": "gate", "gate_lease_seconds": LEASE},
        "kubernetes": {"kubeconfig": api.kubeconfig(str(tmp_path)), "namespace": api.namespace}})
    process = supervisor.start_process(GATE_CONTROLLER_MODULE, config)
    try:
        lease = wait_until(lambda: process.poll() is None and api.lease(),
                           20, "the controller to take the Lease")
        assert lease["spec"]["holderIdentity"]
    finally:
        supervisor.stop_process(process)
    assert process.returncode == 0


def test_the_supervisor_backs_off_and_starts_afresh_after_a_stable_run(tmp_path):
    clock = ManualClock()
    status = str(tmp_path / "status.json")
    exits = []
    program = {"code": "import sys; sys.exit(3)"}

    def start():
        return subprocess.Popen([sys.executable, "-c", program["code"]])

    keeper = supervisor.Supervisor(start, status, what="gate controller", clock=clock,
                                   on_exit=exits.append)
    delays = []
    for _ in range(7):
        keeper.tick()                                   # started
        keeper.process.wait(10)
        keeper.tick()                                   # seen dead
        state = json.loads(open(status).read())
        assert state["state"] == "restarting" and state["last_exit"] == "exited with status 3"
        delays.append(round(state["next_start"] - state["since"]))
        clock.now += 60
    assert delays == [1, 2, 4, 8, 16, 30, 30] and len(exits) == 7 and keeper.restarts == 6
    program["code"] = "import time; time.sleep(60)"
    keeper.tick()
    started = keeper.process
    clock.now += supervisor.STABLE_SECONDS
    keeper.tick()                                       # ran long enough: back-off forgotten
    started.kill()
    started.wait(10)
    keeper.tick()
    state = json.loads(open(status).read())
    assert state["last_exit"] == "killed by SIGKILL"
    assert round(state["next_start"] - state["since"]) == 1
    keeper.stop()
    assert json.loads(open(status).read())["state"] == "stopped"


def test_a_controller_dying_at_every_launch_fails_healthz_after_the_limit(tmp_path,
                                                                          quick_supervisor):
    """Issue 30, finding 6: the supervisor reset "down since" at every launch, so a crash loop
    (its back-off at most 30 s) never reached the 90 s limit: /healthz stayed 200 for ever. The
    limits shrunk (quick_supervisor)."""
    from archway.cluster.pullsecrets import PullSecrets
    from archway.main.worker import build_worker
    from tests.infra.siteclient import SiteClient
    status = str(tmp_path / "status.json")
    config = config_from_dict({"server": {"state_dir": str(tmp_path / "state")},
                               "kubernetes": {"enabled": "off"}})
    client = SiteClient(build_worker(config, pull_secrets=PullSecrets(None, source="disabled"),
                        controller_status=status))
    program = ["false"]                               # dies at once, every time
    started = time.monotonic()
    keeper = supervisor.Supervisor(lambda: subprocess.Popen(program), status,
                                   what="gate controller")

    def healthz(code: int):
        keeper.tick()                                 # the master's loop
        answer = client.get("/healthz")
        return answer.status_code == code and answer.get_json()

    try:
        assert healthz(200)
        failing = wait_until(lambda: healthz(503), 30, "/healthz to fail in the crash loop")
        assert time.monotonic() - started >= supervisor.DOWN_LIMIT_SECONDS
        assert keeper.restarts >= 3
        assert "no gate controller has stayed up for" in failing["problems"]["gate_controller"]
        # A controller that stays up (STABLE_SECONDS) ends it.
        program[:] = ["sleep", "60"]
        wait_until(lambda: healthz(200), 30, "/healthz to pass once a controller stayed up")
        assert keeper.process is not None and keeper.process.poll() is None
    finally:
        keeper.stop()


def test_what_the_health_endpoints_say_about_the_controller_process():
    now = 10_000.0

    def problem(status):
        return supervisor.process_problem(status, now, what="gate controller")

    running = {"state": "running", "pid": 7, "since": now - 30, "restarts": 2,
               "last_exit": "killed by SIGKILL", "next_start": None, "heartbeat": now - 1}
    assert supervisor.process_fact(running, now) == "running (pid 7, up 30 s, restarted 2 times)"
    assert problem(running) is None
    down = dict(running, state="restarting", since=now - 20, next_start=now + 4)
    assert supervisor.process_fact(down, now) == (
        "not running: killed by SIGKILL; starting again in 4 s, restarted 2 times")
    assert problem(down) is None   # being brought back: liveness holds
    long_down = dict(down, down_since=now - supervisor.DOWN_LIMIT_SECONDS - 1)
    assert "no gate controller has stayed up for 91 s (2 restarts, last: killed by SIGKILL)" \
        in problem(long_down)
    # a crash loop seen between two deaths: running, but none stayed up since
    assert problem(dict(long_down, state="running"))
    silent = dict(running, heartbeat=now - supervisor.HEARTBEAT_LIMIT_SECONDS - 5)
    assert "has not looked after the gate controller for 20 s" in problem(silent)
    assert problem(dict(silent, state="stopped")) is None
    assert supervisor.process_fact(None, now) == "not run by this server"


@pytest.mark.parametrize("log_format", ["json", "text"])
def test_the_controller_logs_in_the_servers_format(log_format):
    """server.log_format reaches the controller's process: JSON lines for a log pipeline, or
    text whose values are escaped as every other archway line is."""
    import pickle
    config = config_from_dict({"server": {"log_format": log_format},
                               "kubernetes": {"enabled": "off"}})
    out = subprocess.run([sys.executable, "-P", "-m", "archway.gate.process"],
                         input=pickle.dumps(config), capture_output=True, timeout=60)
    assert out.returncode == 0, out.stderr
    (line,) = out.stderr.decode().splitlines()
    if log_format == "json":
        entry = json.loads(line)
        assert entry["logger"] == "archway.gate" and entry["level"] == "info"
        assert entry["message"] == "gate controller not started: no Kubernetes API configured"
    else:
        assert line.endswith(" INFO archway.gate: gate controller not started: "
                             "no Kubernetes API configured")
