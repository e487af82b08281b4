"""A real Kubernetes control plane on 127.0.0.1, built from source (scripts/k8s-build.sh): etcd,
kube-apiserver, kube-controller-manager and the default kube-scheduler. No kubelet: Nodes are API
objects, pods are bound by the scheduler and never run. The way envtest and Kubernetes' own
integration tests do it, plus what archway needs of a cluster: RBAC, ServiceAccount tokens, the
workload controllers and garbage collection. Recipe and pitfalls: docs/real-control-plane.md.

    plane = ControlPlane(state_dir, bin_dir).start()     # ~10 s on 2 cores
    plane.kube.create(...)                               # admin (system:masters), see kube.py
    plane.stop()

Every process runs in a session of its own (processes.py) and is recorded in
state_dir/processes.json, so a ControlPlane started by one process (scripts/cluster.sh up) is
stopped by another (down). Its credentials: pki.py.
"""
import datetime
import json
import os
import subprocess
import time

import requests
import yaml

from lab.cluster.pki import issue_pki
from lab.cluster.processes import (
    ControlPlaneError,
    Process,
    healthz,
    pid_alive,
    start_process,
    stop_process,
    wait_answering,
)
from lab.kube import Kube
from lab.procs import REPO, free_port
from lab.tls import CertificateAuthority

K8S_BUILD = os.path.join(REPO, "scripts", "k8s-build.sh")
SERVICE_CIDR = "10.0.0.0/24"

# What archway's workflows need: workloads and their pods, owners and garbage collection, the
# namespace lifecycle, ServiceAccounts with tokens, the root CA ConfigMap, PodDisruptionBudgets
# (the Eviction API reads their status). No node lifecycle controller: with no kubelet
# heartbeats it would taint every node not-ready.
CONTROLLERS = ("deployment-controller", "replicaset-controller", "statefulset-controller",
               "daemonset-controller", "job-controller", "cronjob-controller",
               "disruption-controller", "garbage-collector-controller", "namespace-controller",
               "serviceaccount-controller", "serviceaccount-token-controller",
               "root-ca-certificate-publisher-controller", "clusterrole-aggregation-controller")

# A Service has no endpoints without them (a real node runs what a Service selects).
SERVICE_CONTROLLERS = ("endpoints-controller", "endpointslice-controller")

# (name, arch): the cluster's Nodes.
DEFAULT_NODES = (("amd64-1", "amd64"), ("amd64-2", "amd64"), ("arm64-1", "arm64"),
                 ("arm64-2", "arm64"), ("ppc64le-1", "ppc64le"))


def build_binaries() -> str:
    """The folder holding etcd, kube-apiserver, ... (built once per version, then cached)."""
    done = subprocess.run(["bash", K8S_BUILD], capture_output=True, text=True)
    if done.returncode != 0:
        raise ControlPlaneError(f"scripts/k8s-build.sh failed:\n{done.stderr[-3000:]}")
    return done.stdout.strip().splitlines()[-1]


def kubeconfig(path: str, server: str, ca_path: str, token: str, user: str = "admin") -> str:
    doc = {"apiVersion": "v1", "kind": "Config", "current-context": "archway",
           "clusters": [{"name": "archway", "cluster": {"server": server,
                                                        "certificate-authority": ca_path}}],
           "users": [{"name": user, "user": {"token": token}}],
           "contexts": [{"name": "archway", "context": {"cluster": "archway", "user": user}}]}
    with open(path, "w") as f:
        yaml.safe_dump(doc, f)
    os.chmod(path, 0o600)
    return path


