"""The dependency ranges pyproject.toml states, tried at both ends: a fresh virtual environment
(Debian's /usr/bin/python3, as scripts/setup.sh makes) with the checkout and its test extras,
its runtime dependencies at the lowest versions pyproject.toml allows (a constraints file that
scripts/lowest-constraints.py writes from pyproject.toml) or at the newest; in it the fast tier
passes, and so do the slower tests of what the fast tier cannot reach (REACHING), and a real
`archway serve` admits a pod through /mutate, patching it from a real registry.

pip installs from PyPI through its cache (~/.cache/pip): within a minute once the wheels are in it.
"""
import base64
import json
import os
import subprocess
import sys
import time

import pytest
import requests
import yaml
from packaging.version import Version

from lab.procs import REPO, Server, free_port
from lab.servers.registry import RegistryServer

# Starts a real `archway serve` and a registry, and runs the whole fast tier twice.
pytestmark = pytest.mark.slow

PYTHON = "/usr/bin/python3" if os.path.exists("/usr/bin/python3") else sys.executable
FIXTURE = os.path.join(REPO, "tests", "fixtures", "admission", "v1-pod-multiarch.json")
PLATFORMS = ["linux/amd64", "linux/arm64", "linux/arm/v7"]
FAST_TIER_SECONDS = 1500   # ~3 minutes on a quiet 2-core machine; much more on a busy one
# The fast tier starts no server: these reach what it cannot, in about a minute. gunicorn's
# master and archway's worker on its seams (a request's arrival, kept-alive and pipelined
# connections, a graceful stop, hostile clients, httptools' parser under them), and the
# Kubernetes client against a real apiserver (the typed API of certs bootstrap; archway's own
# API client, reads and watches, under the pull secrets).
REACHING = ["tests/test_server.py", "tests/test_hostile_clients.py", "tests/test_bootstrap.py",
            "tests/test_pullsecrets.py"]


@pytest.fixture(scope="module")
def registry(tmp_path_factory):
    server = RegistryServer(tmp_path_factory.mktemp("registry"))
    try:
        server.push_index("archway/multi", "1.0", PLATFORMS)
        yield server
    finally:
        server.stop()


def lower_bounds() -> dict[str, str]:
    """{name: version} as scripts/lowest-constraints.py writes them."""
    out = subprocess.run([sys.executable, os.path.join(REPO, "scripts", "lowest-constraints.py")],
                         check=True, capture_output=True, text=True).stdout
    return dict(line.split("==") for line in out.split())


def make_venv(venv: str, versions: str) -> str:
    """A fresh virtual environment with the checkout (editable) and [test]: the runtime
    dependencies at their `versions` ("lowest" or "newest"). Returns its python."""
    subprocess.run([PYTHON, "-m", "venv", venv], check=True)
    python = os.path.join(venv, "bin", "python")
    install = [python, "-m", "pip", "install", "-q", "--disable-pip-version-check"]
    if versions == "lowest":
        constraints = os.path.join(os.path.dirname(venv), "lowest.txt")
        with open(constraints, "w") as f:
            f.writelines(f"{name}=={version}\n" for name, version in lower_bounds().items())
        install += ["--constraint", constraints]
    else:
        install += ["--upgrade", "--upgrade-strategy", "eager"]
    subprocess.run(install + ["--editable", f"{REPO}[test]"], check=True, timeout=900)
    return python


def installed(python: str, names) -> dict[str, str]:
    script = ("import json, sys, importlib.metadata as m; "
              "print(json.dumps({n: m.version(n) for n in sys.argv[1:]}))")
    out = subprocess.run([python, "-c", script, *names], check=True, capture_output=True,
                         text=True).stdout
    return json.loads(out)


def venv_env(python: str) -> dict:
    """The environment for commands of that virtual environment: its bin first on PATH (the
    tests start `archway`), nothing of the one running this test."""
    env = {key: value for key, value in os.environ.items()
           if key != "VIRTUAL_ENV" and not key.startswith("PYTEST_")}
    env["PATH"] = os.path.dirname(python) + os.pathsep + env.get("PATH", "")
    return env


