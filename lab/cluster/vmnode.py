"""A real node of a foreign architecture beside the real control plane: a Debian VM under
qemu-system-<arch> (TCG: no KVM for another architecture) whose own kernel, containerd, runc,
CNI, kubelet and kube-proxy join the lab's control plane as a Node whose kubelet reports that
architecture. Facts measured here and pitfalls: docs/real-control-plane.md ("A VM node").

    plane = ControlPlane(state_dir, node_ip=node_address(), nodes=...).start()
    vm = VmNode(plane, MACHINES["arm64"], insecure_registries=["192.0.2.2:5000"]).start()
    teardown_vms(plane)     # stops every VM node and undoes what they changed on this machine

The image (kernel, initramfs, root file system) is vmimage.py's, cached; the kubelet and
kube-proxy are the lab's Kubernetes source cross-compiled (scripts/k8s-build.sh --node-arch);
what is this node's (its address, certificates, configuration, the pause image) is on a small
seed disk made per start. No qemu-user handler is registered in the guest: an amd64 binary fails
there with a real exec format error, as on an arm64 machine.

Its packets stay on this machine: the VM's tap is on a bridge the lab makes (BRIDGE, the host
at HOST_ADDRESS), the guest routes everything to the host, and before the VM starts the mangle
table's FORWARD jumps to a chain that drops what the VMs or their pods send out of any interface
but that bridge. What they may reach is the host itself (its own addresses are delivered
locally: the apiserver, the lab's registries) and each other. The host routes each VM's pod
CIDR to it, so the apiserver reaches the kubelet and the pods (logs, exec, webhooks).
"""
import json
import os
import shutil
import subprocess
import time

import requests
import yaml

from lab.cluster.controlplane import ControlPlane, kubeconfig
from lab.cluster.nodehost import GUARD_TABLE, guard_in_place, guard_rules
from lab.cluster.nodeimages import OciImage, go_binary
from lab.cluster.processes import ControlPlaneError, stop_process, tail
from lab.cluster.realnode import PAUSE_IMAGE, hosts_toml, node_name
from lab.cluster.vmimage import BOOT_PATH, MACHINES, Machine, tree_bytes, vm_image
from lab.kube import KubeError
from lab.procs import REPO

BRIDGE = "archway-vm"
HOST_ADDRESS = "10.245.0.1"
VM_NETWORK = "10.245.0.0/24"
GUARD_CHAIN = "ARCHWAY-VM-EGRESS"
KUBELET_PORT = 10250
SEED = "/seed"          # where the guest mounts its seed disk (vmimage.BOOT)


def _index(machine: Machine) -> int:
    return list(MACHINES).index(machine.arch)


def vm_address(machine: Machine) -> str:
    return f"10.245.0.{10 + _index(machine)}"


def pod_cidr(machine: Machine) -> str:
    return f"10.244.{10 + _index(machine)}.0/24"


def tap_name(machine: Machine) -> str:
    return f"awvm-{machine.arch}"[:15]     # an interface name has at most 15 bytes


def guarded_ranges() -> list[str]:
    """Every VM node's address and pod CIDR: what the guard keeps on the bridge."""
    return [VM_NETWORK] + [pod_cidr(m) for m in MACHINES.values()]


def node_binaries(arch: str) -> str:
    """The folder of the kubelet, kube-proxy and kube-scheduler for `arch` (cross-compiled once,
    then cached)."""
    done = subprocess.run(["bash", os.path.join(REPO, "scripts", "k8s-build.sh"), "--node-arch", arch],
                          capture_output=True, text=True)
    if done.returncode != 0:
        raise ControlPlaneError(f"scripts/k8s-build.sh --node-arch {arch} failed:\n{done.stderr[-3000:]}")
    return done.stdout.strip().splitlines()[-1]


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    done = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if check and done.returncode != 0:
        raise ControlPlaneError(f"ip {' '.join(args)}: {done.stderr.strip()}")
    return done


