"""Egress proxies: a real forward proxy (tinyproxy) between archway and a real registry, the
NO_PROXY rules of curl and requests, and the host policy still guarding the target."""
import time

import pytest

from archway.config import ProxySettings, RegistrySettings
from archway.errors import ConfigError, HostRefused
from archway.registry.credentials import Keyring
from archway.registry.proxy import ProxyRules, bypassed
from archway.registry.resolver import Resolver
from lab.tls import session_ca
from tests.infra.fixtures import LOOPBACK_HOSTS, plain_registry, test_ca, token_registry
from tests.infra.forwardproxy import ForwardProxy


@pytest.fixture(scope="module")
def proxy(tmp_path_factory):
    server = ForwardProxy(tmp_path_factory.mktemp("tinyproxy"))
    yield server
    server.stop()


@pytest.fixture
def no_proxy_env(monkeypatch):
    for name in ("https_proxy", "HTTPS_PROXY", "http_proxy", "HTTP_PROXY", "all_proxy",
                 "ALL_PROXY", "no_proxy", "NO_PROXY"):
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def test_https_proxy_from_the_environment_carries_a_token_registry(token_registry, test_ca, proxy,
                                                                   no_proxy_env):
    reg = token_registry
    reg.push_image("team/app", "v1", "linux/arm64")
    no_proxy_env.setenv("HTTPS_PROXY", proxy.url)
    before = len(proxy.requests(settle=0))
    mark = reg.mark()
    info = Resolver(RegistrySettings(allow_hosts=LOOPBACK_HOSTS, ca_file=test_ca.cert_path)).resolve(
        reg.ref("team/app", "v1"), keyring=Keyring.from_dockerconfigjson(reg.dockerconfigjson()),
        deadline=time.monotonic() + 20)
    assert info.architectures == {"arm64"}
    tunnelled = proxy.requests()[before:]
    # The registry and its token service were both reached through CONNECT tunnels: the proxy
    # saw host names only, the credentials travelled inside TLS to their own host.
    assert ("CONNECT", reg.host) in tunnelled
    assert ("CONNECT", reg.token_server.host) in tunnelled
    assert all(method == "CONNECT" for method, _ in tunnelled)
    assert any(e.path == "/v2/team/app/manifests/v1" and e.status == 200
               for e in reg.requests_since(mark))


def test_http_proxy_forwards_plain_http_and_no_proxy_exempts_loopback(plain_registry, proxy,
                                                                      no_proxy_env):
    reg = plain_registry
    reg.push_image("team/plain", "v1", "linux/amd64")
    settings = RegistrySettings(insecure_hosts=(reg.host,))
    no_proxy_env.setenv("http_proxy", proxy.url)
    no_proxy_env.setenv("https_proxy", proxy.url)
    before = len(proxy.requests(settle=0))
    Resolver(settings).resolve(reg.ref("team/plain", "v1"), deadline=time.monotonic() + 20)
    seen = proxy.requests()[before:]
    # An insecure host is tried over https first (a CONNECT), then plain http (absolute URIs).
    assert ("GET", f"http://{reg.host}/v2/team/plain/manifests/v1") in seen
    no_proxy_env.setenv("NO_PROXY", "localhost,127.0.0.0/8")
    before = len(proxy.requests(settle=0))
    Resolver(settings).resolve(reg.ref("team/plain", "v1"), deadline=time.monotonic() + 20)
    assert proxy.requests()[before:] == []


def test_the_config_proxy_wins_over_the_environment(plain_registry, proxy, no_proxy_env):
    reg = plain_registry
    reg.push_image("team/configured", "v1", "linux/386")
    no_proxy_env.setenv("HTTP_PROXY", "http://127.0.0.1:9")   # nothing listens there
    settings = RegistrySettings(insecure_hosts=(reg.host,), proxy=ProxySettings(url=proxy.url))
    before = len(proxy.requests(settle=0))
    info = Resolver(settings).resolve(reg.ref("team/configured", "v1"), deadline=time.monotonic() + 20)
    assert info.architectures == {"386"}
    assert ("GET", f"http://{reg.host}/v2/team/configured/manifests/v1") in proxy.requests()[before:]


