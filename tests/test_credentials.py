"""Pull-secret parsing (dockerconfigjson / dockercfg), host matching, and that secrets never leak."""
import base64
import json

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from archway.errors import ArchwayError, ConfigError
from archway.registry.credentials import Credential, Keyring
from archway.registry.imagematch import registry_key

SECRET = "s3cr3t-Pa55:with-colon"


def b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


def config(auths: dict) -> bytes:
    return json.dumps({"auths": auths}).encode()


def test_auth_field_is_decoded_and_split_at_the_first_colon():
    keyring = Keyring.from_dockerconfigjson(config({"reg.example.com:5000": {"auth": b64(f"bob:{SECRET}")}}))
    credential = keyring.lookup("reg.example.com:5000")
    assert (credential.username, credential.password) == ("bob", SECRET)
    assert credential.registry == "reg.example.com:5000"


def test_username_password_fields_and_auth_overrides_them():
    keyring = Keyring.from_dockerconfigjson(config({
        "a.example": {"username": "u1", "password": "p1"},
        "b.example": {"username": "ignored", "password": "ignored", "auth": b64("u2:p2")},
    }))
    assert (keyring.lookup("a.example").username, keyring.lookup("a.example").password) == ("u1", "p1")
    assert (keyring.lookup("b.example").username, keyring.lookup("b.example").password) == ("u2", "p2")


def test_identity_token_is_kept():
    keyring = Keyring.from_dockerconfigjson(config({"c.example": {"identitytoken": "tok-123"}}))
    assert keyring.lookup("c.example").identity_token == "tok-123"


@pytest.mark.parametrize("key", ["https://index.docker.io/v1/", "docker.io", "index.docker.io",
                                 "registry-1.docker.io", "https://registry-1.docker.io/v2/"])
@pytest.mark.parametrize("host", ["docker.io", "index.docker.io", "registry-1.docker.io"])
def test_docker_hub_keys_all_match_docker_hub(key, host):
    keyring = Keyring.from_dockerconfigjson(config({key: {"auth": b64("hubuser:hubpass")}}))
    assert keyring.lookup(host).username == "hubuser"
    assert keyring.lookup("quay.io") is None


@pytest.mark.parametrize("key,host,matches", [
    ("10.0.0.5:5000", "10.0.0.5:5000", True),
    ("10.0.0.5:5000", "10.0.0.5", False),          # another port is another registry
    ("10.0.0.5:5000", "10.0.0.5:5001", False),
    ("10.0.0.5", "10.0.0.5:5000", False),
    ("https://Reg.Example.com/v2/", "reg.example.com", True),   # scheme, path and case dropped
    ("http://reg.example.com:8080", "REG.example.com:8080", True),
    ("reg.example.com", "sub.reg.example.com", False),
    ("reg.example.com", "reg.example.com.evil.io", False),
])
def test_lookup_matches_exactly_the_named_host_and_port(key, host, matches):
    keyring = Keyring.from_dockerconfigjson(config({key: {"auth": b64("u:p")}}))
    assert (keyring.lookup(host) is not None) == matches


def test_legacy_dockercfg_without_auths():
    data = json.dumps({"old.example": {"auth": b64("legacy:pw"), "email": "x@y"}})
    assert Keyring.from_dockerconfigjson(data).lookup("old.example").username == "legacy"


def test_accepts_bytes_str_and_dict():
    as_dict = {"auths": {"d.example": {"auth": b64("u:p")}}}
    for data in (as_dict, json.dumps(as_dict), json.dumps(as_dict).encode()):
        assert Keyring.from_dockerconfigjson(data).hosts() == ["d.example"]


def test_entries_without_any_secret_are_skipped():
    keyring = Keyring.from_dockerconfigjson(config({"helper.example": {}, "e.example": {"auth": b64("u:p")}}))
    assert keyring.hosts() == ["e.example"]


def test_first_of_several_hub_aliases_wins():
    keyring = Keyring.from_dockerconfigjson(config({
        "https://index.docker.io/v1/": {"auth": b64("first:1")},
        "docker.io": {"auth": b64("second:2")},
    }))
    assert keyring.lookup("docker.io").username == "first"


def test_merged_prefers_self_and_keeps_the_rest():
    mine = Keyring.from_dockerconfigjson(config({"a.example": {"auth": b64("mine:1")}}))
    theirs = Keyring.from_dockerconfigjson(config({"a.example": {"auth": b64("theirs:2")},
                                                   "b.example": {"auth": b64("b:3")}}))
    merged = mine.merged(theirs)
    assert merged.lookup("a.example").username == "mine"
    assert merged.lookup("b.example").username == "b"
    assert mine.merged(None) is mine
    assert Keyring.empty().merged(theirs).lookup("a.example").username == "theirs"


