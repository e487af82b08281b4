"""The SIF parser against real SIF files (other projects' builds when the third-party corpus is
there, Debian's siftool and the project's writer always) and against headers built to lie
(hypothesis)."""
import hashlib
import json
import os
import subprocess
import sys

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from archway.errors import SIFError
from archway.registry import sif
from archway.registry.sif import BlockReader, file_reader, read_sif_platforms
from lab.procs import require_binary
from tests.infra import sifbuild, sifcorpus

HEADER_AND_DEFAULT_TABLE = 128 + 48 * 585  # 28208: all a non-OCI default-layout image costs

README_EXPECTED, README_ERRORS = sifbuild.SHARED_SIF_EXPECTED, sifbuild.SHARED_SIF_ERRORS
GENERATED = sifbuild.GENERATED


class Recorder:
    """A `read` over bytes that records every (offset, length) asked for."""

    def __init__(self, data: bytes):
        self.data = data
        self.calls = []

    def __call__(self, offset, length):
        self.calls.append((offset, length))
        assert offset >= 0 and length >= 0, f"negative read {offset}, {length}"
        return self.data[offset:offset + length]

    @property
    def requested(self):
        return sum(length for _, length in self.calls)

    @property
    def furthest(self):
        return max((o + n for o, n in self.calls), default=0)


def parse(data: bytes):
    recorder = Recorder(data)
    return read_sif_platforms(recorder), recorder


def names(result):
    return {str(p) for p in result.platforms}


def shared(name):
    return sifcorpus.read(name)


@pytest.fixture(scope="module")
def generated(tmp_path_factory) -> dict[str, str]:
    """name -> path of the generated stand-ins of the corpus (sifbuild.GENERATED)."""
    return sifbuild.generated_corpus(str(tmp_path_factory.mktemp("generated-sif")))


def made(generated, name) -> bytes:
    with open(generated[name], "rb") as f:
        return f.read()


# ---------------------------------------------------------------------------------------------
# The real files of the third-party corpus (skipped, with one line, when it is absent)


def test_every_shared_file_is_covered():
    on_disk = {n for n in os.listdir(os.path.dirname(sifcorpus.path("README.md"))) if n != "README.md"}
    assert on_disk == set(README_EXPECTED) | set(README_ERRORS)


@pytest.mark.parametrize("name", sorted(README_EXPECTED))
def test_shared_file_gives_the_readme_architecture(name):
    result = read_sif_platforms(file_reader(sifcorpus.path(name)))
    assert names(result) == README_EXPECTED[name]
    if not result.platforms:
        assert "no architecture" in result.note


@pytest.mark.parametrize("name", sorted(README_ERRORS))
def test_shared_oci_root_index_without_blobs_is_a_clear_error(name):
    with pytest.raises(SIFError, match=README_ERRORS[name]):
        read_sif_platforms(file_reader(sifcorpus.path(name)))


@pytest.mark.parametrize("name,source", [
    ("busybox_amd64.sif", "sif-primary-partition"),
    ("two-groups.sif", "sif-primary-partition"),
    ("empty.sif", "sif-unknown"),
    ("docker-manifest.oci.sif", "oci-sif"),
    ("legacy-squashfs.v4.img", "pre-sif"),
])
def test_source_says_where_the_answer_came_from(name, source):
    assert read_sif_platforms(file_reader(sifcorpus.path(name))).source == source


def test_legacy_squashfs_note():
    result = read_sif_platforms(file_reader(sifcorpus.path("legacy-squashfs.v4.img")))
    assert result.note.startswith("pre-SIF image: no architecture recorded")


@pytest.mark.parametrize("name", ["busybox_amd64.sif", "busybox_ppc64le.sif", "two-groups.sif",
                                  "empty.sif", "one-group-signed-pgp.sif"])
def test_default_layout_reads_only_header_and_table(name):
    _, recorder = parse(shared(name))
    assert recorder.calls == [(0, 128), (4096, 48 * 585)]
    assert recorder.requested == HEADER_AND_DEFAULT_TABLE


