"""Build SIF images for tests.

Two ways, on purpose:
- `siftool_image()`: Debian's `siftool` (the sylabs/sif reference writer) around a real squashfs
  made by `mksquashfs`: what real users' images look like.
- `write_sif()`: a tiny pure-Python writer (test-only) whose every header and descriptor field can
  be overridden, so property tests can produce headers that lie.

`generated_corpus()` makes, with both, one file of every shape the third-party corpus
(../shared/testdata/sif, not part of the project) has, so the reader is covered without it.
"""
import json
import os
import struct
import subprocess
import uuid
from dataclasses import dataclass

from lab.procs import require_binary
from lab.servers.registry import sha256_digest

HEADER_SIZE = 128
DESCRIPTOR_SIZE = 585
DEFAULT_TOTAL = 48
DEFAULT_DESC_OFFSET = 4096
LAUNCH_SCRIPT = b"#!/usr/bin/env run-singularity\n"

# siftool --partarch numbers and the SIF header codes ("%02d" of the same number).
ARCH_NUMBERS = {"386": 1, "amd64": 2, "arm": 3, "arm64": 4, "ppc64": 5, "ppc64le": 6, "mips": 7,
                "mipsle": 8, "mips64": 9, "mips64le": 10, "s390x": 11, "riscv64": 12}
DATA_PARTITION, DATA_GENERIC_JSON, DATA_OCI_ROOT_INDEX, DATA_OCI_BLOB = 0x4004, 0x4006, 0x400A, 0x400B
FS_SQUASHFS, FS_EXT3, FS_RAW = 1, 2, 4
PART_SYSTEM, PART_PRIMARY = 1, 2


# What ../shared/testdata/sif/README.md states for each file (platform strings; an empty set is
# "unknown"), and the files that must fail with a clear error.
SHARED_SIF_EXPECTED = {
    "busybox_amd64.sif": {"linux/amd64"},
    "busybox_arm64.sif": {"linux/arm64"},
    "busybox_ppc64le.sif": {"linux/ppc64le"},
    "one-group.sif": {"linux/386"},
    "one-group-signed-pgp.sif": {"linux/386"},
    "two-groups.sif": {"linux/386"},
    "empty.sif": set(),
    "empty-launch-script.sif": set(),
    "one-object-generic-json.sif": set(),
    "docker-manifest.oci.sif": {"linux/arm64"},
    "image-defaults.oci.sif": {"linux/arm64"},
    "docker-manifest-list.oci.sif": {"linux/386", "linux/amd64", "linux/arm/v5", "linux/arm/v7",
                                     "linux/arm64", "linux/mips64le", "linux/ppc64le",
                                     "linux/riscv64", "linux/s390x"},
    "legacy-squashfs.v4.img": set(),
}
SHARED_SIF_ERRORS = {"one-object-oci-root-index.sif": "missing blob 'sha256:abcdef1234567890'"}


def arch_code(goarch: str | None) -> bytes:
    """The 3-byte SIF arch field: b"02\\0" for amd64, b"00\\0" for None."""
    return b"%02d\0" % (ARCH_NUMBERS[goarch] if goarch else 0)


# ---------------------------------------------------------------------------------------------
# With the real tools


def make_squashfs(workdir: str) -> str:
    """A small real squashfs image (made once per workdir)."""
    path = os.path.join(workdir, "rootfs.sqfs")
    if not os.path.exists(path):
        root = os.path.join(workdir, "rootfs")
        os.makedirs(os.path.join(root, "bin"), exist_ok=True)
        with open(os.path.join(root, "bin", "hello"), "w") as f:
            f.write("#!/bin/sh\necho hello\n")
        subprocess.run([require_binary("mksquashfs"), root, path, "-noappend", "-quiet",
                        "-all-root"], check=True, capture_output=True)
    return path