def test_fingerprint_is_stable_distinguishes_secrets_and_never_contains_them():
    one = Keyring.from_dockerconfigjson(config({"a.example": {"auth": b64(f"u:{SECRET}")}}))
    same = Keyring.from_dockerconfigjson(config({"a.example": {"username": "u", "password": SECRET}}))
    other = Keyring.from_dockerconfigjson(config({"a.example": {"auth": b64("u:different")}}))
    assert one.fingerprint() == same.fingerprint()
    assert one.fingerprint() != other.fingerprint()
    assert Keyring.empty().fingerprint() == "anonymous"
    for text in (one.fingerprint(), one.lookup("a.example").fingerprint()):
        assert SECRET not in text and b64(f"u:{SECRET}") not in text
    assert one == same and hash(one) == hash(same) and one != other


def test_repr_and_str_never_show_secrets():
    keyring = Keyring.from_dockerconfigjson(config({"a.example": {"auth": b64(f"u:{SECRET}"),
                                                                  "identitytoken": "idtok-XYZ"}}))
    credential = keyring.lookup("a.example")
    for text in (repr(keyring), str(keyring), repr(credential), str(credential), f"{credential}",
                 repr([credential]), repr({"k": credential})):
        assert SECRET not in text and "idtok-XYZ" not in text
    assert "a.example" in repr(credential)


def test_basic_header():
    credential = Credential("a.example", "user", "pa:ss")
    assert credential.basic_header() == "Basic " + b64("user:pa:ss")


@pytest.mark.parametrize("data,fragment", [
    (b"{not json", "not valid JSON"),
    (b"[]", "top level must be a JSON object"),
    (json.dumps({"auths": []}), "'auths' must be a JSON object"),
    (config({"a.example": "just a string"}), "must be a JSON object"),
    (config({"a.example": {"auth": "%%%not-base64%%%"}}), "not base64"),
    (config({"a.example": {"auth": b64("no-colon-here")}}), "missing ':'"),
    (config({"a.example": {"username": 5}}), "username must be a string"),
    (config({"": {"auth": b64("u:p")}}), "must name a registry host"),
    (b"\xff\xfe", "not valid JSON"),
    (12345, "expected JSON text"),
    (b" " * (1024 * 1024 + 1), "larger than"),
])
def test_malformed_input_raises_config_error_naming_the_problem(data, fragment):
    with pytest.raises(ConfigError) as info:
        Keyring.from_dockerconfigjson(data)
    assert fragment in str(info.value)


def test_error_messages_never_contain_the_secret():
    bad_auth = base64.b64encode(b"\xff\xfe" + SECRET.encode()).decode()  # not UTF-8
    cases = [
        config({"a.example": {"auth": bad_auth}}),
        config({"a.example": {"auth": b64(SECRET.replace(":", ""))}}),
        ('{"auths": {"a.example": {"password": "' + SECRET + '", }}}').encode(),  # broken JSON
    ]
    for data in cases:
        with pytest.raises(ConfigError) as info:
            Keyring.from_dockerconfigjson(data)
        assert SECRET not in str(info.value) and SECRET.replace(":", "") not in str(info.value)


def test_from_file(tmp_path):
    path = tmp_path / "config.json"
    path.write_bytes(config({"f.example": {"auth": b64("u:p")}}))
    assert Keyring.from_file(str(path)).hosts() == ["f.example"]
    with pytest.raises(ConfigError, match="cannot read credentials file"):
        Keyring.from_file(str(tmp_path / "missing.json"))


@pytest.mark.parametrize("key,expected", [
    ("https://index.docker.io/v1/", "docker.io"), ("REG.example.com:443", "reg.example.com:443"),
    ("http://[::1]:5000/v2", "[::1]:5000"), ("reg.example.com/some/path", "reg.example.com/some/path"),
    ("https://quay.io/v2/team/", "quay.io/team/"), ("*.azurecr.io", "*.azurecr.io"),
])
def test_registry_key(key, expected):
    assert registry_key(key) == expected


def keyring_of(*keys_and_users) -> Keyring:
    return Keyring.from_dockerconfigjson(config({key: {"auth": b64(f"{user}:pw")}
                                                 for key, user in keys_and_users}))


