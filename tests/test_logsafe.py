"""archway.logsafe: a value logged from a request cannot start a log line of its own."""
import io
import logging

from archway.logsafe import SafeFormatter, escape, redact_url


def test_control_characters_are_escaped_and_printable_text_kept():
    assert escape("web\n2026 INFO forged\r\x1b[2K\x00\x85\u2028é ü 日本") == \
        "web\\n2026 INFO forged\\r\\x1b[2K\\x00\\x85\\u2028é ü 日本"
    assert escape("plain text, tabs\tcount") == "plain text, tabs\\tcount"
    assert escape(42) == "42"


def test_the_formatter_escapes_the_message_and_keeps_a_traceback_readable():
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(SafeFormatter("%(levelname)s %(name)s: %(message)s"))
    log = logging.getLogger("archway.test-logsafe")
    log.addHandler(handler)
    log.propagate = False
    try:
        log.warning("admission %s uid=%s", "shop/web\nINFO archway.admission: forged", "u\r1")
        try:
            raise ValueError("boom")
        except ValueError:
            log.exception("failed for %s", "x\ny")
    finally:
        log.removeHandler(handler)
    lines = stream.getvalue().splitlines()
    assert lines[0] == ("WARNING archway.test-logsafe: admission shop/web\\nINFO "
                        "archway.admission: forged uid=u\\r1")
    assert lines[1] == "ERROR archway.test-logsafe: failed for x\\ny"
    assert lines[2] == "Traceback (most recent call last):" and lines[-1] == "ValueError: boom"


# --- the one redactor of a URL's user:password (issue 23) -----------------------------------------

REDACTED = [
    ("https://u:p@ss@files.example/x.sif", "https://***@files.example/x.sif"),   # @ in the password
    ("http://u:p@ss@proxy:3128", "http://***@proxy:3128"),
    ("https://tok:pw@h?x=@y", "https://***@h?x=@y"),               # an @ in the query is not userinfo
    ("https://h/x.sif#a@b", "https://h/x.sif#a@b"),
    ("https://h?a@b", "https://h?a@b"),
    ("https://user@h/x.sif", "https://***@h/x.sif"),
    ("docker.io/library/nginx@sha256:" + "a" * 64, "docker.io/library/nginx@sha256:" + "a" * 64),
]


def test_the_password_of_a_url_is_hidden_up_to_the_authoritys_last_at():
    for text, shown in REDACTED:
        assert redact_url(text) == shown, text


def test_every_place_that_shows_a_url_hides_its_password_the_same_way():
    # The webhook's warnings, the proxy settings' repr and errors, the references' str: one rule,
    # so a password holding an @ leaks nowhere (the webhook's own regex once showed its tail).
    from archway.config import ProxySettings
    from archway.errors import ConfigError
    from archway.placement.decision import display_image
    from archway.registry.proxy import ProxyRules
    from archway.registry.reference import parse_reference
    for text, shown in REDACTED:
        assert display_image(text) == shown, text
    assert str(parse_reference("https://u:p@ss@files.example/x.sif")) == "https://***@files.example/x.sif"
    rules = ProxyRules.from_settings(ProxySettings(url="http://u:p@ss@proxy:3128"))
    assert repr(rules) == "ProxyRules(https=http://***@proxy:3128, http=http://***@proxy:3128, no_proxy=[])"
    try:
        ProxyRules.from_settings(ProxySettings(url="http://u:p@ss@proxy:port"))
    except ConfigError as e:
        assert "p@ss" not in str(e) and "ss@" not in str(e) and "http://***@proxy:port" in str(e)
    else:
        raise AssertionError("a proxy URL with a malformed port is a ConfigError")