def test_oci_sif_reads_only_the_json_it_needs():
    data = shared("docker-manifest.oci.sif")   # 4 descriptors; root index 314, manifest 525, config 1485
    _, recorder = parse(data)
    assert recorder.requested == 128 + 4 * 585 + 314 + 525 + 1485
    # the multi-platform index names every platform: no manifest or config is read
    _, recorder = parse(shared("docker-manifest-list.oci.sif"))
    assert recorder.requested == 128 + 28 * 585 + 2069


def test_block_reader_costs_one_fetch_for_default_layout():
    data = shared("busybox_arm64.sif")
    fetches = []
    reader = BlockReader(lambda o, n: fetches.append((o, n)) or data[o:o + n])
    assert names(read_sif_platforms(reader)) == {"linux/arm64"}
    assert fetches == [(0, 32768)]
    assert (reader.fetches, reader.bytes_fetched) == (1, 32768)


def test_block_reader_fetches_only_the_missing_tail():
    data = shared("docker-manifest-list.oci.sif")   # root index at 67866, past the first block
    fetches = []
    reader = BlockReader(lambda o, n: fetches.append((o, n)) or data[o:o + n])
    assert len(read_sif_platforms(reader).platforms) == 9
    assert fetches == [(0, 32768), (67866, 2069)]


def test_block_reader_small_file_is_one_fetch_even_for_late_reads():
    data = shared("image-defaults.oci.sif")  # 12553 bytes: the first block is the whole file
    reader = BlockReader(lambda o, n: data[o:o + n])
    assert names(read_sif_platforms(reader)) == {"linux/arm64"}
    assert reader.fetches == 1 and reader.bytes_fetched == len(data)
    assert reader(len(data) + 10, 5) == b""


# ---------------------------------------------------------------------------------------------
# The generated stand-ins: every shape of the corpus, made here (siftool, the writer)


def test_every_corpus_file_has_a_generated_stand_in():
    stood_for = {name for shape in GENERATED.values() for name in shape.stands_for}
    assert stood_for == set(README_EXPECTED) | set(README_ERRORS)
    for shape in GENERATED.values():
        for name in shape.stands_for:
            if shape.platforms is None:
                assert name in README_ERRORS
            else:   # the same kind of answer as the file it stands for (unknown, or some arch)
                assert bool(shape.platforms) == bool(README_EXPECTED[name])


@pytest.mark.parametrize("name", sorted(GENERATED))
def test_generated_file_gives_its_answer(generated, name):
    shape, data = GENERATED[name], made(generated, name)
    for reader in (file_reader(generated[name]), BlockReader(lambda o, n: data[o:o + n])):
        if shape.platforms is None:
            with pytest.raises(SIFError, match=shape.error):
                read_sif_platforms(reader)
            continue
        result = read_sif_platforms(reader)
        assert (names(result), result.source) == (set(shape.platforms), shape.source)
        if not result.platforms:
            assert "no architecture" in result.note


@pytest.mark.parametrize("name", ["siftool-amd64.sif", "siftool-ppc64le-aligned.sif",
                                  "siftool-two-groups.sif", "siftool-empty.sif",
                                  "siftool-one-group-signed.sif"])
def test_generated_default_layout_reads_only_header_and_table(generated, name):
    _, recorder = parse(made(generated, name))
    assert recorder.calls == [(0, 128), (4096, 48 * 585)]
    assert recorder.requested == HEADER_AND_DEFAULT_TABLE


@pytest.mark.parametrize("name, documents", [("single.oci.sif", 3),
                                             ("index-past-first-block.oci.sif", 1)])
def test_generated_oci_sif_reads_only_the_json_it_needs(generated, name, documents):
    """Header, table, then whole JSON documents only: root index -> manifest -> config for one
    image; the root index alone when it names every platform."""
    data = made(generated, name)
    _, recorder = parse(data)
    (_, head), (table_at, table), *blobs = recorder.calls
    assert (head, table_at, table % 585) == (128, 4096, 0)
    assert len(blobs) == documents
    assert all(isinstance(json.loads(data[o:o + n]), dict) for o, n in blobs)
    assert recorder.requested == 128 + table + sum(n for _, n in blobs)


