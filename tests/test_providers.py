"""Kubelet credential provider plugins: a real plugin executable, the kubelet's JSON, its caching,
and every way a plugin can fail (each a typed error, a warning, and a lookup without it)."""
import json
import logging
import os
import time

import pytest
from prometheus_client import REGISTRY

from archway.config import CredentialProviderSettings, RegistrySettings
from archway.errors import AuthError, ConfigError, CredentialProviderError, classify_error
from archway.registry.providerconfig import parse_duration, parse_provider_config, read_provider_config
from archway.registry.providers import CredentialProviders
from archway.registry.resolver import Resolver
from lab.clock import ManualClock
from tests.infra.credprovider import API_VERSION, ProviderPlugin, provider
from tests.infra.fixtures import LOOPBACK_HOSTS, plain_registry, test_ca, token_registry


@pytest.fixture
def plugin(tmp_path):
    return ProviderPlugin(tmp_path, names=("test-provider", "second-provider"))


def providers_for(plugin, *entries, clock=None, timeout=10.0):
    plugin.config(*entries)
    return CredentialProviders(plugin.config_path, plugin.bin_dir, timeout,
                               **({"clock": clock} if clock else {}))


def calls_counted(provider_name: str, outcome: str) -> float:
    return REGISTRY.get_sample_value("archway_credential_provider_calls_total",
                                     {"provider": provider_name, "outcome": outcome}) or 0.0


def usernames(keyring, image):
    return [c.username for c in keyring.candidates(image)]


# --- the real thing: a token registry only the plugin's credential opens -------------------------

def test_the_plugins_credential_opens_a_token_registry(token_registry, test_ca, plugin):
    reg = token_registry
    reg.push_image("team/app", "v1", "linux/arm64")
    plugin.config(provider(match=[reg.host], password=reg.users["alice"], args=["--region", "x"]))
    settings = RegistrySettings(allow_hosts=LOOPBACK_HOSTS, ca_file=test_ca.cert_path, credential_providers=CredentialProviderSettings(
        config=plugin.config_path, bin_dir=plugin.bin_dir))
    info = Resolver(settings).resolve(reg.ref("team/app", "v1"), deadline=time.monotonic() + 20)
    assert info.architectures == {"arm64"}
    # The kubelet's request: the image's repository name, no tag; the config's args.
    assert plugin.calls()[0]["image"] == f"{reg.host}/team/app"
    assert plugin.calls()[0]["argv"] == ["--region", "x"]
    assert reg.token_server.requests[-1].user == "alice"
    # Without the provider the same registry refuses archway.
    with pytest.raises(AuthError, match="no pull secret matched"):
        Resolver(RegistrySettings(allow_hosts=LOOPBACK_HOSTS, ca_file=test_ca.cert_path)).resolve(
            reg.ref("team/app", "v1"), deadline=time.monotonic() + 20)


def test_a_failing_plugin_is_named_when_the_registry_then_refuses(token_registry, test_ca, plugin):
    reg = token_registry
    reg.push_image("team/locked", "v1", "linux/amd64")
    plugin.config(provider(match=[reg.host], mode="fail"))
    settings = RegistrySettings(allow_hosts=LOOPBACK_HOSTS, ca_file=test_ca.cert_path, credential_providers=CredentialProviderSettings(
        config=plugin.config_path, bin_dir=plugin.bin_dir))
    with pytest.raises(CredentialProviderError) as info:
        Resolver(settings).resolve(reg.ref("team/locked", "v1"), deadline=time.monotonic() + 20)
    assert isinstance(info.value, AuthError) and info.value.provider == "test-provider"
    assert "401" in str(info.value) and "credential provider test-provider failed" in str(info.value)
    assert classify_error(info.value).words == "credential provider failed"   # the admission warning


# --- caching exactly as the kubelet ------------------------------------------------------------

@pytest.mark.parametrize("key_type, expected_calls", [
    ("Image", ["a.example/x", "a.example/y", "b.example/z"]),   # per repository name
    ("Registry", ["a.example/x", "b.example/z"]),              # per registry host
    ("Global", ["a.example/x"]),                               # one answer for every image
])
def test_answers_are_cached_by_their_cache_key_type(plugin, key_type, expected_calls):
    providers = providers_for(plugin, provider(key_type=key_type, match=["*.example"],
                                               auth_key="*.example"))
    runs = calls_counted("test-provider", "success")
    for image in ("a.example/x", "a.example/x", "a.example/y", "b.example/z", "a.example/x"):
        assert usernames(providers.keyring_for(image)[0], image) == ["alice"]
    assert plugin.images() == expected_calls
    assert calls_counted("test-provider", "success") == runs + len(expected_calls)  # runs, not hits


