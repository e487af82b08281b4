"""One run of a kubelet image credential provider plugin, the way the kubelet runs it: executed
(never through a shell) with a CredentialProviderRequest on stdin, bounded in time (killed with
its process group) and in output, its CredentialProviderResponse read as strictly as the kubelet
reads it. A failure is a typed CredentialProviderError carrying the plugin's stderr. A plugin
in service account token mode (KEP-4412) is also given the pod's ServiceAccount token and
annotations, never shown in an error."""
import json
import os
import selectors
import signal
import subprocess
import time
from dataclasses import dataclass, field

from archway.errors import CredentialProviderError

from .imagematch import registry_key, registry_of
from .providerconfig import ProviderSpec, parse_duration

CACHE_KEY_TYPES = ("Image", "Registry", "Global")
MAX_STDOUT_BYTES = 1024 * 1024        # real answers are a few KiB (one token per registry)
MAX_STDERR_SHOWN = 1000               # characters of stderr kept for the error message
MAX_REQUEST_BYTES = 60 * 1024         # below a pipe's buffer: written at once, never blocking


@dataclass(frozen=True)
class PluginResponse:
    cache_key_type: str
    cache_duration: float | None       # None: the provider's defaultCacheDuration
    auth: tuple[tuple[str, str, str], ...]   # (key, username, password)


@dataclass(frozen=True)
class WorkloadIdentity:
    """What a token-mode plugin is given for a pod: a token of its ServiceAccount for the
    provider's audience, and those of its annotations the provider names."""
    namespace: str
    name: str
    uid: str
    token: str = field(repr=False)
    expires: float                     # when the token expires, on the providers' clock
    annotations: tuple[tuple[str, str], ...] = ()


def request_body(spec: ProviderSpec, image: str,
                 identity: WorkloadIdentity | None = None) -> bytes:
    """The CredentialProviderRequest, encoded as the kubelet encodes it."""
    request: dict[str, object] = {"kind": "CredentialProviderRequest",
                                  "apiVersion": spec.api_version, "image": image}
    if identity is not None:
        request["serviceAccountToken"] = identity.token
        request["serviceAccountAnnotations"] = dict(identity.annotations)
    return json.dumps(request, separators=(",", ":")).encode() + b"\n"


def run_plugin(spec: ProviderSpec, bin_dir: str, image: str, timeout: float,
               environ=None, identity: WorkloadIdentity | None = None) -> PluginResponse:
    """Execute the plugin for `image` (as `identity`, in token mode); its answer, or
    CredentialProviderError."""
    path = os.path.join(bin_dir, spec.name)
    env = dict(os.environ if environ is None else environ)
    env.update(spec.env)   # the config's variables win, as in the kubelet
    fail = _failure(spec, image, identity.token if identity is not None else "")
    request = request_body(spec, image, identity)
    if len(request) > MAX_REQUEST_BYTES:   # annotations that large: a plugin would not read them
        raise fail("request_too_large", f"would be sent a request larger than "
                                        f"{MAX_REQUEST_BYTES} bytes (the ServiceAccount's "
                                        f"annotations): not run")
    try:
        process = subprocess.Popen([path, *spec.args], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                   stderr=subprocess.PIPE, env=env, close_fds=True,
                                   start_new_session=True)   # its own group: killed as a whole
    except OSError as e:
        raise fail("exec_error", f"cannot execute {path}: {e.strerror}") from None
    try:
        stdout, stderr = _communicate(process, request, timeout, fail)
    finally:
        _kill(process)
    if process.returncode != 0:
        raise fail("exit_status", f"exited with status {process.returncode}", stderr)
    return parse_response(stdout, spec, fail)