def _iptables(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    done = subprocess.run(["iptables", "-w", "5", *args], capture_output=True, text=True, timeout=30)
    if check and done.returncode != 0:
        raise ControlPlaneError(f"iptables {' '.join(args)}: {done.stderr.strip()}")
    return done


def link_exists(name: str) -> bool:
    return _ip("link", "show", name, check=False).returncode == 0


class VmNode:
    def __init__(self, plane: ControlPlane, machine: Machine, *, insecure_registries=(),
                 cpus: int = 2, memory_mb: int = 2048):
        if not plane.node_ip:
            raise ControlPlaneError("a VM node needs a control plane started with node_ip "
                                    "(its kubelet reaches the apiserver on that address)")
        self.plane = plane
        self.machine = machine
        self.name = node_name(machine.arch)
        self.ip = vm_address(machine)
        self.registries = list(insecure_registries)
        self.cpus, self.memory_mb = cpus, memory_mb
        self.dir = plane.path(f"vm-{machine.arch}")
        self.process_name = f"vm-{machine.arch}"

    def path(self, *parts: str) -> str:
        return os.path.join(self.dir, *parts)

    # --- lifecycle -------------------------------------------------------------------------
    def start(self, ready_timeout: float = 600.0) -> "VmNode":
        if shutil.which(self.machine.qemu) is None:
            raise ControlPlaneError(f"{self.machine.qemu} is not installed (Debian's "
                                    f"{self.machine.qemu_package}; scripts/setup.sh --test installs it)")
        image = vm_image(self.machine)
        binaries = node_binaries(self.machine.arch)
        os.makedirs(self.dir, exist_ok=True)
        self.plumb()
        seed = self.write_seed(binaries)
        began = time.monotonic()
        self.plane._launch(self.process_name, self.qemu_command(image, seed),
                           self._registered, ready_timeout)
        self.wait_ready(max(30.0, ready_timeout - (time.monotonic() - began)))
        return self

    def plumb(self) -> None:
        """The bridge (shared by every VM node), this VM's tap on it, the route to its pods and
        the egress guard, each made once."""
        if not link_exists(BRIDGE):
            _ip("link", "add", BRIDGE, "type", "bridge")
            _ip("addr", "add", f"{HOST_ADDRESS}/24", "dev", BRIDGE)
            _ip("link", "set", BRIDGE, "up")
        if _iptables("-t", GUARD_TABLE, "-S", GUARD_CHAIN, check=False).returncode != 0:
            for args in guard_rules(GUARD_CHAIN, BRIDGE, guarded_ranges()):
                _iptables(*args)
        tap = tap_name(self.machine)
        if link_exists(tap):
            _ip("link", "del", tap)
        _ip("tuntap", "add", "dev", tap, "mode", "tap")
        _ip("link", "set", tap, "master", BRIDGE)
        _ip("link", "set", tap, "up")
        _ip("route", "replace", pod_cidr(self.machine), "via", self.ip, "dev", BRIDGE)

    def guard_in_place(self) -> bool:
        return guard_in_place(GUARD_CHAIN, BRIDGE, guarded_ranges())

    def qemu_command(self, image, seed: str) -> list[str]:
        m = self.machine
        pci = m.bus == "pci"
        blk, net = ("virtio-blk-pci", "virtio-net-pci") if pci else ("virtio-blk-ccw", "virtio-net-ccw")
        mac = f"52:54:00:ac:00:{10 + _index(m):02x}"
        return [
            m.qemu, *m.board, "-smp", str(self.cpus), "-m", str(self.memory_mb),
            "-accel", "tcg,thread=multi", "-display", "none", "-monitor", "none",
            "-serial", "stdio", "-no-reboot",
            "-kernel", image.kernel, "-initrd", image.initrd,
            "-append", f"console={m.console} root=/dev/vda rw panic=-1 quiet net.ifnames=0 "
                       f"init=/usr/bin/tini -- {BOOT_PATH}",
            # vda: the cached image, its writes kept aside (snapshot) and gone with the VM.
            "-drive", f"file={image.rootfs},format=raw,if=none,id=root,snapshot=on",
            "-device", f"{blk},drive=root",
            "-drive", f"file={seed},format=raw,if=none,id=seed,readonly=on",
            "-device", f"{blk},drive=seed",
            "-netdev", f"tap,id=n0,ifname={tap_name(m)},script=no,downscript=no",
            # romfile= : no PXE option ROM (Debian's ipxe-qemu, a Recommends not installed):
            # the kernel is booted directly.
            "-device", f"{net},netdev=n0,mac={mac}" + (",romfile=" if pci else ""),
        ]

    # --- the seed disk -----------------------------------------------------------------------
    def write_seed(self, binaries: str) -> str:
        """An ext4 image of what is this node's (made with mkfs.ext4 -d: no mount)."""
        folder = self.path("seed")
        shutil.rmtree(folder, ignore_errors=True)
        os.makedirs(os.path.join(folder, "cni"))
        for binary in ("kubelet", "kube-proxy"):
            shutil.copy(os.path.join(binaries, binary), os.path.join(folder, binary))
        shutil.copy(self.plane.ca_path, os.path.join(folder, "ca.crt"))
        self._credentials(folder, "kubelet", f"system:node:{self.name}", ("system:nodes",))
        self._credentials(folder, "kube-proxy", "system:kube-proxy", ())
        OciImage.of({"/pause": go_binary("pause", self.machine.arch)}, entrypoint=["/pause"],
                    arch=self.machine.arch).write_archive(os.path.join(folder, "pause.tar"), PAUSE_IMAGE)
        for host in self.registries:
            os.makedirs(os.path.join(folder, "certs.d", host))
            with open(os.path.join(folder, "certs.d", host, "hosts.toml"), "w") as f:
                f.write(hosts_toml(host))
        files = {
            "init": self.init_script(),
            "containerd.toml": self.containerd_config(),
            "resolv.conf": "# archway's VM node: no nameserver outside this pod\nnameserver 127.0.0.1\n",
            "kubelet.yaml": yaml.safe_dump(self.kubelet_config()),
            "kube-proxy.yaml": yaml.safe_dump(self.kube_proxy_config()),
            "cni/10-archway.conflist": json.dumps(self.cni_config(), indent=1),
        }
        for name, text in files.items():
            with open(os.path.join(folder, name), "w") as f:
                f.write(text)
        seed = self.path("seed.img")
        size_mb = tree_bytes(folder) // 1024 ** 2 + 64
        done = subprocess.run(["mkfs.ext4", "-q", "-F", "-L", "archway-seed", "-d", folder, seed,
                               f"{size_mb}M"], capture_output=True, text=True)
        if done.returncode != 0:
            raise ControlPlaneError(f"mkfs.ext4 (the seed disk): {done.stderr.strip()}")
        shutil.rmtree(folder)
        return seed

    def _credentials(self, folder: str, name: str, user: str, groups: tuple[str, ...]) -> None:
        """A client certificate for `user` and a kubeconfig naming it at guest paths."""
        assert self.plane.ca is not None and self.plane.node_ip
        pair = self.plane.ca.issue(user, hosts=(), client=True, days=365, organizations=groups)
        for source, suffix in ((pair.cert_path, "crt"), (pair.key_path, "key")):
            shutil.move(source, os.path.join(folder, f"{name}.{suffix}"))
        path = os.path.join(folder, f"{name}.kubeconfig")
        server = f"https://{self.plane.node_ip}:{self.plane.ports['apiserver']}"
        kubeconfig(path, server, f"{SEED}/ca.crt", "", user)
        with open(path) as f:
            doc = yaml.safe_load(f)
        doc["users"][0]["user"] = {"client-certificate": f"{SEED}/{name}.crt",
                                   "client-key": f"{SEED}/{name}.key"}
        with open(path, "w") as f:
            yaml.safe_dump(doc, f)

    def init_script(self) -> str:
        modules = ("virtio_net overlay bridge br_netfilter veth nf_conntrack iptable_filter "
                   "iptable_nat iptable_mangle xt_conntrack xt_comment xt_mark xt_MASQUERADE "
                   "xt_addrtype xt_nat nft_compat")
        return f"""#!/bin/sh
# The VM node {self.name}: written by lab/cluster/vmnode.py, run by {BOOT_PATH} under tini.
say() {{ echo "archway-vm: $*"; }}
mountpoint -q /run || mount -t tmpfs tmpfs /run
mkdir -p /dev/pts /dev/shm
mountpoint -q /dev/pts || mount -t devpts devpts /dev/pts
mountpoint -q /dev/shm || mount -t tmpfs tmpfs /dev/shm
mountpoint -q /tmp || mount -t tmpfs tmpfs /tmp
mountpoint -q /sys/fs/cgroup || mount -t cgroup2 cgroup2 /sys/fs/cgroup
echo "+cpu +cpuset +memory +pids +io" > /sys/fs/cgroup/cgroup.subtree_control
for m in {modules}; do modprobe "$m" 2>/dev/null || say "no module $m"; done
hostname {self.name}
n=0; until [ -e /sys/class/net/eth0 ] || [ $n -ge 100 ]; do sleep 0.1; n=$((n + 1)); done
[ -e /sys/class/net/eth0 ] || say "no eth0 (interfaces: $(ls /sys/class/net))"
ip link set lo up
ip link set eth0 up
ip addr add {self.ip}/24 dev eth0
ip route add default via {HOST_ADDRESS}
sysctl -qw net.ipv4.ip_forward=1 net.bridge.bridge-nf-call-iptables=1
say "network up: $(ip -4 -o addr show eth0)"
mkdir -p /var/lib/kubelet /var/log/pods /etc/cni/net.d
containerd --config {SEED}/containerd.toml 2>&1 | sed -u 's/^/containerd: /' &
until ctr version >/dev/null 2>&1; do sleep 0.5; done
ctr --namespace k8s.io images import {SEED}/pause.tar >/dev/null && say "pause image imported"
{SEED}/kubelet --config={SEED}/kubelet.yaml --kubeconfig={SEED}/kubelet.kubeconfig \\
  --hostname-override={self.name} --node-ip={self.ip} --v=1 2>&1 | sed -u 's/^/kubelet: /' &
{SEED}/kube-proxy --config={SEED}/kube-proxy.yaml --v=1 2>&1 | sed -u 's/^/kube-proxy: /' &
say "kubelet and kube-proxy started"
wait
"""

    def containerd_config(self) -> str:
        cri = 'plugins."io.containerd.grpc.v1.cri"'
        return "\n".join([
            "version = 2", "[debug]", '  level = "warn"',
            f"[{cri}]", f'  sandbox_image = "{PAUSE_IMAGE}"', "  disable_apparmor = true",
            f"[{cri}.cni]", '  bin_dir = "/usr/lib/cni"', f'  conf_dir = "{SEED}/cni"',
            f"[{cri}.containerd]", '  snapshotter = "overlayfs"', '  default_runtime_name = "runc"',
            f"[{cri}.containerd.runtimes.runc]", '  runtime_type = "io.containerd.runc.v2"',
            f"[{cri}.containerd.runtimes.runc.options]", "  SystemdCgroup = false",
            f"[{cri}.registry]", f'  config_path = "{SEED}/certs.d"', ""])

    def cni_config(self) -> dict:
        return {"cniVersion": "0.4.0", "name": "archway", "plugins": [{
            "type": "bridge", "bridge": "cni0", "isGateway": True, "ipMasq": False,
            "hairpinMode": True,
            "ipam": {"type": "host-local", "ranges": [[{"subnet": pod_cidr(self.machine)}]],
                     "routes": [{"dst": "0.0.0.0/0"}]}}]}

    def kubelet_config(self) -> dict:
        return {
            "apiVersion": "kubelet.config.k8s.io/v1beta1", "kind": "KubeletConfiguration",
            "address": self.ip, "port": KUBELET_PORT, "readOnlyPort": 0,
            "healthzBindAddress": "127.0.0.1", "cgroupDriver": "cgroupfs",
            "failCgroupV1": False, "failSwapOn": False,
            "containerRuntimeEndpoint": "unix:///run/containerd/containerd.sock",
            "evictionHard": {"memory.available": "100Mi", "nodefs.available": "2%",
                             "imagefs.available": "2%"},
            "imageGCHighThresholdPercent": 100, "serializeImagePulls": False,
            "resolvConf": f"{SEED}/resolv.conf", "clusterDNS": ["127.0.0.1"],
            "clusterDomain": "cluster.local",
            "authentication": {"anonymous": {"enabled": False}, "webhook": {"enabled": True},
                               "x509": {"clientCAFile": f"{SEED}/ca.crt"}},
            "authorization": {"mode": "Webhook"},
            "syncFrequency": "10s", "nodeStatusReportFrequency": "1m",
        }

    def kube_proxy_config(self) -> dict:
        return {
            "apiVersion": "kubeproxy.config.k8s.io/v1alpha1", "kind": "KubeProxyConfiguration",
            "clientConnection": {"kubeconfig": f"{SEED}/kube-proxy.kubeconfig"}, "mode": "iptables",
            "clusterCIDR": pod_cidr(self.machine), "hostnameOverride": self.name,
            "healthzBindAddress": "127.0.0.1:10256", "metricsBindAddress": "127.0.0.1:10249",
            "nodePortAddresses": [f"{self.ip}/32"],
        }

    # --- readiness ---------------------------------------------------------------------------
    def _node(self) -> dict | None:
        kube = self.plane.kube
        assert kube is not None
        try:
            return kube.get(f"/api/v1/nodes/{self.name}")
        except KubeError:
            return None

    def _registered(self) -> bool:
        return self._node() is not None

    def wait_ready(self, timeout: float) -> None:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            node = self._node() or {}
            conditions = (node.get("status") or {}).get("conditions") or []
            if any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions):
                self.plane.save()
                return
            time.sleep(1.0)
        process = self.plane.processes.get(self.process_name)
        raise ControlPlaneError(f"VM node {self.name} not Ready after {timeout:g} s; its console "
                                f"ends:\n{tail(process.log, 60) if process else '(not started)'}")


