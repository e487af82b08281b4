"""What every benchmark section shares: a scratch directory, one test CA, archway's serving
certificate, and the config archway runs with (the same shape the Helm chart renders)."""
import base64
import copy
import json
import os
import shutil
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

from archway.registry.model import ImageInfo
from lab.servers.registry import OCI_INDEX, RegistryServer
from lab.tls import CertificateAuthority

# registry.allow_hosts for the lab's registries, all on loopback, which archway refuses unless
# the operator lists it (registry.hostpolicy).
LOOPBACK_HOSTS = ("127.0.0.1:*", "localhost:*", "[::1]:*")

PLATFORMS = ("linux/amd64", "linux/arm64", "linux/arm/v7")


class Lab:
    def __init__(self, keep: bool = False):
        self.directory = tempfile.mkdtemp(prefix="archway-bench-")
        self.keep = keep
        self.ca = CertificateAuthority(self.path("ca"))
        # archway's serving certificate; the baseline app serves the very same pair.
        self.serving = self.ca.issue("archway-bench-serving", ["127.0.0.1", "localhost"])

    def path(self, *parts: str) -> str:
        """A directory inside the lab, created if needed."""
        path = os.path.join(self.directory, *parts)
        os.makedirs(path, exist_ok=True)
        return path

    def archway_config(self, name: str, **sections) -> dict:
        """archway's config: TLS with the lab's pair, the lab CA trusted for registries, no
        cluster unless a section says otherwise; `sections` are merged over that."""
        config = {
            "server": {"cert_file": self.serving.chain_path, "key_file": self.serving.key_path,
                       "state_dir": self.path("state", name), "workers": 2, "threads": 8},
            "registry": {"ca_file": self.ca.cert_path, "allow_hosts": list(LOOPBACK_HOSTS)},
            "kubernetes": {"enabled": "off"},
        }
        for section, values in sections.items():
            config.setdefault(section, {}).update(copy.deepcopy(values))
        return config

    def cleanup(self) -> None:
        if not self.keep:
            shutil.rmtree(self.directory, ignore_errors=True)


def push_index_variants(registry: RegistryServer, repo: str, count: int, *,
                        prefix: str = "v", platforms=PLATFORMS) -> list[str]:
    """`count` distinct multi-platform images in `repo` for one manifest PUT each: the
    platform manifests are pushed once, and every variant is an index of them with its own
    annotation, so each has its own digest (nothing is shared in a cache by digest).
    Returns the tags."""
    registry.push_index(repo, f"{prefix}-base", list(platforms), attestations=True)
    document = json.loads(registry.get_manifest(repo, f"{prefix}-base").content)
    tags = [f"{prefix}{i}" for i in range(count)]

    def push(tag: str) -> None:
        variant = dict(document, annotations={"org.opencontainers.image.version": tag})
        registry.push_manifest(repo, tag, variant, OCI_INDEX)

    with ThreadPoolExecutor(4) as pool:
        list(pool.map(push, tags))
    return tags


def fixture_text(name: str) -> str:
    from lab.procs import REPO
    with open(os.path.join(REPO, "tests", "fixtures", "admission", name)) as f:
        return f.read()


def pod_review(images: list[str], *, uid: str = "bench", namespace: str = "shop") -> bytes:
    """The multi-arch fixture AdmissionReview (a Deployment's pod as the apiserver sends it)
    with one container per image."""
    review = json.loads(fixture_text("v1-pod-multiarch.json"))
    review["request"]["uid"] = uid
    review["request"]["namespace"] = namespace
    spec = review["request"]["object"]["spec"]
    template = spec["containers"][0]
    spec["containers"] = [dict(copy.deepcopy(template), name=f"c{i}", image=image)
                          for i, image in enumerate(images)]
    return json.dumps(review).encode()


def mutated_archs(response) -> set[str]:
    """The architectures archway's patch constrains the pod to (empty when it did not mutate)."""
    if response.status_code != 200:
        raise RuntimeError(f"admission answered {response.status_code}: {response.text[:300]}")
    answer = response.json()["response"]
    if not answer.get("allowed") or "patch" not in answer:
        return set()
    text = base64.b64decode(answer["patch"]).decode()
    return {a for a in ("amd64", "arm64", "arm") if f'"{a}"' in text}


def resolve_ms(resolver, image: str) -> float:
    """Milliseconds `resolver` took to answer `image` (one call, 5 s at most); a failed answer
    stops the figure."""
    start = time.perf_counter()
    answer = resolver.resolve_many([image], timeout=5)[image]
    elapsed = (time.perf_counter() - start) * 1000
    if not isinstance(answer, ImageInfo):
        raise RuntimeError(f"{image}: {answer}")
    return elapsed
