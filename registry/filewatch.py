"""A file (or directory of files) whose parsed content follows what is on disk, without a restart.

Kubernetes updates a mounted Secret or ConfigMap in place: it writes a new directory and swaps a
symlink to it. A stat of the path follows the link, so (inode, mtime, size) change with every
update; one stat per use is all it costs to notice.
"""
import logging
import os
import threading

from archway.errors import ArchwayError

log = logging.getLogger(__name__)
_UNSET = object()


class WatchedFile:
    """`get()` is `parse(path)`, parsed again whenever the path changes on disk.

    An update that cannot be parsed (a half-written file, a typo) keeps the last good content and
    logs a warning once; the first read raises, so a broken file is refused at start-up.
    """

    def __init__(self, path: str, parse, *, what: str):
        self.path = os.path.expanduser(path)
        self.what = what               # for log lines: "registry.credentials_file"
        self._parse = parse
        self._lock = threading.Lock()
        self._signature = _UNSET
        self._value = _UNSET

    def get(self):
        signature = _signature(self.path)
        if signature == self._signature:
            return self._value
        with self._lock:
            if signature == self._signature:
                return self._value
            try:
                value = self._parse(self.path)
            except ArchwayError as e:
                if self._value is _UNSET:
                    raise
                log.warning("%s %s changed on disk but cannot be used (%s); keeping the previous "
                            "version", self.what, self.path, e)
                self._signature = signature
                return self._value
            if self._value is not _UNSET:
                log.info("%s %s changed on disk: re-read", self.what, self.path)
            self._signature, self._value = signature, value
            return value


def _signature(path: str):
    """What changes when the content does: the file's stat, or every entry's for a directory."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    if not os.path.isdir(path):
        return st.st_ino, st.st_mtime_ns, st.st_size
    entries = []
    try:
        names = sorted(os.listdir(path))
    except OSError:
        return None
    for name in names:
        entries.append((name, _signature(os.path.join(path, name)) if not name.startswith("..")
                        else None))
    return st.st_ino, st.st_mtime_ns, tuple(entries)
