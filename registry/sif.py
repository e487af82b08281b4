"""Learn the CPU architecture of a SIF (Singularity/Apptainer) image from its header.

A pure parser: it gets a `read(offset, length) -> bytes` callable (a local file, or HTTP Range
requests through `BlockReader`) and reads only what it needs: the 128-byte global header, the
descriptor table, and for OCI-SIF images the few small JSON blobs (root index, manifests, configs)
that name the architecture. Layout: ../shared/spec/wire-formats.md section 1.

Which arch wins: the primary-system partition's (the runtime checks that one), else, for OCI-SIF,
the OCI config inside, else the global header; "00" means unknown. Anything malformed raises
SIFError with a message saying what is wrong, never a bare IndexError/struct.error/UnicodeError.
"""
import hashlib
import json
import re
import struct
from collections.abc import Callable
from dataclasses import dataclass

from archway.errors import SIFError

from .platforms import Platform, is_attestation, normalize

Read = Callable[[int, int], bytes]

HEADER_SIZE = 128
DESCRIPTOR_SIZE = 585
SIF_MAGIC = b"SIF_MAGIC\0"
SIF_VERSION = b"01\0"
MAX_DESCRIPTORS = 4096                  # 2.4 MB of table; real images have 48
MAX_JSON_BLOB = 4 * 1024 * 1024         # an OCI manifest is at most 4 MiB by spec
MAX_JSON_TOTAL = 8 * 1024 * 1024        # all OCI JSON read for one image
MAX_OCI_BLOB_READS = 64                 # root index + manifests + configs, whatever the nesting
MAX_OCI_DEPTH = 4                       # root index -> nested index -> manifest -> config
INT64_MAX = 2 ** 63 - 1

DATA_PARTITION = 0x4004
DATA_OCI_ROOT_INDEX = 0x400A
DATA_OCI_BLOB = 0x400B
PARTTYPE_PRIMARY_SYSTEM = 2

# SIF arch codes -> GOARCH (the kubernetes.io/arch value). "00" is "unknown".
ARCH_CODES = {
    "00": "", "01": "386", "02": "amd64", "03": "arm", "04": "arm64", "05": "ppc64",
    "06": "ppc64le", "07": "mips", "08": "mipsle", "09": "mips64", "10": "mips64le",
    "11": "s390x", "12": "riscv64", "13": "loong64",
}

_HEADER = struct.Struct("<32s10s3s3s16s8q")
_DESCRIPTOR = struct.Struct("<iBIIIqqqqqqq128s384s")
_DIGEST = re.compile(r"^[a-z0-9]+(?:[+._-][a-z0-9]+)*:[a-zA-Z0-9=_-]+$")
_SQUASHFS_MAGIC = b"hsqs"
_EXT_MAGIC = b"\x53\xef"
_EXT_MAGIC_OFFSET = 1080
PRE_SIF_NOTE = "pre-SIF image: no architecture recorded"
assert _HEADER.size == HEADER_SIZE and _DESCRIPTOR.size == DESCRIPTOR_SIZE


@dataclass(frozen=True)
class SifArch:
    """What a SIF image says about its architecture. Empty `platforms` = unknown; `note` says why."""
    platforms: frozenset[Platform]
    source: str     # sif-primary-partition | sif-header | oci-sif | sif-unknown | pre-sif
    note: str = ""


@dataclass(frozen=True)
class SifHeader:
    arch: str               # GOARCH, "" for unknown
    descriptors_free: int
    descriptors_total: int
    descriptors_offset: int
    descriptors_size: int
    data_offset: int
    data_size: int


@dataclass(frozen=True)
class Descriptor:
    index: int              # position in the table, for error messages
    data_type: int
    object_id: int
    offset: int
    size: int
    extra: bytes


# ---------------------------------------------------------------------------------------------
# Entry point


def read_sif_platforms(read: Read) -> SifArch:
    """The platforms a SIF (or pre-SIF) image records; SIFError when it is malformed."""
    head = _read(read, 0, HEADER_SIZE, "the global header", allow_short=True)
    if head[32:42] != SIF_MAGIC:
        return _pre_sif(read, head)
    if len(head) < HEADER_SIZE:
        raise SIFError(f"truncated SIF image: the global header needs {HEADER_SIZE} bytes, "
                       f"the image has {len(head)}")
    header = parse_header(head)
    table = read_descriptor_table(read, header)
    descriptors = parse_descriptors(table, header)
    return _decide(read, header, descriptors)


