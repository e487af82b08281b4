"""The server's TLS context: TLS 1.2+, forward-secret AEAD ciphers only, and a certificate that
follows rotation on disk (kubelet Secret sync, cert-manager, `archway certs bootstrap`) without a
restart and without a failed handshake.

How rotation works: the context the server's loop wraps connections in carries an
`sni_callback`. OpenSSL runs it on every ClientHello (with or without SNI) before the
certificate is chosen; at most once a second it stats the two files, and when they changed it loads them into a fresh context and switches the
connection to it. A pair that does not load (half-written, key not matching the certificate) is
logged and the previous certificate stays in use until the files change again.
"""
import logging
import os
import ssl
import threading
import time

from archway.errors import ConfigError

from .x509 import describe, file_signature, load_cert

log = logging.getLogger(__name__)

# TLS 1.2 suites: ECDHE key exchange (forward secrecy) with AEAD ciphers only. TLS 1.3 suites are
# OpenSSL's defaults, all of which are AEAD.
TLS12_CIPHERS = "ECDHE+AESGCM:ECDHE+CHACHA20"
CHECK_INTERVAL_SECONDS = 1.0


def new_server_context(cert_file: str, key_file: str) -> ssl.SSLContext:
    """A plain (non-reloading) server context holding this pair; raises ssl.SSLError/OSError."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.set_ciphers(TLS12_CIPHERS)
    ctx.options |= (ssl.OP_NO_COMPRESSION | ssl.OP_CIPHER_SERVER_PREFERENCE
                    | ssl.OP_NO_RENEGOTIATION)
    ctx.set_alpn_protocols(["http/1.1"])  # archway serves HTTP/1.1 only
    ctx.load_cert_chain(cert_file, key_file)
    return ctx


class ReloadingContext:
    """Owns `context` (give it to wrap_socket) and swaps in a reloaded pair when the files change."""

    def __init__(self, cert_file: str, key_file: str, *,
                 check_interval: float = CHECK_INTERVAL_SECONDS, clock=time.monotonic):
        self.cert_file = cert_file
        self.key_file = key_file
        self._interval = check_interval
        self._clock = clock
        self._lock = threading.Lock()
        self._signature = file_signature(cert_file, key_file)
        try:
            self.context = new_server_context(cert_file, key_file)
        except (OSError, ssl.SSLError) as e:
            raise ConfigError(f"cannot load TLS certificate {cert_file} with key {key_file}: "
                              f"{_reason(e)}") from None
        self.context.sni_callback = self._on_client_hello
        self._active = self.context
        self._rejected: tuple | None = None   # signature of a pair that failed to load
        self._next_check = clock() + check_interval
        self.reloads = 0

    def _on_client_hello(self, sock, server_name, _initial):
        # An exception here would abort the handshake: log it and serve what we have.
        try:
            self.maybe_reload()
            if self._active is not sock.context:
                sock.context = self._active
        except Exception:
            log.exception("TLS certificate reload check failed; keeping the current certificate")
        return None

    def maybe_reload(self, force: bool = False) -> bool:
        """Reload the pair if the files changed (checked at most once per interval).
        True when a new certificate was loaded."""
        now = self._clock()
        if not force and now < self._next_check:
            return False
        with self._lock:
            if not force and now < self._next_check:
                return False
            self._next_check = now + self._interval
            # Stat before reading: if the files change during the load, the next check sees a
            # signature different from the one recorded and loads again.
            signature = file_signature(self.cert_file, self.key_file)
            if signature == self._signature or signature == self._rejected:
                return False
            try:
                ctx = new_server_context(self.cert_file, self.key_file)
            except (OSError, ssl.SSLError) as e:
                self._rejected = signature
                log.warning("keeping the current TLS certificate: %s with key %s cannot be "
                            "loaded (%s); will retry when the files change",
                            self.cert_file, self.key_file, _reason(e))
                return False
            self._active = ctx
            self._signature = signature
            self._rejected = None
            self.reloads += 1
            log.info("loaded rotated TLS certificate %s", _describe_file(self.cert_file))
            return True


def _reason(e: Exception) -> str:
    return getattr(e, "reason", None) or getattr(e, "strerror", None) or str(e)


def _describe_file(path: str) -> str:
    try:
        with open(path, "rb") as f:
            return describe(load_cert(f.read()))
    except Exception:
        return path


_reloaders: dict[tuple[str, str], ReloadingContext] = {}
_reloaders_lock = threading.Lock()


def server_context(cert_file: str, key_file: str) -> ssl.SSLContext:
    """The server context for this pair: TLS 1.2+, reloading a rotated certificate from disk.

    Cached per pair, so callers may ask for it on every connection at no cost. Raises
    ConfigError if the pair cannot be loaded now."""
    key = (os.path.abspath(cert_file), os.path.abspath(key_file))
    with _reloaders_lock:
        reloader = _reloaders.get(key)
        if reloader is None:
            reloader = _reloaders[key] = ReloadingContext(*key)
    return reloader.context
