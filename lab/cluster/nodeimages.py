"""Container images a real node runs, made here without a registry or a build tool: a static Go
program from lab/cluster/go/ (built once, cached by the content of its source) packed as a
one-layer OCI image, either as an OCI archive for `ctr images import` or pushed to a test
registry (lab/servers/registry.py); and any OCI archive's images pushed to such a registry as
one index of several architectures (archway's own image for a cluster of two).

    binary = go_binary("pause")                       # ~/.cache/archway/bin/pause-amd64-<hash>
    image = OciImage.of({"/pause": binary}, entrypoint=["/pause"])
    image.write_archive(path, "localhost/pause:1")    # then: ctr -n k8s.io images import path
"""
import hashlib
import io
import json
import os
import platform
import subprocess
import tarfile
import tempfile
from dataclasses import dataclass

from lab.procs import REPO
from lab.servers.registry import OCI_CONFIG, OCI_INDEX, OCI_MANIFEST, sha256_digest

GO_SOURCES = os.path.join(REPO, "lab", "cluster", "go")
OCI_LAYER = "application/vnd.oci.image.layer.v1.tar"      # uncompressed: its digest is its diff_id
# e_machine values (ELF header offset 18, 2 bytes little-endian).
EM_IA_64 = 50   # a machine no kernel or binfmt/qemu handler here runs


def machine_arch() -> str:
    """This machine's architecture as Kubernetes names it."""
    return {"x86_64": "amd64", "aarch64": "arm64", "ppc64le": "ppc64le",
            "s390x": "s390x"}.get(platform.machine(), platform.machine())


def _go() -> str:
    done = subprocess.run(["bash", os.path.join(REPO, "scripts", "go-toolchain.sh"), "1.21"],
                          capture_output=True, text=True, check=True)
    return done.stdout.strip().splitlines()[-1]


def go_binary(name: str, goarch: str | None = None) -> str:
    """lab/cluster/go/<name>/main.go built static for `goarch`, cached by its source's content."""
    goarch = goarch or machine_arch()
    source = os.path.join(GO_SOURCES, name, "main.go")
    with open(source, "rb") as f:
        digest = hashlib.sha256(f.read()).hexdigest()[:16]
    cache = os.path.join(os.path.expanduser("~/.cache/archway/bin"))
    out = os.path.join(cache, f"{name}-{goarch}-{digest}")
    if not os.path.exists(out):
        os.makedirs(cache, exist_ok=True)
        env = {**os.environ, "CGO_ENABLED": "0", "GOOS": "linux", "GOARCH": goarch,
               "GOFLAGS": "-mod=mod", "GOTOOLCHAIN": "local", "GO111MODULE": "off"}
        partial = out + ".partial"
        subprocess.run([_go(), "build", "-trimpath", "-ldflags=-s -w", "-o", partial, source],
                       env=env, check=True, capture_output=True, cwd=os.path.dirname(source))
        os.replace(partial, out)
    return out


def with_machine(binary: bytes, machine: int) -> bytes:
    """The ELF `binary` claiming another machine: the kernel refuses it with ENOEXEC."""
    if binary[:4] != b"\x7fELF":
        raise ValueError("not an ELF file")
    return binary[:18] + machine.to_bytes(2, "little") + binary[20:]


def _layer(files: dict[str, bytes]) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for path, data in sorted(files.items()):
            info = tarfile.TarInfo(path.lstrip("/"))
            info.size, info.mode, info.mtime = len(data), 0o755, 0
            tar.addfile(info, io.BytesIO(data))
    return buffer.getvalue()


