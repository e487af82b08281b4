"""Node-level credentials: registry.credentials_file swapped on disk the way Kubernetes updates a
mounted Secret, and the kubelet's order (pod, ServiceAccount, providers, then the file)."""
import base64
import json
import logging
import os
import time

import pytest

from archway.config import CredentialProviderSettings, RegistrySettings
from archway.errors import AuthError, ConfigError
from archway.registry.credentials import Keyring
from archway.registry.nodecredentials import NodeCredentials
from archway.registry.resolver import Resolver
from lab.tls import session_ca
from tests.infra.credprovider import ProviderPlugin, provider
from tests.infra.fixtures import LOOPBACK_HOSTS, basic_auth_registry, test_ca


class MountedSecret:
    """A Secret volume as the kubelet writes it: <dir>/..data -> ..<version>/, and the key's
    file a symlink through ..data; an update swaps ..data in one rename."""

    def __init__(self, directory, key=".dockerconfigjson"):
        self.directory, self.key, self.version = str(directory), key, 0
        os.makedirs(self.directory, exist_ok=True)

    @property
    def path(self) -> str:
        return os.path.join(self.directory, self.key)

    def write(self, content: bytes) -> None:
        self.version += 1
        version_dir = os.path.join(self.directory, f"..v{self.version}")
        os.makedirs(version_dir)
        with open(os.path.join(version_dir, self.key), "wb") as f:
            f.write(content)
        link = os.path.join(self.directory, "..data_tmp")
        os.symlink(f"..v{self.version}", link)
        os.replace(link, os.path.join(self.directory, "..data"))
        if not os.path.islink(self.path):
            os.symlink(os.path.join("..data", self.key), self.path)


def secret_for(host: str, user: str, password: str) -> bytes:
    auth = base64.b64encode(f"{user}:{password}".encode()).decode()
    return json.dumps({"auths": {host: {"auth": auth}}}).encode()


def test_a_credentials_file_swapped_on_disk_is_used_by_the_next_lookup(basic_auth_registry, test_ca,
                                                                       tmp_path, caplog):
    reg = basic_auth_registry
    reg.push_image("team/rotated", "v1", "linux/arm64")
    reg.push_image("team/other", "v1", "linux/amd64")
    secret = MountedSecret(tmp_path / "pull-secret")
    secret.write(secret_for(reg.host, "alice", "an-old-password"))
    resolver = Resolver(RegistrySettings(allow_hosts=LOOPBACK_HOSTS, ca_file=test_ca.cert_path, credentials_file=secret.path))
    with pytest.raises(AuthError, match="rejected"):
        resolver.resolve(reg.ref("team/rotated", "v1"), deadline=time.monotonic() + 20)

    secret.write(secret_for(reg.host, "alice", reg.users["alice"]))   # the Secret was updated
    info = resolver.resolve(reg.ref("team/rotated", "v1"), deadline=time.monotonic() + 20)
    assert info.architectures == {"arm64"}   # not the cached failure: the next lookup used it

    secret.write(b"{half a file")             # a broken update keeps the last good credentials
    with caplog.at_level(logging.WARNING):
        info = resolver.resolve(reg.ref("team/other", "v1"), deadline=time.monotonic() + 20)
    assert info.architectures == {"amd64"}
    assert "registry.credentials_file" in caplog.text and "keeping the previous" in caplog.text


def test_the_pods_wrong_secret_is_tried_first_then_the_nodes(basic_auth_registry, test_ca, tmp_path):
    reg = basic_auth_registry
    reg.push_image("team/layered", "v1", "linux/ppc64le")
    secret = MountedSecret(tmp_path / "node")
    secret.write(secret_for(reg.host, "alice", reg.users["alice"]))
    resolver = Resolver(RegistrySettings(allow_hosts=LOOPBACK_HOSTS, ca_file=test_ca.cert_path, credentials_file=secret.path))
    pod = Keyring.from_dockerconfigjson(secret_for(reg.host, "alice", "stale-pod-secret"))
    mark = reg.mark()
    info = resolver.resolve(reg.ref("team/layered", "v1"), keyring=pod, deadline=time.monotonic() + 20)
    assert info.architectures == {"ppc64le"}
    statuses = [e.status for e in reg.requests_since(mark) if "/manifests/" in e.path]
    assert statuses[-1] == 200 and 401 in statuses   # the pod's first (refused), then the node's


def test_providers_come_before_the_file_and_after_the_pod(tmp_path):
    plugin = ProviderPlugin(tmp_path / "plugin")
    plugin.config(provider(match=["reg.example"], username="from-provider"))
    node_file = tmp_path / "node.json"
    node_file.write_bytes(secret_for("reg.example", "from-file", "x"))
    node = NodeCredentials(RegistrySettings(
        credentials_file=str(node_file), credential_providers=CredentialProviderSettings(
            config=plugin.config_path, bin_dir=plugin.bin_dir)))
    keyring, errors = node.for_image("reg.example/app")
    pod = Keyring.from_dockerconfigjson(secret_for("reg.example", "from-pod", "x"))
    assert errors == ()
    assert [c.username for c in pod.then(keyring).candidates("reg.example/app")] == [
        "from-pod", "from-provider", "from-file"]


def test_an_unusable_credentials_file_fails_at_start(tmp_path):
    path = tmp_path / "broken.json"
    path.write_text("not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        NodeCredentials(RegistrySettings(credentials_file=str(path)))
