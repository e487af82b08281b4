"""Karpenter beside the real control plane (controlplane.py): its KWOK cloud provider
(sigs.k8s.io/karpenter/kwok, built and cached by scripts/karpenter-build.sh) turns the NodeClaims
it decides on into Nodes annotated kwok.x-k8s.io/node=fake, which KWOK (kwok.py) makes Ready and
whose pods it plays. What `scripts/cluster.sh up --karpenter` starts and test_karpenter.py uses.

    plane = ControlPlane(state_dir, nodes=()).start()    # no Node a pod could be bound to
    kwok = Kwok(plane).start()
    karpenter = Karpenter(plane).start()                  # ~10 s: CRDs, RBAC, process, NodePool
    karpenter.nodeclaims(); karpenter.set_consolidate_after("5s")

Karpenter runs here as its own chart's ServiceAccount (a TokenRequest token), with the RBAC the
chart renders (`helm template`), leader election on (a Lease in its namespace, as in a pod), and
the environment the chart's Deployment gives it, ports excepted: metrics and health probes bind
every interface, so they get free ports. The instance types are the provider's own, linux only,
with arm64 cheaper than amd64 (arm64_priced).
"""
import copy
import json
import os
import shutil
import subprocess
import time

import requests
import yaml

from lab.cluster.controlplane import ControlPlane, kubeconfig
from lab.cluster.processes import ControlPlaneError, clean_env, pid_alive, start_process, tail, wait_answering
from lab.kube import KubeError
from lab.procs import REPO, free_port

KARPENTER_BUILD = os.path.join(REPO, "scripts", "karpenter-build.sh")
RELEASE = NAMESPACE = "karpenter"
NODEPOOL = "default"
NODECLASS = "default"
NODEPOOL_LABEL = "karpenter.sh/nodepool"       # on every Node and NodeClaim Karpenter made
KARPENTER_API = "/apis/karpenter.sh/v1"
NODECLASS_API = "/apis/karpenter.kwok.sh/v1alpha1"
# Public clouds sell an arm64 (Graviton-class) instance for about 20 % less than the amd64 one
# of the same size; the provider's defaults price both alike, and an unconstrained pod then gets
# amd64 only because that name sorts first. At 0.8x, Karpenter's cost choice is arm64, as on EKS.
ARM64_PRICE = 0.8
# The Deployment's env that only make sense in a pod (its own resources) or name its ports.
POD_ONLY_ENV = ("METRICS_PORT", "HEALTH_PROBE_PORT", "MEMORY_LIMIT", "CPU_REQUESTS",
                "SYSTEM_NAMESPACE")
RBAC_KINDS = ("ServiceAccount", "ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding")
# The v1.15.0 KWOK chart's Deployment reads these two feature gates, which its values.yaml does
# not define: rendered as they are, FEATURE_GATES holds "StaticCapacity=," and karpenter panics
# at start ("invalid value of StaticCapacity"). Their defaults (off), said explicitly.
CHART_VALUES = ("settings.featureGates.staticCapacity=false",
                "settings.featureGates.capacityBuffer=false")


def build_karpenter() -> str:
    """The folder holding `karpenter`, `chart/`, `crds/` and `instance_types.json`."""
    done = subprocess.run(["bash", KARPENTER_BUILD], capture_output=True, text=True)
    if done.returncode != 0:
        raise ControlPlaneError(f"scripts/karpenter-build.sh failed:\n{done.stderr[-3000:]}")
    return done.stdout.strip().splitlines()[-1]


def _offering_key(offering: dict) -> str:
    return json.dumps(sorted((r["key"], r["operator"], sorted(r.get("values") or []))
                             for r in offering["Requirements"]))


def arm64_priced(types: list[dict], factor: float = ARM64_PRICE) -> list[dict]:
    """The linux instance types of `types`, each arm64 offering at `factor` times the price of
    the same-sized amd64 type's offering in the same zone and capacity type."""
    linux = [copy.deepcopy(t) for t in types if "linux" in t.get("operatingSystems", ())]
    by_name = {t["name"]: t for t in linux}
    for kind in linux:
        if kind["architecture"] != "arm64":
            continue
        twin = by_name.get(kind["name"].replace("-arm64-", "-amd64-"))
        if twin is None or twin["resources"] != kind["resources"]:
            raise ControlPlaneError(f"instance type {kind['name']} has no same-sized amd64 twin")
        prices = {_offering_key(o): o["Price"] for o in twin["offerings"]}
        for offering in kind["offerings"]:
            offering["Price"] = round(prices[_offering_key(offering)] * factor, 9)
    return linux


