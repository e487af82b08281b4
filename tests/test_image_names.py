"""An image name is never read as a file unless it is written as one (issue 47): `archway
inspect NAME` asks the registry even where a file NAME is in the current directory, and a
path-like image in a pod (`./tool.sif`) is an invalid reference, not the host ".".

Real parts: the command line in-process, a real file, a closed loopback port for the registry
(connection refused at once), the admission service over the real resolver."""
import json

import pytest
import yaml

from archway.config import RegistrySettings
from archway.errors import InvalidReference
from archway.main.cli import main
from archway.registry.reference import parse_reference
from archway.registry.resolver import Resolver
from lab.procs import free_port
from tests.test_service import response, review, service


@pytest.mark.parametrize("text", ["./tool.sif", "../tools/tool.sif", "/opt/tool.sif", "~/tool.sif",
                                  "./app:1", ".", "..", "oras://./tool:1"])
def test_a_path_is_an_invalid_image_reference(text):
    with pytest.raises(InvalidReference, match="invalid image reference .*a file path"):
        parse_reference(text)


@pytest.mark.parametrize("text", ["a..b/x:1", "-reg.example/x:1", "reg-.example/x:1", "./x"])
def test_a_host_that_is_no_host_name_is_malformed(text):
    with pytest.raises(InvalidReference, match="malformed registry host|a file path"):
        parse_reference(text)


def test_names_ending_in_sif_and_hosts_with_ports_still_parse():
    assert parse_reference("tool.sif").repository == "library/tool.sif"   # a Docker Hub name
    assert parse_reference("reg.example:5000/a/b:1").host == "reg.example:5000"
    assert parse_reference("[::1]:5000/a:1").host == "[::1]:5000"


def test_inspect_asks_the_registry_though_a_file_has_the_images_name(tmp_path, monkeypatch,
                                                                     capsys):
    closed = free_port()
    image = f"127.0.0.1:{closed}/team/app"
    (tmp_path / f"127.0.0.1:{closed}" / "team").mkdir(parents=True)
    (tmp_path / image).write_text("abc")   # what the old code read: "not a SIF image"
    (tmp_path / "tool.sif").write_text("abc")
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("ARCHWAY_CONFIG", raising=False)
    assert main(["inspect", "--json", "--timeout", "5", image, "./tool.sif"]) == 1
    remote, local = json.loads(capsys.readouterr().out)
    assert remote["reference"] == f"{image}:latest"
    assert f"cannot reach 127.0.0.1:{closed}" in remote["error"], remote
    assert "SIF" not in remote["error"]
    assert "not a SIF image" in local["error"] and local["reference"] is None  # written as a path


def test_explain_calls_a_path_in_a_manifest_an_invalid_reference(tmp_path, monkeypatch, capsys):
    manifest = tmp_path / "pod.yaml"
    manifest.write_text(yaml.safe_dump({"apiVersion": "v1", "kind": "Pod",
                                        "metadata": {"name": "p"},
                                        "spec": {"containers": [{"name": "c",
                                                                 "image": "./tool.sif"}]}}))
    monkeypatch.delenv("ARCHWAY_CONFIG", raising=False)
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "none"))
    main(["explain", "-f", str(manifest)])
    out = capsys.readouterr().out
    assert "error: invalid image reference './tool.sif': a file path names no image" in out, out
    assert "could not inspect ./tool.sif (invalid image reference)" in out, out
    assert "cannot reach" not in out and "label" not in out


def test_admission_warns_of_an_invalid_reference_for_a_path():
    resolver = Resolver(RegistrySettings(timeout_seconds=1))
    answer = response(service(resolver=resolver, deadline_seconds=1.5).review(
        review("./tool.sif")))
    assert answer["allowed"]
    assert answer["warnings"] == ["could not inspect ./tool.sif (invalid image reference); it does "
                                  "not restrict placement"]
