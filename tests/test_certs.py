"""certs/: generated certificates checked by the real openssl, the embedded self-signed default,
and the reloading TLS context: against in-process TLS sockets and against a real `archway serve`
(gunicorn) process, including rotation on disk while clients keep connecting."""
import datetime as dt
import logging
import multiprocessing
import os
import socket
import ssl
import stat
import subprocess
import sys
import threading
import time

import pytest

from archway.certs import x509 as cx
from archway.certs.selfsigned import ensure_self_signed
from archway.certs.tls import ReloadingContext, server_context
from lab.procs import REPO, Server, free_port, require_binary, wait_until

SERVICE, NAMESPACE = "archway", "archway-system"
SVC_NAMES = ["archway", "archway.archway-system", "archway.archway-system.svc",
             "archway.archway-system.svc.cluster.local"]


def archway(*args, check=True):
    return subprocess.run([sys.executable, "-m", "archway.main.cli", *args], cwd=REPO,
                          capture_output=True, text=True, timeout=60, check=check)


def openssl(*args) -> str:
    out = subprocess.run([require_binary("openssl"), *args], capture_output=True, text=True,
                         timeout=30)
    return out.stdout + out.stderr


def mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def serial_of(cert_path) -> int:
    with open(cert_path, "rb") as f:
        return cx.load_cert(f.read()).serial_number


# --- archway certs generate -------------------------------------------------------------------

@pytest.fixture(scope="module")
def generated(tmp_path_factory):
    out = tmp_path_factory.mktemp("gen") / "tls"
    result = archway("certs", "generate", "--service", SERVICE, "--namespace", NAMESPACE,
                     "--out", str(out), "--days", "30", "--host", "127.0.0.1", "--keep-ca-key")
    assert "ca.crt" in result.stdout
    return out


def test_generated_files_and_permissions(generated):
    assert sorted(os.listdir(generated)) == ["ca.crt", "ca.key", "tls.crt", "tls.key"]
    assert mode(generated) == 0o700
    assert mode(generated / "tls.key") == 0o600
    assert mode(generated / "ca.key") == 0o600
    assert mode(generated / "tls.crt") == 0o644


def test_openssl_verifies_the_chain_for_server_use(generated):
    out = openssl("verify", "-CAfile", str(generated / "ca.crt"), "-purpose", "sslserver",
                  "-verify_hostname", "archway.archway-system.svc", str(generated / "tls.crt"))
    assert out.strip().endswith(": OK"), out
    # And it does not verify for a name that is not in the SANs.
    out = openssl("verify", "-CAfile", str(generated / "ca.crt"),
                  "-verify_hostname", "other.archway-system.svc", str(generated / "tls.crt"))
    assert "hostname mismatch" in out


def test_leaf_extensions_as_openssl_reads_them(generated):
    text = openssl("x509", "-in", str(generated / "tls.crt"), "-noout", "-ext",
                   "subjectAltName,extendedKeyUsage,keyUsage,basicConstraints")
    sans = text.split("Subject Alternative Name:")[1].split("X509v3")[0]
    names = {n.strip() for n in sans.replace("\n", "").split(",")}
    assert names == {f"DNS:{n}" for n in SVC_NAMES} | {"IP Address:127.0.0.1"}
    assert "TLS Web Server Authentication" in text
    assert "X509v3 Key Usage: critical\n    Digital Signature\n" in text
    assert "CA:FALSE" in text
    ca = openssl("x509", "-in", str(generated / "ca.crt"), "-noout", "-ext",
                 "basicConstraints,keyUsage")
    assert "CA:TRUE, pathlen:0" in ca and "Certificate Sign" in ca


def test_days_and_key_type(generated):
    with open(generated / "tls.crt", "rb") as f:
        cert = cx.load_cert(f.read())
    lifetime = cert.not_valid_after_utc - cert.not_valid_before_utc
    assert dt.timedelta(days=30) <= lifetime <= dt.timedelta(days=30, minutes=10)
    assert "id-ecPublicKey" in openssl("x509", "-in", str(generated / "tls.crt"), "-noout", "-text")


def test_generate_refuses_to_overwrite_without_force(generated):
    before = serial_of(generated / "tls.crt")
    result = archway("certs", "generate", "--service", SERVICE, "--namespace", NAMESPACE,
                     "--out", str(generated), check=False)
    assert result.returncode == 2 and "--force" in result.stderr
    assert serial_of(generated / "tls.crt") == before