def test_generated_block_reader_costs_one_fetch_for_default_layout(generated):
    data = made(generated, "siftool-ppc64le-aligned.sif")
    fetches = []
    reader = BlockReader(lambda o, n: fetches.append((o, n)) or data[o:o + n])
    assert names(read_sif_platforms(reader)) == {"linux/ppc64le"}
    assert fetches == [(0, 32768)] and (reader.fetches, reader.bytes_fetched) == (1, 32768)


def test_generated_block_reader_fetches_only_the_missing_tail(generated):
    data = made(generated, "index-past-first-block.oci.sif")   # the index is the last object
    index = len(data) - data.rindex(b'{"schemaVersion": 2, "mediaType": "application/vnd.oci.image.index')
    fetches = []
    reader = BlockReader(lambda o, n: fetches.append((o, n)) or data[o:o + n])
    assert len(read_sif_platforms(reader).platforms) == 9
    assert fetches == [(0, 32768), (len(data) - index, index)] and len(data) - index > 32768


def test_generated_block_reader_fetches_the_rest_of_an_object_across_the_block(generated):
    data = made(generated, "root-index-without-blobs.sif")     # index at 32176..past 32768
    fetches = []
    with pytest.raises(SIFError, match="missing blob"):
        read_sif_platforms(BlockReader(lambda o, n: fetches.append((o, n)) or data[o:o + n]))
    assert fetches == [(0, 32768), (32768, len(data) - 32768)]


def test_generated_block_reader_small_file_is_one_fetch_even_for_late_reads(generated):
    data = made(generated, "single.oci.sif")
    assert len(data) < 32768
    reader = BlockReader(lambda o, n: data[o:o + n])
    assert names(read_sif_platforms(reader)) == {"linux/arm64"}
    assert reader.fetches == 1 and reader.bytes_fetched == len(data)
    assert reader(len(data) + 10, 5) == b""


def reader_lines(path: str) -> set[int]:
    """The lines of registry/sif.py run while reading `path` through a file reader and through
    a BlockReader (what https:// and oras:// use)."""
    with open(path, "rb") as f:
        data = f.read()
    lines: set[int] = set()

    def trace(frame, event, arg):
        if frame.f_code.co_filename != sif.__file__:
            return None
        if event == "line":
            lines.add(frame.f_lineno)
        return trace

    for reader in (file_reader(path), BlockReader(lambda o, n: data[o:o + n])):
        previous = sys.gettrace()
        sys.settrace(trace)
        try:
            read_sif_platforms(reader)
        except SIFError:
            pass
        finally:
            sys.settrace(previous)
    return lines


def test_generated_files_run_every_reader_line_the_corpus_runs(generated):
    """Coverage without the corpus: every line of the reader some corpus file runs, some
    generated file runs too (a new corpus file with a new path fails here until one is made)."""
    corpus = set().union(*(reader_lines(sifcorpus.path(name))
                           for name in [*README_EXPECTED, *README_ERRORS]))
    made_here = set().union(*(reader_lines(path) for path in generated.values()))
    with open(sif.__file__) as f:
        source = f.read().splitlines()
    missing = [f"{line}: {source[line - 1].strip()}" for line in sorted(corpus - made_here)]
    assert not missing, "only the corpus runs:\n" + "\n".join(missing)
    assert len(corpus) > 100


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 80000), st.integers(0, 40000)), max_size=8),
       st.integers(1, 70000))
def test_block_reader_returns_what_slicing_returns(generated, reads, first_block):
    data = made(generated, "index-past-first-block.oci.sif")
    reader = BlockReader(lambda o, n: data[o:o + n], first_block=first_block)
    for offset, length in reads:
        assert reader(offset, length) == data[offset:offset + length]
    assert reader.bytes_fetched <= first_block + sum(n for _, n in reads)


def test_file_reader_missing_file_is_a_sif_error(tmp_path):
    with pytest.raises(SIFError, match="cannot read"):
        read_sif_platforms(file_reader(str(tmp_path / "nope.sif")))


