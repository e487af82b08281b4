"""archway names itself and its version in every request it makes (issue 38, finding 8): a
registry's, Prometheus' and the Kubernetes API's operators can tell its traffic apart. The real
registry's access log (docker-registry), and a server that records what Prometheus and the
Kubernetes API are sent."""
import json
import threading
from http.server import BaseHTTPRequestHandler

import pytest

from archway import __version__
from archway.config import RegistrySettings, config_from_dict
from archway.extender.prometheus import TrafficPoller
from archway.kubeapi import KubeApi
from archway.kubeclient import build_api_client
from archway.registry.resolver import Resolver
from archway.vocabulary import USER_AGENT
from lab.httpd import BackgroundHTTPServer
from lab.servers.registry import RegistryServer

ARCHWAY = f"archway/{__version__}"


def test_the_user_agent_is_archway_and_its_version():
    assert USER_AGENT == ARCHWAY
    assert __version__ and __version__ != "0+unknown"


def test_a_registry_sees_archway_in_every_request(tmp_path):
    registry = RegistryServer(str(tmp_path / "registry"))
    try:
        registry.push_index("archway/multi", "1.0", ["linux/amd64", "linux/arm64"])
        mark = registry.mark()
        info = Resolver(RegistrySettings(insecure_hosts=(registry.host,))).resolve(
            f"{registry.host}/archway/multi:1.0")
        assert info.architectures == {"amd64", "arm64"}
        seen = registry.requests_since(mark)
        assert seen and {entry.agent for entry in seen} == {ARCHWAY}, seen
    finally:
        registry.stop()


class Recorder:
    """An HTTP server that records each request's User-Agent and answers `body` (JSON)."""

    def __init__(self, body: dict):
        self.agents: list[str] = []
        lock = threading.Lock()
        recorder = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_GET(self):
                with lock:
                    recorder.agents.append(self.headers.get("User-Agent", ""))
                data = json.dumps(body).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.server = BackgroundHTTPServer(Handler)
        self.url = f"http://127.0.0.1:{self.server.port}"

    def stop(self):
        self.server.stop()


@pytest.fixture
def recorder(request):
    server = Recorder(request.param)
    yield server
    server.stop()


@pytest.mark.parametrize("recorder", [{"status": "success",
                                       "data": {"resultType": "vector", "result": []}}],
                         indirect=True)
def test_prometheus_sees_archway(recorder):
    poller = TrafficPoller(config_from_dict({"prometheus": {"url": recorder.url}}).prometheus)
    poller.refresh_once()
    assert poller.last_error is None
    assert recorder.agents == [ARCHWAY]


@pytest.mark.parametrize("recorder", [{"kind": "Namespace", "apiVersion": "v1",
                                       "metadata": {"name": "shop"}}], indirect=True)
def test_the_kubernetes_api_sees_archway(recorder, tmp_path):
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(json.dumps({
        "apiVersion": "v1", "kind": "Config", "current-context": "c",
        "clusters": [{"name": "c", "cluster": {"server": recorder.url}}],
        "users": [{"name": "u", "user": {"token": "t"}}],
        "contexts": [{"name": "c", "context": {"cluster": "c", "user": "u"}}]}))
    settings = config_from_dict({"kubernetes": {"kubeconfig": str(kubeconfig)}}).kubernetes
    client, _ = build_api_client(settings)
    assert KubeApi(client).request("GET", "/api/v1/namespaces/shop")["metadata"]["name"] == "shop"
    assert recorder.agents == [ARCHWAY]
