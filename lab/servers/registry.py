"""A real Debian `docker-registry` (distribution 2.8) for tests, with a token server of its own
(tokenserver.py) when its auth is "token".

    reg = RegistryServer(tmp_dir)                                  # plain HTTP, anonymous
    reg = RegistryServer(tmp_dir, ca=test_ca)                      # TLS signed by the test CA
    reg = RegistryServer(tmp_dir, auth="htpasswd", users={"alice": "pw"})
    reg = RegistryServer(tmp_dir, auth="token", users={"alice": "pw"})   # reg.token_server counts
    reg = RegistryServer(tmp_dir, notify=(url, token))   # events POSTed to url (notifications)

    digest = reg.push_image("team/app", "v1", "linux/arm/v7")          # OCI manifest + config
    index = reg.push_index("team/multi", "v1", ["linux/amd64", "linux/arm64"], attestations=True)
    digest = reg.push_sif("sif/busybox", "latest", sif_bytes)           # an oras SIF artifact

    mark = reg.mark()
    ... the code under test talks to reg.host ...
    reg.requests_since(mark)      # [AccessEntry(method, path, status, size), ...] from the access log

Pushing goes straight to the registry HTTP API (monolithic blob uploads, manifests by PUT) with
an identity that may push (basic auth, or a token the test mints with push rights), so pushes
never show in the token server's counts. The tests' fixtures over it (one registry per module)
are in tests/infra/fixtures.py.
"""
import base64
import hashlib
import json
import os
import re
import subprocess
import time
import uuid
from dataclasses import dataclass, field

import requests

from lab.procs import Server, free_port, require_binary
from lab.servers.jws import sign_schema1
from lab.servers.tokenserver import DEFAULT_USERS, ISSUER, SERVICE, TokenServer
from lab.tls import CertificateAuthority

# Media types (OCI image spec, Docker distribution, Sylabs' oras layout).
OCI_INDEX = "application/vnd.oci.image.index.v1+json"
OCI_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
OCI_CONFIG = "application/vnd.oci.image.config.v1+json"
OCI_LAYER = "application/vnd.oci.image.layer.v1.tar+gzip"
DOCKER_LIST = "application/vnd.docker.distribution.manifest.list.v2+json"
DOCKER_MANIFEST = "application/vnd.docker.distribution.manifest.v2+json"
DOCKER_CONFIG = "application/vnd.docker.container.image.v1+json"
DOCKER_LAYER = "application/vnd.docker.image.rootfs.diff.tar.gzip"
SCHEMA1_SIGNED = "application/vnd.docker.distribution.manifest.v1+prettyjws"
SIF_CONFIG = "application/vnd.sylabs.sif.config.v1+json"
SIF_LAYER = "application/vnd.sylabs.sif.layer.v1.sif"
IN_TOTO = "application/vnd.in-toto+json"
EMPTY_CONFIG = "application/vnd.oci.empty.v1+json"   # an artifact's config (OCI image-spec 1.1)