# ---------------------------------------------------------------------------------------------
# Images built with Debian's siftool + mksquashfs


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("sifbuild"))


@pytest.mark.parametrize("arch", ["amd64", "arm64", "ppc64le", "s390x", "riscv64", "386"])
def test_siftool_image(workdir, arch):
    path = sifbuild.siftool_image(workdir, f"{arch}.sif", arch)
    result = read_sif_platforms(file_reader(path))
    assert names(result) == {f"linux/{arch}"}
    assert result.source == "sif-primary-partition"


def test_siftool_arm_image_is_arm(workdir):
    # SIF records no ARM variant; containerd's default (v7) fills it, the node label is "arm"
    path = sifbuild.siftool_image(workdir, "arm.sif", "arm")
    assert names(read_sif_platforms(file_reader(path))) == {"linux/arm/v7"}


def test_siftool_second_group_system_partition_does_not_count(workdir):
    path = sifbuild.siftool_image(workdir, "two.sif", "arm64", system_arch="amd64")
    assert names(read_sif_platforms(file_reader(path))) == {"linux/arm64"}


def test_primary_partition_wins_over_a_different_header(workdir):
    path = sifbuild.siftool_image(workdir, "lying.sif", "riscv64")
    sifbuild.set_header_arch(path, "amd64")
    with open(path, "rb") as f:
        assert f.read(48)[45:47] == b"02"
    result = read_sif_platforms(file_reader(path))
    assert names(result) == {"linux/riscv64"}
    assert result.source == "sif-primary-partition"


def test_header_arch_when_no_primary_partition():
    result, _ = parse(sifbuild.write_sif([sifbuild.partition(b"x" * 64, "s390x", parttype=1)],
                                         header_arch="s390x"))
    assert names(result) == {"linux/s390x"} and result.source == "sif-header"


def test_primary_partition_00_falls_back_to_header():
    result, _ = parse(sifbuild.write_sif([sifbuild.partition(b"x" * 64, None)], header_arch="ppc64"))
    assert names(result) == {"linux/ppc64"} and result.source == "sif-header"


def test_primary_partition_and_header_00_is_unknown():
    result, _ = parse(sifbuild.write_sif([sifbuild.partition(b"x" * 64, None)]))
    assert result.platforms == frozenset()
    assert "primary system partition and global header both say arch 00" in result.note


def test_two_primary_partitions_is_an_error():
    data = sifbuild.write_sif([sifbuild.partition(b"a" * 8, "amd64"),
                               sifbuild.partition(b"b" * 8, "arm64")], header_arch="amd64")
    with pytest.raises(SIFError, match="2 primary system partitions"):
        parse(data)


def test_unused_descriptors_are_skipped():
    stale = sifbuild.partition(b"a" * 8, "arm64")
    stale.used = 0
    data = sifbuild.write_sif([stale, sifbuild.partition(b"b" * 8, "s390x")], header_arch="s390x")
    assert names(parse(data)[0]) == {"linux/s390x"}


def test_pre_sif_squashfs_after_launch_line(workdir):
    with open(sifbuild.make_squashfs(workdir), "rb") as f:
        squashfs = f.read()
    result, _ = parse(sifbuild.LAUNCH_SCRIPT + squashfs)
    assert result.platforms == frozenset() and result.source == "pre-sif"
    assert result.note.startswith(sif.PRE_SIF_NOTE)


@pytest.mark.parametrize("launch", [b"", sifbuild.LAUNCH_SCRIPT])
def test_pre_sif_ext3(tmp_path, launch):
    image = tmp_path / "fs.ext3"
    subprocess.run([require_binary("mkfs.ext3"), "-q", "-F", str(image), "256"], check=True,
                   capture_output=True)
    result, recorder = parse(launch + image.read_bytes())
    assert result.source == "pre-sif" and "ext3" in result.note
    assert recorder.requested <= 128 + 2


def test_not_a_sif_at_all():
    with pytest.raises(SIFError, match="not a SIF image"):
        parse(b"<html><body>404 Not Found</body></html>" + b" " * 2000)
    with pytest.raises(SIFError, match="not a SIF image"):
        parse(b"")


