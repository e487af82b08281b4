"""`archway scheduler-config`: the KubeSchedulerConfiguration the second scheduler runs with."""
import subprocess
import sys

import pytest
import yaml

from archway.errors import ConfigError
from archway.extender.schedconfig import build_scheduler_config
from lab.procs import REPO

# Field names of the Go types in k8s.io/kube-scheduler/config/v1 (json tags): a misspelt key
# (e.g. the legacy Policy file's `enableHttps`) would be rejected by kube-scheduler's strict decoding.
CONFIG_FIELDS = {"apiVersion", "kind", "parallelism", "leaderElection", "clientConnection",
                 "healthzBindAddress", "metricsBindAddress", "enableProfiling",
                 "enableContentionProfiling", "percentageOfNodesToScore",
                 "podInitialBackoffSeconds", "podMaxBackoffSeconds", "profiles", "extenders",
                 "delayCacheUntilActive"}
LEADER_ELECTION_FIELDS = {"leaderElect", "leaseDuration", "renewDeadline", "retryPeriod",
                          "resourceLock", "resourceName", "resourceNamespace"}
PROFILE_FIELDS = {"schedulerName", "percentageOfNodesToScore", "plugins", "pluginConfig"}
EXTENDER_FIELDS = {"urlPrefix", "filterVerb", "preemptVerb", "prioritizeVerb", "weight", "bindVerb",
                   "enableHTTPS", "tlsConfig", "httpTimeout", "nodeCacheCapable",
                   "managedResources", "ignorable"}


def run_cli(*args):
    return subprocess.run([sys.executable, "-m", "archway.main.cli", "scheduler-config", *args],
                          cwd=REPO, capture_output=True, text=True, timeout=60)


def check_known_fields(doc):
    assert set(doc) <= CONFIG_FIELDS
    assert set(doc["leaderElection"]) <= LEADER_ELECTION_FIELDS
    for profile in doc["profiles"]:
        assert set(profile) <= PROFILE_FIELDS
    for extender in doc["extenders"]:
        assert set(extender) <= EXTENDER_FIELDS


def test_defaults_exactly():
    doc = build_scheduler_config()
    assert doc == {
        "apiVersion": "kubescheduler.config.k8s.io/v1",
        "kind": "KubeSchedulerConfiguration",
        "leaderElection": {"leaderElect": True, "resourceName": "archway-scheduler",
                           "resourceNamespace": "archway"},
        "profiles": [{"schedulerName": "archway-scheduler"}],
        "extenders": [{"urlPrefix": "http://127.0.0.1:8444/scheduler", "filterVerb": "filter",
                       "prioritizeVerb": "prioritize", "weight": 1, "enableHTTPS": False,
                       "nodeCacheCapable": True, "ignorable": True, "httpTimeout": "3s"}],
    }
    # The chart renders the same document: the key order is part of the contract.
    assert list(doc) == ["apiVersion", "kind", "leaderElection", "profiles", "extenders"]
    assert list(doc["extenders"][0]) == ["urlPrefix", "filterVerb", "prioritizeVerb", "weight",
                                         "enableHTTPS", "nodeCacheCapable", "ignorable",
                                         "httpTimeout"]
    check_known_fields(doc)


def test_without_prioritize_no_verb_and_no_weight():
    doc = build_scheduler_config(prioritize=False, weight=0)   # the weight is then unused
    assert list(doc["extenders"][0]) == ["urlPrefix", "filterVerb", "enableHTTPS",
                                         "nodeCacheCapable", "ignorable", "httpTimeout"]
    check_known_fields(doc)
    result = run_cli("--no-prioritize")
    assert result.returncode == 0, result.stderr
    assert yaml.safe_load(result.stdout) == build_scheduler_config(prioritize=False)


def test_cli_prints_the_default_document_as_yaml():
    result = run_cli()
    assert result.returncode == 0, result.stderr
    assert yaml.safe_load(result.stdout) == build_scheduler_config()
    assert result.stdout.startswith("apiVersion: kubescheduler.config.k8s.io/v1\nkind: ")


def test_cli_options_reach_the_document():
    result = run_cli("--scheduler-name", "arch-aware", "--extender-url",
                     "https://archway.archway.svc:8443/scheduler/", "--weight", "3",
                     "--no-node-cache-capable", "--http-timeout", "1500ms",
                     "--lease-namespace", "kube-system", "--lease-name", "arch-aware")
    assert result.returncode == 0, result.stderr
    doc = yaml.safe_load(result.stdout)
    check_known_fields(doc)
    assert doc["profiles"] == [{"schedulerName": "arch-aware"}]
    assert doc["leaderElection"] == {"leaderElect": True, "resourceName": "arch-aware",
                                     "resourceNamespace": "kube-system"}
    extender = doc["extenders"][0]
    # The scheduler POSTs <urlPrefix>/<verb>: these must land on archway's routes.
    assert f"{extender['urlPrefix']}/{extender['filterVerb']}".endswith(":8443/scheduler/filter")
    assert f"{extender['urlPrefix']}/{extender['prioritizeVerb']}".endswith("/scheduler/prioritize")
    assert extender["weight"] == 3 and extender["nodeCacheCapable"] is False
    assert extender["enableHTTPS"] is True and extender["httpTimeout"] == "1500ms"
    assert extender["ignorable"] is True


@pytest.mark.parametrize("args, words", [
    (["--weight", "0"], "weight must be a positive integer"),
    (["--http-timeout", "2 seconds"], "not a duration"),
    (["--extender-url", "127.0.0.1:8444/scheduler"], "must start with http"),
    (["--scheduler-name", ""], "must not be empty"),
])
def test_cli_refuses_values_kube_scheduler_would_refuse(args, words):
    result = run_cli(*args)
    assert result.returncode == 2 and words in result.stderr and result.stdout == ""


def test_builder_refuses_a_bool_weight():
    with pytest.raises(ConfigError):
        build_scheduler_config(weight=True)


TLS_CONFIG_FIELDS = {"insecure", "serverName", "certFile", "keyFile", "caFile", "certData",
                     "keyData", "caData"}


def test_https_extender_gets_the_ca_as_tls_config(tmp_path):
    import base64

    from archway.certs.x509 import issue_ca
    ca = issue_ca("archway test CA", days=1)
    (tmp_path / "ca.crt").write_bytes(ca.cert_pem)
    result = run_cli("--extender-url", "https://archway.archway.svc:8443/scheduler",
                     "--ca-file", str(tmp_path / "ca.crt"))
    assert result.returncode == 0, result.stderr
    doc = yaml.safe_load(result.stdout)
    check_known_fields(doc)
    tls = doc["extenders"][0]["tlsConfig"]
    assert set(tls) <= TLS_CONFIG_FIELDS
    assert base64.b64decode(tls["caData"]) == ca.cert_pem
    insecure = yaml.safe_load(run_cli("--extender-url", "https://a:8443/scheduler",
                                      "--insecure").stdout)
    assert insecure["extenders"][0]["tlsConfig"] == {"insecure": True}
    assert "tlsConfig" not in build_scheduler_config()


@pytest.mark.parametrize("args, words", [
    (["--insecure"], "only applies to an https://"),
    (["--extender-url", "https://a/s", "--ca-file", "/nonexistent/ca.crt"], "no such file"),
    (["--extender-url", "https://a/s", "--ca-file", "/etc/hostname"], "no PEM certificate"),
])
def test_tls_options_refused_where_they_cannot_apply(args, words):
    result = run_cli(*args)
    assert result.returncode == 2 and words in result.stderr and result.stdout == ""