def users(keyring: Keyring, image: str) -> list[str]:
    return [c.username for c in keyring.candidates(image)]


# The kubelet's own rules (pkg/credentialprovider URLsMatch / BasicDockerKeyring.Lookup).
@pytest.mark.parametrize("key,image,matches", [
    ("*.azurecr.io", "team.azurecr.io/app", True),
    ("*.azurecr.io", "a.team.azurecr.io/app", False),        # one label per *
    ("*.azurecr.io", "azurecr.io/app", False),
    ("*.*.registry.io", "a.b.registry.io/x", True),
    ("*.io", "a.k8s.io/x", False),
    ("k8s.*", "k8s.io/x", True),
    ("*", "localhost/x", True),                              # a one-label host
    ("*", "reg.example/x", False),
    ("reg[0-9].example", "reg7.example/x", True),            # Go's filepath.Match classes
    ("reg[^0-9].example", "reg7.example/x", False),
    ("reg?.example", "rega.example/x", False),             # '?' starts a URL query, as in Go
    ("reg.example:5000", "reg.example:5000/x", True),
    ("reg.example:5000", "reg.example/x", False),            # the ports must be equal
    ("reg.example", "reg.example:5000/x", False),
    ("reg.example:5000", "reg.example:5001/x", False),
    ("*.example:5000", "reg.example:5000/x", True),
    ("quay.io/team", "quay.io/team/app", True),              # the key's path is a prefix
    ("quay.io/team", "quay.io/other/app", False),
    ("quay.io/team", "quay.io/teamx/app", True),             # a plain string prefix, as the kubelet
    ("https://quay.io/v2/team", "quay.io/team/app", True),   # /v2/ is the registry's root
    ("https://index.docker.io/v1/", "docker.io/library/nginx", True),
    ("REG.Example", "reg.example/x", True),
])
def test_keys_match_images_as_the_kubelet_does(key, image, matches):
    assert (users(keyring_of((key, "u")), image) == ["u"]) == matches


def test_more_specific_keys_come_first_and_every_match_is_kept():
    keyring = keyring_of(("quay.io", "host"), ("quay.io/team", "team"), ("*.io", "glob"),
                         ("quay.io/team/app", "app"))
    assert users(keyring, "quay.io/team/app") == ["app", "team", "host", "glob"]
    assert users(keyring, "quay.io/other") == ["host", "glob"]
    assert keyring.lookup("quay.io").username == "host"   # a host alone: keys with a path need an image


def test_union_keyring_tries_the_pods_secrets_before_the_nodes():
    pod = keyring_of(("quay.io", "pod"))
    node = keyring_of(("quay.io/team", "node"), ("ghcr.io", "node-ghcr"))
    union = pod.then(node)
    # Unlike one keyring (specific keys first), a union keeps its parts' order.
    assert users(union, "quay.io/team/app") == ["pod", "node"]
    assert users(union, "ghcr.io/x") == ["node-ghcr"]
    assert users(pod.merged(node), "quay.io/team/app") == ["node", "pod"]
    assert union.fingerprint_for("ghcr.io/x") == node.fingerprint_for("ghcr.io/x") != ""
    assert union.fingerprint_for("docker.io/library/x") == ""


def test_pinned_credential_answers_first_for_its_host_and_the_rest_stays():
    keyring = keyring_of(("quay.io/team", "team"), ("auth.quay.io", "realm"))
    second = keyring.candidates("quay.io/team/app")[0]
    pinned = keyring.pinned("quay.io", second)
    assert pinned.lookup("quay.io").username == "team"
    assert pinned.lookup("auth.quay.io").username == "realm"


def test_the_same_secret_under_two_keys_is_tried_once():
    keyring = keyring_of(("quay.io", "same"), ("quay.io/team", "same"))
    assert users(keyring, "quay.io/team/app") == ["same"]


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=20),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=10), children, max_size=4),
    max_leaves=20)


@settings(max_examples=300, deadline=None)
@given(st.one_of(json_values, st.dictionaries(st.text(max_size=30), json_values, max_size=4).map(
    lambda auths: {"auths": auths})))
@example({"auths": {"0": {"auth": "\x80"}}})    # not ASCII: base64 raised a bare ValueError
def test_any_json_either_parses_or_raises_a_typed_error(document):
    try:
        keyring = Keyring.from_dockerconfigjson(json.dumps(document))
    except ArchwayError:
        return
    for host in keyring.hosts():
        assert keyring.lookup(host) is not None