# ---------------------------------------------------------------------------------------------
# OCI-SIF built by the test writer


def test_oci_sif_single_config_arm64_v8_is_arm64():
    result, _ = parse(sifbuild.oci_sif({"architecture": "arm64", "variant": "v8", "os": "linux"}))
    assert names(result) == {"linux/arm64"} and result.source == "oci-sif"


def test_oci_sif_config_arm_v6():
    result, _ = parse(sifbuild.oci_sif({"architecture": "arm", "variant": "v6", "os": "linux"}))
    assert names(result) == {"linux/arm/v6"}


def test_oci_sif_multi_platform_index_skips_attestations():
    platforms = [{"os": "linux", "architecture": "amd64"},
                 {"os": "linux", "architecture": "arm", "variant": "v7"},
                 {"os": "unknown", "architecture": "unknown"}]
    configs = [{"architecture": "amd64", "os": "linux"}, {"architecture": "arm", "os": "linux"},
               {"architecture": "x", "os": "y"}]
    result, _ = parse(sifbuild.oci_sif(configs=configs, index_platforms=platforms))
    assert names(result) == {"linux/amd64", "linux/arm/v7"}


def test_oci_sif_config_without_architecture_is_unknown():
    result, _ = parse(sifbuild.oci_sif({"os": "linux"}))
    assert result.platforms == frozenset() and "record no architecture" in result.note


def _oci_objects(index: bytes, *blobs: bytes):
    return sifbuild.write_sif([sifbuild.oci_blob(b) for b in blobs] +
                              [sifbuild.oci_blob(index, root_index=True)], total=len(blobs) + 1)


def test_oci_sif_missing_config_blob_names_the_digest():
    config = b'{"architecture": "amd64"}'
    config_digest = "sha256:" + hashlib.sha256(config).hexdigest()
    manifest = json.dumps({"config": {"digest": config_digest}, "layers": []}).encode()
    index = json.dumps({"manifests": [
        {"digest": "sha256:" + hashlib.sha256(manifest).hexdigest()}]}).encode()
    with pytest.raises(SIFError, match=f"missing blob '{config_digest}'"):
        parse(_oci_objects(index, manifest))


def test_oci_sif_blob_that_does_not_match_its_digest():
    index = b'{"manifests": []}'
    data = sifbuild.write_sif([sifbuild.oci_blob(index, digest="sha256:" + "0" * 64,
                                                 root_index=True)], total=1)
    with pytest.raises(SIFError, match="does not match its digest"):
        parse(data)


@pytest.mark.parametrize("index,message", [
    (b"{not json", "not valid JSON"),
    (b"\xff\xfe\x00garbage", "not valid JSON"),
    (b"[" * 50000 + b"]" * 50000, "not valid JSON"),
    (b"[1, 2]", "not a JSON object"),
    (b'{"manifests": {"a": 1}}', "not a list of objects"),
    (b'{"manifests": [{"digest": 5}]}', "missing blob 5"),
    (b'{"schemaVersion": 2}', "neither an OCI index nor an image manifest"),
    (b'{"manifests": [{"digest": "sha256:ab", "platform": "linux"}]}', "missing blob"),
])
def test_oci_sif_garbage_root_index(index, message):
    with pytest.raises(SIFError, match=message):
        parse(_oci_objects(index))


def test_oci_sif_platform_must_be_an_object():
    manifest = b'{"config": {"digest": "sha256:00"}}'
    digest = "sha256:" + hashlib.sha256(manifest).hexdigest()
    index = json.dumps({"manifests": [{"digest": digest, "platform": ["linux"]}]}).encode()
    with pytest.raises(SIFError, match="platform is not a JSON object"):
        parse(_oci_objects(index, manifest))