class ControlPlane:
    def __init__(self, state_dir: str, bin_dir: str | None = None, *, nodes=DEFAULT_NODES,
                 audit: bool = True, node_ip: str | None = None):
        self.state_dir = os.path.abspath(state_dir)
        # With a real node (realnode.py): its address, where pods reach the apiserver through the
        # `kubernetes` Service; the Node authorizer and the Service controllers come with it.
        self.node_ip = node_ip
        self.ca: CertificateAuthority | None = None
        self.bin_dir = bin_dir
        self.nodes = nodes
        self.audit = audit   # every request in audit.log (Metadata level): what tests count
        self.processes: dict[str, Process] = {}
        self.ports: dict[str, int] = {}
        self.kube: Kube | None = None

    # --- files ---------------------------------------------------------------------------
    def path(self, *parts: str) -> str:
        return os.path.join(self.state_dir, *parts)

    @property
    def server(self) -> str:
        return f"https://127.0.0.1:{self.ports['apiserver']}"

    @property
    def ca_path(self) -> str:
        return self.path("pki", "ca.crt")

    @property
    def admin_kubeconfig(self) -> str:
        return self.path("admin.kubeconfig")

    def binary(self, name: str) -> str:
        assert self.bin_dir
        return os.path.join(self.bin_dir, name)

    def _pki(self) -> dict[str, str]:
        self.ca, files = issue_pki(self.path("pki"), self.node_ip)
        return files

    # --- lifecycle -----------------------------------------------------------------------
    def start(self) -> "ControlPlane":
        os.makedirs(self.state_dir, exist_ok=True)
        try:
            self.bin_dir = self.bin_dir or build_binaries()
            files = self._step("certificates and tokens", self._pki)
            self.ports = {name: free_port() for name in
                          ("etcd", "etcd-peer", "apiserver", "controller-manager", "scheduler")}
            self._step("etcd", self._start_etcd)
            self._step("kube-apiserver", self._start_apiserver, files)
            kubeconfig(self.admin_kubeconfig, self.server, self.ca_path, files["admin"])
            self.kube = Kube(self.server, files["admin"], self.ca_path)
            self._step("kube-controller-manager", self._start_controller_manager,
                       files["system:kube-controller-manager"])
            self._step("kube-scheduler", self._start_scheduler, files["system:kube-scheduler"])
            self._step("nodes", self._create_nodes)
            self._step("the default ServiceAccount", self._wait_default_service_account)
            self.save()
        except BaseException:
            self.stop()
            raise
        return self

    def _step(self, what: str, fn, *args):
        try:
            return fn(*args)
        except ControlPlaneError:
            raise
        except Exception as e:
            raise ControlPlaneError(f"{what}: {type(e).__name__}: {e}") from e

    def _launch(self, name: str, args: list[str], ready, timeout: float) -> None:
        process = start_process(name, args, self.state_dir)
        self.processes[name] = process
        self.save()
        wait_answering(name, process, ready, timeout=timeout)

    def _start_etcd(self) -> None:
        client = f"http://127.0.0.1:{self.ports['etcd']}"
        peer = f"http://127.0.0.1:{self.ports['etcd-peer']}"
        self._launch("etcd", [
            self.binary("etcd"), "--name=archway", f"--data-dir={self.path('etcd')}",
            f"--listen-client-urls={client}", f"--advertise-client-urls={client}",
            f"--listen-peer-urls={peer}", f"--initial-advertise-peer-urls={peer}",
            f"--initial-cluster=archway={peer}", "--unsafe-no-fsync=true",
            "--listen-metrics-urls=", "--log-level=warn",
        ], lambda: requests.get(f"{client}/health", timeout=1).json().get("health") == "true", 30)

    def _start_apiserver(self, files: dict) -> None:
        admin = files["admin"]
        self._launch("kube-apiserver", [
            self.binary("kube-apiserver"),
            f"--etcd-servers=http://127.0.0.1:{self.ports['etcd']}",
            f"--secure-port={self.ports['apiserver']}", *self._address_flags(files),
            f"--tls-cert-file={files['cert']}", f"--tls-private-key-file={files['key']}",
            f"--client-ca-file={self.ca_path}", f"--token-auth-file={self.path('pki', 'tokens.csv')}",
            "--anonymous-auth=false",
            f"--requestheader-client-ca-file={files['front_ca']}",
            "--requestheader-allowed-names=front-proxy-client",
            "--requestheader-username-headers=X-Remote-User",
            "--requestheader-group-headers=X-Remote-Group",
            "--requestheader-extra-headers-prefix=X-Remote-Extra-",
            f"--proxy-client-cert-file={files['proxy_cert']}",
            f"--proxy-client-key-file={files['proxy_key']}",
            "--service-account-issuer=https://kubernetes.default.svc",
            f"--service-account-key-file={self.path('pki', 'sa.pub')}",
            f"--service-account-signing-key-file={self.path('pki', 'sa.key')}",
            f"--service-cluster-ip-range={SERVICE_CIDR}", "--allow-privileged=true",
            # It puts node.kubernetes.io/not-ready:NoSchedule on every new Node, and only a
            # kubelet would take it off.
            "--disable-admission-plugins=TaintNodesByCondition",
            "--profiling=false", "--v=1", *self._audit_flags(),
        ], lambda: requests.get(f"{self.server}/readyz", verify=self.ca_path, timeout=2,
                                headers={"Authorization": f"Bearer {admin}"}).text == "ok", 90)

    def _address_flags(self, files: dict) -> list[str]:
        if not self.node_ip:
            # A loopback advertise address is refused by the default endpoint reconciler.
            return ["--bind-address=127.0.0.1", "--advertise-address=127.0.0.1",
                    "--endpoint-reconciler-type=none", "--authorization-mode=RBAC"]
        # Pods reach it through the `kubernetes` Service, whose endpoint is the node's address;
        # kubectl logs/exec dial the node's InternalIP, with a client certificate.
        return ["--bind-address=0.0.0.0", f"--advertise-address={self.node_ip}",
                "--endpoint-reconciler-type=lease", "--authorization-mode=Node,RBAC",
                "--enable-admission-plugins=NodeRestriction",
                "--kubelet-preferred-address-types=InternalIP",
                f"--kubelet-client-certificate={files['kubelet_cert']}",
                f"--kubelet-client-key={files['kubelet_key']}"]

    def _audit_flags(self) -> list[str]:
        if not self.audit:
            return []
        policy = self.path("audit-policy.yaml")
        with open(policy, "w") as f:
            yaml.safe_dump({"apiVersion": "audit.k8s.io/v1", "kind": "Policy",
                            "omitStages": ["RequestReceived"], "rules": [{"level": "Metadata"}]}, f)
        return [f"--audit-policy-file={policy}", f"--audit-log-path={self.path('audit.log')}",
                "--audit-log-format=json", "--audit-log-mode=blocking", "--audit-log-maxsize=0"]

    def audit_mark(self) -> int:
        """Where the audit log ends now: `requests_since` reads what comes after."""
        try:
            return os.path.getsize(self.path("audit.log"))
        except FileNotFoundError:
            return 0

    def requests_since(self, mark: int, *, user: str | None = None) -> list[tuple[str, str]]:
        """(verb, requestURI) of every request the apiserver answered after `mark` (by `user`).
        A request's ResponseComplete event is written just after its answer is sent: the log is
        read once it has stopped growing for 0.2 s (at most 3 s)."""
        size, still_since, end = -1, time.monotonic(), time.monotonic() + 3
        while time.monotonic() < end:
            now = self.audit_mark()
            if now != size:
                size, still_since = now, time.monotonic()
            elif time.monotonic() - still_since >= 0.2:
                break
            time.sleep(0.02)
        return [(event["verb"], event["requestURI"]) for event in self.audit_events(mark)
                if user is None or event.get("user", {}).get("username") == user]

    def audit_events(self, mark: int):
        """Every audit event written after `mark`. The apiserver may be writing the last line
        (no newline yet: it is left for the next read), and one killed while writing leaves a
        torn line that the next apiserver's first event continues: that line is no event."""
        with open(self.path("audit.log"), "rb") as f:
            f.seek(mark)
            for line in f:
                if not line.endswith(b"\n"):
                    return
                try:
                    yield json.loads(line)
                except ValueError:
                    continue

    def _start_controller_manager(self, token: str) -> None:
        config = kubeconfig(self.path("controller-manager.kubeconfig"), self.server, self.ca_path,
                            token, "system:kube-controller-manager")
        port = self.ports["controller-manager"]
        self._launch("kube-controller-manager", [
            self.binary("kube-controller-manager"), f"--kubeconfig={config}",
            "--leader-elect=false", "--bind-address=127.0.0.1", f"--secure-port={port}",
            f"--controllers={','.join(CONTROLLERS + (SERVICE_CONTROLLERS if self.node_ip else ()))}",
            # Each controller acts as its own ServiceAccount, under its bootstrap role.
            "--use-service-account-credentials=true",
            f"--root-ca-file={self.ca_path}",
            f"--service-account-private-key-file={self.path('pki', 'sa.key')}",
            f"--cert-dir={self.path('controller-manager-certs')}", "--v=1",
            # Its default client limit (20/s, burst 30) throttles pod creation at ~18/s: a
            # scale test would measure that (docs/real-control-plane.md, KWOK).
            "--kube-api-qps=200", "--kube-api-burst=400",
        ], lambda: healthz(port), 60)

    def _start_scheduler(self, token: str) -> None:
        self.start_scheduler("kube-scheduler", token, {"leaderElection": {"leaderElect": False}},
                             port=self.ports["scheduler"])

    def start_scheduler(self, name: str, token: str, config: dict, *, port: int | None = None,
                        user: str = "system:kube-scheduler") -> Process:
        """A kube-scheduler with `config` (a KubeSchedulerConfiguration, whose
        clientConnection.kubeconfig is set here to `token`'s identity)."""
        port = port or free_port()
        self.ports[name] = port
        client = kubeconfig(self.path(f"{name}.kubeconfig"), self.server, self.ca_path, token, user)
        config = dict(config, apiVersion="kubescheduler.config.k8s.io/v1",
                      kind="KubeSchedulerConfiguration")
        config["clientConnection"] = dict(config.get("clientConnection") or {}, kubeconfig=client)
        path = self.path(f"{name}.config.yaml")
        with open(path, "w") as f:
            yaml.safe_dump(config, f)
        self._launch(name, [
            self.binary("kube-scheduler"), f"--config={path}", "--bind-address=127.0.0.1",
            f"--secure-port={port}", f"--cert-dir={self.path(name + '-certs')}", "--v=1",
            # Its secure port authenticates and authorizes through the API, as in a pod.
            f"--authentication-kubeconfig={client}", f"--authorization-kubeconfig={client}",
        ], lambda: healthz(port), 60)
        self.save()
        return self.processes[name]

    def stop_scheduler(self, name: str) -> None:
        stop_process(self.processes.pop(name))
        self.save()

    def restart_scheduler(self, name: str, client_connection: dict | None = None) -> Process:
        """The scheduler `name` (stopped or not) started again with its own configuration and
        identity; `client_connection` changes its client settings (qps, burst)."""
        if name in self.processes:
            self.stop_scheduler(name)
        with open(self.path(f"{name}.config.yaml")) as f:
            config = yaml.safe_load(f)
        with open(self.path(f"{name}.kubeconfig")) as f:
            (user,) = yaml.safe_load(f)["users"]
        config["clientConnection"].update(client_connection or {})
        return self.start_scheduler(name, user["user"]["token"], config, port=self.ports[name],
                                    user=user["name"])

    def _create_nodes(self) -> None:
        for i, (name, arch) in enumerate(self.nodes):
            self.add_node(name, arch, address=f"10.244.0.{i + 1}")

    def add_node(self, name: str, arch: str, *, address: str, pods: int = 110,
                 labels: dict | None = None) -> dict:
        """A Ready Node as a kubelet would register it (allocatable incl. pods)."""
        assert self.kube is not None
        now = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        resources = {"cpu": "16", "memory": "64Gi", "pods": str(pods), "ephemeral-storage": "100Gi"}
        status = {
            "capacity": resources, "allocatable": resources,
            "conditions": [{"type": "Ready", "status": "True", "reason": "KubeletReady",
                            "message": "a Node object of archway's test control plane (no kubelet)",
                            "lastHeartbeatTime": now, "lastTransitionTime": now}],
            "addresses": [{"type": "InternalIP", "address": address},
                          {"type": "Hostname", "address": name}],
            "nodeInfo": {"architecture": arch, "operatingSystem": "linux",
                         "kubeletVersion": "v0.0.0-none", "containerRuntimeVersion": "none://",
                         "kernelVersion": "", "osImage": "", "machineID": "", "systemUUID": "",
                         "bootID": "", "kubeProxyVersion": ""}}
        node = {"apiVersion": "v1", "kind": "Node",
                "metadata": {"name": name, "labels": {"kubernetes.io/arch": arch,
                                                       "kubernetes.io/os": "linux",
                                                       "kubernetes.io/hostname": name,
                                                       **(labels or {})}},
                "status": status}
        stored = self.kube.create("/api/v1/nodes", node)
        if not stored.get("status", {}).get("allocatable"):
            stored = self.kube.patch(f"/api/v1/nodes/{name}/status", {"status": status})
        return stored

    def _wait_default_service_account(self) -> None:
        assert self.kube is not None
        self.kube.wait_for(lambda: self.kube.get("/api/v1/namespaces/default/serviceaccounts/default"),
                           timeout=60, what="the default ServiceAccount")

    def new_namespace(self, name: str, labels: dict | None = None) -> str:
        """A namespace whose `default` ServiceAccount exists (pods need it)."""
        assert self.kube is not None
        self.kube.create("/api/v1/namespaces", {"apiVersion": "v1", "kind": "Namespace",
                                                "metadata": {"name": name,
                                                             "labels": labels or {}}})
        self.kube.wait_for(
            lambda: self.kube.get(f"/api/v1/namespaces/{name}/serviceaccounts/default"),
            timeout=30, what=f"the default ServiceAccount of {name}")
        return name

    def identity(self, namespace: str, name: str, *, cluster_rules: tuple[dict, ...] | list[dict] = (),
                 namespace_rules: dict[str, list[dict]] | None = None) -> str:
        """A kubeconfig of ServiceAccount `namespace/name` (made here) bound to exactly these
        rules: `cluster_rules` cluster-wide, `namespace_rules` per namespace; RBAC refuses the
        rest, as for archway's own ServiceAccounts in a cluster."""
        assert self.kube is not None
        kube, rbac = self.kube, "/apis/rbac.authorization.k8s.io/v1"
        subject = [{"kind": "ServiceAccount", "name": name, "namespace": namespace}]
        kube.create(f"/api/v1/namespaces/{namespace}/serviceaccounts", {"metadata": {"name": name}})
        bound = f"{namespace}-{name}"
        if cluster_rules:
            kube.create(f"{rbac}/clusterroles", {"metadata": {"name": bound},
                                                 "rules": list(cluster_rules)})
            kube.create(f"{rbac}/clusterrolebindings", {
                "metadata": {"name": bound}, "subjects": subject,
                "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole",
                            "name": bound}})
        for where, rules in (namespace_rules or {}).items():
            kube.create(f"{rbac}/namespaces/{where}/roles", {"metadata": {"name": bound},
                                                            "rules": rules})
            kube.create(f"{rbac}/namespaces/{where}/rolebindings", {
                "metadata": {"name": bound}, "subjects": subject,
                "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role",
                            "name": bound}})
        token = kube.service_account_token(namespace, name, seconds=86400)
        return kubeconfig(self.path(f"{bound}.kubeconfig"), self.server, self.ca_path, token,
                          f"system:serviceaccount:{namespace}:{name}")

    # --- state ---------------------------------------------------------------------------
    def save(self) -> None:
        state = {"bin_dir": self.bin_dir, "ports": self.ports, "node_ip": self.node_ip,
                 "processes": [vars(p) for p in self.processes.values()],
                 "token": self.kube.token if self.kube else None}
        with open(self.path("processes.json"), "w") as f:
            json.dump(state, f, indent=1)

    @classmethod
    def load(cls, state_dir: str) -> "ControlPlane":
        plane = cls(state_dir)
        with open(plane.path("processes.json")) as f:
            state = json.load(f)
        plane.bin_dir = state["bin_dir"]
        plane.ports = state["ports"]
        plane.node_ip = state.get("node_ip")
        plane.processes = {p["name"]: Process(**p) for p in state["processes"]}
        if state.get("token"):
            plane.kube = Kube(plane.server, state["token"], plane.ca_path)
        return plane

    def __enter__(self) -> "ControlPlane":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def running(self) -> dict[str, bool]:
        return {name: pid_alive(p.pid) for name, p in self.processes.items()}

    def stop(self) -> None:
        """Stop every process, the last started first."""
        for process in reversed(list(self.processes.values())):
            stop_process(process)
        self.processes.clear()
        if os.path.isdir(self.state_dir):
            self.save()