def _decide(read: Read, header: SifHeader, descriptors: list[Descriptor]) -> SifArch:
    primary = [d for d in descriptors
               if d.data_type == DATA_PARTITION and partition_type(d) == PARTTYPE_PRIMARY_SYSTEM]
    if len(primary) > 1:
        raise SIFError(f"corrupt SIF image: {len(primary)} primary system partitions "
                       f"(objects {', '.join(str(d.object_id) for d in primary)}); there can be one")
    if primary:
        arch = partition_arch(primary[0])
        if arch:
            return SifArch(_linux(arch), "sif-primary-partition")
    if any(d.data_type == DATA_OCI_ROOT_INDEX for d in descriptors):
        return _oci_sif(read, descriptors)
    if header.arch:
        return SifArch(_linux(header.arch), "sif-header")
    why = ("its primary system partition and global header both say arch 00" if primary
           else "global header arch is 00 and there is no primary system partition")
    return SifArch(frozenset(), "sif-unknown", f"SIF image records no architecture: {why}")


def _linux(goarch: str) -> frozenset[Platform]:
    return frozenset({normalize("linux", goarch)})


# ---------------------------------------------------------------------------------------------
# Reading


def _read(read: Read, offset: int, length: int, what: str, allow_short: bool = False) -> bytes:
    """Call `read` and insist on exactly `length` bytes (a short answer means truncation)."""
    data = read(offset, length)
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise SIFError(f"reading {what}: the reader returned {type(data).__name__}, not bytes")
    data = bytes(data[:length])
    if len(data) < length and not allow_short:
        raise SIFError(f"truncated SIF image: {what} needs {length} bytes at offset {offset}, "
                       f"only {len(data)} are there")
    return data


def file_reader(path: str) -> Read:
    """A `read` callable over a local file (opened per call: the parser makes only a few)."""
    def read(offset: int, length: int) -> bytes:
        try:
            with open(path, "rb") as f:
                f.seek(offset)
                return f.read(length)
        except OSError as e:
            raise SIFError(f"cannot read {path}: {e.strerror or e}") from None
    return read


class BlockReader:
    """A `read` callable that fetches the first `first_block` bytes once and serves every read
    inside them from memory, so the header plus a default descriptor table (32176 bytes) cost a
    single ranged fetch. Reads past the block are fetched on demand (only the missing part).

    `fetch_range(offset, length)` returns the bytes at `offset`, fewer at the end of the data.
    """

    def __init__(self, fetch_range: Callable[[int, int], bytes], first_block: int = 32768):
        if first_block <= 0:
            raise ValueError("first_block must be positive")
        self._fetch_range = fetch_range
        self.first_block = first_block
        self._block: bytes | None = None
        self.bytes_fetched = 0
        self.fetches = 0

    def __call__(self, offset: int, length: int) -> bytes:
        if offset < 0 or length < 0:
            raise SIFError(f"invalid read of {length} bytes at offset {offset}")
        if length == 0:
            return b""
        end = offset + length
        if self._block is None and offset < self.first_block:
            self._block = self._fetch(0, self.first_block)
        block = self._block
        if block is None or offset >= len(block):
            if block is not None and len(block) < self.first_block:
                return b""  # the block ended early: that was the end of the data
            return self._fetch(offset, length)
        if end <= len(block) or len(block) < self.first_block:
            return block[offset:end]
        return block[offset:] + self._fetch(len(block), end - len(block))

    def _fetch(self, offset: int, length: int) -> bytes:
        data = self._fetch_range(offset, length)
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise SIFError(f"fetching {length} bytes at {offset}: got {type(data).__name__}")
        data = bytes(data[:length])
        self.fetches += 1
        self.bytes_fetched += len(data)
        return data


# ---------------------------------------------------------------------------------------------
# Header and descriptors (pure functions over bytes)


def parse_header(head: bytes) -> SifHeader:
    """Decode and check the 128-byte global header."""
    (_launch, magic, version, arch, _uuid, _created, _modified, free, total, desc_offset,
     desc_size, data_offset, data_size) = _HEADER.unpack(head[:HEADER_SIZE])
    if magic != SIF_MAGIC:
        raise SIFError("not a SIF image: no SIF_MAGIC at offset 32")
    if version != SIF_VERSION:
        raise SIFError(f"unsupported SIF version {_show(version)} (only 01 is defined)")
    header = SifHeader(arch_from_code(arch, "the global header"), free, total, desc_offset,
                       desc_size, data_offset, data_size)
    if not 0 <= total <= MAX_DESCRIPTORS:
        raise SIFError(f"corrupt SIF header: {total} descriptors (archway reads at most "
                       f"{MAX_DESCRIPTORS})")
    if not 0 <= free <= total:
        raise SIFError(f"corrupt SIF header: {free} free descriptors out of {total}")
    if desc_size != total * DESCRIPTOR_SIZE:
        raise SIFError(f"corrupt SIF header: descriptor table size {desc_size} is not "
                       f"{total} x {DESCRIPTOR_SIZE}")
    if desc_offset < HEADER_SIZE or desc_offset > INT64_MAX - desc_size:
        raise SIFError(f"corrupt SIF header: descriptor table offset {desc_offset} is outside "
                       f"the image")
    if data_offset < 0 or data_size < 0 or data_offset > INT64_MAX - data_size:
        raise SIFError(f"corrupt SIF header: data section offset {data_offset} size {data_size}")
    return header


