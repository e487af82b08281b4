"""archway changes nothing process-wide: importing it leaves warning filters, the environment,
logging and the garbage collector as they were, and unverified TLS to a host the operator
listed as insecure is quiet without silencing the warning for anyone else."""
import json
import subprocess
import sys
import warnings

import pytest

from archway.config import RegistrySettings
from archway.errors import TransportError
from archway.registry.http import HttpClient
from lab.procs import REPO
from lab.servers.fileserver import FileServer
from tests.infra.fixtures import LOOPBACK_HOSTS, test_ca

_SNAPSHOT = """
import gc, logging, os, socket, sys, warnings
def snapshot():
    return {"warnings": [repr(f) for f in warnings.filters], "environ": dict(os.environ),
            "gc": gc.isenabled(), "root_handlers": len(logging.getLogger().handlers),
            "root_level": logging.getLogger().level, "socket_timeout": socket.getdefaulttimeout()}
"""


def test_importing_every_module_changes_no_process_state():
    code = _SNAPSHOT + """
import importlib, json, pkgutil, archway
# Third-party libraries set their own filters when imported (urllib3 does): not archway's doing.
for library in ("urllib3", "requests", "httptools", "gunicorn", "prometheus_client", "kubernetes",
                "jsonpatch", "yaml", "cryptography"):
    importlib.import_module(library)
before = snapshot()
names = []
import tomllib
with open("pyproject.toml", "rb") as f:
    packages = tomllib.load(f)["tool"]["setuptools"]["packages"]
for package in packages:
    path = importlib.import_module(package).__path__
    names += [f"{package}.{m.name}" for m in pkgutil.iter_modules(path) if not m.ispkg]
for name in names:
    importlib.import_module(name)
print(json.dumps({"before": before, "after": snapshot(), "modules": names}))
"""
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True,
                         capture_output=True, text=True)
    result = json.loads(out.stdout)
    assert {"archway.registry.http", "archway.main.worker", "archway.webhook.service",
            "archway.extender.routes"} <= set(result["modules"])
    assert result["after"] == result["before"]


def test_an_insecure_host_is_fetched_without_a_warning_and_others_still_verify(test_ca):
    server = FileServer(test_ca, {"/x": b"hello"})
    try:
        url = server.url("/x")
        quiet = HttpClient(RegistrySettings(insecure_hosts=(server.host,)))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            response = quiet.get(url, max_bytes=1024)
        assert response.body == b"hello"   # it went through, over unverified TLS
        assert [w for w in caught if "Unverified HTTPS" in str(w.message)] == []
        # The same server is refused when not listed: its certificate is not trusted.
        with pytest.raises(TransportError, match="certificate verify failed"):
            HttpClient(RegistrySettings(allow_hosts=LOOPBACK_HOSTS)).get(url, max_bytes=1024)
    finally:
        server.stop()
