"""`archway certs generate`: a CA and a serving certificate for a Service, written to a directory.

Files: ca.crt (the caBundle / what clients trust), tls.crt, tls.key (0600), and ca.key (0600)
only on request: without it the CA can sign nothing else, which is the safest default for a
one-off pair; keep it if you want to renew tls.crt later under the same caBundle.
"""
import os
from dataclasses import dataclass

from archway.errors import ArchwayError

from .files import PRIVATE_FILE, PUBLIC_FILE, write_atomic
from .x509 import issue_ca, issue_serving_cert, service_dns_names


class GenerateError(ArchwayError):
    """The certificates cannot be written where asked."""


@dataclass(frozen=True)
class GeneratedFiles:
    ca: str
    cert: str
    key: str
    ca_key: str | None


def generate(service: str, namespace: str, out_dir: str, *, days: int = 365,
             ca_days: int | None = None, extra_hosts: tuple[str, ...] = (),
             cluster_domain: str = "cluster.local", keep_ca_key: bool = False,
             force: bool = False) -> GeneratedFiles:
    if days <= 0:
        raise GenerateError("--days must be a positive number of days")
    ca_days = ca_days or max(days, 3650)
    if ca_days < days:
        raise GenerateError("--ca-days must not be shorter than --days")
    names = {"ca": "ca.crt", "cert": "tls.crt", "key": "tls.key"}
    if keep_ca_key:
        names["ca_key"] = "ca.key"
    paths = {k: os.path.join(out_dir, v) for k, v in names.items()}
    existing = [p for p in paths.values() if os.path.exists(p)]
    if existing and not force:
        raise GenerateError(f"refusing to overwrite {', '.join(existing)} (use --force)")
    try:
        os.makedirs(out_dir, mode=0o700, exist_ok=True)
    except OSError as e:
        raise GenerateError(f"cannot create {out_dir}: {e.strerror}") from None

    hosts = list(dict.fromkeys(service_dns_names(service, namespace, cluster_domain)
                               + list(extra_hosts)))
    ca = issue_ca(f"archway CA for {service}.{namespace}", days=ca_days)
    leaf = issue_serving_cert(ca, hosts, days=days, common_name=f"{service}.{namespace}.svc")
    try:
        write_atomic(paths["key"], leaf.key_pem, PRIVATE_FILE)
        write_atomic(paths["cert"], leaf.cert_pem, PUBLIC_FILE)
        write_atomic(paths["ca"], ca.cert_pem, PUBLIC_FILE)
        if keep_ca_key:
            write_atomic(paths["ca_key"], ca.key_pem, PRIVATE_FILE)
    except OSError as e:
        raise GenerateError(f"cannot write into {out_dir}: {e.strerror}") from None
    return GeneratedFiles(paths["ca"], paths["cert"], paths["key"], paths.get("ca_key"))
