"""A process's status, written for other processes to read (the supervisor's for the workers'
/readyz, the trust path's check for the same): JSON, replaced whole."""
import json
import os


def write_status(path: str, status: dict) -> None:
    """Write `status` to `path` as JSON so a reader sees the old file or the new, never half
    (a temporary file beside it, then a rename); OSError as the filesystem raises it."""
    temporary = f"{path}.{os.getpid()}.tmp"
    with open(temporary, "w", encoding="utf-8") as f:
        json.dump(status, f)
    os.replace(temporary, path)
