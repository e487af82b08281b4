"""The real node's pure pieces, without starting anything: the egress guard's rules, the ELF
rewrite that makes a binary no kernel here runs, the OCI image a node imports."""
import json

from lab.cluster.nodehost import HostRecord, guard_rules, jumps_to_ours
from lab.cluster.nodeimages import EM_IA_64, OciImage, with_machine
from lab.servers.registry import sha256_digest


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
