"""The extender's node cache is the one archway.main.app builds for the process (issue 23): it honours
kubernetes.enabled and extender.node_cache, and the extender never builds one of its own."""
import json
import logging
import os
import threading

import pytest

from archway.config import config_from_dict
from archway.main.worker import build_worker
from lab.servers.apiserver import FakeApiServer
from tests.infra.siteclient import SiteClient

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures", "extender")
NAMES = ["amd64-1", "arm64-1", "s390x-1"]


def nodenames_body() -> str:
    with open(os.path.join(FIXTURES, "filter-nodenames.json")) as f:
        pod = json.load(f)["Pod"]   # annotated amd64,arm64 by the webhook
    return json.dumps({"Pod": pod, "Nodes": None, "NodeNames": NAMES})


@pytest.fixture
def api():
    # Only a recorder here: what is checked is that nothing at all reaches it.
    server = FakeApiServer()
    yield server
    server.stop()


def extender_app(api, tmp_path, **kubernetes):
    config = config_from_dict({
        "kubernetes": {"kubeconfig": api.kubeconfig(str(tmp_path)), **kubernetes},
        "extender": {"node_cache": True}, "server": {"tls": False}})
    worker = build_worker(config, product="extender")
    return worker, worker.extender


def test_with_kubernetes_off_the_extender_lists_no_nodes(api, tmp_path, caplog):
    caplog.set_level(logging.INFO)
    worker, extender = extender_app(api, tmp_path, enabled="off")
    try:
        client = SiteClient(worker)
        r = client.post("/scheduler/filter", data=nodenames_body())
        assert r.status_code == 200, r.data
        assert r.get_json()["NodeNames"] == NAMES   # no cache: every name passes
        assert client.post("/scheduler/prioritize", data=nodenames_body()).status_code == 200
        assert extender.node_cache is None
        assert "archway-node-cache" not in {t.name for t in threading.enumerate()}
        assert "node cache stays empty" not in caplog.text
        assert api.requests == []
    finally:
        extender.stop()


def test_with_cluster_access_the_extender_reads_the_one_node_cache_of_the_process(api, tmp_path):
    worker, extender = extender_app(api, tmp_path)
    try:
        assert extender.node_cache is not None
        assert extender.node_cache is worker.node_cache
    finally:
        extender.stop()
