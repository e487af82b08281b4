"""A throw-away certificate authority for tests: a CA, and server/client certificates it signs.

Everything is written as PEM files into a directory the test owns, so real servers (the registry,
gunicorn, Prometheus) can be pointed at them by path, and clients can trust the CA file.

    ca = CertificateAuthority(tmp_path)                # ca.cert_path, ca.cert_pem
    pair = ca.issue("registry", hosts=["127.0.0.1", "localhost"])
    pair.cert_path, pair.key_path, pair.chain_path     # leaf / key / leaf+CA
"""
import datetime
import ipaddress
import os
from dataclasses import dataclass

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

DEFAULT_HOSTS = ("127.0.0.1", "localhost")


@dataclass(frozen=True)
class IssuedCert:
    name: str
    cert_path: str
    key_path: str
    chain_path: str          # leaf followed by the CA: what servers that want a bundle need
    cert: x509.Certificate
    key: object              # the private key object (cryptography)

    @property
    def cert_pem(self) -> bytes:
        return self.cert.public_bytes(serialization.Encoding.PEM)

    @property
    def key_pem(self) -> bytes:
        return _key_pem(self.key)


def _key_pem(key) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def _now() -> datetime.datetime:
    return datetime.datetime.now(datetime.UTC)


def _san(hosts) -> x509.SubjectAlternativeName:
    names: list[x509.GeneralName] = []
    for host in hosts:
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            names.append(x509.DNSName(host))
    return x509.SubjectAlternativeName(names)


def _write(path: str, data: bytes, mode: int = 0o644) -> str:
    with open(path, "wb") as f:
        f.write(data)
    os.chmod(path, mode)
    return path


def new_key(kind: str = "ec"):
    """EC P-256 keys are fast to make; RSA when a consumer insists (JWT RS256 signing)."""
    if kind == "rsa":
        return rsa.generate_private_key(public_exponent=65537, key_size=2048)
    return ec.generate_private_key(ec.SECP256R1())


class CertificateAuthority:
    """A self-signed root CA whose files live in `directory`."""

    def __init__(self, directory, name: str = "archway test CA", days: int = 2):
        self.directory = str(directory)
        os.makedirs(self.directory, exist_ok=True)
        self.name = name
        self.key = new_key()
        subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
        now = _now()
        self.cert = (
            x509.CertificateBuilder()
            .subject_name(subject).issuer_name(subject)
            .public_key(self.key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=days))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                         content_commitment=False, key_encipherment=False,
                                         data_encipherment=False, key_agreement=False,
                                         encipher_only=False, decipher_only=False), critical=True)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(self.key.public_key()),
                           critical=False)
            .sign(self.key, hashes.SHA256())
        )
        slug = name.replace(" ", "-")
        self.cert_path = _write(os.path.join(self.directory, f"{slug}.crt"), self.cert_pem)
        self.key_path = _write(os.path.join(self.directory, f"{slug}.key"), _key_pem(self.key), 0o600)

    @property
    def cert_pem(self) -> bytes:
        return self.cert.public_bytes(serialization.Encoding.PEM)

    def issue(self, name: str, hosts=DEFAULT_HOSTS, *, client: bool = False, days: int = 2,
              key_kind: str = "ec", not_before: datetime.datetime | None = None,
              not_after: datetime.datetime | None = None,
              organizations: tuple[str, ...] = ()) -> IssuedCert:
        """Sign a leaf certificate for `hosts` (IP addresses or DNS names).

        `client=True` makes a client-auth certificate (CN = name, no SAN needed). `not_before` /
        `not_after` let a test make expired or not-yet-valid certificates. `organizations` are
        the subject's O= (Kubernetes reads them as the user's groups).
        """
        key = new_key(key_kind)
        now = _now()
        usage = [ExtendedKeyUsageOID.CLIENT_AUTH] if client else [ExtendedKeyUsageOID.SERVER_AUTH]
        builder = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, o)
                                     for o in organizations]
                                    + [x509.NameAttribute(NameOID.COMMON_NAME, name)]))
            .issuer_name(self.cert.subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(not_before or now - datetime.timedelta(minutes=5))
            .not_valid_after(not_after or now + datetime.timedelta(days=days))
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage(usage), critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(self.key.public_key()),
                           critical=False)
        )
        if hosts:
            builder = builder.add_extension(_san(hosts), critical=False)
        cert = builder.sign(self.key, hashes.SHA256())
        cert_pem = cert.public_bytes(serialization.Encoding.PEM)
        slug = name.replace(" ", "-")
        base = os.path.join(self.directory, slug)
        return IssuedCert(
            name=name,
            cert_path=_write(base + ".crt", cert_pem),
            key_path=_write(base + ".key", _key_pem(key), 0o600),
            chain_path=_write(base + ".chain.crt", cert_pem + self.cert_pem),
            cert=cert, key=key,
        )


def self_signed(directory, name: str, *, key_kind: str = "rsa", days: int = 2) -> IssuedCert:
    """A self-signed certificate that is its own root (e.g. a JWT signing certificate)."""
    key = new_key(key_kind)
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    now = _now()
    cert = (
        x509.CertificateBuilder()
        .subject_name(subject).issuer_name(subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=days))
        .sign(key, hashes.SHA256())
    )
    cert_pem = cert.public_bytes(serialization.Encoding.PEM)
    base = os.path.join(str(directory), name.replace(" ", "-"))
    path = _write(base + ".crt", cert_pem)
    return IssuedCert(name=name, cert_path=path, key_path=_write(base + ".key", _key_pem(key), 0o600),
                      chain_path=path, cert=cert, key=key)


_SESSION_CA: dict[str, CertificateAuthority] = {}


def session_ca(tmp_path_factory) -> CertificateAuthority:
    """The test session's one CA (what the `test_ca` fixture returns), made on first use."""
    base = str(tmp_path_factory.getbasetemp())
    if base not in _SESSION_CA:
        _SESSION_CA[base] = CertificateAuthority(tmp_path_factory.mktemp("test-ca"))
    return _SESSION_CA[base]
