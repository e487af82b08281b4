"""The real-node tier: pods that actually run. A real control plane (lab/cluster/controlplane.py)
with one real node of this machine's architecture (lab/cluster/realnode.py: containerd, runc,
bridge networking, a kubelet, kube-proxy) beside the API-only Nodes of the other architectures,
and a real registry the node pulls from over plain HTTP. One such cluster per test run, started
by the first test that asks for it; only one real node can run on a machine at a time, so a test
that starts its own (`scripts/cluster.sh up --real-node`) stops the session's first
(`session_node.stop()`), and the next test that asks starts it again.
"""
import os

import pytest

from lab.cluster.controlplane import ControlPlane
from lab.cluster.realnode import RealNode, api_only_nodes, node_address, teardown
from lab.servers.registry import RegistryServer


def pytest_collection_modifyitems(items):
    here = os.path.dirname(__file__)
    for item in items:
        if str(item.fspath).startswith(here) and "session_node" in item.fixturenames:
            item.add_marker(pytest.mark.slow)
            item.add_marker(pytest.mark.realnode)


class SessionNode:
    """The session's cluster with a real node, started on first use."""

    def __init__(self, tmp_path_factory, registry: RegistryServer):
        self.tmp_path_factory = tmp_path_factory
        self.registry = registry
        self.plane: ControlPlane | None = None
        self.node: RealNode | None = None
        self.archway = None       # the in_cluster install on this node, when one was made

    def get(self) -> tuple[ControlPlane, RealNode]:
        if self.plane is None or self.node is None:
            plane = ControlPlane(str(self.tmp_path_factory.mktemp("real-node")),
                                 node_ip=node_address(), nodes=api_only_nodes())
            try:
                plane.start()
                self.node = RealNode(plane, insecure_registries=[self.registry.host]).start()
            except BaseException:
                teardown(plane)
                plane.stop()
                raise
            self.plane = plane
        assert self.node is not None
        return self.plane, self.node

    def stop(self) -> list[str]:
        left: list[str] = []
        if self.plane is not None:
            left = teardown(self.plane)
            self.plane.stop()
        self.plane = self.node = self.archway = None
        return left


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A failed test that had archway installed shows archway's logs: CI keeps nothing else of a
    run, and a flaky failure is read only there."""
    report = (yield).get_result()
    install = getattr(item, "funcargs", {}).get("in_cluster")
    if report.when == "call" and report.failed and install is not None and install.installed:
        try:
            report.sections.append(("archway's logs", install.logs()))
        except Exception as e:   # the cluster itself may be what failed
            report.sections.append(("archway's logs", f"could not be read: {e}"))


@pytest.fixture(scope="session")
def node_registry(tmp_path_factory):
    """A plain-HTTP registry on this machine's own address: the node's containerd pulls from it
    (an insecure host of the node) and archway's pods read it."""
    registry = RegistryServer(tmp_path_factory.mktemp("node-registry"), schema1=False,
                              address=node_address())
    try:
        yield registry
    finally:
        registry.stop()


@pytest.fixture(scope="session")
def session_node(tmp_path_factory, node_registry):
    # containerd, the kubelet, iptables and cgroups: only root may start a node. A tier that
    # cannot run fails, so that a run without it never passes for one with it.
    if os.geteuid() != 0:
        pytest.fail("the real-node tier needs root (containerd, the kubelet, iptables, "
                    "cgroups): run the tests as root, or leave the tier out with "
                    "-m 'not realnode'", pytrace=False)
    session = SessionNode(tmp_path_factory, node_registry)
    try:
        yield session
    finally:
        session.stop()


@pytest.fixture
def real_cluster(session_node) -> tuple[ControlPlane, RealNode]:
    return session_node.get()


@pytest.fixture
def in_cluster(session_node, node_registry):
    """archway installed by helm on the session's real node (lab/cluster/incluster.py): once,
    and again only after a test uninstalled it or the node was stopped."""
    from lab.cluster.incluster import InClusterInstall
    plane, node = session_node.get()
    if session_node.archway is None or not session_node.archway.installed:
        session_node.archway = InClusterInstall(plane, node, archway_config={
            "registry": {"insecure_hosts": [node_registry.host]}}).install()
    return session_node.archway