def test_cache_duration_from_the_answer_else_the_default_and_zero_means_never(plugin):
    clock = ManualClock()
    providers = providers_for(plugin, provider(duration="30s", default_duration="1h"), clock=clock)
    providers.keyring_for("a.example/x")
    clock.now += 30
    providers.keyring_for("a.example/x")        # still valid at exactly cacheDuration
    assert len(plugin.calls()) == 1
    clock.now += 0.5
    providers.keyring_for("a.example/x")
    assert len(plugin.calls()) == 2

    providers = providers_for(plugin, provider(default_duration="2m"), clock=clock)  # no cacheDuration
    providers.keyring_for("a.example/x")
    clock.now += 119
    providers.keyring_for("a.example/x")
    clock.now += 2
    providers.keyring_for("a.example/x")
    assert len(plugin.calls()) == 4

    for duration, default in (("0", "1h"), ("0s", "1h"), ("omit", "0")):
        plugin_calls = len(plugin.calls())
        providers = providers_for(plugin, provider(duration=duration, default_duration=default),
                                  clock=clock)
        providers.keyring_for("a.example/x")
        providers.keyring_for("a.example/x")
        assert len(plugin.calls()) == plugin_calls + 2, (duration, default)


def test_plugins_run_only_for_the_images_they_match(plugin):
    providers = providers_for(plugin, provider(match=["*.dkr.ecr.*.amazonaws.com"]))
    assert providers.keyring_for("docker.io/library/nginx")[0].candidates("docker.io/library/nginx") == []
    assert providers.keyring_for("1.dkr.ecr.eu-west-1.amazonaws.com/app")[0]
    assert plugin.images() == ["1.dkr.ecr.eu-west-1.amazonaws.com/app"]


def test_several_plugins_are_combined_and_the_first_listed_wins_a_shared_key(plugin):
    providers = providers_for(plugin, provider("test-provider", username="first"),
                              provider("second-provider", username="second"))
    assert usernames(providers.keyring_for("reg.example/app")[0], "reg.example/app") == [
        "first", "second"]


def test_a_changed_config_is_used_by_the_next_lookup_and_a_broken_one_is_not(plugin, caplog):
    providers = providers_for(plugin, provider(username="before", match=["a.example"]))
    assert usernames(providers.keyring_for("a.example/x")[0], "a.example/x") == ["before"]
    plugin.config(provider(username="after", match=["b.example"]))
    assert providers.keyring_for("a.example/x")[0].candidates("a.example/x") == []
    assert usernames(providers.keyring_for("b.example/x")[0], "b.example/x") == ["after"]
    with open(plugin.config_path, "w") as f:
        f.write("providers: [")
    with caplog.at_level(logging.WARNING):
        assert usernames(providers.keyring_for("b.example/x")[0], "b.example/x") == ["after"]
    assert "cannot be used" in caplog.text


# --- every way a plugin fails: typed error, a warning, and the lookup goes on without it ---------

@pytest.mark.parametrize("mode, reason, words", [
    ("hang", "timeout", "did not answer within 1 s: killed"),
    ("garbage", "invalid_response", "stdout is not a JSON object"),
    ("fail", "exit_status", "exited with status 1; its stderr: AccessDeniedException"),
    ("flood", "output_too_large", "more than 1048576 bytes to stdout: killed"),
])
def test_plugin_faults_are_typed_errors_warnings_and_fail_open(plugin, caplog, mode, reason, words):
    providers = providers_for(plugin, provider("test-provider", mode=mode),
                              provider("second-provider", username="backup"), timeout=1.0)
    failed_before = calls_counted("test-provider", reason)
    started = time.monotonic()
    with caplog.at_level(logging.WARNING):
        keyring, errors = providers.keyring_for("reg.example/app")
    elapsed = time.monotonic() - started
    assert elapsed < 8, elapsed
    (error,) = errors
    assert isinstance(error, CredentialProviderError) and error.reason == reason
    assert error.provider == "test-provider" and words in str(error)
    assert words in caplog.text and "without its credentials" in caplog.text
    # Fail open: the other provider's credentials are still there.
    assert usernames(keyring, "reg.example/app") == ["backup"]
    assert calls_counted("test-provider", reason) == failed_before + 1
    if mode == "hang":   # the plugin and the child it started were killed, not left behind
        call = plugin.calls()[0]
        for pid in (call["pid"], call["child"]):
            assert not pid_alive(pid), pid


