"""Writing certificate files safely: private directories and atomic, permission-correct writes."""
import os
import tempfile

PRIVATE_FILE = 0o600   # private keys
PUBLIC_FILE = 0o644    # certificates
PRIVATE_DIR = 0o700


def ensure_private_dir(path: str) -> str:
    """Create `path` (and parents) and make it 0700, even if it existed with wider permissions."""
    os.makedirs(path, mode=PRIVATE_DIR, exist_ok=True)
    os.chmod(path, PRIVATE_DIR)
    return path


def write_atomic(path: str, data: bytes, mode: int) -> None:
    """Write `data` to `path` so a reader sees the old content or the new, never a partial file,
    and the file never exists with wider permissions than `mode` (mkstemp creates it 0600)."""
    directory = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=f".{os.path.basename(path)}.")
    try:
        with os.fdopen(fd, "wb") as f:
            os.fchmod(f.fileno(), mode)
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
