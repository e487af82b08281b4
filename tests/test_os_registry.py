"""Windows, mixed-OS and artifact content on the real Debian docker-registry, read by the real
resolver and decided on as admission decides (issue 36), and printed by `archway inspect` and
`archway explain -f` as a user runs them."""
import json
import os
import subprocess
import sys

import pytest
import yaml

from archway.config import RegistrySettings
from archway.placement.decision import decide
from archway.placement.policy import Policy
from archway.podview import PodView
from archway.registry.platforms import Platform
from archway.registry.resolver import Resolver
from lab.procs import REPO
from lab.servers.registry import OCI_MANIFEST
from tests.infra.fixtures import LOOPBACK_HOSTS, plain_registry

# Starts a real registry: outside the fast inner loop.
pytestmark = pytest.mark.slow

MODEL_TYPE = "application/vnd.example.model.v1"
ARTIFACT_SOURCE = "oci-artifact"   # registry.model.ARTIFACT_SOURCE, spelt out: the old code lacks it


@pytest.fixture(scope="module")
def content(plain_registry):
    """What the tests read: a Windows image (its config says os windows), an index of
    linux/arm64 + windows/amd64, an amd64-only image and an OCI artifact with artifactType."""
    reg = plain_registry
    win_child = reg.push_image("os/mixed", None, "windows/amd64",
                               config_extra={"os.version": "10.0.20348.2340"})
    reg.push_index("os/mixed", "v1", ["linux/arm64"], extra_entries=[{
        "mediaType": OCI_MANIFEST, "digest": win_child,
        "size": len(reg.get_manifest("os/mixed", win_child).content),
        "platform": {"architecture": "amd64", "os": "windows", "os.version": "10.0.20348.2340"}}])
    reg.push_image("os/win", "v1", "windows/amd64", config_extra={"os.version": "10.0.20348.2340"})
    reg.push_image("os/amd", "v1", "linux/amd64")
    reg.push_index("os/multi", "v1", ["linux/amd64", "linux/arm64"])
    reg.push_artifact("os/model", "v1", MODEL_TYPE)
    return {name: reg.ref(f"os/{name}", "v1") for name in ("mixed", "win", "amd", "multi", "model")}


@pytest.fixture
def resolver(plain_registry):
    return Resolver(RegistrySettings(allow_hosts=LOOPBACK_HOSTS,
                                     insecure_hosts=(plain_registry.host,), timeout_seconds=5))


def pod(*images, os=None, volumes=()):
    spec: dict = {"containers": [{"name": f"c{i}", "image": im} for i, im in enumerate(images)]}
    if os:
        spec["os"] = {"name": os}
        spec["nodeSelector"] = {"kubernetes.io/os": os}
    if volumes:
        spec["volumes"] = [{"name": name, "image": {"reference": ref}} for name, ref in volumes]
    return PodView.of({"metadata": {"name": "p", "namespace": "default"}, "spec": spec})


def admit(resolver, view, policy=Policy()):
    return decide(view, resolver.resolve_many(view.images, timeout=10), policy)


def test_the_real_resolver_keeps_every_os_and_reads_artifacts(content, resolver):
    results = resolver.resolve_many(list(content.values()), timeout=10)
    mixed, win, model = results[content["mixed"]], results[content["win"]], results[content["model"]]
    assert mixed.platforms == {Platform("linux", "arm64"), Platform("windows", "amd64")}
    assert win.platforms == {Platform("windows", "amd64")} and win.source == "oci-manifest"
    assert (model.platforms, model.source) == (frozenset(), ARTIFACT_SOURCE)
    assert MODEL_TYPE in model.note


def test_a_windows_pod_with_the_mixed_index_is_placed_on_amd64(content, resolver):
    d = admit(resolver, pod(content["mixed"], os="windows"))
    assert d.allowed and d.architectures == {"amd64"}
    assert {"op": "add", "path": "/spec/nodeSelector/kubernetes.io~1arch", "value": "amd64"} in d.patch
    assert admit(resolver, pod(content["mixed"])).architectures == {"arm64"}


def test_a_linux_pod_with_the_windows_image_is_denied_or_warned(content, resolver):
    denied = admit(resolver, pod(content["win"]), Policy(deny_on_empty=True))
    assert not denied.allowed
    assert denied.message == f"{content['win']} has no linux platform: windows/amd64 only"
    warned = admit(resolver, pod(content["win"]), Policy(deny_on_empty=False))
    assert warned.allowed and "has no linux platform" in warned.warnings[0]


def test_image_volumes_resolved_as_images_place_the_pod_and_artifacts_do_not(content, resolver):
    d = admit(resolver, pod(content["multi"], volumes=[("tools", content["amd"])]))
    assert d.architectures == {"amd64"}
    d = admit(resolver, pod(content["multi"], volumes=[("models", content["model"])]),
              Policy(fail_closed=True))
    assert d.allowed and d.architectures == {"amd64", "arm64"}
    assert "(image volume 'models') is an OCI artifact, no image" in d.warnings[0]


def archway(*args, stdin=None, config=None):
    return subprocess.run([sys.executable, "-m", "archway.main.cli", *args], cwd=REPO, input=stdin,
                          capture_output=True, text=True, timeout=60,
                          env={**os.environ, "ARCHWAY_CONFIG": config or ""})


@pytest.fixture
def config_file(plain_registry, tmp_path):
    path = tmp_path / "archway.yaml"
    path.write_text(yaml.safe_dump({"registry": {"insecure_hosts": [plain_registry.host],
                                                 "timeout_seconds": 5}}))
    return str(path)


def test_inspect_prints_the_os_of_each_platform(content, config_file):
    result = archway("inspect", content["win"], content["mixed"], content["model"],
                     config=config_file)
    assert result.returncode == 0, result.stderr
    win, mixed, model = result.stdout.strip().split("\n\n")
    assert "architectures: windows: amd64" in win and "platforms:     windows/amd64" in win
    assert "architectures: linux: arm64; windows: amd64" in mixed
    assert "architectures: unknown" in model and MODEL_TYPE in model
    rows = json.loads(archway("inspect", "--json", content["mixed"], config=config_file).stdout)
    assert rows[0]["architectures_by_os"] == {"linux": ["arm64"], "windows": ["amd64"]}


def test_explain_follows_the_pods_os(content, config_file):
    manifest = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "w", "namespace": "d"},
                "spec": {"os": {"name": "windows"}, "nodeSelector": {"kubernetes.io/os": "windows"},
                         "containers": [{"name": "c", "image": content["mixed"]}]}}
    result = archway("explain", "-f", "-", "--json", stdin=json.dumps(manifest), config=config_file)
    assert result.returncode == 0, result.stdout + result.stderr
    (row,) = json.loads(result.stdout)
    assert row["os"] == "windows" and row["architectures"] == ["amd64"] and row["can_run"]
    manifest["spec"] = {"containers": [{"name": "c", "image": content["win"]}]}
    result = archway("explain", "-f", "-", stdin=json.dumps(manifest), config=config_file)
    assert result.returncode == 1
    assert f"CANNOT RUN: {content['win']} has no linux platform: windows/amd64 only" in result.stdout