def test_generate_rejects_bad_days(tmp_path):
    result = archway("certs", "generate", "--service", "a", "--namespace", "b",
                     "--out", str(tmp_path / "x"), "--days", "0", check=False)
    assert result.returncode == 2 and "must be positive" in result.stderr
    assert not (tmp_path / "x").exists()


# --- the embedded self-signed default ---------------------------------------------------------

def test_self_signed_generated_once_then_reused(tmp_path):
    state = tmp_path / "state"
    files = ensure_self_signed(str(state))
    cert, key = files                       # unpacks like the (cert_path, key_path) pair
    assert (cert, key) == (str(state / "tls" / "tls.crt"), str(state / "tls" / "tls.key"))
    assert files.ca_path == str(state / "tls" / "ca.crt")
    assert mode(state) == 0o700 and mode(state / "tls") == 0o700
    assert mode(key) == 0o600 and mode(state / "tls" / "ca.key") == 0o600
    out = openssl("verify", "-CAfile", files.ca_path, "-verify_ip", "127.0.0.1", cert)
    assert out.strip().endswith(": OK"), out
    assert cx.hosts_of(cx.load_issued_files(cert, key).cert) == {"localhost", "127.0.0.1", "::1"}

    stamp = os.stat(cert).st_mtime_ns
    again = ensure_self_signed(str(state))
    assert again == files and os.stat(cert).st_mtime_ns == stamp


def test_self_signed_renewed_when_expiring_keeping_the_ca(tmp_path):
    files = ensure_self_signed(str(tmp_path))
    ca_before, serial_before = open(files.ca_path, "rb").read(), serial_of(files.cert_path)
    later = cx.utcnow() + dt.timedelta(days=362)      # the 365-day leaf has 3 days left
    ensure_self_signed(str(tmp_path), now=later)
    assert serial_of(files.cert_path) != serial_before
    assert open(files.ca_path, "rb").read() == ca_before   # curl --cacert keeps working
    leaf = cx.load_issued_files(files.cert_path, files.key_path)
    assert cx.is_issued_by(leaf.cert, cx.load_cert(ca_before))


def test_self_signed_regenerated_when_unreadable_or_hosts_change(tmp_path):
    files = ensure_self_signed(str(tmp_path))
    with open(files.cert_path, "wb") as f:
        f.write(b"-----BEGIN CERTIFICATE-----\ngarbage\n")
    ensure_self_signed(str(tmp_path))
    assert cx.load_issued_files(files.cert_path, files.key_path)   # parses, key matches again

    ensure_self_signed(str(tmp_path), hosts=("localhost", "webhook.lab"))
    assert "webhook.lab" in cx.hosts_of(cx.load_issued_files(files.cert_path, files.key_path).cert)


def _ensure_in_child(state_dir, queue):
    files = ensure_self_signed(state_dir)
    queue.put(serial_of(files.cert_path))


def test_self_signed_safe_when_workers_start_together(tmp_path):
    """Six processes racing on an empty state dir end up with one and the same pair."""
    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_ensure_in_child, args=(str(tmp_path), queue)) for _ in range(6)]
    for p in procs:
        p.start()
    serials = {queue.get(timeout=30) for _ in procs}
    for p in procs:
        p.join(10)
        assert p.exitcode == 0
    assert len(serials) == 1
    leftovers = [n for n in os.listdir(tmp_path / "tls") if n.startswith(".") and n != ".lock"]
    assert leftovers == []


# --- the reloading server context, in-process ---------------------------------------------------

class _TlsEcho:
    """A tiny TLS server on a thread using one server-side SSLContext, like a gunicorn worker."""

    def __init__(self, context):
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.context = context
        self.stopping = False
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self):
        while not self.stopping:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            try:
                with self.context.wrap_socket(conn, server_side=True) as tls:
                    tls.sendall(b"x")
                    tls.recv(1)
            except (OSError, ssl.SSLError):
                pass

    def close(self):
        self.stopping = True
        self.sock.close()


def _handshake(port, cafile, *, server_hostname="127.0.0.1", min_version=None, max_version=None,
               ciphers=None):
    ctx = ssl.create_default_context(cafile=cafile)
    if min_version:
        ctx.minimum_version = min_version
    if max_version:
        ctx.maximum_version = max_version
    if ciphers:
        ctx.set_ciphers(ciphers)
    with socket.create_connection(("127.0.0.1", port), timeout=5) as raw:
        with ctx.wrap_socket(raw, server_hostname=server_hostname) as tls:
            return int(tls.getpeercert()["serialNumber"], 16), tls.version(), tls.cipher()[0]