def siftool_image(workdir: str, name: str, primary_arch: str | None, *,
                  system_arch: str | None = None, system_group: int = 2, raw_system: bool = False,
                  alignment: int | None = None, signed: bool = False,
                  generic_json: bytes | None = None) -> str:
    """`siftool new` + a primary-system squashfs partition of `primary_arch` (None: none); with
    `system_arch`, first a plain system partition of that arch (group `system_group`; raw with
    `raw_system`), like two-groups.sif and one-group.sif; `alignment` of the partitions (64 KiB
    like busybox_ppc64le.sif); `signed`: a signature object after them; `generic_json`: a
    generic JSON object."""
    siftool = require_binary("siftool")
    squashfs = make_squashfs(workdir)
    path = os.path.join(workdir, name)
    if os.path.exists(path):
        os.unlink(path)
    subprocess.run([siftool, "new", path], check=True, capture_output=True)
    align = ["--alignment", str(alignment)] if alignment else []
    if system_arch:
        _siftool_add(siftool, path, squashfs, PART_SYSTEM, system_arch, group=system_group,
                     fs=FS_RAW if raw_system else FS_SQUASHFS, extra=align)
    if primary_arch:
        _siftool_add(siftool, path, squashfs, PART_PRIMARY, primary_arch, group=1, extra=align)
    if signed:
        signature = os.path.join(workdir, "signature.bin")
        with open(signature, "wb") as f:
            f.write(b"-----BEGIN PGP SIGNED MESSAGE-----\n" + b"\0" * 600)
        subprocess.run([siftool, "add", path, signature, "--datatype", "5", "--signentity",
                        "433FE984155206BD962725E20E8713472A879943", "--signhash", "1",
                        "--groupid", "1", "--link", "1"], check=True, capture_output=True)
    if generic_json is not None:
        document = os.path.join(workdir, "object.json")
        with open(document, "wb") as f:
            f.write(generic_json)
        subprocess.run([siftool, "add", path, document, "--datatype", "6"], check=True,
                       capture_output=True)
    return path


def _siftool_add(siftool, path, squashfs, parttype, arch, group, fs=FS_SQUASHFS, extra=()):
    subprocess.run([siftool, "add", path, squashfs, "--datatype", "4", "--parttype", str(parttype),
                    "--partfs", str(fs), "--partarch", str(ARCH_NUMBERS[arch]),
                    "--groupid", str(group), *extra], check=True, capture_output=True)


def set_header_arch(path: str, goarch: str | None) -> None:
    """Overwrite the global header's arch (offset 45), leaving the partitions alone."""
    with open(path, "r+b") as f:
        f.seek(45)
        f.write(arch_code(goarch))


# ---------------------------------------------------------------------------------------------
# The pure-Python writer


@dataclass
class SifObject:
    data_type: int
    data: bytes
    extra: bytes = b""
    used: int = 1
    group: int = 1
    link: int = 0
    name: bytes = b""
    offset: int | None = None   # None: where the writer puts it; set to lie
    size: int | None = None     # None: len(data); set to lie


def partition(data: bytes, arch: str | None, parttype: int = PART_PRIMARY,
              fstype: int = FS_SQUASHFS, arch_field: bytes | None = None) -> SifObject:
    extra = struct.pack("<ii", fstype, parttype) + (arch_field if arch_field is not None
                                                     else arch_code(arch))
    return SifObject(DATA_PARTITION, data, extra)


def oci_blob(data: bytes, digest: str | None = None, root_index: bool = False) -> SifObject:
    digest = digest or sha256_digest(data)
    return SifObject(DATA_OCI_ROOT_INDEX if root_index else DATA_OCI_BLOB, data,
                     digest.encode() + b"\0")


def write_sif(objects=(), *, header_arch: str | None = None, arch_field: bytes | None = None,
              launch: bytes = b"", magic: bytes = b"SIF_MAGIC\0", version: bytes = b"01\0",
              total: int = DEFAULT_TOTAL, free: int | None = None,
              desc_offset: int = DEFAULT_DESC_OFFSET, desc_size: int | None = None,
              data_offset: int | None = None, data_size: int | None = None,
              align: int = 8) -> bytes:
    """A SIF image in the default layout (header, table at 4096, data after it). Every field
    the parser checks can be overridden with a wrong value."""
    objects = list(objects)
    table_end = desc_offset + max(total, len(objects)) * DESCRIPTOR_SIZE
    real_data_offset = table_end
    blob = bytearray()
    placed = []
    for obj in objects:
        start = real_data_offset + len(blob)
        pad = (-start) % align
        blob += b"\0" * pad + obj.data
        placed.append(start + pad)
    real_data_size = len(blob)
    descriptors = bytearray()
    for number, (obj, at) in enumerate(zip(objects, placed), start=1):
        descriptors += struct.pack(
            "<iBIIIqqqqqqq128s384s", obj.data_type, obj.used, number, obj.group | 0xF0000000,
            obj.link, at if obj.offset is None else obj.offset,
            len(obj.data) if obj.size is None else obj.size, len(obj.data), 0, 0, 0, 0,
            obj.name, obj.extra)
    descriptors += b"\0" * (max(total, len(objects)) * DESCRIPTOR_SIZE - len(descriptors))
    used = sum(1 for o in objects if o.used)
    header = struct.pack(
        "<32s10s3s3s16s8q", launch, magic, version,
        arch_field if arch_field is not None else arch_code(header_arch), uuid.uuid4().bytes,
        1700000000, 1700000000, total - used if free is None else free, total, desc_offset,
        total * DESCRIPTOR_SIZE if desc_size is None else desc_size,
        real_data_offset if data_offset is None else data_offset,
        real_data_size if data_size is None else data_size)
    image = bytearray(header)
    image += b"\0" * (desc_offset - len(image))
    image += descriptors
    image += blob
    return bytes(image)


