import os
import sys

import pytest

# Tests import the packages from the checkout even when it is not pip-installed.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="session")
def control_plane(tmp_path_factory):
    """The test run's one real control plane (lab/cluster/controlplane.py): started by the first
    test that asks for it, stopped at the end. A namespace per test: `control_plane.new_namespace`."""
    from lab.cluster.controlplane import ControlPlane
    plane = ControlPlane(str(tmp_path_factory.mktemp("control-plane"))).start()
    try:
        yield plane
    finally:
        plane.stop()


@pytest.fixture
def quick_supervisor(monkeypatch):
    """archway.server.supervisor's limits in a test's seconds: back-off at most 0.2 s, a run
    counts as stable after 3 s, a crash loop fails /healthz after 1.5 s (90 s in production)."""
    from archway.server import supervisor
    for name, seconds in (("RESTART_MIN_SECONDS", 0.05), ("RESTART_MAX_SECONDS", 0.2),
                          ("STABLE_SECONDS", 3.0), ("DOWN_LIMIT_SECONDS", 1.5)):
        monkeypatch.setattr(supervisor, name, seconds)
    return supervisor


def pytest_collection_modifyitems(items):
    # A test on the real control plane is outside the fast inner loop (`-m "not slow"`).
    for item in items:
        if "control_plane" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.slow)
