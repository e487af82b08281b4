"""The end-to-end tier: archway against a real control plane (lab/cluster/controlplane.py) —
kube-apiserver calling the webhook the chart registered, the real scheduler and archway's second
scheduler binding pods, the controller-manager turning Deployments into pods — with images in a
real registry. One control plane (tests/conftest.py) and one install per test run; a namespace
per test.

What the tests look at is what the API shows an operator: pods, their nodeName, gates,
annotations and Events.
"""
import os
import re
import time

import pytest

from lab.cluster.chart import ChartInstall
from lab.kube import Kube
from lab.servers.proxy import DelayProxy
from lab.servers.registry import RegistryServer

DEADLINE = 1.0         # admission.deadline_seconds: a registry slower than this is a miss
GATE_MAX = 60.0        # admission.gate_max_seconds for the session (tests that need less restart)
LEASE = 6.0            # admission.gate_lease_seconds

# repository -> platforms, pushed once per session
IMAGES = {
    "e2e/multi": ["linux/amd64", "linux/arm64"],
    "e2e/arm64": ["linux/arm64"],
    "e2e/amd64": ["linux/amd64"],
    "e2e/ppc64le": ["linux/ppc64le"],
    "e2e/everywhere": ["linux/amd64", "linux/arm64", "linux/ppc64le"],
}


def pytest_collection_modifyitems(items):
    here = os.path.dirname(__file__)
    for item in items:
        if str(item.fspath).startswith(here):
            item.add_marker(pytest.mark.e2e)
            item.add_marker(pytest.mark.slow)


class Images:
    """The session's registry, and the slowed and dead ways to reach it."""

    def __init__(self, registry: RegistryServer, slow: DelayProxy, dead: DelayProxy):
        self.registry = registry
        self.slow = slow
        self.dead = dead
        self._fresh = 0

    def ref(self, repo: str, tag: str = "1", via: str = "registry") -> str:
        host = {"registry": self.registry.host, "slow": self.slow.host, "dead": self.dead.host}[via]
        return f"{host}/{repo}:{tag}"

    def fresh(self, repo: str, platforms=None) -> str:
        """A tag nobody has read yet (so archway's cache cannot answer it): the tag only."""
        self._fresh += 1
        tag = f"fresh-{self._fresh}-{int(time.time() * 1000) % 100000}"
        platforms = platforms or IMAGES[repo]
        if len(platforms) == 1:
            self.registry.push_image(repo, tag, platforms[0])
        else:
            self.registry.push_index(repo, tag, platforms)
        return tag


@pytest.fixture(scope="session")
def images(tmp_path_factory):
    registry = RegistryServer(tmp_path_factory.mktemp("e2e-registry"))
    slow = DelayProxy(registry.port)
    dead = DelayProxy(registry.port, hang=True)
    try:
        for repo, platforms in IMAGES.items():
            if len(platforms) == 1:
                registry.push_image(repo, "1", platforms[0])
            else:
                registry.push_index(repo, "1", platforms)
        yield Images(registry, slow, dead)
    finally:
        for part in (dead, slow, registry):
            part.stop()


def archway_config(images: Images) -> dict:
    return {
        "registry": {"insecure_hosts": [images.registry.host, images.slow.host, images.dead.host],
                     "timeout_seconds": 2.0},
        "admission": {"deadline_seconds": DEADLINE, "gate_max_seconds": GATE_MAX,
                      "gate_lease_seconds": LEASE},
        "server": {"workers": 2, "threads": 4, "log_every_admission": True},
        # No kubelet stands behind these Nodes: asked for a pod's log, the apiserver would
        # resolve the Node's name or dial its address, traffic that must not leave the machine.
        # The log path is tested on a real node (tests/node/test_closed_loop.py).
        # Eviction (on by default) is off here: the learning tests watch the failing pods stay;
        # test_remediation.py turns it on, and tests/node/test_crash_loops.py runs the default.
        "remediation": {"read_logs": False, "evict": False},
    }


@pytest.fixture(scope="session")
def archway(control_plane, images):
    """archway installed by the chart (gate mode, its default), running as its ServiceAccounts."""
    install = ChartInstall(control_plane, archway_config=archway_config(images)).install()
    try:
        yield install
    finally:
        install.stop_processes()
        logs = "\n".join(a.log(100000) for a in [install.webhook, install.extender, *install.replicas]
                         if a is not None)
        # archway runs with the chart's RBAC: it must never have been refused anything.
        refused = [line for line in logs.splitlines()
                   if re.search(r"(?i)forbidden|(?<![,.:\d-])\b403\b(?![.,]\d)", line)]
        assert not refused, "archway was refused by the apiserver:\n" + "\n".join(refused[:20])


@pytest.fixture
def slow_registry(images):
    """The registry as archway reaches it through `images.slow`: slower than any lookup may
    take, until the test sets the delay back to 0."""
    images.slow.delay = 3.0
    yield images.slow
    images.slow.delay = 0.0


@pytest.fixture
def kube(control_plane) -> Kube:
    return control_plane.kube


@pytest.fixture
def namespace(control_plane, request):
    """A namespace of the test's own, deleted after it."""
    name = re.sub(r"[^a-z0-9-]", "-", f"e2e-{request.node.name.lower()}")[:50].strip("-")
    name = f"{name}-{int(time.time() * 1000) % 10000}"
    control_plane.new_namespace(name)
    yield name
    control_plane.kube.delete(f"/api/v1/namespaces/{name}")