# --- teardown ----------------------------------------------------------------------------------

def vm_processes(plane: ControlPlane) -> list[str]:
    return [name for name in plane.processes if name.startswith("vm-")]


def teardown_vms(plane: ControlPlane) -> list[str]:
    """Stop every VM node of `plane` and remove what they made on this machine: the qemu
    processes, taps, routes, the bridge, the guard and their Node objects; returns what is
    still there (empty when all went)."""
    names = vm_processes(plane)
    for name in names:
        stop_process(plane.processes.pop(name), timeout=15)
        if plane.kube is not None:
            arch = name[len("vm-"):]
            try:
                plane.kube.delete(f"/api/v1/nodes/{node_name(arch)}")
            except (KubeError, requests.RequestException):
                pass    # the apiserver is going too; the Node goes with its etcd
    if names and os.path.isdir(plane.state_dir):
        plane.save()
    for machine in MACHINES.values():
        _ip("route", "del", pod_cidr(machine), check=False)
        if link_exists(tap_name(machine)):
            _ip("link", "del", tap_name(machine), check=False)
    if link_exists(BRIDGE):
        _ip("link", "del", BRIDGE, check=False)
    while _iptables("-t", GUARD_TABLE, "-D", "FORWARD", "-j", GUARD_CHAIN, check=False).returncode == 0:
        pass
    _iptables("-t", GUARD_TABLE, "-F", GUARD_CHAIN, check=False)
    _iptables("-t", GUARD_TABLE, "-X", GUARD_CHAIN, check=False)
    return vm_leftovers()


