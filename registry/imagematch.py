"""Which registry key or matchImages pattern covers an image, by the kubelet's own rules.

The kubelet (k8s.io/kubernetes pkg/credentialprovider) files a dockerconfigjson key or a credential
provider's auth key as `host[:port][/path]` (scheme dropped; a leading `/v1/` or `/v2/` path is
the registry root) and matches it against the image's repository name (`docker.io/library/nginx`,
`reg.example:5000/team/app`; no tag, no digest):

- the host may hold globs, one label per `*` (Go's filepath.Match per dot-separated label):
  `*.azurecr.io` matches `team.azurecr.io`, not `a.team.azurecr.io`; both need as many labels;
- the ports must be equal (a key without a port matches only images without one);
- the key's path must be a prefix of the image's path (a plain string prefix, as the kubelet).

Host names compare case-insensitively (the kubelet compares them as written; DNS does not care).
"""
import functools
import re

DOCKER_HUB = "docker.io"
# Every name Docker Hub's credentials may be stored under (Docker writes the first one).
DOCKER_HUB_KEYS = {"index.docker.io", "docker.io", "registry-1.docker.io"}


def registry_key(location: str) -> str:
    """A credential's key as the kubelet files it: 'https://index.docker.io/v1/' -> 'docker.io',
    'HTTPS://Reg:5000/v2/' -> 'reg:5000', 'quay.io/team' -> 'quay.io/team'. '' when no host."""
    text = location.strip()
    scheme, sep, rest = text.partition("://")
    if not sep or scheme.lower() not in ("http", "https"):
        rest = text
    host, path = _split_host_path(rest)
    parts = _split(host)
    if not host or parts is None or any(_glob(label) is None for label in parts[0]):
        return ""   # Go's url.Parse or filepath.Match would refuse it: it names no registry
    for root in ("/v1", "/v2"):   # the registry API root names the registry itself
        if path == root or path.startswith(root + "/"):
            path = path[len(root):]
    host = host.lower()
    if host in DOCKER_HUB_KEYS:
        host = DOCKER_HUB
    return host + (path if path not in ("", "/") else "")


def image_matches(pattern: str, image: str) -> bool:
    """Does `pattern` (a registry key or a matchImages entry) cover `image` (a repository name)?"""
    want, have = _split(pattern), _split(image)
    if want is None or have is None:
        return False
    (want_labels, want_port, want_path), (labels, port, path) = want, have
    if want_port != port or len(want_labels) != len(labels) or not path.startswith(want_path):
        return False
    return all((glob := _glob(p)) is not None and glob.fullmatch(label) is not None
               for p, label in zip(want_labels, labels))


def registry_of(image: str) -> str:
    """The registry part of an image name, as the kubelet's Registry cache key: 'host[:port]'."""
    return image.split("/", 1)[0]


def _split_host_path(text: str) -> tuple[str, str]:
    for stop in "?#":
        text = text.split(stop, 1)[0]
    host, slash, path = text.partition("/")
    return host, slash + path


@functools.lru_cache(maxsize=4096)
def _split(text: str) -> tuple[list[str], str, str] | None:
    """(host labels, port, path) as Go's url.Parse("https://" + text) and net.SplitHostPort see
    them; None when Go would refuse the URL (a port that is not a number)."""
    host, path = _split_host_path(text.strip())
    name, port = host, ""
    if host.startswith("["):
        end = host.find("]")
        if end > 0 and host[end + 1:].startswith(":"):
            name, port = host[1:end], host[end + 2:]
    elif host.count(":") == 1:
        name, port = host.split(":")
    if port and not port.isdigit():
        return None
    return name.lower().split("."), port, path


@functools.lru_cache(maxsize=4096)
def _glob(pattern: str) -> re.Pattern | None:
    """Go's filepath.Match syntax (`*`, `?`, `[^a-z]`, `\\` escapes) as a regex for one label;
    None for a pattern Go rejects (the kubelet then counts it as no match)."""
    out, i, n = [], 0, len(pattern)
    while i < n:
        c = pattern[i]
        if c == "*":
            out.append("[^/]*")
        elif c == "?":
            out.append("[^/]")
        elif c == "\\":
            if i + 1 >= n:
                return None
            i += 1
            out.append(re.escape(pattern[i]))
        elif c == "[":
            parsed = _char_class(pattern, i + 1)
            if parsed is None:
                return None
            text, i = parsed
            out.append(text)
            continue
        else:
            out.append(re.escape(c))
        i += 1
    return re.compile("".join(out), re.DOTALL)


def _char_class(pattern: str, i: int) -> tuple[str, int] | None:
    """Parse a class after its '[' the way Go does; (regex, index after ']') or None."""
    negated = i < len(pattern) and pattern[i] == "^"
    i += negated
    ranges: list[tuple[str, str]] = []
    while True:
        if i < len(pattern) and pattern[i] == "]" and ranges:
            i += 1
            break
        low = _class_char(pattern, i)
        if low is None:
            return None
        lo, i = low
        hi = lo
        if pattern[i] == "-":
            high = _class_char(pattern, i + 1)
            if high is None:
                return None
            hi, i = high
        ranges.append((lo, hi))
    usable = "".join(f"{re.escape(lo)}-{re.escape(hi)}" for lo, hi in ranges if lo <= hi)
    if negated:
        return f"[^/{usable}]", i
    return (f"[{usable}]" if usable else "(?!)"), i


def _class_char(pattern: str, i: int) -> tuple[str, int] | None:
    """One (possibly escaped) character of a class; None where Go reports ErrBadPattern."""
    if i >= len(pattern) or pattern[i] in "-]":
        return None
    if pattern[i] == "\\":
        i += 1
        if i >= len(pattern):
            return None
    char, i = pattern[i], i + 1
    if i >= len(pattern):
        return None   # the class never closes
    return char, i
