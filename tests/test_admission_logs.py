"""What a fail-open admission's log line says (issue 21, item 9): each image that failed and why,
in text and in JSON; a dead egress proxy named as the proxy, not as the registry; a registry
that wants credentials none of the pod's secrets hold is not said to have refused them.

Real peers fail here: docker-registry with token auth (lab/servers/registry.py), a closed port,
a proxy address nobody listens on, tinyproxy in front of a registry that is gone."""
import json
import logging

import pytest

from archway.config import ProxySettings, RegistrySettings
from archway.errors import AuthError, ProxyFailed, classify_error
from archway.logs import JsonFormatter
from archway.placement.policy import Policy
from archway.registry.credentials import Credential, Keyring
from archway.registry.resolver import Resolver
from lab.procs import free_port
from lab.tls import session_ca
from tests.infra.fixtures import LOOPBACK_HOSTS, plain_registry, test_ca, token_registry
from tests.infra.forwardproxy import ForwardProxy
from tests.test_service import Secrets, review, service

pytestmark = pytest.mark.slow


def admit(resolver, *images, keyring=None):
    return service(resolver, Secrets(keyring=keyring), policy=Policy()).review(review(*images))


def fail_open_record(caplog):
    records = [r for r in caplog.records if r.name == "archway.admission"
               and "outcome=fail_open" in r.getMessage()]
    assert len(records) == 1, [r.getMessage() for r in caplog.records]
    return records[0]


def test_the_line_names_each_failed_image_and_why(token_registry, test_ca, caplog):
    reg = token_registry
    reg.push_image("team/private", "v1", "linux/arm64")
    down = f"127.0.0.1:{free_port()}"
    resolver = Resolver(RegistrySettings(allow_hosts=LOOPBACK_HOSTS, ca_file=test_ca.cert_path, insecure_hosts=(down,),
                                         timeout_seconds=2))
    private, gone = reg.ref("team/private", "v1"), f"{down}/team/gone:v1"
    caplog.set_level(logging.INFO, logger="archway.admission")
    answer = admit(resolver, private, gone)
    assert answer.body["response"]["auditAnnotations"]["outcome"] == "fail_open"
    record = fail_open_record(caplog)
    line = record.getMessage()
    assert (f"failed: {private} (credentials required; none sent: 401 from "
            f"{reg.host} for team/private: no pull secret matched this host") in line, line
    assert f"{gone} (registry unreachable: cannot reach {down}: connection refused)" in line, line
    assert "refused the credentials" not in line
    entry = json.loads(JsonFormatter().format(record))
    assert [(f["image"], f["error"]) for f in entry["failed_images"]] == [
        (private, "credentials required; none sent"),
        (gone, "registry unreachable")]
    assert entry["failed_images"][1]["detail"] == f"cannot reach {down}: connection refused"


def test_credentials_that_were_sent_and_refused_are_said_to_be_refused(token_registry, test_ca):
    reg = token_registry
    reg.push_image("team/refused", "v1", "linux/arm64")
    wrong = Keyring([Credential(reg.host, "archway", "not-the-password")])
    answer = Resolver(RegistrySettings(allow_hosts=LOOPBACK_HOSTS, ca_file=test_ca.cert_path)).resolve_many(
        [reg.ref("team/refused", "v1")], keyring=wrong, timeout=20)[reg.ref("team/refused", "v1")]
    assert isinstance(answer, AuthError)
    assert classify_error(answer).words == "registry refused the credentials"


def test_a_dead_proxy_is_named_as_the_proxy(plain_registry, caplog):
    plain_registry.push_image("team/app", "v1", "linux/amd64")
    proxy = f"http://127.0.0.1:{free_port()}"
    resolver = Resolver(RegistrySettings(allow_hosts=LOOPBACK_HOSTS, insecure_hosts=(plain_registry.host,), timeout_seconds=2,
                                         proxy=ProxySettings(url=proxy)))
    image = plain_registry.ref("team/app", "v1")
    caplog.set_level(logging.INFO, logger="archway.admission")
    admit(resolver, image)
    line = fail_open_record(caplog).getMessage()
    assert (f"{image} (registry unreachable: cannot reach the egress proxy {proxy} (for "
            f"{plain_registry.host}): connection refused)") in line, line
    assert f"cannot reach {plain_registry.host}" not in line
    result = resolver.resolve_many([image], timeout=5)[image]
    assert isinstance(result, ProxyFailed)


def test_a_proxy_that_cannot_reach_the_registry_says_so(tmp_path, test_ca):
    proxy = ForwardProxy(tmp_path / "tinyproxy")
    try:
        gone = f"127.0.0.1:{free_port()}"
        resolver = Resolver(RegistrySettings(allow_hosts=LOOPBACK_HOSTS, ca_file=test_ca.cert_path, timeout_seconds=5,
                                             proxy=ProxySettings(url=proxy.url)))
        image = f"{gone}/team/app:v1"
        answer = resolver.resolve_many([image], timeout=10)[image]
    finally:
        proxy.stop()
    assert isinstance(answer, ProxyFailed), answer
    assert str(answer).startswith(f"the egress proxy {proxy.url} could not reach {gone}: "), answer