def nodepool(consolidate_after: str = "30s", cpu_limit: int = 64) -> dict:
    """NodePool `default`: amd64 and arm64, linux, on-demand and spot, on the KWOKNodeClass;
    empty or underused nodes consolidated after `consolidate_after`; at most `cpu_limit` CPUs
    (a handful of KWOK Nodes: a runaway provisioning stops there)."""
    requirement = [("kubernetes.io/arch", ["amd64", "arm64"]), ("kubernetes.io/os", ["linux"]),
                   ("karpenter.sh/capacity-type", ["on-demand", "spot"])]
    return {"apiVersion": "karpenter.sh/v1", "kind": "NodePool", "metadata": {"name": NODEPOOL},
            "spec": {"template": {"spec": {
                "nodeClassRef": {"group": "karpenter.kwok.sh", "kind": "KWOKNodeClass",
                                 "name": NODECLASS},
                "requirements": [{"key": k, "operator": "In", "values": v} for k, v in requirement],
                "expireAfter": "Never"}},
                "disruption": {"consolidationPolicy": "WhenEmptyOrUnderutilized",
                               "consolidateAfter": consolidate_after},
                "limits": {"cpu": str(cpu_limit)}}}


def nodeclass() -> dict:
    return {"apiVersion": "karpenter.kwok.sh/v1alpha1", "kind": "KWOKNodeClass",
            "metadata": {"name": NODECLASS}}


def ready(obj: dict) -> bool:
    return any(c.get("type") == "Ready" and c.get("status") == "True"
               for c in (obj.get("status") or {}).get("conditions") or [])