@pytest.mark.parametrize("image, words", [
    ("169.254.169.254/latest/meta-data:x", "link-local or metadata"),
    ("metadata.google.internal/computemetadata/v1:x", "cloud metadata service"),
    ("denied.example/app:v1", "registry.deny_hosts"),
])
def test_a_refused_target_is_refused_before_the_proxy_sees_a_request(proxy, no_proxy_env, image,
                                                                     words):
    no_proxy_env.setenv("HTTPS_PROXY", proxy.url)
    settings = RegistrySettings(deny_hosts=("denied.example",))
    before = len(proxy.requests(settle=0))
    with pytest.raises(HostRefused, match=words):
        Resolver(settings).resolve(image, deadline=time.monotonic() + 20)
    host = image.split("/")[0]
    assert not [t for _, t in proxy.requests()[before:] if host in t]


# --- the rules, as curl and requests apply them --------------------------------------------------

@pytest.mark.parametrize("host, port, no_proxy, exempt", [
    ("127.0.0.1", 5000, [], False),                       # loopback is proxied unless listed
    ("localhost", 5000, [], False),
    ("127.0.0.1", 5000, ["127.0.0.1"], True),
    ("127.0.0.1", 5000, ["127.0.0.0/8"], True),
    ("10.1.2.3", 443, ["10.0.0.0/8"], True),
    ("11.1.2.3", 443, ["10.0.0.0/8"], False),
    ("registry.corp.example", 443, ["corp.example"], True),   # a name covers its subdomains
    ("registry.corp.example", 443, [".corp.example"], True),
    ("registry.corp.example", 443, ["*.corp.example"], True),
    ("corp.example", 443, [".corp.example"], True),
    ("notcorp.example", 443, ["corp.example"], False),        # at a dot boundary only
    ("registry.corp.example", 5000, ["registry.corp.example:443"], False),
    ("registry.corp.example", 443, ["registry.corp.example:443"], True),
    ("::1", 5000, ["[::1]"], True),
    ("anything.example", 443, ["*"], True),
    ("REGISTRY.Corp.Example", 443, ["corp.example"], True),
])
def test_no_proxy_rules(host, port, no_proxy, exempt):
    assert bypassed(host, port, no_proxy) == exempt


def test_environment_variables_lower_case_first_and_per_scheme():
    env = {"https_proxy": "lower:3128", "HTTPS_PROXY": "http://upper:3128",
           "HTTP_PROXY": "http://plain:8080", "NO_PROXY": "internal.example, .svc"}
    rules = ProxyRules.from_settings(ProxySettings(), env)
    assert rules.for_url("https://ghcr.io/v2/") == {"https": "http://lower:3128"}
    assert rules.for_url("http://registry.lab/v2/") == {"http": "http://plain:8080"}
    assert rules.for_url("https://a.internal.example/v2/") == {}
    assert rules.for_url("https://registry.kube-system.svc/v2/") == {}
    assert ProxyRules.from_settings(ProxySettings(), {"ALL_PROXY": "http://all:1"}).for_url(
        "https://x.example/") == {"https": "http://all:1"}
    assert ProxyRules.from_settings(ProxySettings(from_environment=False), env).for_url(
        "https://ghcr.io/") == {}
    assert ProxyRules.from_settings(ProxySettings(url="http://cfg:1", no_proxy=("ghcr.io",)),
                                    env).for_url("https://ghcr.io/") == {}


@pytest.mark.parametrize("value, words", [
    ("socks5://proxy:1080", "http:// and https:// proxies only"),
    ("http://proxy:port", "not a proxy URL"),
    ("http://", "names no proxy host"),
])
def test_unusable_proxy_urls_are_config_errors(value, words):
    with pytest.raises(ConfigError, match=words):
        ProxyRules.from_settings(ProxySettings(), {"HTTPS_PROXY": value})


def test_a_proxy_password_is_never_shown():
    rules = ProxyRules.from_settings(ProxySettings(url="http://user:hunter2@proxy:3128"))
    assert "hunter2" not in repr(rules)
    with pytest.raises(ConfigError) as info:
        ProxyRules.from_settings(ProxySettings(url="http://user:hunter2@proxy:port"))
    assert "hunter2" not in str(info.value)
