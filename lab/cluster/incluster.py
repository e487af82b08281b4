"""archway installed in the cluster the way users install it, on the real node (realnode.py):
its image built from this checkout (scripts/build-image.sh, cached by the content of the tree)
and imported into the node's containerd, the second scheduler's image made from the built
kube-scheduler, then `helm install --wait` WITH its hooks (the certificate Job runs on the node),
the webhook reached by the apiserver through the chart's Service and archway reaching the
apiserver from its pods through the `kubernetes` Service.

    install = InClusterInstall(plane, node, archway_config={...}).install()
    install.uninstall()                 # `helm uninstall --wait`: its pre-delete hooks run as Jobs

With `registry=` (a lab/servers/registry.py RegistryServer every node pulls from) and several
`architectures`, both images are pushed there as indexes of those architectures instead, as a
release pushes them: a cluster of two real architectures (the arm64 VM node) pulls each its own.
"""
import hashlib
import json
import os
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor

import requests
import urllib3
import yaml

from lab.cluster.chart import ChartInstall, deep_merge
from lab.cluster.controlplane import ControlPlane
from lab.cluster.nodeimages import OciImage, machine_arch, push_archive, push_index
from lab.cluster.processes import ControlPlaneError
from lab.cluster.realnode import RealNode
from lab.cluster.vmnode import node_binaries
from lab.procs import REPO


def image_inputs(root: str = REPO) -> tuple[str, ...]:
    """The Dockerfile and what it copies from the tree (its COPY lines without --from): the
    image changes only when one of these does. Read from the Dockerfile, so a folder it starts
    copying counts at once (a hand-kept list missed the rooms the house moved)."""
    inputs = ["Dockerfile"]
    with open(os.path.join(root, "Dockerfile")) as f:
        for line in f:
            words = line.split()
            if words[:1] == ["COPY"] and not any(w.startswith("--from") for w in words):
                inputs += [w.rstrip("/") for w in words[1:-1] if not w.startswith("--")]
    return tuple(dict.fromkeys(inputs))
IMAGE_CACHE = os.path.expanduser("~/.cache/archway/image")
ARCHWAY_IMAGE = "localhost/archway"
SCHEDULER_IMAGE = "localhost/kube-scheduler"
HELM_TIMEOUT = "6m"
EMULATED_START_SECONDS = 900   # archway's pods on an emulated node: minutes on a busy machine


def tree_digest(root: str = REPO) -> str:
    """sha256 over the paths and contents of what goes into the image (no byte code)."""
    digest = hashlib.sha256()
    for top in image_inputs(root):
        path = os.path.join(root, top)
        files = [path] if os.path.isfile(path) else sorted(
            os.path.join(folder, name) for folder, dirs, names in os.walk(path)
            for name in names if "__pycache__" not in folder and not name.endswith(".pyc"))
        for file in files:
            digest.update(os.path.relpath(file, root).encode() + b"\0")
            with open(file, "rb") as f:
                digest.update(f.read() + b"\0")
    return digest.hexdigest()[:16]


def archway_image_archive(arch: str | None = None) -> tuple[str, str]:
    """(OCI archive path, image name) of archway's image for `arch`, built when the tree changed."""
    arch = arch or machine_arch()
    tag = f"{arch}-{tree_digest()}"
    name = f"{ARCHWAY_IMAGE}:{tag}"
    path = os.path.join(IMAGE_CACHE, f"archway-{tag}.oci.tar")
    if not os.path.exists(path):
        os.makedirs(IMAGE_CACHE, exist_ok=True)
        for old in os.listdir(IMAGE_CACHE):     # one image per architecture is kept
            if old.startswith(f"archway-{arch}-") and old.endswith(".oci.tar"):
                os.unlink(os.path.join(IMAGE_CACHE, old))
        done = subprocess.run(["bash", os.path.join(REPO, "scripts", "build-image.sh"),
                               "--platforms", f"linux/{arch}", "--oci-archive",
                               f"{path}.part:{name}"], capture_output=True, text=True)
        if done.returncode != 0:
            raise ControlPlaneError(f"scripts/build-image.sh failed:\n{done.stderr[-3000:]}")
        os.replace(f"{path}.part", path)
    return path, name