class Karpenter:
    def __init__(self, plane: ControlPlane, folder: str | None = None, *,
                 consolidate_after: str = "30s", batch_idle: str = "1s", batch_max: str = "10s"):
        self.plane = plane
        self.folder = folder
        self.consolidate_after = consolidate_after
        self.batch = {"BATCH_IDLE_DURATION": batch_idle, "BATCH_MAX_DURATION": batch_max}
        self.health_port = 0

    @property
    def kube(self):
        assert self.plane.kube is not None
        return self.plane.kube

    # --- install -----------------------------------------------------------------------
    def start(self) -> "Karpenter":
        self.folder = self.folder or build_karpenter()
        self.kubectl("apply", "--server-side", "-f", os.path.join(self.folder, "crds"))
        for api in (f"{KARPENTER_API}/nodepools", f"{KARPENTER_API}/nodeclaims",
                    f"{NODECLASS_API}/kwoknodeclasses"):
            self.poll(lambda a=api: self.kube.get(a), timeout=60, what=f"{api} served")
        manifests = self.rendered_chart()
        if not self.kube.exists(f"/api/v1/namespaces/{NAMESPACE}"):
            self.plane.new_namespace(NAMESPACE)
        rbac = [doc for doc in manifests if doc["kind"] in RBAC_KINDS]
        self.kubectl("apply", "--server-side", "-f", "-",
                     stdin=yaml.safe_dump_all(rbac))
        (deployment,) = [doc for doc in manifests if doc["kind"] == "Deployment"]
        self.start_process(deployment)
        self.apply(NODECLASS_API + "/kwoknodeclasses", nodeclass())
        self.apply(KARPENTER_API + "/nodepools", nodepool(self.consolidate_after))
        self.wait_ready()
        return self

    def kubectl(self, *args: str, stdin: str | None = None) -> str:
        done = subprocess.run([self.plane.binary("kubectl"), f"--kubeconfig={self.plane.admin_kubeconfig}",
                               *args], input=stdin, capture_output=True, text=True, timeout=120)
        if done.returncode != 0:
            raise ControlPlaneError(f"kubectl {' '.join(args[:3])} failed: {done.stderr.strip()}")
        return done.stdout

    def rendered_chart(self) -> list[dict]:
        """The provider's chart as `helm template` renders it for release `karpenter`."""
        helm = shutil.which("helm")
        if not helm:
            raise ControlPlaneError("helm is not installed (scripts/install-helm.sh)")
        assert self.folder
        done = subprocess.run([helm, "template", RELEASE, os.path.join(self.folder, "chart"),
                               "--namespace", NAMESPACE,
                               *[f"--set={value}" for value in CHART_VALUES]],
                              capture_output=True, text=True,
                              timeout=120)
        if done.returncode != 0:
            raise ControlPlaneError(f"helm template of Karpenter's chart failed: {done.stderr}")
        return [doc for doc in yaml.safe_load_all(done.stdout) if doc]

    def apply(self, collection: str, body: dict) -> dict:
        try:
            return self.kube.create(collection, body)
        except KubeError as e:
            if e.status != 409:
                raise
            return self.kube.patch(f"{collection}/{body['metadata']['name']}",
                                   {"spec": body.get("spec", {})})

    # --- the process ---------------------------------------------------------------------
    def instance_types_file(self) -> str:
        assert self.folder
        with open(os.path.join(self.folder, "instance_types.json")) as f:
            types = arm64_priced(json.load(f))
        path = self.plane.path("karpenter-instance-types.json")
        with open(path, "w") as f:
            json.dump(types, f)
        return path

    def environment(self, deployment: dict) -> dict:
        """The chart's env for the controller (plain values only), as this process needs it."""
        (container,) = deployment["spec"]["template"]["spec"]["containers"]
        account = deployment["spec"]["template"]["spec"]["serviceAccountName"]
        env = {var["name"]: var["value"] for var in container.get("env") or []
               if "value" in var and var["name"] not in POD_ONLY_ENV}
        token = self.kube.service_account_token(NAMESPACE, account, seconds=7 * 86400)
        config = kubeconfig(self.plane.path("karpenter.kubeconfig"), self.plane.server,
                            self.plane.ca_path, token,
                            f"system:serviceaccount:{NAMESPACE}:{account}")
        self.health_port = free_port()
        return {**clean_env(), **env, **self.batch, "KUBECONFIG": config,
                "SYSTEM_NAMESPACE": NAMESPACE,
                # Out of a pod, leader election needs to be told its Lease's namespace.
                "LEADER_ELECTION_NAMESPACE": NAMESPACE,
                "METRICS_PORT": str(free_port()), "HEALTH_PROBE_PORT": str(self.health_port)}

    def start_process(self, deployment: dict) -> None:
        env = self.environment(deployment)
        assert self.folder
        process = start_process("karpenter", [
            os.path.join(self.folder, "karpenter"),
            f"--instance-types-file-path={self.instance_types_file()}"],
            self.plane.state_dir, env=env)
        self.plane.processes["karpenter"] = process
        self.save(env)
        wait_answering("karpenter", process, lambda: requests.get(
            f"http://127.0.0.1:{self.health_port}/readyz", timeout=2).status_code == 200,
            timeout=90, interval=0.3)

    def save(self, env: dict) -> None:
        with open(self.plane.path("karpenter.json"), "w") as f:
            json.dump({"metrics_port": env["METRICS_PORT"], "health_port": env["HEALTH_PROBE_PORT"],
                       "consolidate_after": self.consolidate_after}, f)
        self.plane.save()

    def wait_ready(self, timeout: float = 120.0) -> None:
        """Until the NodePool and the KWOKNodeClass are Ready and Karpenter holds its Lease."""
        def done():
            self.check_alive()
            return (ready(self.kube.get(f"{NODECLASS_API}/kwoknodeclasses/{NODECLASS}"))
                    and ready(self.kube.get(f"{KARPENTER_API}/nodepools/{NODEPOOL}"))
                    and self.leader())
        self.poll(done, timeout=timeout, what="the NodePool and the KWOKNodeClass Ready, "
                                               "Karpenter holding its Lease")

    def check_alive(self) -> None:
        process = self.plane.processes["karpenter"]
        if not pid_alive(process.pid):
            raise ControlPlaneError(f"karpenter exited; its log {process.log} ends:\n"
                                    f"{tail(process.log)}")

    def poll(self, condition, *, timeout: float, what: str, interval: float = 0.5):
        """condition()'s first true value, asked every `interval` s (a 404, 429 or 503 counts
        as not yet); ControlPlaneError with Karpenter's log after `timeout` s."""
        end = time.monotonic() + timeout
        while True:
            try:
                value = condition()
            except KubeError as e:
                if e.status not in (404, 429, 503):   # 429, 503: a new CRD's storage starting
                    raise
                value = None
            if value:
                return value
            if time.monotonic() > end:
                raise ControlPlaneError(f"timed out after {timeout:g} s waiting for {what}; "
                                        f"karpenter's log ends:\n"
                                        f"{tail(self.plane.path('logs', 'karpenter.log'))}")
            time.sleep(interval)

    def leader(self) -> str:
        lease = self.kube.get(f"/apis/coordination.k8s.io/v1/namespaces/{NAMESPACE}/leases/"
                              f"karpenter-leader-election")
        return (lease.get("spec") or {}).get("holderIdentity") or ""

    # --- what tests look at ----------------------------------------------------------------
    def nodeclaims(self) -> list[dict]:
        return self.kube.items(f"{KARPENTER_API}/nodeclaims")

    def nodes(self) -> list[dict]:
        """The Nodes Karpenter launched (its NodePool's label)."""
        return self.kube.items("/api/v1/nodes", labelSelector=NODEPOOL_LABEL)

    def set_consolidate_after(self, duration: str) -> None:
        self.kube.patch(f"{KARPENTER_API}/nodepools/{NODEPOOL}",
                        {"spec": {"disruption": {"consolidateAfter": duration}}})
        self.consolidate_after = duration

    def describe(self) -> str:
        claims = self.nodeclaims()
        archs = sorted((c["metadata"].get("labels") or {}).get("kubernetes.io/arch", "?")
                       for c in claims)
        return (f"Karpenter (KWOK provider) up: NodePool {NODEPOOL} (amd64, arm64; linux; "
                f"on-demand, spot; arm64 at {ARM64_PRICE:g}x amd64's price), "
                f"{len(claims)} NodeClaims{' (' + ', '.join(archs) + ')' if archs else ''}; "
                f"log {self.plane.path('logs', 'karpenter.log')}")


