"""What a node of a foreign architecture boots (vmnode.py): Debian's kernel, its initramfs and a
root file system of that architecture, built once and cached under ~/.cache/archway/vm/.

    machine = MACHINES["arm64"]
    image = vm_image(machine)      # VmImage(kernel, initrd, rootfs): built, or found cached

The root file system is `mmdebstrap --arch=...` (the foreign steps run under the qemu-user
binfmt handlers the image build registers) with Debian's containerd, runc, CNI plugins,
iptables and the cloud kernel, written into an ext4 image by `mkfs.ext4 -d` (no loop mount).
The VM boots it read-write with `snapshot=on`: the cached image is never changed. A small boot
script in it mounts the node's seed disk (made per start by vmnode.py) and runs what that holds,
so the image does not change with the lab's Kubernetes version or the node's certificates.
"""
import fcntl
import glob
import hashlib
import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass

from lab.cluster.processes import ControlPlaneError

CACHE = os.path.expanduser(os.environ.get("ARCHWAY_VM_CACHE", "~/.cache/archway/vm"))
SUITE = "bookworm"
MIRROR = "http://deb.debian.org/debian"


@dataclass(frozen=True)
class Machine:
    """How one architecture boots under qemu-system: a third architecture is a row, not a copy."""
    arch: str                  # as Kubernetes names it
    debian_arch: str           # as Debian names it
    qemu: str                  # the emulator
    qemu_package: str          # the Debian package that holds it
    board: tuple[str, ...]     # machine and CPU options
    console: str               # the serial console's device in the guest
    kernel: str                # Debian's kernel package
    bus: str = "pci"           # virtio devices' transport: pci, or ccw (s390x)


MACHINES = {m.arch: m for m in (
    # cortex-a72 (ARMv8.0): TCG emulates it faster than `max` (no pointer authentication, no SVE).
    Machine("arm64", "arm64", "qemu-system-aarch64", "qemu-system-arm",
            ("-M", "virt", "-cpu", "cortex-a72"), "ttyAMA0", "linux-image-cloud-arm64"),
    Machine("ppc64le", "ppc64el", "qemu-system-ppc64", "qemu-system-ppc",
            ("-M", "pseries", "-cpu", "power9"), "hvc0", "linux-image-powerpc64le"),
    Machine("s390x", "s390x", "qemu-system-s390x", "qemu-system-s390x",
            ("-M", "s390-ccw-virtio",), "ttysclp0", "linux-image-s390x", bus="ccw"),
)}

# What runs in the guest: the node's runtime and networking, and a PID 1 that reaps orphans.
PACKAGES = ("initramfs-tools", "kmod", "udev", "containerd", "runc", "containernetworking-plugins",
            "iptables", "conntrack", "iproute2", "tini", "ca-certificates", "procps", "mount",
            "util-linux")

# The rootfs's own boot script (PID 1's child, under tini): the seed disk says the rest.
BOOT = """#!/bin/sh
# archway lab VM node: mount what the initramfs left out, then run the seed disk's script.
mountpoint -q /proc || mount -t proc proc /proc
mountpoint -q /sys || mount -t sysfs sysfs /sys
mountpoint -q /dev || mount -t devtmpfs devtmpfs /dev
mkdir -p /seed
mount -o ro /dev/vdb /seed || { echo "archway-boot: no seed disk at /dev/vdb"; exec sleep infinity; }
exec /bin/sh /seed/init
"""
BOOT_PATH = "/usr/local/sbin/archway-boot"
# Grown per boot by writes into the snapshot: containerd's images and pods' layers.
FREE_BYTES = 3 * 1024 ** 3


@dataclass(frozen=True)
class VmImage:
    kernel: str
    initrd: str
    rootfs: str


def recipe(machine: Machine) -> str:
    """What the cached image is made of: a change of any part builds another."""
    return "\n".join([machine.debian_arch, machine.kernel, SUITE, *PACKAGES, BOOT])


def image_dir(machine: Machine) -> str:
    digest = hashlib.sha256(recipe(machine).encode()).hexdigest()[:12]
    return os.path.join(CACHE, f"{machine.arch}-{digest}")


def vm_image(machine: Machine, log=print) -> VmImage:
    """The image of `machine`, built (about 5 minutes for arm64 here) when not cached; one build
    at a time per architecture (a second caller waits, then finds it)."""
    folder = image_dir(machine)
    image = VmImage(*(os.path.join(folder, n) for n in ("vmlinuz", "initrd.img", "rootfs.img")))
    if all(os.path.exists(p) for p in (image.kernel, image.initrd, image.rootfs)):
        return image
    os.makedirs(CACHE, exist_ok=True)
    with open(os.path.join(CACHE, f".{machine.arch}.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not os.path.exists(image.rootfs):
            log(f"vm image: building {machine.arch}'s root file system (mmdebstrap, cached in {folder})")
            _build(machine, folder)
    return image


def _build(machine: Machine, folder: str) -> None:
    for tool in ("mmdebstrap", "mkfs.ext4"):
        if shutil.which(tool) is None:
            raise ControlPlaneError(f"{tool} is not installed (scripts/setup.sh --test installs it)")
    work = tempfile.mkdtemp(prefix=f".build-{machine.arch}-", dir=CACHE)
    try:
        root = os.path.join(work, "root")
        hook = f'cat > "$1{BOOT_PATH}" <<"EOF"\n{BOOT}EOF\nchmod 755 "$1{BOOT_PATH}"'
        _run(["mmdebstrap", f"--arch={machine.debian_arch}", "--variant=minbase",
              f"--include={','.join((machine.kernel,) + PACKAGES)}",
              # containerd's unit would start nothing here: the seed's script starts it.
              "--customize-hook", hook, SUITE, root, MIRROR], os.path.join(work, "mmdebstrap.log"))
        kernels = sorted(glob.glob(os.path.join(root, "boot", "vmlinu*-*")))
        initrds = sorted(glob.glob(os.path.join(root, "boot", "initrd.img-*")))
        if not kernels or not initrds:
            raise ControlPlaneError(f"{machine.kernel} left no kernel or initramfs in /boot")
        staged = os.path.join(work, "out")
        os.makedirs(staged)
        shutil.copy(kernels[-1], os.path.join(staged, "vmlinuz"))
        shutil.copy(initrds[-1], os.path.join(staged, "initrd.img"))
        size = tree_bytes(root) + FREE_BYTES
        _run(["mkfs.ext4", "-q", "-F", "-L", "archway-root", "-d", root,
              os.path.join(staged, "rootfs.img"), f"{size // 1024 ** 2}M"],
             os.path.join(work, "mkfs.log"))
        shutil.rmtree(folder, ignore_errors=True)
        os.replace(staged, folder)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def tree_bytes(root: str) -> int:
    """Bytes under `root` (one file system): what an ext4 image of it must hold."""
    done = subprocess.run(["du", "-sb", "-x", root], capture_output=True, text=True, check=True)
    return int(done.stdout.split()[0])


def _run(args: list[str], log: str) -> None:
    with open(log, "w") as out:
        done = subprocess.run(args, stdout=out, stderr=subprocess.STDOUT)
    if done.returncode != 0:
        with open(log) as f:
            tail = f.read()[-3000:]
        raise ControlPlaneError(f"{args[0]} failed (exit {done.returncode}):\n{tail}")
