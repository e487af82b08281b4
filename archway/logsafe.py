"""Text fit for a log line or a message: no line a client can forge, no password of a URL.

Pod names, namespaces, image references, peers and error texts reach the log from requests.
A newline in one of them would start a line of the client's choosing ("... INFO admission
kube-system/x mutated" under archway's name). `archway serve` (and every CLI command) formats
its log through SafeFormatter, so every value logged anywhere is escaped once, here, whatever
module logs it; `escape` is the same rule for text built outside logging. `redact_url` is the
one rule for the user:password a URL may carry (a SIF image URL, a proxy): every message, warning
and log line that shows such a URL shows it through this function; `clip` is the one rule for
text shown to a user in a bounded space (a warning, an annotation).
"""
import logging
import re

# C0 and C1 controls, DEL, and the Unicode line and paragraph separators.
_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029]")
_NAMED = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}


def _escape_char(match: re.Match) -> str:
    char = match.group()
    if char in _NAMED:
        return _NAMED[char]
    return f"\\x{ord(char):02x}" if ord(char) < 0x100 else f"\\u{ord(char):04x}"


def escape(text: object) -> str:
    """`text` as one printable line: \\n, \\r, \\t and \\xNN / \\uNNNN for other controls."""
    text = str(text)
    return _CONTROL.sub(_escape_char, text) if _CONTROL.search(text) else text


_UNPRINTABLE = re.compile(r"[^\x20-\x7e]")


def clip(text: str, limit: int) -> str:
    """`text` with every character outside printable ASCII as `?`, cut to `limit` characters
    (the last three `...` when cut): what an apiserver warning header or a short message may hold."""
    text = _UNPRINTABLE.sub("?", text)
    return text if len(text) <= limit else text[:limit - 3] + "..."


def redact_url(text: str) -> str:
    """`text` with the user:password of a URL's authority replaced by `***`: safe to show, log
    or put in an error (`https://u:pw@host/x.sif` -> `https://***@host/x.sif`). The authority
    ends at the first / ? or #, and its user information at its LAST @ (a password may hold an @:
    `https://u:p@ss@host/` -> `https://***@host/`). Text without `://` is returned as it is."""
    scheme, sep, rest = text.partition("://")
    end = min((i for i in (rest.find(c) for c in "/?#") if i >= 0), default=len(rest))
    if not sep or "@" not in rest[:end]:
        return text
    return f"{scheme}://***@{rest[:end].rpartition('@')[2]}{rest[end:]}"


class SafeFormatter(logging.Formatter):
    """A Formatter whose message part (the template with its values) is escaped; a traceback,
    which archway writes itself, keeps its lines."""

    def formatMessage(self, record: logging.LogRecord) -> str:
        record.message = escape(record.message)
        return super().formatMessage(record)


def configure(level: int, fmt: str) -> None:
    """logging.basicConfig with SafeFormatter."""
    handler = logging.StreamHandler()
    handler.setFormatter(SafeFormatter(fmt))
    logging.basicConfig(level=level, handlers=[handler])