def test_a_missing_plugin_executable_is_an_exec_error(plugin):
    providers = providers_for(plugin, provider("not-installed"))
    _, (error,) = providers.keyring_for("reg.example/app")
    assert error.reason == "exec_error" and "cannot execute" in str(error)


def test_a_failing_plugin_does_not_stop_a_public_image_from_resolving(plain_registry, plugin, caplog):
    reg = plain_registry
    reg.push_image("public/app", "v1", "linux/s390x")
    plugin.config(provider(match=[reg.host], mode="garbage"))
    settings = RegistrySettings(allow_hosts=LOOPBACK_HOSTS, credential_providers=CredentialProviderSettings(
        config=plugin.config_path, bin_dir=plugin.bin_dir), insecure_hosts=(reg.host,))
    with caplog.at_level(logging.WARNING):
        info = Resolver(settings).resolve(reg.ref("public/app", "v1"), deadline=time.monotonic() + 20)
    assert info.architectures == {"s390x"}
    assert "credential provider test-provider" in caplog.text


def pid_alive(pid: int) -> bool:
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        try:   # a zombie of ours counts as gone once reaped; children of the plugin get reparented
            with open(f"/proc/{pid}/stat") as f:
                if f.read().split(") ", 1)[1].startswith("Z"):
                    return False
        except (FileNotFoundError, IndexError):
            return False
        time.sleep(0.05)
    return True


# --- the response is read as strictly as the kubelet reads it -----------------------------------

@pytest.mark.parametrize("answer, words", [
    ({"apiVersion": "credentialprovider.kubelet.k8s.io/v1beta1", "kind": "CredentialProviderResponse",
      "cacheKeyType": "Image"}, "is not the configured"),
    ({"apiVersion": API_VERSION, "kind": "Other", "cacheKeyType": "Image"}, "kind"),
    ({"apiVersion": API_VERSION, "kind": "CredentialProviderResponse", "cacheKeyType": "Repo"},
     "cacheKeyType must be Image, Registry or Global"),
    ({"apiVersion": API_VERSION, "kind": "CredentialProviderResponse"}, "cacheKeyType"),
    ({"apiVersion": API_VERSION, "kind": "CredentialProviderResponse", "cacheKeyType": "Image",
      "extra": 1}, "unknown field"),
    ({"apiVersion": API_VERSION, "kind": "CredentialProviderResponse", "cacheKeyType": "Image",
      "cacheDuration": "soon"}, "cacheDuration is not a duration"),
    ({"apiVersion": API_VERSION, "kind": "CredentialProviderResponse", "cacheKeyType": "Image",
      "auth": {"reg.example": {"username": "u", "password": "SECRET-PW", "token": "x"}}},
     "auth entry"),
])
def test_unusable_answers_are_refused_without_quoting_them(answer, words):
    from archway.registry.providerconfig import ProviderSpec
    from archway.registry.providerplugin import parse_response
    spec = ProviderSpec("p", ("*",), 60.0, API_VERSION)
    with pytest.raises(CredentialProviderError) as info:
        parse_response(json.dumps(answer).encode(), spec)
    assert words in str(info.value) and info.value.reason == "invalid_response"
    assert "SECRET-PW" not in str(info.value)


def test_duplicate_fields_are_refused():
    from archway.registry.providerconfig import ProviderSpec
    from archway.registry.providerplugin import parse_response
    spec = ProviderSpec("p", ("*",), 60.0, API_VERSION)
    body = (f'{{"apiVersion": "{API_VERSION}", "kind": "CredentialProviderResponse", '
            f'"cacheKeyType": "Image", "cacheKeyType": "Global"}}').encode()
    with pytest.raises(CredentialProviderError):
        parse_response(body, spec)


# --- the CredentialProviderConfig, validated as the kubelet validates it -----------------------

CONFIG = """apiVersion: kubelet.config.k8s.io/v1
kind: CredentialProviderConfig
providers:
  - name: ecr-credential-provider
    matchImages: ["*.dkr.ecr.*.amazonaws.com", "*.dkr.ecr.*.amazonaws.com.cn"]
    defaultCacheDuration: "12h"
    apiVersion: credentialprovider.kubelet.k8s.io/v1
    args: [get-credentials]
    env: [{name: AWS_PROFILE, value: temp}]
"""


