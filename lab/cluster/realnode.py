"""One real node for this machine's architecture beside the real control plane (controlplane.py):
containerd (Debian's, its own root, state and socket), runc, bridge + host-local networking,
a kubelet authenticated as system:node:<name> by a client certificate, kube-proxy in iptables
mode. Recipe and pitfalls: docs/real-control-plane.md ("A real node").

    plane = ControlPlane(state_dir, node_ip=node_address(), nodes=api_only_nodes()).start()
    node = RealNode(plane, insecure_registries=["192.0.2.2:5000"]).start()   # Ready
    node.import_image(OciImage.of(...), "localhost/x:1")
    teardown(plane)          # stops it and undoes everything it changed on this machine

Every packet stays on this machine: before the first pod, the mangle table's FORWARD (the first
table a forwarded packet meets) jumps to a chain that drops whatever the pods or the Service
range send out of any interface but the node's bridge (`guard_in_place` reads it back), the
bridge does not masquerade, and pods get a resolv.conf naming only their own loopback.
"""
import hashlib
import json
import os
import subprocess
import time

import requests
import yaml

from lab.cluster.controlplane import DEFAULT_NODES, SERVICE_CIDR, ControlPlane, kubeconfig
from lab.cluster.nodehost import HostRecord, guard_in_place, guard_rules, leftovers, undo
from lab.cluster.nodeimages import OciImage, go_binary, machine_arch
from lab.cluster.processes import ControlPlaneError, stop_process, tail
from lab.kube import KubeError
from lab.procs import free_port

POD_CIDR = "10.244.1.0/24"
BRIDGE = "archway0"
GUARD_CHAIN = "ARCHWAY-NODE-EGRESS"
CGROUP_ROOT = "/archway-node"
PAUSE_IMAGE = "localhost/archway-pause:1"
CNI_BIN = "/usr/lib/cni"


def node_address() -> str:
    """This machine's default-route source address: the routing table is read, nothing sent."""
    done = subprocess.run(["ip", "-4", "route", "get", "1.1.1.1"], capture_output=True,
                          text=True, check=True)
    words = done.stdout.split()
    if "src" not in words:
        raise ControlPlaneError(f"no default route source address in: {done.stdout.strip()}")
    return words[words.index("src") + 1]


def owned_dirs(node_dir: str) -> tuple[str, str]:
    """(sockets, kubelet root) of the node in `node_dir`: short paths of its own (a unix socket's
    path has at most 104 bytes; the kubelet makes sockets under its root)."""
    tag = hashlib.sha256(node_dir.encode()).hexdigest()[:10]
    return f"/run/archway-node-{tag}", f"/var/lib/archway-node-{tag}"


def hosts_toml(host: str) -> str:
    """containerd's certs.d/HOST/hosts.toml for a plain-HTTP registry."""
    return (f'server = "http://{host}"\n[host."http://{host}"]\n'
            f'  capabilities = ["pull", "resolve"]\n  skip_verify = true\n')


def api_only_nodes(*real: str) -> tuple:
    """The control plane's API-only Nodes of every architecture but the real nodes' (this
    machine's when none is named)."""
    archs = set(real or (machine_arch(),))
    return tuple((name, a) for name, a in DEFAULT_NODES if a not in archs)


def node_name(arch: str | None = None) -> str:
    return f"{arch or machine_arch()}-node"


