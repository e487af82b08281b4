"""Run a pushed image the way a kubelet would, with no container engine (podman/crun fail here).

    image = PulledImage(ref, "linux/arm64", tmp_dir)     # buildah pulls that platform (own storage)
    argv = pod_argv(image, ["--version"])                 # ENTRYPOINT + args, as pod `args:` do
    subprocess.run(pod_command(image, argv, mounts, user="65532:65532"), env=image.env())
    image.close()

pod_command() is `unshare` (new mount and PID namespaces) + `chroot`: the image's root bound
read-only, /dev and a fresh /proc, the pod's volumes bound over it (the mount points are made
first, as a runtime does), then the command as the pod's user. Foreign architectures run through
binfmt_misc (qemu-user-static, registered with the F flag, so it works inside the chroot). All
mounts vanish with the namespace when the process ends.
"""
import json
import os
import shlex
import shutil
import subprocess
from dataclasses import dataclass

from lab.procs import require_binary


@dataclass(frozen=True)
class Mount:
    source: str          # a directory of this machine
    target: str          # where it appears in the container
    read_only: bool = False


class PulledImage:
    """One platform of an image on a registry, pulled by buildah into its own vfs storage."""

    def __init__(self, ref: str, platform: str, directory: str, *, tls_verify: bool = False):
        self.directory = directory
        self._buildah = [require_binary("buildah"), "--root", os.path.join(directory, "storage"),
                         "--runroot", os.path.join(directory, "run"), "--storage-driver", "vfs"]
        os_name, arch = platform.split("/")
        self.container = self._run("from", "--quiet", f"--tls-verify={str(tls_verify).lower()}",
                                   "--os", os_name, "--arch", arch, f"docker://{ref}")
        self.rootfs = self._run("mount", self.container)
        oci = json.loads(self._run("inspect", "--type", "container", self.container))["OCIv1"]
        self.architecture: str = oci["architecture"]
        self.config: dict = oci["config"]   # Env, Entrypoint, Cmd, User, WorkingDir, ...

    def _run(self, *args: str) -> str:
        result = subprocess.run([*self._buildah, *args], capture_output=True, text=True, timeout=600,
                                check=False)
        if result.returncode:
            raise RuntimeError(f"buildah {' '.join(args)}: {result.stderr.strip()}")
        return result.stdout.strip()

    def path(self, inside: str) -> str:
        """The host path of `inside` (absolute, in the image), its symlinks resolved in the image."""
        rel = inside.lstrip("/")
        for _ in range(40):
            host = os.path.join(self.rootfs, rel)
            if not os.path.islink(host):
                return host
            target = os.readlink(host)
            rel = os.path.normpath(target.lstrip("/") if os.path.isabs(target)
                                   else os.path.join(os.path.dirname(rel), target))
        raise RuntimeError(f"{inside}: too many symbolic links")

    def env(self, extra: dict | None = None) -> dict:
        """The image's environment (Env), plus what the pod spec adds."""
        env = dict(item.split("=", 1) for item in self.config.get("Env") or [])
        return {**env, **(extra or {})}

    def close(self) -> None:
        self._run("umount", self.container)
        self._run("rm", self.container)
        shutil.rmtree(self.directory, ignore_errors=True)


def pod_argv(image: PulledImage, args: list[str] | None = None) -> list[str]:
    """A container without `command:`: the image's ENTRYPOINT, then `args:` (else its CMD)."""
    if args is None:
        args = image.config.get("Cmd") or []
    return [*(image.config.get("Entrypoint") or []), *args]


def pod_command(image: PulledImage, argv: list[str], mounts: list[Mount], *, user: str,
                read_only_root: bool = True) -> list[str]:
    """The command line that runs `argv` in `image` like a container; see the module doc."""
    q = shlex.quote
    root = q(image.rootfs)
    newroot = q(os.path.join(image.directory, "newroot"))
    lines = ["set -eu", f"mkdir -p {newroot}"]
    # Mount points exist before the root turns read-only, as a container runtime makes them.
    lines += [f"mkdir -p {q(image.rootfs + m.target)}" for m in mounts]
    lines += [f"mount --bind {root} {newroot}",
              f"mount --rbind /dev {newroot}/dev",
              f"mount -t proc proc {newroot}/proc"]
    if read_only_root:
        lines.append(f"mount -o remount,bind,ro {newroot}")
    for m in mounts:
        target = q(os.path.join(image.directory, "newroot") + m.target)
        lines.append(f"mount --bind {q(m.source)} {target}")
        if m.read_only:
            lines.append(f"mount -o remount,bind,ro {target}")
    lines.append(f"exec chroot --userspec={q(user)} {newroot} {' '.join(q(a) for a in argv)}")
    return [require_binary("unshare"), "--mount", "--propagation", "private", "--pid", "--fork",
            "sh", "-c", "\n".join(lines)]


def elf_machine(path: str) -> str:
    """The architecture an ELF file is built for (e_machine), in Go/OCI names."""
    with open(path, "rb") as f:
        header = f.read(20)
    assert header[:4] == b"\x7fELF", f"{path} is not an ELF file"
    machine = int.from_bytes(header[18:20], "little")
    return {0x3E: "amd64", 0xB7: "arm64"}.get(machine, hex(machine))
