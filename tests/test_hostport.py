"""host[:port] text: one reader and writer for registry hosts, policies and bind addresses."""
import pytest

from archway.errors import ConfigError, HostRefused
from archway.hostport import host_of, join_host_port, split_bind, split_host_port
from archway.registry.hostpolicy import HostPolicy


@pytest.mark.parametrize("text, expected", [
    ("Reg.Example:5000", ("reg.example", 5000)),
    ("reg.example", ("reg.example", None)),
    ("[FD00::1]:443", ("fd00::1", 443)),
    ("[::1]", ("::1", None)),
    (":8443", ("", 8443)),
])
def test_split(text, expected):
    assert split_host_port(text) == expected
    host, port = expected
    if host:
        assert split_host_port(join_host_port(host, port)) == expected   # round trip


@pytest.mark.parametrize("text", ["[::1", "host:99999", "host:port"])
def test_malformed_is_a_value_error_for_the_caller_to_word(text):
    with pytest.raises(ValueError):
        split_host_port(text)
    assert host_of(text) == text.lower()       # never raises: used for comparisons only


def test_callers_word_the_error_their_way():
    with pytest.raises(HostRefused, match="malformed host"):
        HostPolicy(resolve=lambda *a, **k: []).check("reg:99999")
    for bind in ("host:99999", "host", "host:0", "[::1"):
        with pytest.raises(ConfigError, match="must be HOST:PORT"):
            split_bind(bind)
    assert split_bind("[::1]:8443") == ("::1", 8443) and split_bind(":8443") == ("0.0.0.0", 8443)