def _issue_into(ca: cx.Issued, cert_path, key_path, hosts=("127.0.0.1", "localhost")):
    leaf = cx.issue_serving_cert(ca, list(hosts), days=2)
    with open(key_path, "wb") as f:
        f.write(leaf.key_pem)
    with open(cert_path, "wb") as f:
        f.write(leaf.cert_pem)
    return leaf


def test_reload_keeps_old_pair_while_half_written(tmp_path, caplog):
    ca = cx.issue_ca("test CA", days=3)
    (tmp_path / "ca.crt").write_bytes(ca.cert_pem)
    cert, key = str(tmp_path / "tls.crt"), str(tmp_path / "tls.key")
    first = _issue_into(ca, cert, key)
    clock = [0.0]
    reloader = ReloadingContext(cert, key, check_interval=1.0, clock=lambda: clock[0])
    server = _TlsEcho(reloader.context)
    cafile = str(tmp_path / "ca.crt")
    try:
        assert _handshake(server.port, cafile)[0] == first.cert.serial_number

        second = cx.issue_serving_cert(ca, ["127.0.0.1"], days=2)
        (tmp_path / "tls.crt").write_bytes(second.cert_pem)      # the key is not there yet
        clock[0] += 1.5
        with caplog.at_level(logging.WARNING, logger="archway.certs.tls"):
            assert _handshake(server.port, cafile)[0] == first.cert.serial_number
        assert "keeping the current TLS certificate" in caplog.text
        assert "BEGIN" not in caplog.text                         # no key material in logs

        (tmp_path / "tls.key").write_bytes(second.key_pem)
        assert _handshake(server.port, cafile)[0] == first.cert.serial_number  # < 1 s: no stat
        clock[0] += 1.5
        assert _handshake(server.port, cafile)[0] == second.cert.serial_number
        assert reloader.reloads == 1
    finally:
        server.close()


def test_server_context_is_cached_and_fails_clearly(tmp_path):
    files = ensure_self_signed(str(tmp_path))
    assert server_context(*files) is server_context(*files)
    from archway.errors import ConfigError
    with pytest.raises(ConfigError, match="cannot load TLS certificate"):
        server_context(files.cert_path, str(tmp_path / "missing.key"))


# --- a real `archway serve` with generated certificates -------------------------------------------

def _kubelet_style_dir(root, files: dict[str, bytes]):
    """Lay files out as the kubelet's AtomicWriter does for a Secret volume, or swap them:
    <root>/..<ts>/<name>, <root>/..data -> ..<ts>, <root>/<name> -> ..data/<name>."""
    version = os.path.join(root, f"..{time.time_ns()}")
    os.makedirs(version)
    for name, data in files.items():
        with open(os.path.join(version, name), "wb") as f:
            f.write(data)
    tmp_link = os.path.join(root, "..data_tmp")
    os.symlink(os.path.basename(version), tmp_link)
    os.replace(tmp_link, os.path.join(root, "..data"))         # the atomic swap
    for name in files:
        link = os.path.join(root, name)
        if not os.path.islink(link):
            os.symlink(os.path.join("..data", name), link)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """`archway serve` (2 gunicorn workers) on a certificate mounted like a Secret volume."""
    base = tmp_path_factory.mktemp("serve")
    ca = cx.issue_ca("archway test CA", days=3)
    (base / "ca.crt").write_bytes(ca.cert_pem)
    hosts = SVC_NAMES + ["127.0.0.1"]
    leaf = cx.issue_serving_cert(ca, hosts, days=2)
    mount = base / "tls"
    mount.mkdir()
    _kubelet_style_dir(str(mount), {"tls.crt": leaf.cert_pem, "tls.key": leaf.key_pem})
    config = base / "archway.yaml"
    config.write_text(
        f"server:\n  cert_file: {mount}/tls.crt\n  key_file: {mount}/tls.key\n"
        f"  state_dir: {base}/state\n  workers: 2\n  threads: 4\n"
        "kubernetes:\n  enabled: \"off\"\n")
    port = free_port()
    env = {**os.environ, "PYTHONPATH": REPO}
    server = Server([sys.executable, "-m", "archway.main.cli", "--config", str(config), "serve",
                     "--bind", f"127.0.0.1:{port}"], port=port, log_path=str(base / "log"),
                    env=env, cwd=REPO, ready_timeout=30)
    try:
        yield {"port": port, "ca": ca, "cafile": str(base / "ca.crt"), "mount": str(mount),
               "serial": leaf.cert.serial_number, "hosts": hosts, "server": server}
    finally:
        server.stop()