def read_descriptor_table(read: Read, header: SifHeader) -> bytes:
    if header.descriptors_total == 0:
        return b""
    return _read(read, header.descriptors_offset, header.descriptors_size,
                 f"the descriptor table ({header.descriptors_total} descriptors)")


def parse_descriptors(table: bytes, header: SifHeader) -> list[Descriptor]:
    """The used descriptors, each checked to lie inside the header's data section."""
    data_end = header.data_offset + header.data_size
    used = []
    for index in range(header.descriptors_total):
        (data_type, is_used, object_id, _group, _link, offset, size, _padded, _created,
         _modified, _uid, _gid, _name, extra) = _DESCRIPTOR.unpack_from(table, index * DESCRIPTOR_SIZE)
        if not is_used:
            continue
        if offset < 0 or size < 0 or offset > INT64_MAX - size:
            raise SIFError(f"corrupt SIF descriptor {index}: offset {offset} size {size}")
        if offset < header.data_offset or offset + size > data_end:
            raise SIFError(f"corrupt SIF descriptor {index}: object at {offset}..{offset + size} "
                           f"lies outside the data section {header.data_offset}..{data_end}")
        used.append(Descriptor(index, data_type, object_id, offset, size, extra))
    return used


def arch_from_code(raw: bytes, where: str) -> str:
    """GOARCH for a 3-byte SIF arch field ("02\\0" -> "amd64"); "" for "00" (unknown)."""
    code = raw[:2].decode("ascii", "replace")
    if raw[2:3] != b"\0" or code not in ARCH_CODES:
        raise SIFError(f"corrupt SIF image: {where} has arch code {_show(raw)}, not one of "
                       f"00..{max(ARCH_CODES)}")
    return ARCH_CODES[code]


def partition_type(d: Descriptor) -> int:
    return int.from_bytes(d.extra[4:8], "little", signed=True)


def partition_arch(d: Descriptor) -> str:
    return arch_from_code(d.extra[8:11], f"partition object {d.object_id}")


def descriptor_digest(d: Descriptor) -> str:
    """The `sha256:<hex>` an OCI blob / root index descriptor carries in its extra field."""
    raw = d.extra.split(b"\0", 1)[0]
    try:
        digest = raw.decode("ascii")
    except UnicodeDecodeError:
        digest = ""
    if not _DIGEST.match(digest):
        raise SIFError(f"corrupt SIF descriptor {d.index}: OCI object without a valid digest "
                       f"({_show(raw[:80])})")
    return digest


def _show(raw: bytes) -> str:
    return repr(bytes(raw).rstrip(b"\0").decode("ascii", "backslashreplace"))


# ---------------------------------------------------------------------------------------------
# Pre-SIF images (Singularity 2.x): a bare squashfs or ext3 image, maybe after a launch line


def _pre_sif(read: Read, head: bytes) -> SifArch:
    start = 0
    if head.startswith(b"#!"):
        newline = head.find(b"\n")
        start = newline + 1 if newline >= 0 else len(head)
    if head[start:start + 4] == _SQUASHFS_MAGIC:
        return SifArch(frozenset(), "pre-sif", PRE_SIF_NOTE + " (squashfs)")
    # anything shorter than a header cannot hold an ext3 superblock
    if len(head) == HEADER_SIZE and _read(read, start + _EXT_MAGIC_OFFSET, 2, "the ext3 magic",
                                          allow_short=True) == _EXT_MAGIC:
        return SifArch(frozenset(), "pre-sif", PRE_SIF_NOTE + " (ext3)")
    if len(head) < 42:
        raise SIFError(f"not a SIF image: only {len(head)} bytes, a SIF header is {HEADER_SIZE}")
    raise SIFError(f"not a SIF image: no SIF_MAGIC at offset 32 (the image starts with "
                   f"{head[:8].hex()}), nor a squashfs or ext3 pre-SIF image")


# ---------------------------------------------------------------------------------------------
# OCI-SIF (SingularityCE 4): the arch is in the OCI config, reached from the root index