def run_tests(python: str, *selection: str) -> None:
    """pytest of that virtual environment, from the checkout: `selection` passes."""
    result = subprocess.run([python, "-m", "pytest", "-q", "-p", "no:cacheprovider", *selection],
                            cwd=REPO, env=venv_env(python), capture_output=True, text=True,
                            timeout=FAST_TIER_SECONDS)
    if result.returncode != 0:
        pytest.fail(f"pytest {' '.join(selection)} failed:\n"
                    + (result.stdout + result.stderr)[-8000:], pytrace=False)


def serve_and_mutate(python: str, registry: RegistryServer, workdir) -> dict:
    """`archway serve` of that virtual environment, with its self-signed certificate on
    localhost, admits the fixture's pod: the AdmissionReview's response."""
    config = {"server": {"state_dir": str(workdir / "state"), "workers": 2, "threads": 4},
              "registry": {"insecure_hosts": [registry.host]}}
    config_path = workdir / "archway.yaml"
    config_path.write_text(yaml.safe_dump(config))
    port = free_port()
    archway = os.path.join(os.path.dirname(python), "archway")
    with Server([archway, "--config", str(config_path), "serve", "--bind", f"127.0.0.1:{port}"],
                port=port, log_path=str(workdir / "serve.log"), cwd=str(workdir),
                env=venv_env(python), ready_timeout=60) as server:
        session = requests.Session()
        session.trust_env = False
        session.verify = str(workdir / "state" / "tls" / "ca.crt")
        url = f"https://127.0.0.1:{port}"
        end = time.monotonic() + 60
        while session.get(url + "/readyz", timeout=5).status_code != 200:
            assert time.monotonic() < end, "archway serve never became ready:\n" + server.log()
            time.sleep(0.1)
        with open(FIXTURE) as f:
            review = json.loads(f.read().replace("REGISTRY", registry.host))
        # Twice on one kept-alive connection: the worker hands it back to its main loop between.
        answers = [session.post(url + "/mutate", data=json.dumps(review), timeout=30,
                                headers={"Content-Type": "application/json"}) for _ in range(2)]
        metrics = session.get(url + "/metrics", timeout=10)
        with open(server.log_path, encoding="utf-8", errors="replace") as f:
            log = f.read()
    assert metrics.status_code == 200 and "archway_" in metrics.text, metrics.text[:2000]
    for answer in answers:
        assert answer.status_code == 200, answer.text + "\n" + log
    assert "Traceback" not in log and "Error handling request" not in log, log
    assert answers[0].json() == answers[1].json()
    response = answers[0].json()["response"]
    assert response["uid"] == review["request"]["uid"]
    return response


@pytest.mark.timeout(2 * FAST_TIER_SECONDS)
@pytest.mark.parametrize("versions", ["lowest", "newest"])
def test_the_fast_tier_passes_and_archway_serves_at_either_end_of_the_ranges(
        versions, registry, tmp_path):
    python = make_venv(str(tmp_path / "venv"), versions)
    bounds = lower_bounds()
    versions_in = installed(python, bounds)
    if versions == "lowest":   # else the range's lowest end is not what was tried
        assert {name: Version(v) for name, v in versions_in.items()} == \
            {name: Version(v) for name, v in bounds.items()}
    else:
        assert all(Version(versions_in[name]) >= Version(low) for name, low in bounds.items())
    print(f"{versions}: " + ", ".join(f"{name} {v}" for name, v in versions_in.items()))

    run_tests(python, "-m", "not slow")   # the fast tier (this module is slow: not in it)
    run_tests(python, *REACHING)

    response = serve_and_mutate(python, registry, tmp_path)
    assert response["allowed"] is True
    patch = json.loads(base64.b64decode(response["patch"]))
    patched = json.dumps(patch)
    assert '"kubernetes.io/arch"' in patched and '"arm64"' in patched, patch