def _communicate(process, request: bytes, timeout: float, fail) -> tuple[bytes, bytes]:
    """Write the request, read stdout and stderr until both close, within `timeout` and with
    stdout bounded; then wait for the exit status."""
    deadline = time.monotonic() + timeout
    try:
        process.stdin.write(request)   # below a pipe buffer (MAX_REQUEST_BYTES): never blocks
        process.stdin.close()
    except BrokenPipeError:
        pass   # it exited or closed stdin without reading: its exit status will tell
    out, err = bytearray(), bytearray()
    with selectors.DefaultSelector() as selector:
        selector.register(process.stdout, selectors.EVENT_READ, out)
        selector.register(process.stderr, selectors.EVENT_READ, err)
        while selector.get_map():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise fail("timeout", f"did not answer within {timeout:g} s: killed", err)
            for key, _ in selector.select(remaining):
                chunk = os.read(key.fd, 65536)
                if not chunk:
                    selector.unregister(key.fileobj)
                    continue
                buffer = key.data
                if buffer is out and len(out) + len(chunk) > MAX_STDOUT_BYTES:
                    raise fail("output_too_large",
                               f"wrote more than {MAX_STDOUT_BYTES} bytes to stdout: killed", err)
                if buffer is out or len(err) < MAX_STDERR_SHOWN * 4:
                    buffer.extend(chunk)
    try:
        process.wait(max(0.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        raise fail("timeout", f"did not exit within {timeout:g} s: killed", err) from None
    return bytes(out), bytes(err)


def _kill(process) -> None:
    """The plugin and anything it left running, by its process group (the plugin's own session:
    nothing else is in it); then reap it."""
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    process.wait()
    for pipe in (process.stdin, process.stdout, process.stderr):
        if pipe is not None and not pipe.closed:
            pipe.close()


def _failure(spec: ProviderSpec, image: str, token: str = ""):
    def fail(reason: str, what: str, stderr: bytes = b"") -> CredentialProviderError:
        text = f"credential provider {spec.name} for {image} {what}"
        if token:   # a plugin that echoes its input does not put the pod's token in a log
            stderr = stderr.replace(token.encode(), b"[service account token]")
        shown = _printable(stderr)
        if shown:
            text += f"; its stderr: {shown}"
        count_call(spec.name, reason)
        return CredentialProviderError(text, provider=spec.name, reason=reason,
                                       host=registry_of(image))
    return fail


def count_call(provider: str, outcome: str) -> None:
    """One plugin call in archway_credential_provider_calls_total{provider, outcome}."""
    # Imported on first use: `archway serve` must choose the metrics storage before anything
    # imports prometheus_client, and its start-up check reads the provider config.
    from archway import metrics
    metrics.CREDENTIAL_PROVIDER_CALLS.labels(provider, outcome).inc()


def _printable(data: bytes) -> str:
    text = data.decode("utf-8", "replace").strip()
    text = "".join(c if c.isprintable() else " " for c in text)
    return text if len(text) <= MAX_STDERR_SHOWN else text[:MAX_STDERR_SHOWN - 3] + "..."


_RESPONSE_FIELDS = {"apiVersion", "kind", "cacheKeyType", "cacheDuration", "auth"}


def parse_response(data: bytes, spec: ProviderSpec, fail=None) -> PluginResponse:
    """Decode a CredentialProviderResponse as strictly as the kubelet. Errors never quote the
    answer: it holds credentials."""
    fail = fail or _failure(spec, "?")
    try:
        document = _response_document(data, spec)
        return PluginResponse(_cache_key_type(document), _cache_duration(document),
                              _auth_entries(document))
    except _Unusable as e:
        raise fail("invalid_response",
                   f"answered an unusable CredentialProviderResponse: {e}") from None


class _Unusable(Exception):
    """What is wrong with a plugin's answer (never a quote of it: it holds credentials)."""


def _response_document(data: bytes, spec: ProviderSpec) -> dict:
    try:
        document = json.loads(data, object_pairs_hook=_unique_keys)
    except (ValueError, UnicodeDecodeError):
        raise _Unusable("stdout is not a JSON object") from None
    if not isinstance(document, dict):
        raise _Unusable("stdout is not a JSON object")
    if document.get("apiVersion") != spec.api_version:
        raise _Unusable(f"apiVersion {str(document.get('apiVersion'))[:80]!r} is not the "
                        f"configured {spec.api_version}")
    if document.get("kind") != "CredentialProviderResponse":
        raise _Unusable(f"kind {str(document.get('kind'))[:80]!r} is not CredentialProviderResponse")
    unknown = sorted(k for k in document if k not in _RESPONSE_FIELDS)
    if unknown:
        raise _Unusable(f"unknown field(s) {', '.join(k[:40] for k in unknown[:5])}")
    return document


def _cache_key_type(document: dict) -> str:
    key_type = document.get("cacheKeyType")
    if key_type not in CACHE_KEY_TYPES:
        raise _Unusable(f"cacheKeyType must be Image, Registry or Global, got {str(key_type)[:40]!r}")
    return key_type


def _cache_duration(document: dict) -> float | None:
    duration = document.get("cacheDuration")
    if duration is None:
        return None
    try:
        return parse_duration(duration)
    except ValueError:
        raise _Unusable("cacheDuration is not a duration") from None


def _auth_entries(document: dict) -> tuple[tuple[str, str, str], ...]:
    auth = document.get("auth") or {}
    if not isinstance(auth, dict):
        raise _Unusable("auth is not an object")
    entries = []
    for key, entry in auth.items():
        if not isinstance(entry, dict) or not set(entry) <= {"username", "password"} \
                or not all(isinstance(v, str) for v in entry.values()):
            raise _Unusable("an auth entry is not {username, password}")
        if not registry_key(key):
            raise _Unusable("an auth key names no registry")
        entries.append((key, entry.get("username", ""), entry.get("password", "")))
    return tuple(entries)


def _unique_keys(pairs):
    keys = [k for k, _ in pairs]
    if len(keys) != len(set(keys)):
        raise ValueError("duplicate field")
    return dict(pairs)
