"""Pure X.509 building and checking: a small CA and the serving certificates it signs.

Keys are ECDSA P-256: generated in about a millisecond (RSA 2048 takes ~50-100 ms, which matters
for a Job and for start-up), a server signature per handshake several times cheaper than RSA's,
128-bit strength, and accepted by every client archway has (Go's crypto/tls in the kube-apiserver,
OpenSSL in curl and Python).
"""
import datetime as dt
import ipaddress
import os
from dataclasses import dataclass

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from archway.errors import ArchwayError

# Issue certificates a little in the past so a node whose clock runs slightly behind accepts them.
CLOCK_SKEW = dt.timedelta(minutes=5)


class CertificateError(ArchwayError, ValueError):
    """PEM data that is not a usable certificate or key."""


@dataclass(frozen=True)
class Issued:
    """A certificate and its private key."""
    cert: x509.Certificate
    key: ec.EllipticCurvePrivateKey

    @property
    def cert_pem(self) -> bytes:
        return cert_to_pem(self.cert)

    @property
    def key_pem(self) -> bytes:
        return key_to_pem(self.key)


def utcnow() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


def new_key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def service_dns_names(service: str, namespace: str, cluster_domain: str = "cluster.local") -> list[str]:
    """The names a client may use for a Service: the kube-apiserver calls NAME.NS.svc."""
    return [service, f"{service}.{namespace}", f"{service}.{namespace}.svc",
            f"{service}.{namespace}.svc.{cluster_domain}"]


def issue_ca(common_name: str, *, days: int, now: dt.datetime | None = None) -> Issued:
    """A self-signed CA that may sign leaf certificates only (pathLen 0)."""
    now = now or utcnow()
    key = new_key()
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name[:64])])
    ski = x509.SubjectKeyIdentifier.from_public_key(key.public_key())
    cert = (
        x509.CertificateBuilder()
        .subject_name(name).issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - CLOCK_SKEW)
        .not_valid_after(now + dt.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(_key_usage(digital_signature=True, key_cert_sign=True, crl_sign=True),
                       critical=True)
        .add_extension(ski, critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_subject_key_identifier(ski),
                       critical=False)
        .sign(key, hashes.SHA256())
    )
    return Issued(cert, key)


def issue_serving_cert(ca: Issued, hosts: list[str], *, days: int,
                       now: dt.datetime | None = None, common_name: str | None = None) -> Issued:
    """A TLS server certificate for `hosts` (DNS names and IP addresses), signed by `ca`.

    Never valid longer than the CA: a leaf outliving its issuer would fail verification early."""
    if not hosts:
        raise CertificateError("a serving certificate needs at least one host name")
    now = now or utcnow()
    key = new_key()
    not_after = min(now + dt.timedelta(days=days), ca.cert.not_valid_after_utc)
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, (common_name or hosts[0])[:64])]))
        .issuer_name(ca.cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - CLOCK_SKEW)
        .not_valid_after(not_after)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        # ECDSA keys sign the handshake; keyEncipherment is an RSA-only usage.
        .add_extension(_key_usage(digital_signature=True), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(x509.SubjectAlternativeName([_general_name(h) for h in hosts]),
                       critical=False)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca.key.public_key()),
                       critical=False)
        .sign(ca.key, hashes.SHA256())
    )
    return Issued(cert, key)


def _key_usage(*, digital_signature=False, key_cert_sign=False, crl_sign=False) -> x509.KeyUsage:
    return x509.KeyUsage(digital_signature=digital_signature, content_commitment=False,
                         key_encipherment=False, data_encipherment=False, key_agreement=False,
                         key_cert_sign=key_cert_sign, crl_sign=crl_sign, encipher_only=False,
                         decipher_only=False)


def _general_name(host: str) -> x509.GeneralName:
    try:
        return x509.IPAddress(ipaddress.ip_address(host))
    except ValueError:
        return x509.DNSName(host)


# --- PEM ---------------------------------------------------------------------------------------