class _OciBlobs:
    """The OCI blobs of one SIF image by digest, read within a total byte and count budget."""

    def __init__(self, read: Read, descriptors: list[Descriptor]):
        self._read = read
        self._by_digest: dict[str, Descriptor] = {}
        for d in descriptors:
            if d.data_type in (DATA_OCI_BLOB, DATA_OCI_ROOT_INDEX):
                self._by_digest.setdefault(descriptor_digest(d), d)
        self.bytes_read = 0
        self.reads = 0

    def require(self, digest, named_by: str) -> Descriptor:
        if not isinstance(digest, str) or digest not in self._by_digest:
            raise SIFError(f"OCI-SIF image is missing blob {digest!r} named by {named_by}")
        return self._by_digest[digest]

    def json(self, d: Descriptor, what: str) -> dict:
        digest = descriptor_digest(d)
        if d.size > MAX_JSON_BLOB:
            raise SIFError(f"OCI-SIF {what} {digest} is {d.size} bytes, more than the "
                           f"{MAX_JSON_BLOB} archway reads")
        if self.bytes_read + d.size > MAX_JSON_TOTAL or self.reads >= MAX_OCI_BLOB_READS:
            raise SIFError(f"OCI-SIF image needs more than {MAX_OCI_BLOB_READS} JSON blobs or "
                           f"{MAX_JSON_TOTAL} bytes of them to name its architecture")
        self.reads += 1
        self.bytes_read += d.size
        body = _read(self._read, d.offset, d.size, f"OCI {what} {digest}")
        algorithm, _, expected = digest.partition(":")
        if algorithm == "sha256" and hashlib.sha256(body).hexdigest() != expected:
            raise SIFError(f"OCI-SIF {what} does not match its digest {digest}")
        try:
            document = json.loads(body)
        except (ValueError, RecursionError) as e:  # UnicodeDecodeError is a ValueError
            raise SIFError(f"OCI-SIF {what} {digest} is not valid JSON: {str(e)[:120]}") from None
        if not isinstance(document, dict):
            raise SIFError(f"OCI-SIF {what} {digest} is not a JSON object")
        return document


def _oci_sif(read: Read, descriptors: list[Descriptor]) -> SifArch:
    roots = [d for d in descriptors if d.data_type == DATA_OCI_ROOT_INDEX]
    if len(roots) > 1:
        raise SIFError(f"corrupt OCI-SIF image: {len(roots)} OCI root indexes; there can be one")
    blobs = _OciBlobs(read, descriptors)
    root = blobs.json(roots[0], "root index")
    platforms = frozenset(_platforms_of(root, blobs, "the root index", depth=0))
    if not platforms:
        return SifArch(frozenset(), "oci-sif",
                       "OCI-SIF image: its OCI index and config record no architecture")
    return SifArch(platforms, "oci-sif")


def _platforms_of(document: dict, blobs: _OciBlobs, what: str, depth: int) -> list[Platform]:
    if depth > MAX_OCI_DEPTH:
        raise SIFError(f"OCI-SIF image nests indexes more than {MAX_OCI_DEPTH} deep")
    if "manifests" in document:
        return _index_platforms(document, blobs, what, depth)
    if "config" in document:
        config_ref = document["config"]
        if not isinstance(config_ref, dict):
            raise SIFError(f"OCI-SIF {what}: `config` is not an object")
        config = blobs.json(blobs.require(config_ref.get("digest"), what), "image config")
        platform = _platform_of(config, "image config")
        return [platform] if platform else []
    raise SIFError(f"OCI-SIF {what} is neither an OCI index nor an image manifest")


def _index_platforms(index: dict, blobs: _OciBlobs, what: str, depth: int) -> list[Platform]:
    entries = index["manifests"]
    if not isinstance(entries, list) or not all(isinstance(e, dict) for e in entries):
        raise SIFError(f"OCI-SIF {what}: `manifests` is not a list of objects")
    platforms = []
    for entry in entries:
        if is_attestation(entry):
            continue
        manifest = blobs.require(entry.get("digest"), what)  # absent blobs are an error either way
        declared = entry.get("platform")
        if declared is not None:
            # The index already says the platform, as registries use it: no need to read further.
            platform = _platform_of(declared, f"{what} entry")
            if platform:
                platforms.append(platform)
            continue
        document = blobs.json(manifest, "manifest")
        platforms += _platforms_of(document, blobs, f"manifest {entry.get('digest')}", depth + 1)
    return platforms


def _platform_of(fields, what: str) -> Platform | None:
    """os/architecture/variant of an index entry's `platform` or an image config."""
    if not isinstance(fields, dict):
        raise SIFError(f"OCI-SIF {what}: platform is not a JSON object")
    values = [fields.get(k) for k in ("os", "architecture", "variant")]
    if not all(v is None or isinstance(v, str) for v in values):
        raise SIFError(f"OCI-SIF {what}: os/architecture/variant must be strings")
    os_name, arch, variant = values
    if not arch:
        return None
    return normalize(os_name or "linux", arch, variant)  # SIF images are Linux images
