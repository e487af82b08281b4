"""The code's own checks, run by CI with the tests: ruff (pyproject's [tool.ruff]) on everything,
and mypy (0 errors) on the `archway` packages as installed and on the lab: the folders mapped by package-dir
(webhook/ -> archway.webhook, ...) are linked into one tree first, since mypy reads sources,
not the install's import hooks."""
import os
import subprocess
import sys
import tomllib

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
with open(os.path.join(REPO, "pyproject.toml"), "rb") as _f:
    # Every folder installed as an archway.* package (gate/ and tools/ were once left out).
    PACKAGES = tuple(folder for name, folder in
                     tomllib.load(_f)["tool"]["setuptools"]["package-dir"].items() if name != "archway")

pytestmark = pytest.mark.slow


def test_ruff_finds_nothing():
    out = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "archway",
                          *PACKAGES, "tests", "bench"], cwd=REPO, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr


def test_mypy_finds_no_error_in_the_packages(tmp_path):
    tree = tmp_path / "archway"
    tree.mkdir()
    for name in os.listdir(os.path.join(REPO, "archway")):
        path = os.path.join(REPO, "archway", name)
        # its modules, and its own subpackages (archway/server/)
        if name.endswith(".py") or os.path.exists(os.path.join(path, "__init__.py")):
            os.symlink(path, tree / name)
    for package in PACKAGES:
        os.symlink(os.path.join(REPO, package), tree / package)
    out = subprocess.run([sys.executable, "-m", "mypy", "--config-file",
                          os.path.join(REPO, "pyproject.toml"), "--cache-dir", str(tmp_path / "cache"),
                          "-p", "archway"], cwd=tmp_path, capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr


def test_mypy_finds_no_error_in_the_lab(tmp_path):
    """The lab (outside the wheel) is held to the same bar: the tests and the bench stand on it."""
    out = subprocess.run([sys.executable, "-m", "mypy", "--config-file",
                          os.path.join(REPO, "pyproject.toml"), "--cache-dir", str(tmp_path / "cache"),
                          "-p", "lab"], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr
