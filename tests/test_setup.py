"""The README's two first commands on a stock Debian 12, whose python3 is externally managed
(PEP 668: its pip refuses to install anything into it): scripts/setup.sh, serve.sh and test.sh.

What this proves, and what it does not:
- `test_the_readme_commands_on_a_fresh_debian_12`: a throwaway bookworm (mmdebstrap minbase,
  tests/infra/debian.py) with Debian's python3 and python3-pip and nothing of Python besides; as
  root, with the machine's network, in a chroot. It proves that the system pip refuses, that
  setup.sh installs python3-venv itself and puts archway into a virtual environment made from
  /usr/bin/python3, that serve.sh answers over TLS, that test.sh runs pytest from that
  environment with its bin first on PATH (a selection of the tests: the whole suite is what
  test.sh runs everywhere else), and that only the service of a package this run installed is
  stopped. To keep it at about two minutes, the big packages of `setup.sh --test` (buildah,
  qemu, prometheus...) are in the cached rootfs already; tinyproxy and zsh are left for the run to
  install. It does not prove: a machine with systemd (a chroot has no init: `service` calls are
  recorded, the daemons never run), a run as a user through sudo, a machine without a route
  to deb.debian.org and PyPI.
- `test_setup_prefers_debians_python_and_takes_any_python_3_11`: on this machine, with a clean
  HOME and another python3 first on PATH: setup.sh still makes the environment with
  /usr/bin/python3, or with the one ARCHWAY_PYTHON names, at ARCHWAY_VENV.
"""
import os
import re
import subprocess
import sys

import pytest
import requests

from lab.procs import REPO, free_port, require_binary, wait_for_port
from tests.infra.debian import CACHE, Chroot, copy_checkout, rootfs_tarball

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(os.geteuid() != 0, reason="a chroot needs root")]

PIP_CACHE = os.path.join(CACHE, "pip")
# What the run must install itself (the rest of `setup.sh --test` is in the cached rootfs).
LEFT_FOR_THE_RUN = {"tinyproxy", "zsh"}


def packages_the_tests_start() -> list[str]:
    """The apt packages of setup.sh's "What the tests start" block."""
    with open(os.path.join(REPO, "scripts", "setup.sh")) as f:
        block = f.read().split("install_what_the_tests_start() {", 1)[1].split("\n}", 1)[0]
    return [word for line in re.findall(r"^\s*apt_install ([^#\n]+)", block, re.M)
            for word in line.split()]


def stock_debian_with(*packages) -> list[str]:
    # python3-pip: the pip that refuses; python3-venv is NOT there (setup.sh must install it).
    return ["python3", "python3-pip", "ca-certificates", *packages]


RECORD_SERVICE = """#!/bin/sh
# Records what setup.sh asks of `service`, then does it.
echo "$*" >> /var/log/service-calls
exec /usr/sbin/service "$@"
"""


