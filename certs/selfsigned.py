"""The embedded default: with no certificate configured, `archway serve` makes its own.

A small CA plus a serving certificate signed by it (rather than one self-signed leaf): clients
trust `ca.crt` once (`curl --cacert <state_dir>/tls/ca.crt`) and keep trusting it when the serving
certificate is renewed. Files live in `<state_dir>/tls/` (0700): ca.crt, ca.key (0600), tls.crt,
tls.key (0600). Generated once, reused while valid, regenerated when expiring, unreadable or not
covering the requested hosts. Several gunicorn workers may call this at once: a lock file
serialises them and every file is replaced atomically.
"""
import datetime as dt
import fcntl
import logging
import os
from typing import NamedTuple

from .files import PRIVATE_FILE, PUBLIC_FILE, ensure_private_dir, write_atomic
from .x509 import (
    CertificateError,
    Issued,
    describe,
    hosts_of,
    is_issued_by,
    issue_ca,
    issue_serving_cert,
    load_issued_files,
    normalize_hosts,
    remaining,
    utcnow,
)

log = logging.getLogger(__name__)

DEFAULT_HOSTS = ("localhost", "127.0.0.1", "::1")
CA_DAYS = 3650
CERT_DAYS = 365
RENEW_BEFORE = dt.timedelta(days=7)


class SelfSignedFiles(NamedTuple):
    """Unpacks as (cert_path, key_path); `ca_path` is what clients pass to `curl --cacert`."""
    cert_path: str
    key_path: str

    @property
    def ca_path(self) -> str:
        return os.path.join(os.path.dirname(self.cert_path), "ca.crt")


def tls_dir(state_dir: str) -> str:
    return os.path.join(os.path.expanduser(state_dir), "tls")


def ensure_self_signed(state_dir: str, hosts=DEFAULT_HOSTS, *,
                       now: dt.datetime | None = None) -> SelfSignedFiles:
    """Paths of a valid serving pair for `hosts` in `state_dir`, generating it if needed."""
    now = now or utcnow()
    wanted = list(dict.fromkeys(hosts))
    directory = tls_dir(state_dir)
    state = os.path.expanduser(state_dir)
    if not os.path.isdir(state):
        os.makedirs(state, mode=0o700, exist_ok=True)
    ensure_private_dir(directory)
    p = _paths(directory)
    with _locked(os.path.join(directory, ".lock")):
        ca = _usable_ca(p, now)
        if ca is not None and _serving_is_usable(p, ca, normalize_hosts(wanted), now):
            return SelfSignedFiles(p["cert"], p["key"])
        if ca is None:
            ca = issue_ca("archway local CA", days=CA_DAYS, now=now)
            write_atomic(p["ca_key"], ca.key_pem, PRIVATE_FILE)
            write_atomic(p["ca"], ca.cert_pem, PUBLIC_FILE)
            log.info("generated a local CA %s", describe(ca.cert))
        leaf = issue_serving_cert(ca, wanted, days=CERT_DAYS, now=now)
        # Key first, then certificate: a reloading server that reads in between sees a key
        # that does not match and keeps its previous pair (see certs/tls.py).
        write_atomic(p["key"], leaf.key_pem, PRIVATE_FILE)
        write_atomic(p["cert"], leaf.cert_pem, PUBLIC_FILE)
        log.info("generated a self-signed serving certificate %s for %s; clients trust %s",
                 describe(leaf.cert), ", ".join(wanted), p["ca"])
        return SelfSignedFiles(p["cert"], p["key"])


def _paths(directory: str) -> dict[str, str]:
    return {name: os.path.join(directory, file) for name, file in
            (("ca", "ca.crt"), ("ca_key", "ca.key"), ("cert", "tls.crt"), ("key", "tls.key"))}


def _usable_ca(p, now) -> Issued | None:
    try:
        ca = load_issued_files(p["ca"], p["ca_key"])
    except (OSError, CertificateError) as e:
        if not isinstance(e, FileNotFoundError):
            log.warning("regenerating the local CA: %s", e)
        return None
    # Keep the CA only if a fresh serving certificate can live its full term under it.
    if remaining(ca.cert, now) < dt.timedelta(days=CERT_DAYS) + RENEW_BEFORE:
        return None
    return ca


def _serving_is_usable(p, ca: Issued, wanted: frozenset[str], now) -> bool:
    try:
        leaf = load_issued_files(p["cert"], p["key"])
    except (OSError, CertificateError) as e:
        if not isinstance(e, FileNotFoundError):
            log.warning("regenerating the serving certificate: %s", e)
        return False
    return (is_issued_by(leaf.cert, ca.cert) and wanted <= hosts_of(leaf.cert)
            and leaf.cert.not_valid_before_utc <= now
            and remaining(leaf.cert, now) > RENEW_BEFORE)


class _locked:
    """An exclusive flock on `path`, held for the block (released if the process dies)."""

    def __init__(self, path: str):
        self.path = path

    def __enter__(self):
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, PRIVATE_FILE)
        fcntl.flock(self.fd, fcntl.LOCK_EX)
        return self

    def __exit__(self, *exc):
        fcntl.flock(self.fd, fcntl.LOCK_UN)
        os.close(self.fd)