def sha256_digest(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def split_platform(text: str) -> dict:
    """'linux/arm/v7' -> {"os": "linux", "architecture": "arm", "variant": "v7"} (as registries store it)."""
    parts = text.split("/")
    platform = {"architecture": parts[1], "os": parts[0]}
    if len(parts) > 2:
        platform["variant"] = parts[2]
    return platform


@dataclass(frozen=True)
class AccessEntry:
    method: str
    path: str       # without the query string
    query: str
    status: int
    size: int       # response body bytes the registry sent
    agent: str = ""  # the client's User-Agent: archway/<version> or a mirror (Go)
    remote: str = ""  # the client's address: which node's containerd asked


# 127.0.0.1 - - [02/Jan/2025:10:00:00 +0000] "GET /v2/ HTTP/1.1" 200 2 "" "archway/0.1.0"
_ACCESS_LINE = re.compile(
    r'^(?P<remote>\S+) \S+ \S+ \[[^\]]+\] "(?P<method>[A-Z]+) (?P<target>\S+) HTTP/[0-9.]+" '
    r'(?P<status>\d{3}) (?P<size>\d+|-)(?: "[^"]*" "(?P<agent>[^"]*)")?')


def parse_access_log(text: str) -> list[AccessEntry]:
    entries = []
    for line in text.splitlines():
        m = _ACCESS_LINE.match(line)
        if m:
            path, _, query = m["target"].partition("?")
            size = 0 if m["size"] == "-" else int(m["size"])
            entries.append(AccessEntry(m["method"], path, query, int(m["status"]), size,
                                       m["agent"] or "", m["remote"]))
    return entries


@dataclass
class PushedIndex:
    digest: str
    children: dict = field(default_factory=dict)   # "linux/arm/v7" -> manifest digest
    attestations: list = field(default_factory=list)


class RegistryServer:
    """One `docker-registry serve` process with its own storage, config and log in `directory`."""

    def __init__(self, directory, *, ca: CertificateAuthority | None = None,
                 auth: str | None = None, users: dict | None = None,
                 token_server: TokenServer | None = None, schema1: bool = True,
                 anonymous_pull: bool = False, token_expires_in: int | None = 300,
                 token_realm_host: str = "127.0.0.1", mirror_of: "RegistryServer | None" = None,
                 address: str = "127.0.0.1", notify: tuple[str, str] | None = None):
        self.binary = require_binary("docker-registry")
        # Where it listens: this machine's own address when pods on a real node read it.
        self.address = address
        self.directory = str(directory)
        os.makedirs(self.directory, exist_ok=True)
        self.port = free_port()
        self.ca = ca
        self.auth = auth
        self.users = dict(DEFAULT_USERS if users is None else users)
        self.mirror_of = mirror_of   # a pull-through cache of that registry (proxy.remoteurl)
        # (url, bearer token): push and pull events posted there (its notifications.endpoints)
        self.notify = notify
        self.scheme = "https" if ca else "http"
        self.token_server = None
        self._own_token_server = False
        if auth == "token":
            # Over TLS when the registry is: clients send passwords to the realm.
            self.token_server = token_server or TokenServer(
                self.directory, self.users, anonymous_pull=anonymous_pull,
                expires_in=token_expires_in, realm_host=token_realm_host,
                tls=ca.issue(f"token-server-{self.port}") if ca else None)
            self._own_token_server = token_server is None
        config_path = os.path.join(self.directory, "config.yml")
        with open(config_path, "w") as f:
            json.dump(self._config(schema1), f, indent=1)   # JSON is YAML
        self.http = requests.Session()
        self.http.trust_env = False
        self.verify = ca.cert_path if ca else True
        self._push_auth = self._make_push_auth()
        env = None
        if mirror_of is not None and mirror_of.ca is not None:   # the mirror must trust its upstream
            env = {**os.environ, "SSL_CERT_FILE": mirror_of.ca.cert_path}
        self.server = Server([self.binary, "serve", config_path], port=self.port, env=env,
                             log_path=os.path.join(self.directory, "registry.log"),
                             host=self.address)

    # -- setup
    def _config(self, schema1: bool) -> dict:
        config: dict = {
            "version": 0.1,
            "log": {"level": "warn", "accesslog": {"disabled": False},
                    "fields": {"service": "registry"}},
            "storage": {"filesystem": {"rootdirectory": os.path.join(self.directory, "data")},
                        "delete": {"enabled": True}, "maintenance": {
                            "uploadpurging": {"enabled": False}}},
            "http": {"addr": f"{self.address}:{self.port}", "secret": uuid.uuid4().hex,
                     "headers": {"X-Content-Type-Options": ["nosniff"]}},
            "health": {"storagedriver": {"enabled": False}},
        }
        if schema1:
            config["compatibility"] = {"schema1": {"enabled": True}}
        if self.ca:
            pair = self.ca.issue(f"registry-{self.port}", ["127.0.0.1", "localhost"])
            config["http"]["tls"] = {"certificate": pair.chain_path, "key": pair.key_path,
                                     "minimumtls": "tls1.2"}
        if self.auth == "htpasswd":
            config["auth"] = {"htpasswd": {"realm": "archway-test", "path": self._htpasswd()}}
        elif self.auth == "token":
            assert self.token_server is not None
            config["auth"] = {"token": {"realm": self.token_server.realm, "service": SERVICE,
                                        "issuer": ISSUER,
                                        "rootcertbundle": self.token_server.cert_path}}
        elif self.auth is not None:
            raise ValueError(f"unknown auth {self.auth!r}: use None, 'htpasswd' or 'token'")
        if self.notify is not None:
            url, token = self.notify
            config["notifications"] = {"events": {"includereferences": True}, "endpoints": [{
                "name": "archway", "url": url, "headers": {"Authorization": [f"Bearer {token}"]},
                "timeout": "1s", "threshold": 5, "backoff": "1s"}]}
        if self.mirror_of is not None:
            upstream = self.mirror_of
            config["proxy"] = {"remoteurl": upstream.url}
            if upstream.auth:   # the mirror pulls with its own account, as real ones do
                user = next(iter(upstream.users))
                config["proxy"].update(username=user, password=upstream.users[user])
        return config

    def _htpasswd(self) -> str:
        htpasswd = require_binary("htpasswd")
        lines = []
        for user, password in self.users.items():
            out = subprocess.run([htpasswd, "-Bbn", user, password], check=True,
                                 capture_output=True, text=True, timeout=30).stdout
            lines.append(out.strip())
        path = os.path.join(self.directory, "htpasswd")
        with open(path, "w") as f:
            f.write("\n".join(lines) + "\n")
        return path

    def _make_push_auth(self):
        user, password = next(iter(self.users.items())) if self.users else ("", "")
        if self.auth == "htpasswd":
            return lambda repo: {"Authorization": "Basic " + base64.b64encode(
                f"{user}:{password}".encode()).decode()}
        if self.auth == "token":
            return lambda repo: {"Authorization": "Bearer " + self.token_server.mint(
                user, [{"type": "repository", "name": repo, "actions": ["pull", "push"]}])}
        return lambda repo: {}

    # -- addresses
    @property
    def host(self) -> str:
        """host:port as it appears in image references."""
        return f"{self.address}:{self.port}"

    @property
    def url(self) -> str:
        return f"{self.scheme}://{self.host}"

    def ref(self, repo: str, tag: str | None = None, digest: str | None = None,
            scheme: str = "") -> str:
        text = f"{self.host}/{repo}" + (f":{tag}" if tag else "") + (f"@{digest}" if digest else "")
        return f"{scheme}://{text}" if scheme else text

    def dockerconfigjson(self, user: str | None = None, password: str | None = None,
                         key: str | None = None) -> bytes:
        """A pull secret's `.dockerconfigjson` naming this registry (or `key`)."""
        user = user or next(iter(self.users))
        password = self.users[user] if password is None else password
        auth = base64.b64encode(f"{user}:{password}".encode()).decode()
        return json.dumps({"auths": {key or self.host: {"auth": auth}}}).encode()

    # -- raw API
    def _request(self, method, repo, path, **kwargs):
        headers = {**self._push_auth(repo), **kwargs.pop("headers", {})}
        r = self.http.request(method, self.url + path, headers=headers, verify=self.verify,
                              timeout=30, **kwargs)
        return r

    def push_blob(self, repo: str, data: bytes) -> str:
        digest = sha256_digest(data)
        r = self._request("POST", repo, f"/v2/{repo}/blobs/uploads/")
        if r.status_code != 202:
            raise RuntimeError(f"blob upload start: {r.status_code} {r.text[:300]}")
        location = r.headers["Location"]
        if location.startswith("/"):
            location = self.url + location
        sep = "&" if "?" in location else "?"
        r = self.http.put(f"{location}{sep}digest={digest}", data=data, verify=self.verify,
                          headers={**self._push_auth(repo),
                                   "Content-Type": "application/octet-stream"}, timeout=60)
        if r.status_code != 201:
            raise RuntimeError(f"blob upload: {r.status_code} {r.text[:300]}")
        return digest

    def push_manifest(self, repo: str, reference: str, body, media_type: str) -> str:
        data = body if isinstance(body, bytes) else json.dumps(body, indent=2).encode()
        r = self._request("PUT", repo, f"/v2/{repo}/manifests/{reference}", data=data,
                          headers={"Content-Type": media_type})
        if r.status_code != 201:
            raise RuntimeError(f"manifest push {repo}:{reference}: {r.status_code} {r.text[:500]}")
        return r.headers.get("Docker-Content-Digest") or sha256_digest(data)

    def get_manifest(self, repo: str, reference: str) -> requests.Response:
        accept = ", ".join([OCI_INDEX, OCI_MANIFEST, DOCKER_LIST, DOCKER_MANIFEST, SCHEMA1_SIGNED])
        return self._request("GET", repo, f"/v2/{repo}/manifests/{reference}",
                             headers={"Accept": accept})

    # -- content
    def push_image(self, repo: str, tag: str | None, platform: str = "linux/amd64", *,
                   kind: str = "oci", layer: bytes | None = None, config_extra: dict | None = None
                   ) -> str:
        """A single-platform image (config + one layer + manifest); returns the manifest digest.

        `tag=None` pushes by digest only (an index child). `kind` is "oci" or "docker".
        """
        config = {**split_platform(platform), "rootfs": {"type": "layers", "diff_ids": []},
                  "config": {}, **(config_extra or {})}
        config_bytes = json.dumps(config).encode()
        layer = layer if layer is not None else f"layer of {repo} {platform} {uuid.uuid4()}".encode()
        config_digest = self.push_blob(repo, config_bytes)
        layer_digest = self.push_blob(repo, layer)
        manifest_type = OCI_MANIFEST if kind == "oci" else DOCKER_MANIFEST
        manifest = {
            "schemaVersion": 2, "mediaType": manifest_type,
            "config": {"mediaType": OCI_CONFIG if kind == "oci" else DOCKER_CONFIG,
                       "digest": config_digest, "size": len(config_bytes)},
            "layers": [{"mediaType": OCI_LAYER if kind == "oci" else DOCKER_LAYER,
                        "digest": layer_digest, "size": len(layer)}],
        }
        data = json.dumps(manifest, indent=2).encode()
        return self.push_manifest(repo, tag or sha256_digest(data), data, manifest_type)

    def push_artifact(self, repo: str, tag: str, artifact_type: str | None = None, *,
                      config_media_type: str = EMPTY_CONFIG, blob: bytes = b"weights") -> str:
        """An OCI artifact (a model, a config bundle): `artifactType` and the empty config, as
        `oras push --artifact-type` writes it (artifact_type None: the config's media type says
        what it is). No platform anywhere. Returns the manifest digest."""
        config = b"{}"
        manifest = {"schemaVersion": 2, "mediaType": OCI_MANIFEST,
                    "config": {"mediaType": config_media_type,
                               "digest": self.push_blob(repo, config), "size": len(config)},
                    "layers": [{"mediaType": "application/octet-stream",
                                "digest": self.push_blob(repo, blob), "size": len(blob),
                                "annotations": {"org.opencontainers.image.title": "model.bin"}}]}
        if artifact_type is not None:
            manifest["artifactType"] = artifact_type
        return self.push_manifest(repo, tag, json.dumps(manifest).encode(), OCI_MANIFEST)

    def push_attestation(self, repo: str, subject_digest: str) -> str:
        """A BuildKit-style attestation manifest (in-toto layer) for an index entry."""
        statement = json.dumps({"_type": "https://in-toto.io/Statement/v0.1",
                                "subject": [{"digest": {"sha256": subject_digest[7:]}}]}).encode()
        config = json.dumps({"architecture": "unknown", "os": "unknown",
                             "rootfs": {"type": "layers", "diff_ids": []}}).encode()
        config_digest = self.push_blob(repo, config)
        layer_digest = self.push_blob(repo, statement)
        manifest = {"schemaVersion": 2, "mediaType": OCI_MANIFEST,
                    "config": {"mediaType": OCI_CONFIG, "digest": config_digest, "size": len(config)},
                    "layers": [{"mediaType": IN_TOTO, "digest": layer_digest, "size": len(statement),
                                "annotations": {"in-toto.io/predicate-type":
                                                "https://slsa.dev/provenance/v0.2"}}]}
        data = json.dumps(manifest).encode()
        return self.push_manifest(repo, sha256_digest(data), data, OCI_MANIFEST)

    def push_index(self, repo: str, tag: str, platforms, *, kind: str = "oci",
                   attestations: bool = False, extra_entries=()) -> PushedIndex:
        """A multi-platform image: one child manifest per platform, then the index/list.

        `kind="oci"` -> OCI index of OCI manifests; `kind="docker"` -> Docker manifest list of
        Docker v2 manifests. `attestations=True` adds one BuildKit attestation entry per platform
        (platform unknown/unknown + `vnd.docker.reference.type` annotation).
        """
        child_type = OCI_MANIFEST if kind == "oci" else DOCKER_MANIFEST
        pushed = PushedIndex(digest="")
        entries = []
        for platform in platforms:
            digest = self.push_image(repo, None, platform, kind=kind)
            pushed.children[platform] = digest
            size = len(self.get_manifest(repo, digest).content)
            entry = {"mediaType": child_type, "digest": digest, "size": size,
                     "platform": split_platform(platform)}
            entries.append(entry)
            if attestations:
                att = self.push_attestation(repo, digest)
                pushed.attestations.append(att)
                entries.append({"mediaType": OCI_MANIFEST, "digest": att,
                                "size": len(self.get_manifest(repo, att).content),
                                "platform": {"architecture": "unknown", "os": "unknown"},
                                "annotations": {"vnd.docker.reference.type": "attestation-manifest",
                                                "vnd.docker.reference.digest": digest}})
        entries.extend(extra_entries)
        media_type = OCI_INDEX if kind == "oci" else DOCKER_LIST
        index = {"schemaVersion": 2, "mediaType": media_type, "manifests": entries}
        pushed.digest = self.push_manifest(repo, tag, index, media_type)
        return pushed

    def push_schema1(self, repo: str, tag: str, architecture: str = "amd64") -> str:
        """A signed schema1 manifest (libtrust JWS, ES256), accepted when schema1 is enabled."""
        layer = f"schema1 layer {uuid.uuid4()}".encode()
        layer_digest = self.push_blob(repo, layer)
        manifest = {
            "schemaVersion": 1, "name": repo, "tag": tag, "architecture": architecture,
            "fsLayers": [{"blobSum": layer_digest}],
            "history": [{"v1Compatibility": json.dumps(
                {"id": hashlib.sha256(layer).hexdigest(), "architecture": architecture,
                 "os": "linux", "created": "2020-01-01T00:00:00Z"})}],
        }
        return self.push_manifest(repo, tag, sign_schema1(manifest), SCHEMA1_SIGNED)

    def push_sif(self, repo: str, tag: str, sif_bytes: bytes, *, title: str = "image.sif") -> str:
        """An oras SIF artifact as apptainer pushes it: config `{}` + one SIF layer."""
        config = b"{}"
        config_digest = self.push_blob(repo, config)
        layer_digest = self.push_blob(repo, sif_bytes)
        manifest = {
            "schemaVersion": 2, "mediaType": OCI_MANIFEST,
            "config": {"mediaType": SIF_CONFIG, "digest": config_digest, "size": len(config)},
            "layers": [{"mediaType": SIF_LAYER, "digest": layer_digest, "size": len(sif_bytes),
                        "annotations": {"org.opencontainers.image.title": title}}],
        }
        return self.push_manifest(repo, tag, manifest, OCI_MANIFEST)

    def wait_for_blob(self, digest: str, timeout: float = 10.0) -> None:
        """Wait until the blob is in this registry's storage: a pull-through cache stores what
        it fetched for a client in the background, after answering."""
        algorithm, hex_digest = digest.split(":", 1)
        path = os.path.join(self.directory, "data", "docker", "registry", "v2", "blobs", algorithm,
                            hex_digest[:2], hex_digest, "data")
        end = time.monotonic() + timeout
        while not os.path.exists(path):
            if time.monotonic() > end:
                raise TimeoutError(f"blob {digest} never reached {self.host}'s storage")
            time.sleep(0.02)

    # -- what the registry served
    def access_log(self) -> list[AccessEntry]:
        return parse_access_log(self._log_text())

    def _log_text(self, start: int = 0) -> str:
        with open(self.server.log_path, "rb") as f:
            f.seek(start)
            return f.read().decode("utf-8", "replace")

    def mark(self) -> int:
        """A position in the access log; pass it to requests_since()."""
        self._sync()
        return os.path.getsize(self.server.log_path)

    def requests_since(self, mark: int) -> list[AccessEntry]:
        """Requests the registry logged after `mark`, excluding the sync probes.

        The registry writes an access-log line just after it answers, so a client can see its
        answer before the line exists: a probe request whose own line appears marks "all done".
        """
        self._sync()
        return [e for e in parse_access_log(self._log_text(mark))
                if not e.path.startswith("/v2/archway-sync-probe/")]

    def manifest_gets(self, mark: int, repo: str | None = None) -> list[AccessEntry]:
        return [e for e in self.requests_since(mark)
                if e.method in ("GET", "HEAD") and "/manifests/" in e.path
                and (repo is None or e.path.startswith(f"/v2/{repo}/"))]

    def _sync(self, timeout: float = 5.0, settle: float = 0.03) -> None:
        """Wait until every request answered so far is in the access log.

        The registry logs a request after its handler returns, and a ranged blob body goes out
        (sendfile) before that: a client can have its answer, send the probe, and see the probe
        logged first. So: wait for the probe's line, then until the log stops growing.
        """
        probe = f"/v2/archway-sync-probe/{uuid.uuid4().hex}/tags/list"
        self.http.get(self.url + probe, verify=self.verify, timeout=10)
        end = time.monotonic() + timeout
        while probe not in self._log_text():
            if time.monotonic() > end:
                raise TimeoutError(f"registry access log did not record {probe}")
            time.sleep(0.01)
        size = os.path.getsize(self.server.log_path)
        while time.monotonic() < end:
            time.sleep(settle)
            now = os.path.getsize(self.server.log_path)
            if now == size:
                return
            size = now

    def stop(self) -> None:
        self.server.stop()
        self.http.close()
        if self._own_token_server and self.token_server is not None:
            self.token_server.stop()
