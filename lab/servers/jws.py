"""JSON Web Signatures as registries use them: the JWTs a token server issues (RS256, the
signing certificate in `x5c`) and schema1 manifests signed as docker/libtrust signs them (a
pretty JWS, ES256, the public key embedded)."""
import base64
import json
import time

from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, padding
from cryptography.hazmat.primitives.asymmetric.utils import decode_dss_signature


def b64url(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def canonical(obj) -> bytes:
    return json.dumps(obj, separators=(",", ":"), sort_keys=True).encode()


def jwt(signing, claims: dict) -> str:
    """`claims` signed RS256 with `signing` (an IssuedCert of an RSA key), its certificate in
    the header's `x5c`."""
    header = {"typ": "JWT", "alg": "RS256",
              "x5c": [base64.b64encode(signing.cert.public_bytes(serialization.Encoding.DER)).decode()]}
    signing_input = f"{b64url(canonical(header))}.{b64url(canonical(claims))}".encode()
    signature = signing.key.sign(signing_input, padding.PKCS1v15(), hashes.SHA256())
    return signing_input.decode() + "." + b64url(signature)


def sign_schema1(manifest: dict) -> bytes:
    """Sign a schema1 manifest as docker/libtrust does (pretty JWS, ES256, embedded JWK)."""
    key = ec.generate_private_key(ec.SECP256R1())
    payload = json.dumps(manifest, indent=3).encode()
    format_length = payload.rindex(b"\n}")
    format_tail = payload[format_length:]
    protected = b64url(json.dumps({
        "formatLength": format_length, "formatTail": b64url(format_tail),
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}).encode())
    signing_input = f"{protected}.{b64url(payload)}".encode()
    r, s = decode_dss_signature(key.sign(signing_input, ec.ECDSA(hashes.SHA256())))
    numbers = key.public_key().public_numbers()
    jwk = {"crv": "P-256", "kty": "EC",
           "x": b64url(numbers.x.to_bytes(32, "big")), "y": b64url(numbers.y.to_bytes(32, "big"))}
    signature = {"header": {"jwk": jwk, "alg": "ES256"},
                 "signature": b64url(r.to_bytes(32, "big") + s.to_bytes(32, "big")),
                 "protected": protected}
    signatures = json.dumps([signature], indent=3).replace("\n", "\n   ").encode()
    return payload[:format_length] + b',\n   "signatures": ' + signatures + format_tail
