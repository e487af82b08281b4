"""The one config system: every section checked alike, errors that name file, section and key,
and docs/configuration.md listing exactly the keys the schema has."""
import os
import re

import pytest

from archway.config import Config, config_from_dict, documented_keys, load_config
from archway.errors import ArchwayError, ConfigError

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_defaults_when_no_file(monkeypatch):
    monkeypatch.delenv("ARCHWAY_CONFIG", raising=False)
    assert load_config() == Config()


def test_values_are_read_and_normalised():
    c = config_from_dict({"registry": {"insecure_hosts": [" Reg:5000 "], "timeout_seconds": 2,
                                       "max_manifest_bytes": 1024,
                                       "cache": {"tag_ttl_seconds": 7}},
                          "sif": {"library_url": "https://lib.example/"}})
    assert c.registry.insecure_hosts == ("reg:5000",) and c.registry.timeout_seconds == 2.0
    assert c.registry.max_manifest_bytes == 1024          # documented, and now read
    assert c.registry.cache.tag_ttl_seconds == 7.0 and c.registry.cache.max_entries == 10_000
    assert c.sif.library_url == "https://lib.example"


@pytest.mark.parametrize("data, message", [
    ({"registry": {"alow_hosts": ["a"]}},
     r"cfg.yaml: unknown key\(s\) registry\.alow_hosts \(known in section registry: .*allow_hosts"),
    ({"registry": {"cache": {"max_entrys": 5}}}, r"unknown key\(s\) registry\.cache\.max_entrys"),
    ({"server": {"bnd": "x"}}, r"unknown key\(s\) server\.bnd"),
    ({"regsitry": {}}, r"unknown section\(s\) regsitry"),
    ({"registry": ["x"]}, r"section registry must be a mapping"),
    ({"registry": {"insecure_hosts": "x"}}, r"registry\.insecure_hosts must be a list of strings"),
    ({"registry": {"timeout_seconds": 0}}, r"registry\.timeout_seconds must be a positive number"),
    ({"registry": {"timeout_seconds": True}}, r"registry\.timeout_seconds must be a positive"),
    ({"registry": {"cache": {"max_entries": 2.5}}}, r"registry\.cache\.max_entries must be a whole"),
    ({"registry": {"ca_file": 5}}, r"registry\.ca_file must be a string"),
    ({"server": {"tls": "yes"}}, r"server\.tls must be true or false"),
    ({"prometheus": {"match": "ip"}}, r"prometheus\.match must be one of name, address"),
    ({"placement": {"scheduler_name": False}}, r"YAML reads unquoted on/off.*quote the value"),
])
def test_every_section_is_checked_alike(data, message):
    with pytest.raises(ConfigError, match=message):
        config_from_dict(data, origin="cfg.yaml")


def test_error_names_the_file(tmp_path):
    path = tmp_path / "archway.yaml"
    path.write_text("registry:\n  alow_hosts: [registry.example]\n")
    with pytest.raises(ConfigError, match=re.escape(f"{path}: unknown key(s) registry.alow_hosts")):
        load_config(str(path))
    assert issubclass(ConfigError, ArchwayError)


def test_off_as_the_docs_write_it(tmp_path):
    path = tmp_path / "archway.yaml"
    path.write_text("kubernetes:\n  enabled: off\n")   # YAML 1.1 reads this as false
    assert load_config(str(path)).kubernetes.enabled == "off"


def test_docs_list_exactly_the_schema_keys():
    text = open(os.path.join(REPO, "docs", "configuration.md"), encoding="utf-8").read()
    documented, section = set(), None
    for line in text.splitlines():
        heading = re.match(r"^## (\w+)$", line)
        if heading:
            section = heading.group(1)
            continue
        row = re.match(r"^\| `([\w.]+)`(?:, `([\w.]+)`)? \|", line)
        if row and section:
            documented.update(f"{section}.{k}" for k in row.groups() if k)
    assert documented == set(documented_keys())


def test_unresolved_replaces_fail_closed_which_still_works_with_a_warning():
    from archway.config import deprecations
    assert Config().admission.unresolved == "admit" and deprecations(Config()) == []
    old = config_from_dict({"admission": {"fail_closed": True}})
    assert old.admission.unresolved == "deny"
    assert deprecations(old) == [("admission.fail_closed is deprecated: write "
                                  "admission.unresolved: deny instead")]
    assert config_from_dict({"admission": {"fail_closed": False}}).admission.unresolved == "admit"
    new = config_from_dict({"admission": {"unresolved": "gate", "gate_max_seconds": 30},
                            "placement": {"fallback_architectures": ["amd64"]}})
    assert (new.admission.unresolved, new.admission.gate_max_seconds,
            new.placement.fallback_architectures) == ("gate", 30.0, ("amd64",))
    with pytest.raises(ConfigError, match="admission.unresolved must be one of admit, gate, deny"):
        config_from_dict({"admission": {"unresolved": "wait"}})


def test_gate_without_a_kubernetes_api_is_refused_at_start_up(tmp_path):
    import subprocess
    import sys
    path = tmp_path / "c.yaml"
    path.write_text("admission: {unresolved: gate}\nkubernetes: {enabled: \"off\"}\n"
                    f"server: {{state_dir: {tmp_path}}}\n")
    done = subprocess.run([sys.executable, "-m", "archway.main.cli", "--config", str(path), "serve",
                           "--bind", "127.0.0.1:1"], capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 2
    assert "admission.unresolved is gate, but no Kubernetes API is configured" in done.stderr


def test_a_metrics_address_on_the_serving_port_is_refused_at_start_up(tmp_path):
    import subprocess
    import sys
    path = tmp_path / "c.yaml"
    path.write_text(f"server: {{state_dir: {tmp_path}, metrics_bind: '0.0.0.0:9443'}}\n"
                    "kubernetes: {enabled: \"off\"}\n")
    done = subprocess.run([sys.executable, "-m", "archway.main.cli", "--config", str(path), "serve",
                           "--bind", "127.0.0.1:9443"], capture_output=True, text=True, timeout=60,
                          check=False)
    assert done.returncode == 2
    assert "server.metrics_bind 0.0.0.0:9443 must use another port" in done.stderr
