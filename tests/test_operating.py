"""Operating archway: the metrics reference lists exactly the metrics archway declares; a real
`archway serve` reports its version and its certificate's expiry on /metrics, writes only JSON
lines with server.log_format json, and logs a denial with its reason."""
import datetime as dt
import json
import logging
import os
import re
import sys

import pytest
import requests
import yaml
from cryptography import x509
from prometheus_client import Counter, Gauge, Histogram
from prometheus_client.parser import text_string_to_metric_families

import archway
import archway.metrics
from archway.logs import JsonFormatter, logging_dict
from lab.procs import REPO, Server, free_port

FIXTURES = os.path.join(REPO, "tests", "fixtures", "admission")


def declared() -> dict[str, tuple[str, ...]]:
    """Exported name -> label names, for every metric archway/metrics.py declares."""
    found = {}
    for value in vars(archway.metrics).values():
        if isinstance(value, (Counter, Gauge, Histogram)):
            name = value._name + ("_total" if isinstance(value, Counter) else "")
            found[name] = tuple(value._labelnames)
    return found


def test_metrics_reference_lists_exactly_the_declared_metrics():
    with open(os.path.join(REPO, "docs", "metrics.md")) as f:
        rows = re.findall(r"^\| `(archway_[a-z_]+)` \| (\w+) \|([^|]*)\|", f.read(), re.MULTILINE)
    documented = {name: tuple(re.findall(r"`(\w+)`", labels)) for name, _, labels in rows}
    assert len(documented) == len(rows), "a metric is listed twice"
    assert documented == declared()
    kinds = {name: kind for name, kind, _ in rows}
    for value in vars(archway.metrics).values():
        if isinstance(value, (Counter, Gauge, Histogram)):
            name = value._name + ("_total" if isinstance(value, Counter) else "")
            assert kinds[name] == type(value).__name__.lower(), name


def test_json_formatter_writes_one_object_per_line_with_the_extra_fields():
    record = logging.LogRecord("archway.admission", logging.INFO, __file__, 1,
                               "admission %s\nsecond line", ("team/app",), None)
    record.outcome, record.duration_ms, record.odd = "denied", 1.5, object()
    line = JsonFormatter().format(record)
    assert "\n" not in line
    entry = json.loads(line)
    assert entry["message"] == "admission team/app\nsecond line"
    assert entry["level"] == "info" and entry["logger"] == "archway.admission"
    assert entry["outcome"] == "denied" and entry["duration_ms"] == 1.5
    assert entry["odd"].startswith("<object object")
    assert entry["time"].endswith("Z") and dt.datetime.fromisoformat(entry["time"]).tzinfo is not None
    try:
        raise ValueError("boom")
    except ValueError:
        record.exc_info = sys.exc_info()
    assert "ValueError: boom" in json.loads(JsonFormatter().format(record))["exception"]
    config = logging_dict(logging.INFO)
    assert config["loggers"]["gunicorn.error"]["propagate"] is False
    assert config["formatters"]["archway"] == {"()": "archway.logs.JsonFormatter"}


@pytest.fixture(scope="module")
def json_serve(tmp_path_factory):
    """`archway serve` with JSON logs, failing closed: an unreachable image is a denial."""
    home = tmp_path_factory.mktemp("serve")
    port = free_port()
    config = {"server": {"bind": f"127.0.0.1:{port}", "product": "webhook", "log_format": "json",
                         "state_dir": str(home / "state"), "workers": 2, "threads": 2},
              "admission": {"fail_closed": True, "deadline_seconds": 1.0},
              "kubernetes": {"enabled": "off"}}
    (home / "config.yaml").write_text(yaml.safe_dump(config))
    env = {k: v for k, v in os.environ.items()
           if k not in ("ARCHWAY_CONFIG", "PROMETHEUS_MULTIPROC_DIR", "KUBECONFIG")}
    env["HOME"] = str(home)
    server = Server([sys.executable, "-m", "archway.main.cli", "--config", str(home / "config.yaml"),
                     "serve"], port=port, log_path=str(home / "serve.log"), cwd=REPO, env=env,
                    ready_timeout=30)
    session = requests.Session()
    session.trust_env = False
    session.verify = str(home / "state" / "tls" / "ca.crt")
    try:
        yield server, session, f"https://127.0.0.1:{port}", home
    finally:
        server.stop()


def test_metrics_report_the_version_and_the_certificate_expiry(json_serve):
    _, session, base, home = json_serve
    families = {f.name: f for f in text_string_to_metric_families(
        session.get(f"{base}/metrics", timeout=10).text)}
    [info] = families["archway_build_info"].samples
    assert info.labels == {"version": archway.__version__} and info.value == 1
    with open(home / "state" / "tls" / "tls.crt", "rb") as f:
        cert = x509.load_pem_x509_certificate(f.read())
    [expiry] = families["archway_tls_certificate_expiry_timestamp_seconds"].samples
    assert expiry.value == cert.not_valid_after_utc.timestamp()


def test_a_denial_is_logged_with_its_reason_and_every_line_is_json(json_serve):
    server, session, base, home = json_serve
    with open(os.path.join(FIXTURES, "v1-pod-unreachable-image.json")) as f:
        review = json.load(f)
    reply = session.post(f"{base}/mutate", json=review, timeout=10).json()["response"]
    assert reply["allowed"] is False
    message = reply["status"]["message"]
    assert "could not read the architectures of 127.0.0.1:9/team/app:1.0" in message
    server.stop()   # flushes the workers' lines; SIGTERM is a graceful stop
    with open(home / "serve.log") as f:
        lines = [line for line in f.read().splitlines() if line.strip()]
    entries = [json.loads(line) for line in lines]          # every line: one JSON object
    assert {"gunicorn.error", "archway.server", "archway.admission"} <= {e["logger"] for e in entries}
    [denial] = [e for e in entries if e.get("outcome") == "denied"]
    assert denial["reason"] == message and denial["uid"] == review["request"]["uid"]
    assert denial["pod"] == "default/lonely" and message in denial["message"]