def test_oci_sif_lying_digest_field_is_caught():
    # A root index cannot name itself (its digest would contain itself); a descriptor whose
    # digest field lies could fake that loop, and the sha256 check catches it.
    index = b'{"manifests": [{"digest": "sha256:' + b"1" * 64 + b'"}]}'
    data = sifbuild.write_sif([sifbuild.oci_blob(index, digest="sha256:" + "1" * 64),
                               sifbuild.oci_blob(index, digest="sha256:" + "1" * 64, root_index=True)],
                              total=2)
    with pytest.raises(SIFError, match="does not match its digest"):
        parse(data)


def _index_chain(depth: int, config: dict):
    """Blobs for root index -> (depth-1) nested indexes -> manifest -> config."""
    config_bytes = json.dumps(config).encode()
    document = json.dumps({"config": {"digest": _sha(config_bytes)}}).encode()
    blobs = [config_bytes, document]
    for _ in range(depth - 1):
        document = json.dumps({"manifests": [{"digest": _sha(document)}]}).encode()
        blobs.append(document)
    root = json.dumps({"manifests": [{"digest": _sha(document)}]}).encode()
    return root, blobs


def _sha(data):
    return "sha256:" + hashlib.sha256(data).hexdigest()


def test_oci_sif_nested_indexes_are_followed():
    root, blobs = _index_chain(3, {"architecture": "s390x", "os": "linux"})
    assert names(parse(_oci_objects(root, *blobs))[0]) == {"linux/s390x"}


def test_oci_sif_nesting_is_bounded():
    root, blobs = _index_chain(sif.MAX_OCI_DEPTH + 2, {"architecture": "s390x"})
    with pytest.raises(SIFError, match="nests indexes more than"):
        parse(_oci_objects(root, *blobs))


def test_oci_sif_oversized_blob_is_refused_without_reading_it():
    big = 64 * 1024 * 1024
    root = sifbuild.oci_blob(b"{}", root_index=True)
    root.size = big
    data = sifbuild.write_sif([root], total=1, data_size=big + 64)
    recorder = Recorder(data)
    with pytest.raises(SIFError, match="more than the 4194304 archway reads"):
        read_sif_platforms(recorder)
    assert recorder.requested == 128 + 585


def test_two_root_indexes_is_an_error():
    data = _oci_objects(b'{"manifests": []}', b"x")
    data2 = sifbuild.write_sif([sifbuild.oci_blob(b'{"manifests": []}', root_index=True),
                                sifbuild.oci_blob(b'{"manifests":[]}', root_index=True)], total=2)
    assert parse(data)[0].platforms == frozenset()
    with pytest.raises(SIFError, match="2 OCI root indexes"):
        parse(data2)


# ---------------------------------------------------------------------------------------------
# Malformed headers, one by one


@pytest.mark.parametrize("kwargs,message", [
    ({"magic": b"SIF_MAGIX\0"}, "not a SIF image"),
    ({"version": b"02\0"}, "unsupported SIF version '02'"),
    ({"arch_field": b"99\0"}, "arch code '99'"),
    ({"arch_field": b"2\0\0"}, "arch code"),
    ({"arch_field": b"02x"}, "arch code"),
])
def test_malformed_header_bytes(kwargs, message):
    with pytest.raises(SIFError, match=message):
        parse(sifbuild.write_sif([sifbuild.partition(b"x" * 16, "amd64")], header_arch="amd64",
                                 **kwargs))


@pytest.mark.parametrize("fields,message", [
    ({"total": 4097, "desc_size": 4097 * 585}, "4097 descriptors"),
    ({"total": -1}, "-1 descriptors"),
    ({"free": 49}, "49 free descriptors"),
    ({"free": -1}, "-1 free descriptors"),
    ({"desc_size": 100}, "descriptor table size 100"),
    ({"desc_offset": 64}, "descriptor table offset 64"),
    ({"desc_offset": 2 ** 63 - 100}, "descriptor table offset"),
    ({"total": 4096, "free": 4095, "desc_size": 4096 * 585},
     "truncated SIF image: the descriptor table"),
    ({"desc_offset": 10 ** 9}, "truncated SIF image: the descriptor table"),
    ({"data_offset": -5}, "data section"),
    ({"data_offset": 2 ** 63 - 10, "data_size": 100}, "data section"),
    ({"data_size": 0}, "outside the data section"),
])
def test_lying_header(fields, message):
    image = sifbuild.write_sif([sifbuild.partition(b"x" * 16, "amd64")], header_arch="amd64")
    with pytest.raises(SIFError, match=message):
        parse(sifbuild.patch_header(image, **fields))


