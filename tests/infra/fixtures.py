"""pytest fixtures over the lab's servers: a test module imports the ones it uses
(`from tests.infra.fixtures import plain_registry`). One CA per session; one registry per module
that asks for it; one Prometheus stack per session."""
import pytest

from lab.servers.prometheus import (
    FAKE_RATES,
    LINK_RATES,
    LINK_SPEEDS,
    FakeNodeExporters,
    NodeExporter,
    PrometheusServer,
    PrometheusStack,
)
from lab.servers.registry import RegistryServer
from lab.tls import CertificateAuthority, session_ca

# registry.allow_hosts for tests whose registries, token services and mirrors listen on
# loopback: archway refuses loopback unless the operator lists it (registry.hostpolicy).
LOOPBACK_HOSTS = ("127.0.0.1:*", "localhost:*", "[::1]:*")


@pytest.fixture(scope="session")
def test_ca(tmp_path_factory) -> CertificateAuthority:
    """One CA for the whole test session; issue what you need from it."""
    return session_ca(tmp_path_factory)


@pytest.fixture(scope="session")
def prometheus_stack(tmp_path_factory):
    """Prometheus + three fake nodes (FAKE_RATES) + this machine's node_exporter, once per
    session, and the LINK_RATES nodes in job "links". Tests that change rates or stop Prometheus
    must put things back."""
    directory = tmp_path_factory.mktemp("prometheus")
    fake = FakeNodeExporters(FAKE_RATES)
    links = FakeNodeExporters(LINK_RATES, LINK_SPEEDS, subnet=1)
    node_exporter = prometheus = None
    try:
        node_exporter = NodeExporter(directory)
        prometheus = PrometheusServer(directory, fake, node_exporter, links)
        yield PrometheusStack(fake, node_exporter, prometheus, links)
    finally:
        for part in (prometheus, node_exporter, fake, links):
            if part is not None:
                part.stop()


def registry_fixture(**options):
    @pytest.fixture(scope="module")
    def fixture(tmp_path_factory):
        kwargs = dict(options)
        if kwargs.pop("tls", False):
            kwargs["ca"] = session_ca(tmp_path_factory)
        server = RegistryServer(tmp_path_factory.mktemp("registry"), **kwargs)
        try:
            yield server
        finally:
            server.stop()
    return fixture


plain_registry = registry_fixture()                       # HTTP, anonymous
tls_registry = registry_fixture(tls=True)                 # HTTPS signed by test_ca, anonymous
basic_auth_registry = registry_fixture(tls=True, auth="htpasswd")
token_registry = registry_fixture(tls=True, auth="token")  # token server: pull+push for users only
