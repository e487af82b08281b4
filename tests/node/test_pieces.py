"""The real node's pieces, without starting a node: the egress guard's rules, the ELF rewrite
that makes a binary no kernel here runs, the OCI image a node imports, and image archives pushed
to a registry as one index of several architectures."""
import io
import json
import tarfile

import requests

from lab.cluster.nodehost import HostRecord, guard_rules, jumps_to_ours
from lab.cluster.nodeimages import EM_IA_64, OciImage, push_archive, push_index, with_machine
from lab.servers.registry import OCI_INDEX, RegistryServer, sha256_digest


def test_the_guard_drops_what_pods_and_services_send_out_of_any_other_interface():
    rules = guard_rules("ARCHWAY-NODE-EGRESS", "archway0", ["10.244.1.0/24", "10.0.0.0/24"])
    assert [r[2:] for r in rules] == [
        ["-N", "ARCHWAY-NODE-EGRESS"],
        ["-A", "ARCHWAY-NODE-EGRESS", "-s", "10.244.1.0/24", "!", "-o", "archway0", "-j", "DROP"],
        ["-A", "ARCHWAY-NODE-EGRESS", "-s", "10.0.0.0/24", "!", "-o", "archway0", "-j", "DROP"],
        ["-I", "FORWARD", "1", "-j", "ARCHWAY-NODE-EGRESS"]]
    assert {tuple(r[:2]) for r in rules} == {("-t", "mangle")}   # before filter's FORWARD


def test_cleanup_takes_only_chains_the_node_made_and_the_jumps_to_them():
    record = HostRecord("/archway-node", "archway0", "/state/node",
                        existing_chains={"iptables filter": ["KUBE-OLD", "DOCKER"]})
    assert record.ours("iptables", "filter", "KUBE-SERVICES")
    assert not record.ours("iptables", "filter", "KUBE-OLD")      # was there before
    assert not record.ours("iptables", "filter", "DOCKER")
    assert jumps_to_ours(record, "iptables", "filter", "-A FORWARD -j KUBE-FORWARD")
    assert not jumps_to_ours(record, "iptables", "filter", "-A FORWARD -j KUBE-OLD")
    assert not jumps_to_ours(record, "iptables", "filter", "-A KUBE-FORWARD -j KUBE-X")


def test_an_elf_rewritten_to_ia64_keeps_everything_but_its_machine():
    elf = b"\x7fELF" + bytes(14) + (62).to_bytes(2, "little") + b"rest of the binary"
    rewritten = with_machine(elf, EM_IA_64)
    assert rewritten[18:20] == b"\x32\x00" and len(rewritten) == len(elf)
    assert rewritten[:18] == elf[:18] and rewritten[20:] == elf[20:]


def test_an_image_claims_the_architecture_it_is_given_and_its_layer_is_its_diff_id():
    image = OciImage.of({"/hello": b"binary"}, entrypoint=["/hello"], arch="arm64")
    config = json.loads(image.config)
    assert config["architecture"] == "arm64" and config["config"]["Entrypoint"] == ["/hello"]
    assert config["rootfs"]["diff_ids"] == [sha256_digest(image.layer)]
    manifest = json.loads(image.manifest)
    assert manifest["config"]["digest"] == sha256_digest(image.config)


def _layout(path: str, images: list[OciImage]) -> None:
    """An OCI archive as buildah's `manifest push --all` writes it: index.json names an index,
    which names each image's manifest."""
    inner = json.dumps({"schemaVersion": 2, "mediaType": OCI_INDEX,
                        "manifests": [i.index_entry() for i in images]}).encode()
    outer = json.dumps({"schemaVersion": 2, "mediaType": OCI_INDEX, "manifests": [{
        "mediaType": OCI_INDEX, "digest": sha256_digest(inner), "size": len(inner)}]}).encode()
    blobs = [inner, *(b for i in images for b in (i.config, i.layer, i.manifest))]
    with tarfile.open(path, "w") as tar:
        for name, data in [("oci-layout", b'{"imageLayoutVersion": "1.0.0"}'), ("index.json", outer),
                           *((f"blobs/sha256/{sha256_digest(b).split(':')[1]}", b) for b in blobs)]:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))


def test_an_archives_images_are_pushed_by_digest_and_make_one_index_with_another_archives(tmp_path):
    """How archway's image of each architecture (one build-image.sh archive each) becomes the
    one index a cluster of two architectures pulls: on a real registry."""
    amd64 = OciImage.of({"/app": b"amd64 binary"}, entrypoint=["/app"], arch="amd64")
    arm64 = OciImage.of({"/app": b"arm64 binary"}, entrypoint=["/app"], arch="arm64")
    _layout(str(tmp_path / "both.tar"), [amd64, arm64])
    amd64.write_archive(str(tmp_path / "amd64.tar"), "localhost/app:amd64")   # no index inside
    registry = RegistryServer(tmp_path / "registry", schema1=False)
    try:
        nested = push_archive(registry, "app", str(tmp_path / "both.tar"))
        assert [(e["digest"], e["platform"]) for e in nested] == [
            (amd64.digest, {"architecture": "amd64", "os": "linux"}),
            (arm64.digest, {"architecture": "arm64", "os": "linux"})]
        (flat,) = push_archive(registry, "app", str(tmp_path / "amd64.tar"))
        assert flat == amd64.index_entry()      # its platform read from its config
        index = push_index(registry, "app", "v1", [flat, nested[1]])
        served = registry.get_manifest("app", "v1")
        assert served.headers["Docker-Content-Digest"] == index
        assert [m["digest"] for m in served.json()["manifests"]] == [amd64.digest, arm64.digest]
        for image in (amd64, arm64):
            assert registry.get_manifest("app", image.digest).content == image.manifest
            layer = json.loads(image.manifest)["layers"][0]["digest"]
            assert requests.get(f"{registry.url}/v2/app/blobs/{layer}", verify=registry.verify,
                                timeout=10).content == image.layer
    finally:
        registry.stop()