@pytest.mark.parametrize("field,value,message", [
    ("offset", -1, "offset -1"),
    ("size", -7, "size -7"),
    ("offset", 2 ** 63 - 2, "offset"),
    ("size", 10 ** 9, "outside the data section"),
    ("offset", 100, "outside the data section"),
])
def test_malformed_descriptor(field, value, message):
    obj = sifbuild.partition(b"x" * 16, "amd64")
    setattr(obj, field, value)
    with pytest.raises(SIFError, match=message):
        parse(sifbuild.write_sif([obj], header_arch="amd64"))


def test_bad_partition_arch_code():
    with pytest.raises(SIFError, match="partition object 1 has arch code"):
        parse(sifbuild.write_sif([sifbuild.partition(b"x", None, arch_field=b"\xff\xfe\0")],
                                 header_arch="amd64"))


def test_oci_descriptor_without_digest():
    obj = sifbuild.oci_blob(b"{}", root_index=True)
    obj.extra = b"\xffnot-a-digest\0"
    with pytest.raises(SIFError, match="without a valid digest"):
        parse(sifbuild.write_sif([obj], total=1))


def test_reader_returning_garbage_type():
    with pytest.raises(SIFError, match="not bytes"):
        read_sif_platforms(lambda offset, length: None)


# ---------------------------------------------------------------------------------------------
# Properties: truncated, corrupted and lying images raise SIFError and nothing else, and the
# parser never asks for more than the header + table + capped OCI JSON.

