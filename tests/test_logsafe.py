"""archway.logsafe: a value logged from a request cannot start a log line of its own."""
import io
import logging

from archway.logsafe import SafeFormatter, escape


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