@dataclass(frozen=True)
class OciImage:
    config: bytes
    layer: bytes
    manifest: bytes

    @classmethod
    def of(cls, files: dict[str, str | bytes], *, entrypoint: list[str], arch: str | None = None,
           user: str | None = None) -> "OciImage":
        """One layer holding `files` (path in the image -> a file here or its bytes)."""
        contents = {}
        for path, source in files.items():
            if isinstance(source, bytes):
                contents[path] = source
            else:
                with open(source, "rb") as f:
                    contents[path] = f.read()
        layer = _layer(contents)
        config_doc = {"architecture": arch or machine_arch(), "os": "linux",
                      "config": {"Entrypoint": entrypoint, **({"User": user} if user else {})},
                      "rootfs": {"type": "layers", "diff_ids": [sha256_digest(layer)]}}
        config = json.dumps(config_doc, sort_keys=True).encode()
        manifest = json.dumps({
            "schemaVersion": 2, "mediaType": OCI_MANIFEST,
            "config": {"mediaType": OCI_CONFIG, "digest": sha256_digest(config), "size": len(config)},
            "layers": [{"mediaType": OCI_LAYER, "digest": sha256_digest(layer), "size": len(layer)}],
        }, sort_keys=True).encode()
        return cls(config, layer, manifest)

    @property
    def digest(self) -> str:
        return sha256_digest(self.manifest)

    def index_entry(self) -> dict:
        """This image as an entry of an index (push_index)."""
        config = json.loads(self.config)
        return {"mediaType": OCI_MANIFEST, "digest": self.digest, "size": len(self.manifest),
                "platform": {"architecture": config["architecture"], "os": config["os"]}}

    def write_archive(self, path: str, name: str) -> str:
        """An OCI image layout tar whose image `ctr images import` names `name`."""
        index = json.dumps({"schemaVersion": 2, "mediaType": OCI_INDEX, "manifests": [{
            "mediaType": OCI_MANIFEST, "digest": self.digest, "size": len(self.manifest),
            "annotations": {"io.containerd.image.name": name,
                            "org.opencontainers.image.ref.name": name.rsplit(":", 1)[-1]}}]}).encode()
        entries = {"oci-layout": b'{"imageLayoutVersion": "1.0.0"}', "index.json": index}
        for blob in (self.config, self.layer, self.manifest):
            entries[f"blobs/sha256/{sha256_digest(blob).split(':')[1]}"] = blob
        directory = os.path.dirname(path)
        with tempfile.NamedTemporaryFile(dir=directory, delete=False) as out:
            with tarfile.open(fileobj=out, mode="w") as tar:
                for member, data in entries.items():
                    info = tarfile.TarInfo(member)
                    info.size, info.mode = len(data), 0o644
                    tar.addfile(info, io.BytesIO(data))
        os.replace(out.name, path)
        return path

    def push(self, registry, repo: str, tag: str) -> str:
        """Pushed to a lab/servers/registry.py RegistryServer; returns the manifest digest."""
        registry.push_blob(repo, self.config)
        registry.push_blob(repo, self.layer)
        return registry.push_manifest(repo, tag, self.manifest, OCI_MANIFEST)


def push_archive(registry, repo: str, path: str) -> list[dict]:
    """Every image manifest of an OCI archive (an image layout tar: build-image.sh's
    --oci-archive) pushed to `registry` by digest, its blobs first. Returns an index entry per
    manifest (mediaType, digest, size, platform), so that several archives make one index."""
    entries = []
    with tarfile.open(path) as tar:
        members = {m.name.removeprefix("./"): m for m in tar.getmembers()}

        def read(name: str) -> bytes:
            f = tar.extractfile(members[name])
            assert f is not None, name
            return f.read()

        def blob(digest: str) -> bytes:
            return read(f"blobs/sha256/{digest.split(':', 1)[1]}")

        pending = list(json.loads(read("index.json"))["manifests"])
        while pending:
            descriptor = pending.pop(0)
            body = blob(descriptor["digest"])
            doc = json.loads(body)
            if "manifests" in doc:      # an index inside: its images are pushed, not it
                pending += doc["manifests"]
                continue
            config = blob(doc["config"]["digest"])
            for data in (config, *(blob(layer["digest"]) for layer in doc["layers"])):
                registry.push_blob(repo, data)
            registry.push_manifest(repo, descriptor["digest"], body, descriptor["mediaType"])
            platform = descriptor.get("platform") or {
                k: json.loads(config)[k] for k in ("architecture", "os")}
            entries.append({"mediaType": descriptor["mediaType"], "digest": descriptor["digest"],
                            "size": len(body), "platform": platform})
    return entries


def push_index(registry, repo: str, tag: str, entries: list[dict]) -> str:
    """An OCI index of `entries` (index entries of manifests already pushed) at `repo:tag`."""
    index = json.dumps({"schemaVersion": 2, "mediaType": OCI_INDEX, "manifests": entries}).encode()
    return registry.push_manifest(repo, tag, index, OCI_INDEX)
