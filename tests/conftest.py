import os
import sys

import pytest

# Tests import the packages from the checkout even when it is not pip-installed.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="session")
def control_plane(tmp_path_factory):
    """The test run's one real control plane (tests/infra/controlplane.py): started by the first
    test that asks for it, stopped at the end. A namespace per test: `control_plane.new_namespace`."""
    from tests.infra.controlplane import ControlPlane
    plane = ControlPlane(str(tmp_path_factory.mktemp("control-plane"))).start()
    try:
        yield plane
    finally:
        plane.stop()


def pytest_collection_modifyitems(items):
    # A test on the real control plane is outside the fast inner loop (`-m "not slow"`).
    for item in items:
        if "control_plane" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.slow)