def vm_leftovers() -> list[str]:
    """What a VM node leaves when not torn down: nothing, after teardown_vms."""
    left = []
    for machine in MACHINES.values():
        if link_exists(tap_name(machine)):
            left.append(f"interface {tap_name(machine)}")
        if _ip("route", "show", pod_cidr(machine), check=False).stdout.strip():
            left.append(f"route to {pod_cidr(machine)}")
        for pid in _pids_of(machine.qemu):
            left.append(f"{machine.qemu} (pid {pid})")
    if link_exists(BRIDGE):
        left.append(f"bridge {BRIDGE}")
    if _iptables("-t", GUARD_TABLE, "-S", GUARD_CHAIN, check=False).returncode == 0:
        left.append(f"iptables chain {GUARD_TABLE} {GUARD_CHAIN}")
    return left


def _pids_of(program: str) -> list[int]:
    done = subprocess.run(["pgrep", "-x", program[:15]], capture_output=True, text=True)
    return [int(p) for p in done.stdout.split()]


# --- scripts/cluster.sh's hooks ----------------------------------------------------------------

def start_for(plane: ControlPlane, arch: str, archway_config: dict) -> VmNode:
    """The VM node of `arch`, with every registry.insecure_hosts of archway's configuration as
    plain HTTP."""
    if arch not in MACHINES:
        raise ControlPlaneError(f"no VM node for {arch}: one of {', '.join(MACHINES)}")
    hosts = (archway_config.get("registry") or {}).get("insecure_hosts") or []
    return VmNode(plane, MACHINES[arch], insecure_registries=hosts).start()


def vm_nodes(plane: ControlPlane) -> list[tuple[str, str]]:
    """(name, arch) of the VM nodes `plane` runs."""
    return [(node_name(name[3:]), name[3:]) for name in vm_processes(plane)]