def test_served_handshake_and_health(served):
    serial, version, cipher = _handshake(served["port"], served["cafile"],
                                         server_hostname="archway.archway-system.svc")
    assert serial == served["serial"] and version == "TLSv1.3"
    ctx = ssl.create_default_context(cafile=served["cafile"])
    with socket.create_connection(("127.0.0.1", served["port"]), timeout=5) as raw:
        with ctx.wrap_socket(raw, server_hostname="archway.archway-system.svc") as tls:
            tls.sendall(b"GET /healthz HTTP/1.1\r\nHost: archway\r\nConnection: close\r\n\r\n")
            reply = b""
            while chunk := tls.recv(4096):
                reply += chunk
    assert reply.startswith(b"HTTP/1.1 200")


@pytest.mark.filterwarnings("ignore:ssl.TLSVersion.TLSv1_1 is deprecated:DeprecationWarning")
def test_served_tls_versions(served):
    port, cafile = served["port"], served["cafile"]
    _, version, cipher = _handshake(port, cafile, max_version=ssl.TLSVersion.TLSv1_2)
    assert version == "TLSv1.2"
    assert cipher.startswith("ECDHE-ECDSA-") and ("GCM" in cipher or "CHACHA20" in cipher), cipher
    assert _handshake(port, cafile, min_version=ssl.TLSVersion.TLSv1_3)[1] == "TLSv1.3"

    # A client that can only speak TLS 1.1 (allowed on its side by SECLEVEL=0) is refused by the
    # server with a protocol_version alert.
    with pytest.raises(ssl.SSLError) as refused:
        _handshake(port, cafile, min_version=ssl.TLSVersion.TLSv1_1,
                   max_version=ssl.TLSVersion.TLSv1_1, ciphers="DEFAULT:@SECLEVEL=0")
    assert "ALERT_PROTOCOL_VERSION" in str(refused.value).upper()

    # A TLS 1.2 client offering only non-forward-secret / CBC suites finds nothing in common.
    with pytest.raises(ssl.SSLError):
        _handshake(port, cafile, max_version=ssl.TLSVersion.TLSv1_2, ciphers="AES128-SHA:AES256-SHA")


def test_served_rotation_is_picked_up_without_failed_handshakes(served):
    """Clients keep connecting while the Secret volume is swapped the kubelet's way: every
    handshake succeeds, and new clients soon see the new serial from both workers."""
    port, cafile = served["port"], served["cafile"]
    results, failures, stop = [], [], threading.Event()

    def client_loop():
        while not stop.is_set():
            try:
                results.append((time.monotonic(), _handshake(port, cafile)[0]))
            except (OSError, ssl.SSLError) as e:
                failures.append(repr(e))

    threads = [threading.Thread(target=client_loop) for _ in range(2)]
    for t in threads:
        t.start()
    try:
        # handshakes with the old certificate first (asserted below)
        wait_until(lambda: len(results) >= 4 or failures, 30, "handshakes before the swap")
        new = cx.issue_serving_cert(served["ca"], served["hosts"], days=2)
        swapped_at = time.monotonic()
        _kubelet_style_dir(served["mount"], {"tls.crt": new.cert_pem, "tls.key": new.key_pem})
        deadline = swapped_at + 10
        while time.monotonic() < deadline:
            recent = [s for at, s in results[-20:] if at > swapped_at]
            if len(recent) >= 20 and set(recent) == {new.cert.serial_number}:
                break
            time.sleep(0.1)
    finally:
        stop.set()
        for t in threads:
            t.join(10)
    assert failures == []
    after = [s for at, s in results if at > swapped_at]
    assert {s for at, s in results if at < swapped_at} == {served["serial"]}
    assert after[-20:] == [new.cert.serial_number] * 20, "the new certificate was never served"
    first_new = next(at for at, s in results if s == new.cert.serial_number)
    assert first_new - swapped_at < 3.0       # checked at most once a second per worker
    served["serial"] = new.cert.serial_number
    assert "Traceback" not in served["server"].log()


def test_serve_says_clearly_when_the_state_directory_is_not_writable(tmp_path):
    blocker = tmp_path / "not-a-directory"
    blocker.write_text("a file where the state directory should go")
    config = tmp_path / "archway.yaml"
    config.write_text(f"server:\n  state_dir: {blocker}/state\nkubernetes:\n  enabled: \"off\"\n")
    result = subprocess.run([sys.executable, "-m", "archway.main.cli", "--config", str(config), "serve",
                             "--bind", f"127.0.0.1:{free_port()}"], cwd=REPO, capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert f"server.state_dir {blocker}/state is not writable" in result.stderr
    assert "server.cert_file" in result.stderr   # says what to do instead
