"""What archway trusts when it verifies a registry's certificate: the public CAs (certifi) plus
registry.ca_file and a hosts.toml's `ca` files, as one bundle; and the SSLContext built from a
bundle, shared by every verified connection (registry.connections)."""
import atexit
import os
import ssl
import tempfile

import certifi
from urllib3.util.ssl_ import create_urllib3_context

from archway.errors import ConfigError

MAX_CA_FILE_BYTES = 4 * 1024 * 1024


def read_ca_file(ca_file: str, what: str = "registry.ca_file") -> bytes:
    """The PEM certificates of a CA file; ConfigError naming `what` when unusable."""
    try:
        with open(os.path.expanduser(ca_file), "rb") as f:
            pem = f.read(MAX_CA_FILE_BYTES)
    except OSError as e:
        raise ConfigError(f"cannot read {what} {ca_file}: {e.strerror}") from None
    if b"-----BEGIN CERTIFICATE-----" not in pem:
        raise ConfigError(f"{what} {ca_file} holds no PEM certificate")
    return pem


def trust_bundle(ca_file: str | None, *more_ca_files: str) -> str:
    """The public CAs plus the extra ones: requests takes one bundle path, and an extra CA must
    add to the system's trust, not replace it. registry.ca_file first, then hosts.toml `ca`s."""
    extra = [read_ca_file(ca_file)] if ca_file else []
    extra += [read_ca_file(f, "hosts.toml ca") for f in more_ca_files]
    with open(certifi.where(), "rb") as f:
        public = f.read()
    bundle = tempfile.NamedTemporaryFile(prefix="archway-ca-", suffix=".pem", delete=False)
    with bundle:
        bundle.write(b"\n".join([public, *extra]))
    atexit.register(_remove_if_mine, bundle.name, os.getpid())
    return bundle.name


def _remove_if_mine(path: str, creator_pid: int) -> None:
    """Forked children inherit atexit hooks: only the process that made the file removes it."""
    if os.getpid() == creator_pid:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass



def verifying_context(trust):
    """A client context trusting `trust` (True: certifi's public CAs; else a bundle path)."""
    context = create_urllib3_context(cert_reqs=ssl.CERT_REQUIRED)
    context.load_verify_locations(certifi.where() if trust is True else trust)
    return context

