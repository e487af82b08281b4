"""`archway inspect` as a user runs it: a real process against the real registry."""
import json
import os
import subprocess
import sys

import pytest
import yaml

from lab.procs import REPO
from tests.infra import sifbuild
from tests.infra.fixtures import plain_registry

# Starts real servers (registries, archway serve, helm...): outside the fast inner loop.
pytestmark = pytest.mark.slow


def archway(*args, env=None, timeout=60):
    return subprocess.run([sys.executable, "-m", "archway.main.cli", *args], cwd=REPO,
                          capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})


@pytest.fixture(scope="module")
def config_file(plain_registry, tmp_path_factory):
    path = tmp_path_factory.mktemp("inspect") / "archway.yaml"
    path.write_text(yaml.safe_dump({"registry": {"insecure_hosts": [plain_registry.host],
                                                 "timeout_seconds": 2}}))
    return str(path)


def test_json_lists_platforms_digest_and_source(plain_registry, config_file, tmp_path):
    index = plain_registry.push_index("cli/multi", "v1", ["linux/amd64", "linux/arm/v7"],
                                      kind="docker", attestations=True)
    plain_registry.push_image("cli/single", "v1", "linux/s390x")
    sif = sifbuild.siftool_image(str(tmp_path), "tool.sif", "ppc64le")
    images = [plain_registry.ref("cli/multi", "v1"), plain_registry.ref("cli/single", "v1"), sif]
    result = archway("inspect", "--json", "--config", config_file, *images)
    assert result.returncode == 0, result.stderr
    rows = json.loads(result.stdout)
    assert [r["image"] for r in rows] == images
    multi, single, local = rows
    assert multi["architectures"] == ["amd64", "arm"]
    assert multi["platforms"] == ["linux/amd64", "linux/arm/v7"]
    assert multi["digest"] == index.digest and multi["source"] == "docker-manifest-list"
    assert single["architectures"] == ["s390x"] and single["source"] == "oci-manifest"
    assert local["architectures"] == ["ppc64le"]
    assert all(r["error"] is None for r in rows)


def test_an_image_that_cannot_be_resolved_exits_1_and_says_why(plain_registry, config_file):
    missing = plain_registry.ref("cli/absent", "v9")
    result = archway("inspect", "--json", missing, env={"ARCHWAY_CONFIG": config_file})
    assert result.returncode == 1
    (row,) = json.loads(result.stdout)
    assert row["architectures"] == [] and "cli/absent" in row["error"]


def test_text_output_reads_well_and_refused_hosts_are_explained(plain_registry, config_file):
    digest = plain_registry.push_image("cli/text", "v1", "linux/arm64")
    result = archway("--config", config_file, "inspect", plain_registry.ref("cli/text", "v1"),
                     "169.254.169.254/latest/meta:1")
    assert result.returncode == 1
    assert "architectures: arm64" in result.stdout
    # the digest as a reference to paste into a manifest: name@sha256:...
    assert f"  digest:        {plain_registry.host}/cli/text@{digest}\n" in result.stdout
    as_json = json.loads(archway("--config", config_file, "inspect", "--json",
                                 plain_registry.ref("cli/text", "v1")).stdout)
    assert as_json[0]["digest"] == digest
    assert as_json[0]["pinned"] == f"{plain_registry.host}/cli/text@{digest}"
    assert "link-local or metadata address" in result.stdout


def test_a_broken_config_file_is_a_clear_error(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("registry:\n  timeout_seconds: soon\n")
    result = archway("inspect", "--config", str(bad), "nginx")
    assert result.returncode == 2
    assert "timeout_seconds" in result.stderr and "Traceback" not in result.stderr


@pytest.mark.parametrize("value", ["0", "-1", "nan", "soon"])
def test_timeout_must_be_above_zero(value):
    result = archway("inspect", "--timeout", value, "nginx")
    assert result.returncode == 2 and "--timeout" in result.stderr and result.stdout == ""


def test_timeout_bounds_the_whole_command_even_when_a_registry_never_answers(tmp_path):
    import socket
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(16)          # the kernel accepts connections; nobody ever answers
    host = f"127.0.0.1:{silent.getsockname()[1]}"
    config = tmp_path / "archway.yaml"
    config.write_text(yaml.safe_dump({"registry": {"insecure_hosts": [host],
                                                   "timeout_seconds": 120}}))
    try:
        # Without a real bound this takes minutes (per-read timeouts of 120 s) and the
        # subprocess limit below fails the test.
        result = archway("inspect", "--json", "--timeout", "1", "--config", str(config),
                         f"{host}/silent/image:1", timeout=30)
    finally:
        silent.close()
    assert result.returncode == 1
    (row,) = json.loads(result.stdout)
    # the resolver's own deadline, or the command's wall-clock bound, whichever came first
    assert "no answer within" in row["error"] and "1 s" in row["error"]


def test_a_local_path_that_does_not_exist_says_no_such_file(tmp_path):
    missing = str(tmp_path / "tool.sif")
    result = archway("inspect", "--json", missing, "./relative/other.sif")
    assert result.returncode == 1
    rows = json.loads(result.stdout)
    assert [r["error"] for r in rows] == [f"no such file: {missing}",
                                          "no such file: ./relative/other.sif"]
    assert all(r["reference"] is None for r in rows)


def test_the_normalised_reference_is_shown(plain_registry, config_file):
    plain_registry.push_image("library/shown", "latest", "linux/arm64")
    short = f"{plain_registry.host}/library/shown"
    result = archway("inspect", "--config", config_file, short)
    assert result.returncode == 0, result.stderr
    assert f"  reference:     {short}:latest\n" in result.stdout
    as_json = json.loads(archway("inspect", "--json", "--config", config_file, short).stdout)
    assert as_json[0]["reference"] == f"{short}:latest"
    offline = json.loads(archway("inspect", "--json", "--timeout", "0.5", "nginx",
                                 env={"ARCHWAY_CONFIG": config_file}).stdout)
    assert offline[0]["reference"] == "docker.io/library/nginx:latest"
