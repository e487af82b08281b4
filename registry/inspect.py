"""`archway inspect IMAGE...`: which architectures does this image support?"""
import dataclasses
import json
import os
import sys

from . import sif
from archway.errors import ArchwayError
from .model import ImageInfo
from .reference import redact_url
from .resolver import Resolver


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
    parser.add_argument("--timeout", type=float, default=30.0, metavar="SECONDS",
                        help="overall time limit (default 30)")
    parser.set_defaults(func=run)


def run(args) -> int:
    from archway.config import load_config  # the config file format is shared with the server

    config = load_config(args.config)
    remote = [image for image in args.images if not os.path.isfile(image)]
    resolver = Resolver(config.registry, sif=config.sif)
    # A lookup may outlive an admission's deadline to fill the cache; a command has no cache to
    # fill, and its process cannot exit while a lookup runs: none outlives --timeout.
    resolver.fetch_timeout = min(resolver.fetch_timeout, args.timeout)
    results = resolver.resolve_many(remote, timeout=args.timeout) if remote else {}
    answers = [_local_file(image) if os.path.isfile(image) else results[image]
               for image in args.images]
    rows = [_redacted(image, row) for image, row in zip(args.images, answers)]
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
    try:
        found = sif.read_sif_platforms(sif.file_reader(path))
    except OSError as e:
        return ArchwayError(f"cannot read {path}: {e.strerror}")
    except ArchwayError as e:
        return e
    return ImageInfo(path, found.platforms, None, f"file:{found.source}", found.note)


def _to_json(image: str, row) -> dict:
    if isinstance(row, ImageInfo):
        return row.to_json()
    return {"image": image, "architectures": [], "platforms": [], "digest": None,
            "source": None, "note": None, "error": str(row)}


def _to_text(image: str, row) -> str:
    if not isinstance(row, ImageInfo):
        return f"{image}\n  error:         {row}\n"
    archs = " ".join(sorted(row.architectures)) or "unknown"
    lines = [image, f"  architectures: {archs}"]
    if row.platforms:
        lines.append(f"  platforms:     {' '.join(sorted(str(p) for p in row.platforms))}")
    if row.note:
        lines.append(f"  note:          {row.note}")
    lines += [f"  digest:        {row.digest or '-'}", f"  source:        {row.source}", ""]
    return "\n".join(lines)