def test_a_real_world_config_parses():
    (spec,) = parse_provider_config(CONFIG.encode(), "config.yaml")
    assert spec.name == "ecr-credential-provider" and spec.default_cache_duration == 12 * 3600
    assert spec.args == ("get-credentials",) and spec.env == (("AWS_PROFILE", "temp"),)


@pytest.mark.parametrize("change, words", [
    (("kind: CredentialProviderConfig", "kind: Other"), "kind must be CredentialProviderConfig"),
    (("kubelet.config.k8s.io/v1", "kubelet.config.k8s.io/v2"), "apiVersion must be one of"),
    (('defaultCacheDuration: "12h"', 'defaultCacheDuration: "-1h"'), "greater than or equal to 0"),
    (('    defaultCacheDuration: "12h"\n', ""), "defaultCacheDuration is required"),
    (("name: ecr-credential-provider", "name: ../ecr"), "no '/'"),
    (("credentialprovider.kubelet.k8s.io/v1", "credentialprovider.kubelet.k8s.io/v9"),
     "providers[0].apiVersion"),
    (("    args:", "    tokenAttributes: {serviceAccountTokenAudience: x}\n    args:"),
     "tokenAttributes"),
    (("    args:", "    argz: [x]\n    args:"), "unknown field(s) argz"),
    (('matchImages: ["*.dkr.ecr.*.amazonaws.com", "*.dkr.ecr.*.amazonaws.com.cn"]',
      "matchImages: []"), "matchImages must be a non-empty list"),
])
def test_config_errors_name_the_field(change, words):
    with pytest.raises(ConfigError) as info:
        parse_provider_config(CONFIG.replace(*change).encode(), "config.yaml")
    assert words in str(info.value) and "config.yaml" in str(info.value)


def test_a_config_directory_is_merged_in_lexical_order_and_names_stay_unique(tmp_path):
    (tmp_path / "20-gcp.yaml").write_text(CONFIG.replace("ecr-credential-provider", "auth-provider-gcp"))
    (tmp_path / "10-ecr.json").write_text(json.dumps(
        {"apiVersion": "kubelet.config.k8s.io/v1", "kind": "CredentialProviderConfig",
         "providers": [{"name": "ecr-credential-provider", "matchImages": ["*"],
                        "defaultCacheDuration": "1m", "apiVersion": API_VERSION}]}))
    (tmp_path / "README.md").write_text("ignored")
    assert [p.name for p in read_provider_config(str(tmp_path))] == [
        "ecr-credential-provider", "auth-provider-gcp"]
    (tmp_path / "30-again.yml").write_text(CONFIG)
    with pytest.raises(ConfigError, match="duplicate provider name"):
        read_provider_config(str(tmp_path))


def test_settings_need_a_bin_dir(tmp_path):
    config = tmp_path / "c.yaml"
    config.write_text(CONFIG)
    with pytest.raises(ConfigError, match="bin_dir is not"):
        CredentialProviders.from_settings(CredentialProviderSettings(config=str(config)))
    with pytest.raises(ConfigError, match="is not a directory"):
        CredentialProviders.from_settings(CredentialProviderSettings(
            config=str(config), bin_dir=str(tmp_path / "nope")))
    assert CredentialProviders.from_settings(CredentialProviderSettings()) is None


def test_settings_refuse_a_provider_without_its_executable(plugin):
    plugin.config(provider("not-installed"))
    with pytest.raises(ConfigError, match="not-installed: .* is not an executable file"):
        CredentialProviders.from_settings(CredentialProviderSettings(
            config=plugin.config_path, bin_dir=plugin.bin_dir))


@pytest.mark.parametrize("text, seconds", [
    ("0", 0), ("12h", 43200), ("1h30m", 5400), ("1.5s", 1.5), ("300ms", 0.3), ("-1m", -60),
    ("2h45m30.5s", 9930.5), ("1us", 1e-6), ("1µs", 1e-6),
])
def test_go_durations(text, seconds):
    assert parse_duration(text) == pytest.approx(seconds)


@pytest.mark.parametrize("text", ["", "5", "1d", "h", "1h ", 5, None, "1.h2"])
def test_bad_go_durations(text):
    with pytest.raises(ValueError):
        parse_duration(text)