@pytest.mark.timeout(2400)
def test_the_readme_commands_on_a_fresh_debian_12(tmp_path):
    seeded = [p for p in packages_the_tests_start() if p not in LEFT_FOR_THE_RUN]
    assert "tinyproxy" in packages_the_tests_start() and "docker-registry" in seeded
    chroot = Chroot(rootfs_tarball(stock_debian_with(*seeded)), str(tmp_path / "bookworm"))
    pip_cache = [(PIP_CACHE, "/root/.cache/pip")]     # wheels kept between runs; pip still installs
    try:
        chroot.copy_checkout("/root/archway")
        with open(chroot.path("/usr/local/sbin/service"), "w") as f:
            f.write(RECORD_SERVICE)
        os.chmod(chroot.path("/usr/local/sbin/service"), 0o755)

        # The machine the issue describes: Debian's python3 3.11, a pip that refuses, no venv support.
        stock = chroot.run("command -v python3; python3 --version; "
                           "python3 -m pip install --dry-run flask; echo pip=$?; "
                           "python3 -c 'import ensurepip' 2>/dev/null; echo ensurepip=$?")
        assert stock.stdout.startswith("/usr/bin/python3\nPython 3.11."), stock.stdout
        assert "externally-managed-environment" in stock.stderr and "pip=1" in stock.stdout
        assert "ensurepip=1" in stock.stdout

        setup = chroot.run("cd /root/archway && bash scripts/setup.sh", binds=pip_cache)
        assert setup.returncode == 0, setup.stderr[-3000:]
        check = chroot.run(
            "cd /root/archway && cat .venv/pyvenv.cfg && .venv/bin/archway --version && "
            "dpkg-query -W -f='${Status}\\n' python3-venv && "
            "(python3 -c 'import flask' 2>/dev/null && echo system-flask || echo no-system-flask)")
        assert check.returncode == 0, check.stderr
        assert "home = /usr/bin" in check.stdout and "archway 0." in check.stdout
        assert "install ok installed" in check.stdout and "no-system-flask" in check.stdout

        # bash scripts/serve.sh: the webhook and extender over TLS, a CA it made for curl
        port = free_port()
        serving = chroot.start(f"cd /root/archway && bash scripts/serve.sh --bind 127.0.0.1:{port}",
                               log_path=str(tmp_path / "serve.log"), binds=pip_cache)
        try:
            wait_for_port(port, timeout=120, proc=serving)
            ca = chroot.path("/root/.local/state/archway/tls/ca.crt")
            answer = requests.get(f"https://127.0.0.1:{port}/healthz", verify=ca, timeout=10)
            assert answer.status_code == 200 and answer.json() == {"status": "ok"}
        finally:
            Chroot.stop(serving)

        # The control plane the e2e tests start is built with Go >= its go.mod's line: a stock
        # Debian has none, so the script fetches one (Debian's golang-go 1.19 downloads the
        # toolchain module). The builds (~5 min; KWOK ~2.5, Karpenter ~3) are not repeated here:
        # the binaries this machine built are lent to the chroot, so setup.sh finds them.
        go = chroot.run("cd /root/archway && command -v go; bash scripts/go-toolchain.sh 1.26.0",
                        timeout=600)
        assert go.returncode == 0, go.stderr[-3000:]
        assert go.stdout.strip() == "/root/.cache/archway/go/go1.26.10/bin/go", go.stdout
        assert "installing Debian's golang-go" in go.stderr
        version = chroot.run(f"{go.stdout.strip()} version")
        assert version.stdout.startswith("go version go1.26.10 linux/"), version.stdout
        binaries = os.path.dirname(subprocess.run(
            ["bash", os.path.join(REPO, "scripts", "k8s-build.sh")], capture_output=True,
            text=True, check=True).stdout.strip())
        kwok = os.path.dirname(subprocess.run(
            ["bash", os.path.join(REPO, "scripts", "kwok-build.sh")], capture_output=True,
            text=True, check=True).stdout.strip())
        karpenter = os.path.dirname(subprocess.run(
            ["bash", os.path.join(REPO, "scripts", "karpenter-build.sh")], capture_output=True,
            text=True, check=True).stdout.strip())
        lent = pip_cache + [(binaries, "/root/.cache/archway/k8s"),
                            (kwok, "/root/.cache/archway/kwok"),
                            (karpenter, "/root/.cache/archway/karpenter")]
        # The arm64 VM node's image as this machine's setup.sh built it (in the chroot it is
        # minutes of mmdebstrap under emulation, proving nothing more).
        from lab.cluster.vmimage import CACHE as VM_CACHE
        if os.path.isdir(VM_CACHE):
            lent.append((VM_CACHE, "/root/.cache/archway/vm"))

        # bash scripts/test.sh: what the tests start, then pytest from the environment
        tests = chroot.run("cd /root/archway && bash scripts/test.sh -q -p no:cacheprovider "
                           "tests/test_cli.py tests/test_sif.py -k 'help or completion or generated'",
                           binds=lent, timeout=1500)
        assert tests.returncode == 0, tests.stdout[-3000:] + tests.stderr[-3000:]
        assert re.search(r"\d\d+ passed", tests.stdout), tests.stdout[-2000:]
        assert "SKIPPED [1] tests/infra/sifcorpus.py" in tests.stdout   # no corpus here
        with open(chroot.path("/var/log/service-calls")) as f:
            assert f.read().splitlines() == ["tinyproxy stop"]   # not docker-registry, prometheus...

        again = chroot.run("cd /root/archway && bash scripts/setup.sh --test && command -v helm zsh",
                           binds=lent)
        assert again.returncode == 0 and "Setting up" not in again.stderr
        assert again.stdout.split() == ["/usr/local/bin/helm", "/usr/bin/zsh"]
        with open(chroot.path("/var/log/service-calls")) as f:
            assert f.read().splitlines() == ["tinyproxy stop"]   # nothing this run installed
    finally:
        chroot.remove()


def setup(copy, tmp_path, **env):
    """setup.sh with a clean HOME and, first on PATH, another python3 (a throwaway environment
    without pip: nothing can be installed into it by mistake)."""
    decoy = tmp_path / "decoy"
    if not decoy.exists():
        subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(decoy)], check=True)
    environment = {"HOME": str(tmp_path / "home"), "PATH": f"{decoy}/bin:/usr/sbin:/usr/bin:/sbin:/bin",
                   "PIP_CACHE_DIR": PIP_CACHE, **env}
    return subprocess.run([require_binary("bash"), "scripts/setup.sh"], cwd=copy, env=environment,
                          capture_output=True, text=True, timeout=900)


def made_by(venv: str) -> str:
    """The interpreter that made the environment (pyvenv.cfg: command = PYTHON -m venv ...)."""
    with open(os.path.join(venv, "pyvenv.cfg")) as f:
        return re.search(r"^command = (\S+) -m venv ", f.read(), re.M).group(1)


@pytest.mark.timeout(1200)
def test_setup_prefers_debians_python_and_takes_any_python_3_11(tmp_path):
    if not os.path.exists("/usr/lib/python3.11/EXTERNALLY-MANAGED"):
        pytest.skip("not a Debian 12 machine: no externally managed /usr/bin/python3")
    copy = str(tmp_path / "archway")
    copy_checkout(copy)
    # Debian's own, whatever python3 comes first on PATH
    result = setup(copy, tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert made_by(os.path.join(copy, ".venv")) == "/usr/bin/python3"
    assert subprocess.run([os.path.join(copy, ".venv", "bin", "archway"), "--version"],
                          capture_output=True, text=True).stdout.startswith("archway ")
    # any python3 >= 3.11 named by ARCHWAY_PYTHON, into the environment ARCHWAY_VENV names
    other = str(tmp_path / "elsewhere")
    result = setup(copy, tmp_path, ARCHWAY_PYTHON=sys.executable, ARCHWAY_VENV=other)
    assert result.returncode == 0, result.stderr[-3000:]
    assert made_by(other) == sys.executable
    assert os.path.exists(os.path.join(other, "bin", "archway"))
    refused = setup(copy, tmp_path, ARCHWAY_PYTHON="/bin/false", ARCHWAY_VENV=str(tmp_path / "no"))
    assert refused.returncode == 1 and "ARCHWAY_PYTHON=/bin/false is not a python >= 3.11" in refused.stderr
