"""Build SIF images for tests.

Two ways, on purpose:
- `siftool_image()`: Debian's `siftool` (the sylabs/sif reference writer) around a real squashfs
  made by `mksquashfs`: what real users' images look like.
- `write_sif()`: a tiny pure-Python writer (test-only) whose every header and descriptor field can
  be overridden, so property tests can produce headers that lie.
"""
import hashlib
import json
import os
import struct
import subprocess
import uuid
from dataclasses import dataclass

from .procs import require_binary

HEADER_SIZE = 128
DESCRIPTOR_SIZE = 585
DEFAULT_TOTAL = 48
DEFAULT_DESC_OFFSET = 4096
LAUNCH_SCRIPT = b"#!/usr/bin/env run-singularity\n"

# siftool --partarch numbers and the SIF header codes ("%02d" of the same number).
ARCH_NUMBERS = {"386": 1, "amd64": 2, "arm": 3, "arm64": 4, "ppc64": 5, "ppc64le": 6, "mips": 7,
                "mipsle": 8, "mips64": 9, "mips64le": 10, "s390x": 11, "riscv64": 12}
DATA_PARTITION, DATA_GENERIC_JSON, DATA_OCI_ROOT_INDEX, DATA_OCI_BLOB = 0x4004, 0x4006, 0x400A, 0x400B
FS_SQUASHFS, FS_EXT3 = 1, 2
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


def siftool_image(workdir: str, name: str, primary_arch: str, *, system_arch: str | None = None) -> str:
    """`siftool new` + a primary-system squashfs partition of `primary_arch`; with `system_arch`,
    first a plain system partition of another arch (in its own group), like two-groups.sif."""
    siftool = require_binary("siftool")
    squashfs = make_squashfs(workdir)
    path = os.path.join(workdir, name)
    if os.path.exists(path):
        os.unlink(path)
    subprocess.run([siftool, "new", path], check=True, capture_output=True)
    if system_arch:
        _siftool_add(siftool, path, squashfs, PART_SYSTEM, system_arch, group=2)
    _siftool_add(siftool, path, squashfs, PART_PRIMARY, primary_arch, group=1)
    return path


def _siftool_add(siftool, path, squashfs, parttype, arch, group):
    subprocess.run([siftool, "add", path, squashfs, "--datatype", "4", "--parttype", str(parttype),
                    "--partfs", "1", "--partarch", str(ARCH_NUMBERS[arch]), "--groupid", str(group)],
                   check=True, capture_output=True)


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
    digest = digest or "sha256:" + hashlib.sha256(data).hexdigest()
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
            configs: list[dict] | None = None) -> bytes:
    """An OCI-SIF image: a root index -> manifest(s) -> config(s), as SingularityCE 4 writes.

    `config` alone: a single-image root index whose entry has no platform (arch from the config).
    `configs` + `index_platforms`: a multi-platform index whose entries carry those platforms.
    """
    configs = configs if configs is not None else [config or {"architecture": "amd64", "os": "linux"}]
    blobs, entries = [], []
    for number, cfg in enumerate(configs):
        config_bytes = json.dumps(cfg).encode()
        config_blob = oci_blob(config_bytes)
        manifest = json.dumps({
            "schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
            "config": {"mediaType": "application/vnd.oci.image.config.v1+json",
                       "digest": _digest(config_bytes), "size": len(config_bytes)},
            "layers": []}).encode()
        blobs += [config_blob, oci_blob(manifest)]
        entry = {"mediaType": "application/vnd.oci.image.manifest.v1+json",
                 "digest": _digest(manifest), "size": len(manifest)}
        if index_platforms is not None:
            entry["platform"] = index_platforms[number]
        entries.append(entry)
    index = json.dumps({"schemaVersion": 2, "mediaType": "application/vnd.oci.image.index.v1+json",
                        "manifests": entries}).encode()
    return write_sif(blobs + [oci_blob(index, root_index=True)], total=len(blobs) + 1)


def _digest(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()
