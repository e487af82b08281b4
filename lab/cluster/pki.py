"""The control plane's credentials (controlplane.py): its CA, the apiserver's serving
certificate, the clients the apiserver and the front proxy show, the ServiceAccount signing key
and the static tokens of the admin and the two components."""
import os
import secrets

from cryptography.hazmat.primitives import serialization

from lab.tls import CertificateAuthority, new_key


def issue_pki(pki: str, node_ip: str | None) -> tuple[CertificateAuthority, dict[str, str]]:
    """A CA, the apiserver's serving pair, the ServiceAccount signing key and static tokens
    for the admin and the two components (their bootstrap RBAC roles bind these users), in the
    folder `pki` (the CA's certificate as ca.crt); the CA, and the paths and tokens the
    components are started with."""
    ca = CertificateAuthority(pki, name="ca", days=365)
    os.replace(ca.cert_path, os.path.join(pki, "ca.crt"))
    serving = ca.issue("apiserver", hosts=("127.0.0.1", "localhost", "10.0.0.1", "kubernetes",
                                          "kubernetes.default", "kubernetes.default.svc",
                                          *([node_ip] if node_ip else [])),
                       days=365)
    # What the apiserver shows a kubelet's port (logs, exec): an admin's client certificate.
    kubelet_client = ca.issue("apiserver-kubelet-client", hosts=(), client=True, days=365,
                              organizations=("system:masters",))
    # The front proxy's CA and client: the aggregation layer and every component's delegated
    # authentication read them from kube-system/extension-apiserver-authentication.
    front = CertificateAuthority(pki, name="front-proxy-ca", days=365)
    proxy_client = front.issue("front-proxy-client", hosts=(), client=True, days=365)
    sa_key = new_key("rsa")
    with open(os.path.join(pki, "sa.key"), "wb") as f:
        f.write(sa_key.private_bytes(serialization.Encoding.PEM,
                                     serialization.PrivateFormat.TraditionalOpenSSL,
                                     serialization.NoEncryption()))
    with open(os.path.join(pki, "sa.pub"), "wb") as f:
        f.write(sa_key.public_key().public_bytes(serialization.Encoding.PEM,
                                                 serialization.PublicFormat.SubjectPublicKeyInfo))
    tokens = {user: secrets.token_hex(24) for user in
              ("admin", "system:kube-controller-manager", "system:kube-scheduler")}
    with open(os.path.join(pki, "tokens.csv"), "w") as f:
        f.write(f'{tokens["admin"]},admin,uid-admin,"system:masters"\n')
        for user in ("system:kube-controller-manager", "system:kube-scheduler"):
            f.write(f"{tokens[user]},{user},uid-{user.split(':')[1]}\n")
    os.chmod(os.path.join(pki, "tokens.csv"), 0o600)
    return ca, {"cert": serving.cert_path, "key": serving.key_path, "front_ca": front.cert_path,
                "kubelet_cert": kubelet_client.cert_path, "kubelet_key": kubelet_client.key_path,
                "proxy_cert": proxy_client.cert_path, "proxy_key": proxy_client.key_path, **tokens}