def cert_to_pem(cert: x509.Certificate) -> bytes:
    return cert.public_bytes(serialization.Encoding.PEM)


def key_to_pem(key) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def load_cert(pem: bytes) -> x509.Certificate:
    try:
        return x509.load_pem_x509_certificate(pem)
    except (ValueError, TypeError) as e:
        raise CertificateError(f"not a PEM certificate: {e}") from None


def load_certs(pem: bytes) -> list[x509.Certificate]:
    """Every certificate of a PEM bundle (a caBundle may hold several CAs)."""
    try:
        return x509.load_pem_x509_certificates(pem)
    except (ValueError, TypeError) as e:
        raise CertificateError(f"not a PEM certificate bundle: {e}") from None


def load_key(pem: bytes):
    try:
        return serialization.load_pem_private_key(pem, password=None)
    except (ValueError, TypeError) as e:
        raise CertificateError(f"not an unencrypted PEM private key: {e}") from None


def load_issued(cert_pem: bytes, key_pem: bytes) -> Issued:
    """Parse a certificate and its key, checking that they belong together."""
    cert, key = load_cert(cert_pem), load_key(key_pem)
    if not key_matches(cert, key):
        raise CertificateError("the private key does not belong to the certificate")
    return Issued(cert, key)


def load_issued_files(cert_path: str, key_path: str) -> Issued:
    with open(cert_path, "rb") as c, open(key_path, "rb") as k:
        return load_issued(c.read(), k.read())


def bundle_pem(certs: list[x509.Certificate]) -> bytes:
    return b"".join(cert_to_pem(c) for c in certs)


# --- checks (pure) -----------------------------------------------------------------------------

def key_matches(cert: x509.Certificate, key) -> bool:
    pub = serialization.PublicFormat.SubjectPublicKeyInfo
    return (cert.public_key().public_bytes(serialization.Encoding.DER, pub)
            == key.public_key().public_bytes(serialization.Encoding.DER, pub))


def is_issued_by(cert: x509.Certificate, issuer: x509.Certificate) -> bool:
    """True when `issuer`'s key signed `cert` (name match plus a real signature check)."""
    if cert.issuer != issuer.subject:
        return False
    try:
        cert.verify_directly_issued_by(issuer)
    except (ValueError, TypeError, InvalidSignature):
        return False
    return True


def hosts_of(cert: x509.Certificate) -> frozenset[str]:
    """The certificate's SAN entries as strings (DNS names lower-cased, IPs normalised)."""
    try:
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return frozenset()
    names = {n.lower() for n in san.get_values_for_type(x509.DNSName)}
    names |= {str(ip) for ip in san.get_values_for_type(x509.IPAddress)}
    return frozenset(names)


def normalize_hosts(hosts) -> frozenset[str]:
    out = set()
    for h in hosts:
        try:
            out.add(str(ipaddress.ip_address(h)))
        except ValueError:
            out.add(h.lower())
    return frozenset(out)


def remaining(cert: x509.Certificate, now: dt.datetime | None = None) -> dt.timedelta:
    return cert.not_valid_after_utc - (now or utcnow())


def is_ca(cert: x509.Certificate) -> bool:
    try:
        return cert.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    except x509.ExtensionNotFound:
        return False


def describe(cert: x509.Certificate) -> str:
    """One log-friendly line: subject, serial, expiry. Never key material."""
    return (f"{cert.subject.rfc4514_string()} serial {cert.serial_number:x} "
            f"expires {cert.not_valid_after_utc:%Y-%m-%d %H:%M}Z")


def file_signature(*paths: str) -> tuple:
    """What changes when any of the files is replaced or rewritten (follows symlinks, as the
    kubelet swaps a Secret volume's `..data` link)."""
    sig: list[tuple[int, int, int, int] | None] = []
    for p in paths:
        try:
            st = os.stat(p)
            sig.append((st.st_dev, st.st_ino, st.st_mtime_ns, st.st_size))
        except OSError:
            sig.append(None)
    return tuple(sig)
