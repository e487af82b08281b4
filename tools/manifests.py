"""The manifests `archway explain -f` reads: a file, every manifest under a directory, or
stdin, all of them together bounded in size, parsed as multi-document YAML (JSON is YAML)."""
import os
import sys

import yaml

from archway.errors import ArchwayError

MAX_MANIFEST_BYTES = 64 * 1024 * 1024


def load_manifests(text: str, origin: str) -> list:
    """Multi-document YAML (JSON is YAML); ArchwayError when it does not parse."""
    try:
        return [doc for doc in yaml.safe_load_all(text) if doc is not None]
    except yaml.YAMLError as e:
        raise ArchwayError(f"{origin} is not valid YAML or JSON: {e}") from None


MANIFEST_SUFFIXES = (".yaml", ".yml", ".json")


def manifest_files(directory: str) -> list[str]:
    """Every *.yaml, *.yml and *.json under `directory`, sorted by path; hidden files and
    directories (.git) skipped."""
    found = []
    for root, dirs, files in os.walk(directory):
        dirs[:] = [d for d in dirs if not d.startswith(".")]
        found += [os.path.join(root, name) for name in files
                  if name.endswith(MANIFEST_SUFFIXES) and not name.startswith(".")]
    return sorted(found)


def read_sources(path: str) -> list[tuple[str, str]]:
    """(text, origin) of each manifest file of -f PATH: a file, a directory (every manifest
    under it) or - (stdin); all of them together bounded in size."""
    if path != "-" and os.path.isdir(path):
        files = manifest_files(path)
        if not files:
            raise ArchwayError(f"no *.yaml, *.yml or *.json file under {path}")
    else:
        files = [path]
    sources, size = [], 0
    for file in files:
        text, origin = read_source(file, MAX_MANIFEST_BYTES - size)
        size += len(text)
        sources.append((text, origin))
    return sources


def read_source(path: str, limit: int = MAX_MANIFEST_BYTES) -> tuple[str, str]:
    """(text, origin) of one file or - (stdin), at most `limit` characters."""
    if path == "-":
        text, origin = sys.stdin.read(limit + 1), "stdin"
    else:
        try:
            with open(path, encoding="utf-8") as f:
                text = f.read(limit + 1)
        except FileNotFoundError:
            raise ArchwayError(f"no such file: {path}") from None
        except (OSError, UnicodeDecodeError) as e:
            raise ArchwayError(f"cannot read {path}: {getattr(e, 'strerror', None) or e}") from None
        origin = path
    if len(text) > limit:
        raise ArchwayError(f"{origin} makes the manifests larger than {MAX_MANIFEST_BYTES} bytes")
    return text, origin