# --- scripts/cluster.sh up --karpenter -----------------------------------------------------------

def plane_options(karpenter: bool) -> dict:
    """ControlPlane arguments for a cluster whose worker Nodes Karpenter makes: none of the
    plane's API-only Nodes. They are Ready, untainted and roomy, so the scheduler would bind every
    pending pod there and Karpenter would never see a pod it must provision for; and KWOK does not
    play them, so their pods would never run."""
    return {"nodes": ()} if karpenter else {}


def idle_stand_ins(plane: ControlPlane, namespace: str) -> None:
    """The Deployments of `namespace` (archway's chart: its second scheduler) scaled to 0: their
    pods would only stand in for the processes that run on this machine, and Karpenter would
    launch a Node for them."""
    assert plane.kube is not None
    for item in plane.kube.items(f"/apis/apps/v1/namespaces/{namespace}/deployments"):
        plane.kube.patch(f"/apis/apps/v1/namespaces/{namespace}/deployments/"
                         f"{item['metadata']['name']}/scale", {"spec": {"replicas": 0}})


def start_with_kwok(plane: ControlPlane, stand_ins: str | None = None, **options) -> "Karpenter":
    """KWOK (it makes Karpenter's Nodes Ready and runs their pods), then Karpenter, once the
    Deployments of `stand_ins` are idle (idle_stand_ins)."""
    from lab.cluster.kwok import Kwok
    if stand_ins:
        idle_stand_ins(plane, stand_ins)
    Kwok(plane).start()
    return Karpenter(plane, **options).start()


def status_line(plane: ControlPlane) -> str | None:
    """What `cluster.sh status` says of Karpenter: its NodeClaims (None: not started here)."""
    if not os.path.exists(plane.path("karpenter.json")):
        return None
    try:
        return Karpenter(plane).describe()
    except (KubeError, requests.RequestException) as e:
        return f"Karpenter: NodeClaims unreadable ({e})"