MAX_REQUEST = 128 + sif.MAX_DESCRIPTORS * 585 + sif.MAX_JSON_TOTAL + 1082 + 64
PROPERTY = settings(max_examples=200, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

SAMPLES = ["siftool-amd64.sif", "siftool-two-groups.sif", "single.oci.sif",
           "index-past-first-block.oci.sif", "siftool-generic-json.sif"]


def _prefix_needed(data):
    recorder = Recorder(data)
    read_sif_platforms(recorder)
    return recorder.furthest


@pytest.fixture(scope="module")
def samples(generated) -> dict[str, tuple[bytes, int]]:
    """name -> (its first 80000 bytes, how many of them the reader needs)."""
    out = {}
    for name in SAMPLES:
        data = made(generated, name)[:80000]
        out[name] = (data, _prefix_needed(data))
    return out


def parse_safely(data):
    """Parse; SIFError is an accepted outcome, anything else escapes and fails the test."""
    recorder = Recorder(data)
    try:
        result = read_sif_platforms(recorder)
    except SIFError as e:
        assert str(e), "a SIFError must say what is wrong"
        result = None
    assert recorder.requested <= MAX_REQUEST
    assert all(n <= max(sif.MAX_DESCRIPTORS * 585, sif.MAX_JSON_BLOB) for _, n in recorder.calls)
    return result, recorder


@PROPERTY
@given(st.sampled_from(SAMPLES), st.data())
def test_truncated_image_raises_sif_error(samples, name, data):
    image, needed = samples[name]
    cut = data.draw(st.integers(0, needed - 1), label="cut")
    with pytest.raises(SIFError):
        read_sif_platforms(Recorder(image[:cut]))


@PROPERTY
@given(st.sampled_from(SAMPLES), st.data())
def test_truncation_after_what_is_needed_changes_nothing(samples, name, data):
    image, needed = samples[name]
    cut = data.draw(st.integers(needed, len(image)), label="cut")
    assert read_sif_platforms(Recorder(image[:cut])) == read_sif_platforms(Recorder(image))


@PROPERTY
@given(st.sampled_from(SAMPLES), st.data())
def test_corrupted_image_gives_sif_error_or_an_answer(samples, name, data):
    image, needed = samples[name]
    image = bytearray(image)
    changes = data.draw(st.lists(st.tuples(st.integers(0, needed - 1), st.integers(0, 255)),
                                 min_size=1, max_size=12), label="changes")
    for position, value in changes:
        image[position] = value
    result, _ = parse_safely(bytes(image))
    assert result is None or isinstance(result, sif.SifArch)


@PROPERTY
@given(st.sampled_from(SAMPLES), st.integers(32, 127), st.binary(min_size=1, max_size=96))
def test_corrupted_header_fields(samples, name, start, junk):
    image, _ = samples[name]
    image = bytearray(image)
    junk = junk[:128 - start]
    image[start:start + len(junk)] = junk
    parse_safely(bytes(image))


INT64 = st.integers(-(2 ** 63), 2 ** 63 - 1)


@PROPERTY
@given(st.sampled_from(["total", "free", "desc_offset", "desc_size", "data_offset", "data_size"]),
       INT64)
def test_lying_header_counts(field, value):
    honest = sifbuild.write_sif([sifbuild.partition(b"x" * 64, "arm64")], header_arch="arm64")
    fields = sifbuild.header_fields(honest)
    assume(fields[field] != value)
    image = sifbuild.patch_header(honest, **{field: value})
    result, _ = parse_safely(image)
    object_start, object_end = fields["data_offset"], fields["data_offset"] + 64
    fields[field] = value
    data_end = fields["data_offset"] + fields["data_size"]
    must_fail = {
        "total": True,                      # the table size no longer matches
        "desc_size": True,
        "free": not 0 <= value <= 48,
        "desc_offset": value < 128 or value + 48 * 585 > len(image),
        "data_offset": not (0 <= value <= object_start and object_end <= data_end <= 2 ** 63 - 1),
        "data_size": not (value >= 0 and object_end <= data_end <= 2 ** 63 - 1),
    }[field]
    if must_fail:
        assert result is None
    elif field != "desc_offset":  # a shifted table may decode as anything; elsewhere, the answer
        assert {str(p) for p in result.platforms} == {"linux/arm64"}


@PROPERTY
@given(st.sampled_from(["offset", "size"]), INT64)
def test_lying_descriptor_offsets(field, value):
    obj = sifbuild.partition(b"x" * 64, "arm64")
    honest_offset = 4096 + 48 * 585  # where the writer puts the first object (8-aligned)
    honest_offset += (-honest_offset) % 8
    setattr(obj, field, value)
    image = sifbuild.write_sif([obj], header_arch="arm64")
    result, _ = parse_safely(image)
    data_start, data_end = honest_offset, honest_offset + 64
    offset = value if field == "offset" else honest_offset
    size = value if field == "size" else 64
    inside = offset >= data_start and size >= 0 and offset + size <= data_end
    assert (result is not None) == inside


VALID_CODES = {b"%02d\0" % n for n in range(14)}


@PROPERTY
@given(st.binary(min_size=3, max_size=3), st.booleans())
def test_lying_arch_codes(code, in_partition):
    assume(code not in VALID_CODES)
    if in_partition:
        image = sifbuild.write_sif([sifbuild.partition(b"x", None, arch_field=code)],
                                   header_arch="amd64")
    else:
        image = sifbuild.write_sif([], arch_field=code)
    with pytest.raises(SIFError, match="arch code"):
        read_sif_platforms(Recorder(image))


@PROPERTY
@given(st.binary(max_size=2048))
def test_random_oci_root_index_bytes(body):
    result, _ = parse_safely(_oci_objects(body))
    assert result is None or result.source == "oci-sif"


JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(
        st.sampled_from(["manifests", "config", "digest", "platform", "architecture", "os",
                         "variant", "annotations", "x"]), inner, max_size=5),
    max_leaves=20)


@PROPERTY
@given(JSON_VALUES)
def test_random_oci_root_index_json(document):
    result, _ = parse_safely(_oci_objects(json.dumps(document).encode()))
    assert result is None or result.source == "oci-sif"


@PROPERTY
@given(st.integers(0, 32), st.binary(max_size=4096))
def test_random_bytes_never_crash(count, tail):
    parse_safely(b"\0" * count + tail)