class RealNode:
    def __init__(self, plane: ControlPlane, *, insecure_registries=(), name: str | None = None):
        if not plane.node_ip:
            raise ControlPlaneError("a real node needs a control plane started with node_ip")
        self.plane = plane
        self.name = name or node_name()
        self.ip = plane.node_ip
        self.registries = list(insecure_registries)
        self.dir = plane.path("node")
        self.run_dir, self.kubelet_dir = owned_dirs(self.dir)

    def path(self, *parts: str) -> str:
        return os.path.join(self.dir, *parts)

    @property
    def socket(self) -> str:
        return os.path.join(self.run_dir, "containerd.sock")

    # --- lifecycle -------------------------------------------------------------------------
    def start(self, ready_timeout: float = 120.0) -> "RealNode":
        os.makedirs(self.dir, exist_ok=True)
        record = HostRecord.take(CGROUP_ROOT, BRIDGE, self.dir, list(owned_dirs(self.dir)))
        with open(self.path("host-record.json"), "w") as f:
            json.dump(record.as_dict(), f)
        self.install_guard()
        self.write_cni()
        self.start_containerd()
        self.import_image(OciImage.of({"/pause": go_binary("pause")}, entrypoint=["/pause"]),
                          PAUSE_IMAGE)
        self.start_kubelet()
        self.start_kube_proxy()
        self.wait_ready(ready_timeout)
        return self

    def install_guard(self) -> None:
        for args in guard_rules(GUARD_CHAIN, BRIDGE, [POD_CIDR, SERVICE_CIDR]):
            self._iptables(*args)
        with open("/proc/sys/net/ipv4/ip_forward", "w") as f:   # the bridge routes ClusterIPs
            f.write("1")

    def guard_in_place(self) -> bool:
        return guard_in_place(GUARD_CHAIN, BRIDGE, [POD_CIDR, SERVICE_CIDR])

    @staticmethod
    def _iptables(*args: str) -> None:
        done = subprocess.run(["iptables", "-w", "5", *args], capture_output=True, text=True)
        if done.returncode != 0:
            raise ControlPlaneError(f"iptables {' '.join(args)}: {done.stderr.strip()}")

    def write_cni(self) -> None:
        os.makedirs(self.path("cni", "net.d"), exist_ok=True)
        config = {"cniVersion": "0.4.0", "name": "archway", "plugins": [{
            "type": "bridge", "bridge": BRIDGE, "isGateway": True, "ipMasq": False,
            "hairpinMode": True,
            "ipam": {"type": "host-local", "dataDir": self.path("cni", "ipam"),
                     "ranges": [[{"subnet": POD_CIDR}]], "routes": [{"dst": "0.0.0.0/0"}]}}]}
        with open(self.path("cni", "net.d", "10-archway.conflist"), "w") as f:
            json.dump(config, f, indent=1)

    def containerd_config(self) -> str:
        cri = 'plugins."io.containerd.grpc.v1.cri"'
        lines = [
            "version = 2",
            f'root = "{self.path("containerd", "root")}"',
            f'state = "{self.path("containerd", "state")}"',
            "[grpc]", f'  address = "{self.socket}"',
            "[ttrpc]", f'  address = "{self.socket}.ttrpc"',
            "[debug]", '  level = "warn"',
            f"[{cri}]", f'  sandbox_image = "{PAUSE_IMAGE}"',
            "  disable_apparmor = true",
            # No CAP_SYS_RESOURCE here: runc cannot lower the pause container's oom_score_adj.
            "  restrict_oom_score_adj = true",
            "  netns_mounts_under_state_dir = true",
            f"[{cri}.cni]", f'  bin_dir = "{CNI_BIN}"',
            f'  conf_dir = "{self.path("cni", "net.d")}"',
            f"[{cri}.containerd]", '  snapshotter = "overlayfs"', '  default_runtime_name = "runc"',
            f"[{cri}.containerd.runtimes.runc]", '  runtime_type = "io.containerd.runc.v2"',
            f"[{cri}.containerd.runtimes.runc.options]", "  SystemdCgroup = false",
            f'  Root = "{self.path("runc")}"',
            f"[{cri}.registry]", f'  config_path = "{self.path("containerd", "certs.d")}"',
        ]
        return "\n".join(lines) + "\n"

    def write_registries(self) -> None:
        """Each insecure registry as a plain-HTTP host for containerd (certs.d/HOST/hosts.toml)."""
        for host in self.registries:
            folder = self.path("containerd", "certs.d", host)
            os.makedirs(folder, exist_ok=True)
            with open(os.path.join(folder, "hosts.toml"), "w") as f:
                f.write(hosts_toml(host))

    def start_containerd(self) -> None:
        os.makedirs(self.path("containerd"), exist_ok=True)
        os.makedirs(self.run_dir, mode=0o700, exist_ok=True)
        config = self.path("containerd", "config.toml")
        with open(config, "w") as f:
            f.write(self.containerd_config())
        self.write_registries()
        self.plane._launch("containerd", ["containerd", "--config", config],
                           lambda: self.ctr("version").returncode == 0, 60)

    def ctr(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
        return subprocess.run(["ctr", "--address", self.socket, "--namespace", "k8s.io", *args],
                              capture_output=True, text=True, timeout=timeout)

    def import_image(self, image: OciImage, name: str) -> None:
        archive = image.write_archive(self.path(f"image-{image.digest[7:19]}.tar"), name)
        done = self.ctr("images", "import", archive)
        os.unlink(archive)
        if done.returncode != 0:
            raise ControlPlaneError(f"ctr images import {name}: {done.stderr.strip()}")

    def _client_kubeconfig(self, name: str, user: str, groups: tuple[str, ...]) -> str:
        assert self.plane.ca is not None
        pair = self.plane.ca.issue(user, hosts=(), client=True, days=365,
                                   organizations=groups)
        for source, suffix in ((pair.cert_path, "crt"), (pair.key_path, "key")):
            os.replace(source, self.path(f"{name}.{suffix}"))
        pair = type(pair)(pair.name, self.path(f"{name}.crt"), self.path(f"{name}.key"),
                          pair.chain_path, pair.cert, pair.key)
        path = self.path(f"{name}.kubeconfig")
        kubeconfig(path, self.plane.server, self.plane.ca_path, "", user)
        with open(path) as f:
            doc = yaml.safe_load(f)
        doc["users"][0]["user"] = {"client-certificate": pair.cert_path,
                                   "client-key": pair.key_path}
        with open(path, "w") as f:
            yaml.safe_dump(doc, f)
        return path

    def kubelet_session(self):
        """requests with the kubelet's client certificate (what the apiserver sees it as)."""
        session = requests.Session()
        session.trust_env = False
        session.verify = self.plane.ca_path
        session.cert = (self.path("kubelet.crt"), self.path("kubelet.key"))
        return session

    def kubelet_config(self) -> dict:
        with open(self.path("resolv.conf"), "w") as f:
            f.write("# archway's test node: no nameserver outside this pod\nnameserver 127.0.0.1\n")
        return {
            "apiVersion": "kubelet.config.k8s.io/v1beta1", "kind": "KubeletConfiguration",
            "address": self.ip, "port": self.plane.ports.setdefault("kubelet", free_port()),
            "healthzBindAddress": "127.0.0.1",
            "healthzPort": self.plane.ports.setdefault("kubelet-healthz", free_port()),
            "readOnlyPort": 0, "cgroupDriver": "cgroupfs", "cgroupRoot": CGROUP_ROOT,
            "failCgroupV1": False, "failSwapOn": False,
            "containerRuntimeEndpoint": f"unix://{self.socket}",
            "podLogsDir": self.path("pod-logs"), "volumePluginDir": self.path("volume-plugins"),
            "evictionHard": {"memory.available": "100Mi", "nodefs.available": "2%",
                             "imagefs.available": "2%"},
            "imageGCHighThresholdPercent": 100, "serializeImagePulls": False,
            # Pods' DNS goes to their own loopback: nothing leaves, and no per-pod warning.
            "resolvConf": self.path("resolv.conf"), "clusterDNS": ["127.0.0.1"],
            "clusterDomain": "cluster.local",
            "authentication": {"anonymous": {"enabled": False}, "webhook": {"enabled": True},
                               "x509": {"clientCAFile": self.plane.ca_path}},
            "authorization": {"mode": "Webhook"},
            "protectKernelDefaults": False,
            "syncFrequency": "10s", "nodeStatusReportFrequency": "1m",
        }

    def start_kubelet(self) -> None:
        for folder in ("pod-logs", "volume-plugins", "kubelet-certs"):
            os.makedirs(self.path(folder), exist_ok=True)
        os.makedirs(self.kubelet_dir, mode=0o700, exist_ok=True)
        for hierarchy in os.listdir("/sys/fs/cgroup"):     # the kubelet wants its root to exist
            folder = os.path.join("/sys/fs/cgroup", hierarchy)
            if os.path.isdir(folder) and hierarchy != "unified":
                os.makedirs(os.path.join(folder, CGROUP_ROOT.strip("/")), exist_ok=True)
        config = self.path("kubelet.yaml")
        with open(config, "w") as f:
            yaml.safe_dump(self.kubelet_config(), f)
        client = self._client_kubeconfig("kubelet", f"system:node:{self.name}", ("system:nodes",))
        port = self.plane.ports["kubelet-healthz"]
        self.plane._launch("kubelet", [
            self.plane.binary("kubelet"), f"--config={config}", f"--kubeconfig={client}",
            f"--root-dir={self.kubelet_dir}", f"--cert-dir={self.path('kubelet-certs')}",
            f"--hostname-override={self.name}", f"--node-ip={self.ip}", "--v=1",
        ], lambda: _http_ok(f"http://127.0.0.1:{port}/healthz"), 90)

    def start_kube_proxy(self) -> None:
        client = self._client_kubeconfig("kube-proxy", "system:kube-proxy", ())
        health, metrics = free_port(), free_port()
        self.plane.ports.update({"kube-proxy-healthz": health, "kube-proxy-metrics": metrics})
        config = self.path("kube-proxy.yaml")
        with open(config, "w") as f:
            yaml.safe_dump({
                "apiVersion": "kubeproxy.config.k8s.io/v1alpha1", "kind": "KubeProxyConfiguration",
                "clientConnection": {"kubeconfig": client}, "mode": "iptables",
                "clusterCIDR": POD_CIDR, "hostnameOverride": self.name,
                "healthzBindAddress": f"127.0.0.1:{health}",
                "metricsBindAddress": f"127.0.0.1:{metrics}",
                "nodePortAddresses": [f"{self.ip}/32"],
                # Leave the machine's conntrack settings alone.
                "conntrack": {"maxPerCore": 0, "min": 0, "tcpEstablishedTimeout": "0s",
                              "tcpCloseWaitTimeout": "0s"},
            }, f)
        self.plane._launch("kube-proxy", [
            self.plane.binary("kube-proxy"), f"--config={config}", "--v=1",
        ], lambda: _http_ok(f"http://127.0.0.1:{health}/healthz"), 60)

    def wait_ready(self, timeout: float) -> None:
        kube = self.plane.kube
        assert kube is not None
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            try:
                node = kube.get(f"/api/v1/nodes/{self.name}")
                if any(c["type"] == "Ready" and c["status"] == "True"
                       for c in node["status"].get("conditions", [])):
                    self.plane.save()
                    return
            except (requests.RequestException, KubeError, KeyError):   # not registered yet
                pass
            time.sleep(0.5)
        raise ControlPlaneError(f"node {self.name} not Ready after {timeout:g} s; the kubelet's "
                                f"log ends:\n{tail(self.plane.path('logs', 'kubelet.log'))}")


def _http_ok(url: str) -> bool:
    return requests.get(url, timeout=2).status_code == 200


NODE_PROCESSES = ("kube-proxy", "kubelet", "containerd")


def host_record(state_dir: str) -> HostRecord | None:
    path = os.path.join(state_dir, "node", "host-record.json")
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return HostRecord(**json.load(f))


def teardown(plane: ControlPlane) -> list[str]:
    """Stop the node (if one was started in `plane`) and undo what it changed on this machine;
    returns what could not be removed (empty when all went)."""
    record = host_record(plane.state_dir)
    for name in NODE_PROCESSES:      # the kubelet first would restart what containerd stops
        process = plane.processes.pop(name, None)
        if process is not None:
            stop_process(process, timeout=15)
    if plane.processes or os.path.isdir(plane.state_dir):
        plane.save()
    if record is None:
        return []
    undo(record)
    return leftovers(record)


# --- scripts/cluster.sh's hooks --------------------------------------------------------------

def plane_options(real_node: bool, vm_archs=()) -> dict:
    """ControlPlane arguments for a cluster with (or without) the real node and VM nodes of
    `vm_archs` (vmnode.py): no API-only Node remains of an architecture a real node runs."""
    if not (real_node or vm_archs):
        return {}
    archs = ([machine_arch()] if real_node else []) + list(vm_archs)
    return {"node_ip": node_address(), "nodes": api_only_nodes(*archs)}


def start_for(plane: ControlPlane, archway_config: dict) -> RealNode:
    """The node, with every registry.insecure_hosts of archway's configuration as plain HTTP."""
    hosts = (archway_config.get("registry") or {}).get("insecure_hosts") or []
    return RealNode(plane, insecure_registries=hosts).start()


def real_nodes(plane: ControlPlane) -> list[tuple[str, str]]:
    """(name, arch) of the real node `plane` runs, if any."""
    return [(node_name(), machine_arch())] if "kubelet" in plane.processes else []