_HEADER_FIELDS = {"free": 80, "total": 88, "desc_offset": 96, "desc_size": 104,
                  "data_offset": 112, "data_size": 120}


def patch_header(image: bytes, **fields: int) -> bytes:
    """Overwrite int64 fields of a built image's global header (to make it lie)."""
    image = bytearray(image)
    for name, value in fields.items():
        struct.pack_into("<q", image, _HEADER_FIELDS[name], value)
    return bytes(image)


def header_fields(image: bytes) -> dict:
    return {name: struct.unpack_from("<q", image, at)[0] for name, at in _HEADER_FIELDS.items()}


def oci_sif(config: dict | None = None, *, index_platforms: list[dict] | None = None,
            configs: list[dict] | None = None, layer_bytes: int = 0) -> bytes:
    """An OCI-SIF image: a root index -> manifest(s) -> config(s), as SingularityCE 4 writes.

    `config` alone: a single-image root index whose entry has no platform (arch from the config).
    `configs` + `index_platforms`: a multi-platform index whose entries carry those platforms.
    `layer_bytes`: a layer blob of that size first, so the JSON lies that far into the file.
    """
    configs = configs if configs is not None else [config or {"architecture": "amd64", "os": "linux"}]
    blobs, entries = [], []
    if layer_bytes:
        blobs.append(oci_blob((bytes(range(256)) * (layer_bytes // 256 + 1))[:layer_bytes]))
    for number, cfg in enumerate(configs):
        config_bytes = json.dumps(cfg).encode()
        config_blob = oci_blob(config_bytes)
        manifest = json.dumps({
            "schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
            "config": {"mediaType": "application/vnd.oci.image.config.v1+json",
                       "digest": sha256_digest(config_bytes), "size": len(config_bytes)},
            "layers": []}).encode()
        blobs += [config_blob, oci_blob(manifest)]
        entry = {"mediaType": "application/vnd.oci.image.manifest.v1+json",
                 "digest": sha256_digest(manifest), "size": len(manifest)}
        if index_platforms is not None:
            entry["platform"] = index_platforms[number]
        entries.append(entry)
    index = json.dumps({"schemaVersion": 2, "mediaType": "application/vnd.oci.image.index.v1+json",
                        "manifests": entries}).encode()
    return write_sif(blobs + [oci_blob(index, root_index=True)], total=len(blobs) + 1)


# ---------------------------------------------------------------------------------------------
# The corpus's shapes, made here


@dataclass(frozen=True)
class Shape:
    """What the reader answers for a generated file, and the corpus files of the same shape."""
    platforms: frozenset[str] | None     # None: the reader raises SIFError matching `error`
    source: str | None
    stands_for: tuple[str, ...]
    error: str = ""


NINE_PLATFORMS = [{"os": "linux", "architecture": a, **({"variant": v} if v else {})}
                  for a, v in (("386", ""), ("amd64", ""), ("arm", "v5"), ("arm", "v7"),
                               ("arm64", "v8"), ("mips64le", ""), ("ppc64le", ""),
                               ("riscv64", ""), ("s390x", ""))]
MISSING_MANIFEST = "sha256:" + "ab" * 32

GENERATED = {
    "siftool-amd64.sif": Shape(frozenset({"linux/amd64"}), "sif-primary-partition",
                               ("busybox_amd64.sif",)),
    "siftool-arm64.sif": Shape(frozenset({"linux/arm64"}), "sif-primary-partition",
                               ("busybox_arm64.sif",)),
    "siftool-ppc64le-aligned.sif": Shape(frozenset({"linux/ppc64le"}), "sif-primary-partition",
                                         ("busybox_ppc64le.sif",)),
    "siftool-one-group.sif": Shape(frozenset({"linux/386"}), "sif-primary-partition",
                                   ("one-group.sif",)),
    "siftool-one-group-signed.sif": Shape(frozenset({"linux/386"}), "sif-primary-partition",
                                          ("one-group-signed-pgp.sif",)),
    "siftool-two-groups.sif": Shape(frozenset({"linux/386"}), "sif-primary-partition",
                                    ("two-groups.sif",)),
    "siftool-empty.sif": Shape(frozenset(), "sif-unknown", ("empty.sif",)),
    "siftool-empty-launch-script.sif": Shape(frozenset(), "sif-unknown", ("empty-launch-script.sif",)),
    "siftool-generic-json.sif": Shape(frozenset(), "sif-unknown", ("one-object-generic-json.sif",)),
    "single.oci.sif": Shape(frozenset({"linux/arm64"}), "oci-sif",
                            ("docker-manifest.oci.sif", "image-defaults.oci.sif")),
    "index-past-first-block.oci.sif": Shape(
        frozenset({"linux/386", "linux/amd64", "linux/arm/v5", "linux/arm/v7", "linux/arm64",
                   "linux/mips64le", "linux/ppc64le", "linux/riscv64", "linux/s390x"}),
        "oci-sif", ("docker-manifest-list.oci.sif",)),
    "pre-sif-squashfs.img": Shape(frozenset(), "pre-sif", ("legacy-squashfs.v4.img",)),
    "root-index-without-blobs.sif": Shape(None, None, ("one-object-oci-root-index.sif",),
                                          f"missing blob '{MISSING_MANIFEST}'"),
}


def generated_corpus(workdir: str) -> dict[str, str]:
    """name -> path of every file of GENERATED, made in `workdir` (once)."""
    paths = {name: os.path.join(workdir, name) for name in GENERATED}
    if all(os.path.exists(p) for p in paths.values()):
        return paths
    siftool_image(workdir, "siftool-amd64.sif", "amd64")
    siftool_image(workdir, "siftool-arm64.sif", "arm64")
    siftool_image(workdir, "siftool-ppc64le-aligned.sif", "ppc64le", alignment=65536)
    siftool_image(workdir, "siftool-one-group.sif", "386", system_arch="386", system_group=1,
                  raw_system=True)
    siftool_image(workdir, "siftool-one-group-signed.sif", "386", system_arch="386",
                  system_group=1, raw_system=True, signed=True)
    siftool_image(workdir, "siftool-two-groups.sif", "386", system_arch="amd64")
    siftool_image(workdir, "siftool-empty.sif", None)
    with open(siftool_image(workdir, "siftool-empty-launch-script.sif", None), "r+b") as f:
        f.write(b"#!/usr/bin/env run-script\n")          # the 32-byte launch field
    siftool_image(workdir, "siftool-generic-json.sif", None, generic_json=b'{"one": "object"}')
    written = {
        "single.oci.sif": oci_sif({"architecture": "arm64", "variant": "v8", "os": "linux"}),
        # a layer first puts the JSON past the first 32 KiB a BlockReader fetches
        "index-past-first-block.oci.sif": oci_sif(
            configs=[{"architecture": p["architecture"], "os": "linux"} for p in NINE_PLATFORMS],
            index_platforms=NINE_PLATFORMS, layer_bytes=40000),
        # default table: the index starts at 32176 and runs past the first 32 KiB
        "root-index-without-blobs.sif": write_sif([oci_blob(json.dumps({
            "schemaVersion": 2, "manifests": [{
                "digest": MISSING_MANIFEST, "size": 525,
                "annotations": {"org.opencontainers.image.ref.name": "x" * 700}}]}).encode(),
            root_index=True)]),
    }
    with open(make_squashfs(workdir), "rb") as f:
        written["pre-sif-squashfs.img"] = f.read()
    for name, data in written.items():
        with open(paths[name], "wb") as f:
            f.write(data)
    return paths
