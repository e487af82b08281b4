"""`archway inspect IMAGE...`: which architectures does this image support?

Also the helpers every command that resolves images shares (`explain`, `report`): the
`--timeout` type and the normalised reference shown next to what the user wrote. The wall-clock
bound itself is the resolver's: `resolve_many` returns at its timeout, lookups run on daemon
threads, and archway.main.cli exits without waiting for them.
"""
import argparse
import dataclasses
import json
import os
import sys

from archway.errors import ArchwayError
from archway.logsafe import redact_url

from . import sif
from .http import HttpClient
from .imageref import PATH_PREFIXES
from .model import ImageInfo
from .reference import KINDS, parse_reference
from .resolver import Resolver


def positive_seconds(text: str) -> float:
    """argparse type of --timeout: a number of seconds above 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a number of seconds above 0, got {text}")
    return value


def normalized(image: str) -> str | None:
    """The reference as archway reads it (`nginx` -> `docker.io/library/nginx:latest`); None
    when it cannot be parsed (the resolution's own error then says why)."""
    try:
        return str(parse_reference(image))
    except ArchwayError:
        return None


def pinned(image: str, digest: str | None) -> str | None:
    """`name@digest`, the reference that always names the bytes that were read
    (`nginx` + sha256:... -> `docker.io/library/nginx@sha256:...`): what to put in a manifest.
    None without a digest, or where a digest is no reference (https:// files, library://)."""
    if not digest or ":" not in digest:
        return None
    try:
        reference = parse_reference(image)
    except ArchwayError:
        return None
    if KINDS[reference.scheme].head_digest is None:   # a file, a library image: no name@digest
        return None
    return str(dataclasses.replace(reference, tag=None, digest=digest))


def looks_like_path(image: str) -> bool:
    """A local SIF file rather than a reference: an explicit path, or a *.sif name."""
    return "://" not in image and (image.startswith(PATH_PREFIXES) or image.endswith(".sif"))


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "inspect", help="print the platforms each image supports",
        description="Print, for each image, the platforms it supports, the digest it resolved to "
                    "and where the answer came from. IMAGE is a registry reference (nginx, "
                    "ghcr.io/org/app:v1, ...@sha256:...), oras://, library://, an https:// URL of "
                    "a SIF file, or a local SIF file path. Exit status 0 when every image "
                    "resolved, 1 otherwise.")
    parser.add_argument("images", nargs="+", metavar="IMAGE")
    parser.add_argument("--json", action="store_true", help="print a JSON list")
    parser.add_argument("--timeout", type=positive_seconds, default=30.0, metavar="SECONDS",
                        help="overall wall-clock limit for all images (default 30)")
    parser.set_defaults(func=run)


def run(args) -> int:
    from archway.config import load_config  # the config file format is shared with the server

    config = load_config(args.config)
    # Written as a path, never found as one: `archway inspect nginx` asks the registry even
    # where a file named nginx is in the current directory.
    local = {image for image in args.images if looks_like_path(image)}
    remote = [image for image in args.images if image not in local]
    # The images the operator typed: loopback and the cluster's addresses are theirs to ask
    # about (registry.hostpolicy refuses them for references a pod's author wrote).
    resolver = Resolver(config.registry, sif=config.sif,
                        http=HttpClient(config.registry, refuse_cluster=False))
    results = resolver.resolve_many(remote, timeout=args.timeout) if remote else {}
    rows = [_redacted(image, _local_file(image) if image in local else results[image])
            for image in args.images]
    if args.json:
        json.dump([_to_json(image, row) for image, row in rows], sys.stdout, indent=2)
        print()
    else:
        for image, row in rows:
            print(_to_text(image, row))
    return 0 if all(isinstance(row, ImageInfo) for _, row in rows) else 1


def _redacted(image: str, row: ImageInfo | ArchwayError) -> tuple[str, ImageInfo | ArchwayError]:
    """The row as shown: no user:password of an https:// reference, in its name or its error."""
    shown = redact_url(image)
    if shown == image:
        return image, row
    if isinstance(row, ImageInfo):
        return shown, dataclasses.replace(row, image=shown)
    return shown, ArchwayError(str(row).replace(image, shown))


def _local_file(path: str) -> ImageInfo | ArchwayError:
    if not os.path.exists(os.path.expanduser(path)):
        return ArchwayError(f"no such file: {path}")
    path = os.path.expanduser(path)
    if not os.path.isfile(path):
        return ArchwayError(f"not a file: {path}")
    try:
        found = sif.read_sif_platforms(sif.file_reader(path))
    except OSError as e:
        return ArchwayError(f"cannot read {path}: {e.strerror}")
    except ArchwayError as e:
        return e
    return ImageInfo(path, found.platforms, None, f"file:{found.source}", found.note)


def _reference(image: str, row) -> str | None:
    if isinstance(row, ImageInfo) and row.source.startswith("file:"):
        return None
    return None if looks_like_path(image) else normalized(image)


def _to_json(image: str, row) -> dict:
    if isinstance(row, ImageInfo):
        return {**row.to_json(), "reference": _reference(image, row),
                "pinned": pinned(image, row.digest)}
    return {"image": image, "reference": _reference(image, row), "architectures": [],
            "architectures_by_os": {}, "platforms": [], "digest": None, "source": None,
            "note": None, "error": str(row), "pinned": None}


def _to_text(image: str, row) -> str:
    reference = _reference(image, row)
    shown = [f"  reference:     {reference}"] if reference and reference != image else []
    if not isinstance(row, ImageInfo):
        return "\n".join([image, *shown, f"  error:         {row}", ""])
    by_os = row.architectures_by_os()
    if not by_os:
        archs = "unknown"
    elif list(by_os) == ["linux"]:
        archs = " ".join(by_os["linux"])
    else:   # a Windows or mixed-OS image: which architectures a pod of each OS gets
        archs = "; ".join(f"{os_name}: {' '.join(found)}" for os_name, found in by_os.items())
    lines = [image, *shown, f"  architectures: {archs}"]
    if row.platforms:
        lines.append(f"  platforms:     {' '.join(sorted(str(p) for p in row.platforms))}")
    if row.note:
        lines.append(f"  note:          {row.note}")
    lines += [f"  digest:        {pinned(image, row.digest) or row.digest or '-'}",
              f"  source:        {row.source}", ""]
    return "\n".join(lines)
