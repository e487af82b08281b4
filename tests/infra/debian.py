"""A throwaway Debian 12 (bookworm) to run the project's scripts in: a rootfs made by mmdebstrap
(cached as a tarball, made again after 7 days), unpacked into a directory, entered with chroot
inside its own mount and PID namespaces (unshare), so every process and mount it starts ends
with it. It shares the machine's network; it trusts the CAs this machine trusts (a
TLS-inspecting proxy in front of the package registries), added the way an administrator would
(/usr/local/share/ca-certificates). Needs root, mmdebstrap and unshare.
"""
import hashlib
import os
import re
import shutil
import subprocess
import time

from lab.procs import REPO, require_binary

SUITE = "bookworm"
MIRROR = os.environ.get("DEBIAN_MIRROR", "http://deb.debian.org/debian")
SECURITY = os.environ.get("DEBIAN_SECURITY_MIRROR", "http://deb.debian.org/debian-security")
CACHE = os.path.join(os.environ.get("ARCHWAY_CACHE_DIR")
                     or os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"),
                                     "archway"), "debian-chroot")
MAX_AGE_SECONDS = 7 * 24 * 3600
PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"   # Debian's root PATH
_CERT = re.compile(r"-----BEGIN CERTIFICATE-----.+?-----END CERTIFICATE-----", re.S)


def rootfs_tarball(packages: list[str]) -> str:
    """A minbase bookworm with `packages`, as a tarball: made once per package list and week."""
    os.makedirs(CACHE, exist_ok=True)
    key = hashlib.sha256(" ".join(sorted(packages)).encode()).hexdigest()[:16]
    tarball = os.path.join(CACHE, f"{SUITE}-{key}.tar")
    if os.path.exists(tarball) and time.time() - os.path.getmtime(tarball) < MAX_AGE_SECONDS:
        return tarball
    part = tarball + ".part"
    result = subprocess.run(
        [require_binary("mmdebstrap"), "--variant=minbase", "--format=tar",
         f"--include={','.join(packages)}", "--aptopt=Acquire::Retries \"3\"",
         "--dpkgopt=path-exclude=/usr/share/man/*", "--dpkgopt=path-exclude=/usr/share/doc/*",
         "--dpkgopt=path-exclude=/usr/share/locale/*", SUITE, part,
         f"deb {MIRROR} {SUITE} main", f"deb {MIRROR} {SUITE}-updates main",
         f"deb {SECURITY} {SUITE}-security main"],
        capture_output=True, text=True, timeout=1200)
    if result.returncode != 0:
        raise RuntimeError(f"mmdebstrap failed:\n{result.stderr[-3000:]}")
    os.replace(part, tarball)
    return tarball


def copy_checkout(directory: str) -> None:
    """The repository's files as they are now (tracked and new ones; not .venv, .git) into
    `directory`."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                            cwd=REPO, capture_output=True, check=True).stdout.split(b"\0")
    for name in filter(None, (n.decode() for n in listed)):
        source = os.path.join(REPO, name)
        if os.path.isfile(source):
            target = os.path.join(directory, name)
            os.makedirs(os.path.dirname(target), exist_ok=True)
            shutil.copy2(source, target)


class Chroot:
    """An unpacked rootfs; `run` and `start` enter it as root with a clean environment."""

    def __init__(self, tarball: str, directory: str):
        self.root = directory
        os.makedirs(directory)
        subprocess.run(["tar", "-C", directory, "-xf", tarball], check=True, timeout=600)
        shutil.copy("/etc/resolv.conf", os.path.join(directory, "etc", "resolv.conf"))
        self._trust_this_machines_cas()

    def path(self, inside: str) -> str:
        return os.path.join(self.root, inside.lstrip("/"))

    def copy_checkout(self, inside: str) -> None:
        copy_checkout(self.path(inside))

    def _command(self, script: str, env: dict, binds) -> list[str]:
        """`binds`: (host directory, directory inside) pairs, bind-mounted for this command."""
        for host, inside in binds:
            os.makedirs(host, exist_ok=True)
            os.makedirs(self.path(inside), exist_ok=True)
        mounts = [f"mount -t proc proc {self.root}/proc", f"mount --rbind /dev {self.root}/dev",
                  f"mount --rbind /sys {self.root}/sys"]
        mounts += [f"mount --bind {host} {self.root}{inside}" for host, inside in binds]
        environment = [f"{k}={v}" for k, v in {"HOME": "/root", "PATH": PATH, "LANG": "C.UTF-8",
                                               "TERM": "dumb", **env}.items()]
        return [require_binary("unshare"), "--mount", "--pid", "--fork", "--kill-child",
                "--propagation", "private", "sh", "-ec",
                " && ".join(mounts) + ' && exec chroot "$0" /usr/bin/env -i "$@"', self.root,
                *environment, "bash", "-c", script]

    def run(self, script: str, *, env=None, binds=(), timeout=900) -> subprocess.CompletedProcess:
        return subprocess.run(self._command(script, env or {}, binds), capture_output=True,
                              text=True, timeout=timeout)

    def start(self, script: str, *, log_path: str, env=None, binds=()) -> subprocess.Popen:
        """In the background; stop it with `stop` (its PID namespace ends with it)."""
        log = open(log_path, "ab")
        return subprocess.Popen(self._command(script, env or {}, binds), stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)

    @staticmethod
    def stop(process: subprocess.Popen) -> None:
        if process.poll() is None:
            process.terminate()          # unshare --kill-child ends pid 1 and so everything
            try:
                process.wait(20)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(20)

    def _trust_this_machines_cas(self) -> None:
        with open("/etc/ssl/certs/ca-certificates.crt") as f:
            ours = _CERT.findall(f.read())
        with open(self.path("/etc/ssl/certs/ca-certificates.crt")) as f:
            theirs = set(_CERT.findall(f.read()))
        extra = [cert for cert in ours if cert not in theirs]
        local = self.path("/usr/local/share/ca-certificates")
        os.makedirs(local, exist_ok=True)
        for number, cert in enumerate(extra):
            with open(os.path.join(local, f"this-machine-{number}.crt"), "w") as f:
                f.write(cert + "\n")
        if extra:
            result = self.run("update-ca-certificates >/dev/null", timeout=120)
            if result.returncode != 0:
                raise RuntimeError(f"update-ca-certificates failed: {result.stderr[-2000:]}")

    def remove(self) -> None:
        """Delete the unpacked rootfs (nothing is mounted in it outside its own namespaces)."""
        shutil.rmtree(self.root, ignore_errors=True)