class InClusterInstall(ChartInstall):
    def __init__(self, plane: ControlPlane, node: RealNode | None, *, registry=None,
                 architectures: tuple[str, ...] = (), **kwargs):
        super().__init__(plane, **kwargs)
        if node is None and registry is None:
            raise ValueError("the images go into a node's containerd or to a registry")
        self.node = node
        self.registry = registry
        self.architectures = list(architectures) or [machine_arch()]
        self.pushed: dict[str, dict[str, str]] = {}   # image -> arch (and "index") -> digest
        self.helm_timeout = HELM_TIMEOUT
        self.image_tag = ""
        self.scheduler_tag = ""
        self.timings: dict[str, float] = {}     # seconds per step, for `up` to report
        self.installed = False

    @property
    def values(self) -> dict:
        where = f"{self.registry.host}/" if self.registry else "localhost/"
        pull = "IfNotPresent" if self.registry else "Never"
        return deep_merge({
            "image": {"repository": where + "archway", "tag": self.image_tag, "pullPolicy": pull,
                      "architectures": self.architectures},
            "scheduler": {"enabled": True,
                          "image": {"repository": where + "kube-scheduler", "tag": self.scheduler_tag,
                                    "pullPolicy": pull}},
            "config": self.archway_config,
        }, self.extra_values)

    @classmethod
    def on_two_architectures(cls, plane: ControlPlane, registry, foreign: str, *,
                             archway_config: dict) -> "InClusterInstall":
        """archway from `registry` on a cluster of this machine's node and an emulated node of
        `foreign`: a webhook replica on each node, the second scheduler and its extender on
        the emulated one, with minutes to start there (TCG on a busy machine)."""
        webhook = {"app.kubernetes.io/component": "webhook"}
        install = cls(plane, None, registry=registry, architectures=(machine_arch(), foreign),
                      archway_config=archway_config, values={
                          "webhook": {"startupSeconds": EMULATED_START_SECONDS,
                                      "topologySpreadConstraints": [{
                                          "maxSkew": 1, "topologyKey": "kubernetes.io/hostname",
                                          "whenUnsatisfiable": "DoNotSchedule",
                                          "labelSelector": {"matchLabels": webhook}}]},
                          "scheduler": {"nodeSelector": {"kubernetes.io/arch": foreign},
                                        "extender": {"startupSeconds": EMULATED_START_SECONDS}}})
        install.helm_timeout = "20m"
        return install

    def load_images(self) -> None:
        assert self.kube is not None
        self.scheduler_tag = self.kube.get("/version")["gitVersion"]
        if self.registry is not None:
            self.push_images()
            return
        node = self.node
        assert node is not None
        path, name = archway_image_archive()
        self.image_tag = name.rsplit(":", 1)[1]
        archives = (path, self.scheduler_archive())
        with ThreadPoolExecutor(len(archives)) as pool:     # both at once: ~1/3 less time
            results = list(pool.map(lambda a: node.ctr("images", "import", a, timeout=300),
                                    archives))
        for archive, done in zip(archives, results, strict=True):
            if done.returncode != 0:
                raise ControlPlaneError(f"ctr images import {archive}: {done.stderr.strip()}")

    def scheduler_image(self, arch: str) -> OciImage:
        """The built kube-scheduler of `arch` as an image (another architecture's is
        cross-compiled with the VM node's kubelet)."""
        binary = (self.plane.binary("kube-scheduler") if arch == machine_arch()
                  else os.path.join(node_binaries(arch), "kube-scheduler"))
        return OciImage.of({"/usr/local/bin/kube-scheduler": binary}, arch=arch,
                           entrypoint=["/usr/local/bin/kube-scheduler"], user="65532:65532")

    def scheduler_archive(self) -> str:
        """The built kube-scheduler as an image archive (made once per binary, kept with archway's)."""
        binary = self.plane.binary("kube-scheduler")
        stamp = f"{self.scheduler_tag}-{machine_arch()}-{int(os.stat(binary).st_mtime)}"
        path = os.path.join(IMAGE_CACHE, f"kube-scheduler-{stamp}.oci.tar")
        if not os.path.exists(path):
            os.makedirs(IMAGE_CACHE, exist_ok=True)
            self.scheduler_image(machine_arch()).write_archive(
                path, f"{SCHEDULER_IMAGE}:{self.scheduler_tag}")
        return path

    def push_images(self) -> None:
        """archway's image and the kube-scheduler's, each an index of self.architectures."""
        assert self.registry is not None
        self.image_tag = tree_digest()
        entries = [entry for arch in self.architectures
                   for entry in push_archive(self.registry, "archway", archway_image_archive(arch)[0])]
        self.pushed["archway"] = self._pushed(entries, push_index(
            self.registry, "archway", self.image_tag, entries))
        entries = []
        for arch in self.architectures:
            image = self.scheduler_image(arch)
            image.push(self.registry, "kube-scheduler", image.digest)
            entries.append(image.index_entry())
        self.pushed["kube-scheduler"] = self._pushed(entries, push_index(
            self.registry, "kube-scheduler", self.scheduler_tag, entries))

    @staticmethod
    def _pushed(entries: list[dict], index: str) -> dict[str, str]:
        return {"index": index, **{e["platform"]["architecture"]: e["digest"] for e in entries}}

    def install(self) -> "InClusterInstall":
        started = time.monotonic()
        self.load_images()
        self.timings["images"] = time.monotonic() - started
        values_file = self.plane.path("values.yaml")
        with open(values_file, "w") as f:
            yaml.safe_dump(self.values, f)
        try:
            self.helm("install", self.release, os.path.join(REPO, "charts", "archway"),
                      "--create-namespace", "--values", values_file, "--wait", "--wait-for-jobs",
                      "--timeout", self.helm_timeout)
        except ControlPlaneError as e:
            raise ControlPlaneError(f"{e}\n{self.not_ready()}") from None
        self.timings["helm install --wait"] = time.monotonic() - started - self.timings["images"]
        self.installed = True
        self.wait_until_webhook_acts(timeout=60)
        self.save_in_cluster()
        return self

    def not_ready(self) -> str:
        """What keeps the release's pods from Ready: each one's phase, node, restarts and last
        end, and the namespace's warning Events (what `helm --wait` does not say)."""
        assert self.kube is not None
        lines = []
        for pod in self.kube.items(f"/api/v1/namespaces/{self.namespace}/pods"):
            for status in pod["status"].get("containerStatuses") or []:
                ended = (status.get("lastState") or {}).get("terminated") or {}
                lines.append(f"  {pod['metadata']['name']}/{status['name']} on "
                             f"{pod['spec'].get('nodeName') or '-'}: {pod['status'].get('phase')}, "
                             f"ready {status.get('ready')}, restarts {status.get('restartCount', 0)}"
                             + (f", last ended {ended.get('reason')} ({ended.get('exitCode')})" if ended else ""))
        for event in self.kube.items(f"/api/v1/namespaces/{self.namespace}/events")[-20:]:
            if event.get("type") == "Warning":
                lines.append(f"  event {event['involvedObject'].get('name')}: {event.get('reason')}: "
                             f"{event.get('message', '')[:200]}")
        return "the release's pods:\n" + "\n".join(lines or ["  none"])

    def upgrade(self, config: dict | None = None, values: dict | None = None) -> None:
        """`helm upgrade --wait` with `config` merged into archway's and `values` into the
        chart's: a changed config rolls the webhook Deployment (its pods carry its checksum)."""
        self.archway_config = deep_merge(self.archway_config, config or {})
        self.extra_values = deep_merge(self.extra_values, values or {})
        values_file = self.plane.path("values.yaml")
        with open(values_file, "w") as f:
            yaml.safe_dump(self.values, f)
        self.helm("upgrade", self.release, os.path.join(REPO, "charts", "archway"),
                  "--values", values_file, "--wait", "--wait-for-jobs", "--timeout", self.helm_timeout)
        # `--wait` returns once the new pods are ready; the old ones may still be terminating,
        # one of them still leading the gate controller with the old configuration.
        assert self.kube is not None
        self.kube.wait_for(lambda: not any(
            p["metadata"].get("deletionTimestamp")
            for p in self.kube.items(f"/api/v1/namespaces/{self.namespace}/pods")),
            timeout=120, what="archway's replaced pods gone")
        self.wait_until_webhook_acts(timeout=60)

    def uninstall(self, timeout: str = HELM_TIMEOUT) -> None:
        """`helm uninstall --wait` as a user runs it: its hooks run as Jobs on the node."""
        self.installed = False
        self.helm("uninstall", self.release, "--wait", "--timeout", timeout)

    def webhook_addresses(self, port: str = "https") -> list[tuple[str, str]]:
        """(node name, https://IP:PORT) of each running webhook pod, at its container port named
        `port` (https: admissions; https-metrics: /metrics, /healthz and /readyz only)."""
        assert self.kube is not None
        found = []
        for pod in self.kube.items(f"/api/v1/namespaces/{self.namespace}/pods",
                                   labelSelector="app.kubernetes.io/component=webhook"):
            if pod["status"].get("phase") != "Running" or pod["metadata"].get("deletionTimestamp"):
                continue
            (number,) = [p["containerPort"] for p in pod["spec"]["containers"][0]["ports"]
                         if p["name"] == port]
            found.append((pod["spec"]["nodeName"], f"https://{pod['status']['podIP']}:{number}"))
        return found

    def webhook_metrics(self) -> list[str]:
        """/metrics of each running webhook pod, read on its own address; a pod not serving yet
        is left out."""
        urllib3.disable_warnings(urllib3.exceptions.InsecureRequestWarning)   # the pod's own cert
        texts = []
        for _, address in self.webhook_addresses("https-metrics"):
            try:
                texts.append(requests.get(f"{address}/metrics", verify=False, timeout=10).text)
            except requests.RequestException:
                continue
        return texts

    def logs(self, tail: int = 150) -> str:
        """The last `tail` lines of each of the release's containers, with the leader's Lease
        holder: what a failed test prints of archway (the logs of a run are gone with it)."""
        assert self.kube is not None
        parts = []
        for lease in self.kube.items(f"/apis/coordination.k8s.io/v1/namespaces/{self.namespace}/leases"):
            spec = lease.get("spec") or {}
            parts.append(f"lease {lease['metadata']['name']}: held by {spec.get('holderIdentity')}, "
                         f"renewed {spec.get('renewTime')}, transitions {spec.get('leaseTransitions')}")
        for pod in self.kube.items(f"/api/v1/namespaces/{self.namespace}/pods"):
            for container in pod["spec"]["containers"]:
                name = f"{pod['metadata']['name']}/{container['name']}"
                response = self.kube.session.get(
                    f"{self.kube.server}/api/v1/namespaces/{self.namespace}/pods/"
                    f"{pod['metadata']['name']}/log",
                    params={"container": container["name"], "tailLines": tail}, timeout=10)
                parts.append(f"--- {name} ---\n{response.text[-200_000:]}")
        return "\n".join(parts)

    def save_in_cluster(self) -> None:
        with open(self.plane.path("archway.json"), "w") as f:
            json.dump({"release": self.release, "namespace": self.namespace, "in_cluster": True,
                       "image": f"{self.values['image']['repository']}:{self.image_tag}"}, f)


def describe(install: InClusterInstall) -> list[str]:
    """What `scripts/cluster.sh up --in-cluster` tells the user about the install."""
    names = install.resource_names()
    return [f"archway in the cluster: image {install.values['image']['repository']}:{install.image_tag}, Deployments "
            f"{', '.join(names.get('Deployment', []))} in {install.namespace}; webhook through "
            f"Service {', '.join(names.get('Service', []))}; second scheduler "
            f"'{install.scheduler_name}'",
            "took: " + ", ".join(f"{step} {seconds:.0f} s" for step, seconds in install.timings.items())]
