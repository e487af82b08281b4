"""archway installed by its Helm chart on a real control plane (controlplane.py), running on this
machine as the chart's ServiceAccounts: what `scripts/cluster.sh` starts and the e2e tests use.

    plane = ControlPlane(state_dir).start()
    install = ChartInstall(plane, archway_config={"registry": {"insecure_hosts": [...]}}).install()
    install.webhook        # the `archway serve` the apiserver calls (Archway: port, log, config)
    install.restart_webhook({"admission": {"gate_max_seconds": 5}})
    install.uninstall()

The install is the chart's, not a copy: `helm install --no-hooks` with webhook.url pointing at
this machine, then each hook the chart declares, in helm's order, run here: its ServiceAccount
and RBAC created from the rendered hook manifests, the Job's `archway` command run with a
TokenRequest token of the Job's ServiceAccount (no kubelet runs the Job). The webhook and the
extender run with the configuration the chart rendered into its ConfigMap, deep-merged with the
caller's fragment; the second kube-scheduler with the chart's KubeSchedulerConfiguration.
"""
import base64
import copy
import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass

import requests
import yaml

from lab.cluster.controlplane import ControlPlane, kubeconfig
from lab.cluster.processes import (
    ControlPlaneError,
    Process,
    pid_alive,
    start_process,
    stop_process,
    tail,
    wait_answering,
)
from lab.kube import Kube, KubeError
from lab.procs import REPO, free_port

CHART = os.path.join(REPO, "charts", "archway")
RELEASE = "archway"
NAMESPACE = "archway-system"
PROBE_NAMESPACE = "archway-probe"
# helm's InstallOrder for the kinds the chart's hooks hold.
KIND_ORDER = ("PriorityClass", "Namespace", "ServiceAccount", "Secret", "ConfigMap", "ClusterRole",
              "ClusterRoleBinding", "Role", "RoleBinding", "Service", "Job")
CLUSTER_KINDS = ("PriorityClass", "ClusterRole", "ClusterRoleBinding")


def deep_merge(base: dict, extra: dict) -> dict:
    """`extra` over `base`: maps merge key by key, anything else replaces."""
    out = copy.deepcopy(base)
    for key, value in (extra or {}).items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def archway_command() -> list[str]:
    """The `archway` of the Python running this (the project's virtualenv)."""
    script = os.path.join(os.path.dirname(sys.executable), "archway")
    return [script] if os.path.exists(script) else [sys.executable, "-m", "archway.main.cli"]


@dataclass
class Archway:
    """One `archway serve` on this machine."""
    name: str
    port: int
    config_path: str
    process: Process
    tls_ca: str | None = None

    @property
    def url(self) -> str:
        return f"{'https' if self.tls_ca else 'http'}://127.0.0.1:{self.port}"

    def get(self, path: str, timeout: float = 5.0) -> requests.Response:
        return requests.get(self.url + path, verify=self.tls_ca or False, timeout=timeout)

    def log(self, lines: int = 200) -> str:
        return tail(self.process.log, lines)

    def alive(self) -> bool:
        return pid_alive(self.process.pid)


class ChartInstall:
    def __init__(self, plane: ControlPlane, *, archway_config: dict | None = None,
                 values: dict | None = None, release: str = RELEASE, namespace: str = NAMESPACE):
        self.plane = plane
        self.kube: Kube = plane.kube  # type: ignore[assignment]
        self.release = release
        self.namespace = namespace
        self.archway_config = archway_config or {}
        self.extra_values = values or {}
        self.webhook_port = free_port()
        self.extender_port = free_port()
        self.webhook: Archway | None = None
        self.extender: Archway | None = None
        self.replicas: list[Archway] = []      # further webhook replicas a test started

    # --- helm ----------------------------------------------------------------------------
    @property
    def values(self) -> dict:
        return deep_merge({
            "webhook": {"url": f"https://127.0.0.1:{self.webhook_port}/mutate"},
            "scheduler": {"enabled": True, "extender": {"port": self.extender_port}},
        }, self.extra_values)

    def helm(self, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        helm = shutil.which("helm")
        if not helm:
            raise ControlPlaneError("helm is not installed (scripts/install-helm.sh)")
        done = subprocess.run([helm, *args, "--kubeconfig", self.plane.admin_kubeconfig,
                               "--namespace", self.namespace], capture_output=True, text=True,
                              env={**os.environ, "HELM_CACHE_HOME": self.plane.path("helm", "cache"),
                                   "HELM_CONFIG_HOME": self.plane.path("helm", "config"),
                                   "HELM_DATA_HOME": self.plane.path("helm", "data")})
        if check and done.returncode != 0:
            raise ControlPlaneError(f"helm {' '.join(args[:2])} failed: {done.stderr.strip()}")
        return done

    def install(self) -> "ChartInstall":
        values_file = self.plane.path("values.yaml")
        with open(values_file, "w") as f:
            yaml.safe_dump(self.values, f)
        self.helm("install", self.release, CHART, "--create-namespace", "--no-hooks",
                  "--values", values_file)
        self.run_hooks("pre-install")
        self.run_hooks("post-install")
        self.webhook = self.start_webhook("archway-webhook", self.webhook_port)
        self.extender = self.start_extender()
        self.start_second_scheduler()
        self.wait_until_webhook_acts()
        self.save()
        return self

    def uninstall(self) -> None:
        """What `helm uninstall` does with its hooks: pre-delete hooks (the gate release), then
        the release's objects, then post-delete hooks (the cleanup of archway's Leases). helm
        deletes the Deployments before the RBAC; their pods' grace period races the RBAC's
        deletion, and here the processes stop first."""
        hooks = self.hook_manifests()
        self.run_hooks("pre-delete", hooks)
        self.stop_processes()
        self.helm("uninstall", self.release, "--no-hooks")
        self.run_hooks("post-delete", hooks)

    def stop_processes(self) -> None:
        for archway in [*self.replicas, self.webhook, self.extender]:
            if archway is not None:
                stop_process(archway.process)
        scheduler = self.plane.processes.pop("archway-scheduler", None)
        if scheduler is not None:
            stop_process(scheduler)
        self.replicas.clear()

    # --- hooks -----------------------------------------------------------------------------
    def hook_manifests(self) -> list[dict]:
        out = self.helm("get", "hooks", self.release).stdout
        return [doc for doc in yaml.safe_load_all(out) if doc]

    def run_hooks(self, event: str, manifests: list[dict] | None = None) -> list[str]:
        """The chart's hooks for `event` (of `manifests`, default the release's) in helm's order
        (weight, kind, name); returns what each Job's command printed."""
        hooks = []
        for doc in self.hook_manifests() if manifests is None else manifests:
            annotations = doc["metadata"].get("annotations") or {}
            events = [e.strip() for e in annotations.get("helm.sh/hook", "").split(",")]
            if event in events:
                weight = int(annotations.get("helm.sh/hook-weight", "0"))
                kind = KIND_ORDER.index(doc["kind"]) if doc["kind"] in KIND_ORDER else len(KIND_ORDER)
                hooks.append((weight, kind, doc["metadata"]["name"], doc))
        ordered = [doc for *_, doc in sorted(hooks, key=lambda h: h[:3])]
        outputs = [self.run_job(doc) if doc["kind"] == "Job" else (self.apply(doc), "")[1]
                   for doc in ordered]
        for doc in ordered:   # the Jobs never existed: only what apply() created goes
            policy = (doc["metadata"].get("annotations") or {}).get("helm.sh/hook-delete-policy", "")
            if "hook-succeeded" in policy and doc["kind"] != "Job":
                self.kube.delete(self.object_path(doc))
        return outputs

    def object_path(self, doc: dict, collection: bool = False) -> str:
        group_version = doc["apiVersion"]
        base = f"/api/{group_version}" if "/" not in group_version else f"/apis/{group_version}"
        plural = {"PriorityClass": "priorityclasses", "ServiceAccount": "serviceaccounts",
                  "Secret": "secrets", "ConfigMap": "configmaps", "ClusterRole": "clusterroles",
                  "ClusterRoleBinding": "clusterrolebindings", "Role": "roles",
                  "RoleBinding": "rolebindings", "Service": "services", "Job": "jobs"}[doc["kind"]]
        if doc["kind"] in CLUSTER_KINDS:
            path = f"{base}/{plural}"
        else:
            path = f"{base}/namespaces/{doc['metadata'].get('namespace') or self.namespace}/{plural}"
        return path if collection else f"{path}/{doc['metadata']['name']}"

    def apply(self, doc: dict) -> dict:
        try:
            return self.kube.create(self.object_path(doc, collection=True), doc)
        except KubeError as e:
            if e.status != 409:
                raise
            current = self.kube.get(self.object_path(doc))
            doc = dict(doc, metadata=dict(doc["metadata"],
                                          resourceVersion=current["metadata"]["resourceVersion"]))
            return self.kube.put(self.object_path(doc), doc)

    def run_job(self, job: dict) -> str:
        """The Job's one container, run here as its ServiceAccount (the image's entrypoint is
        `archway`: its args are archway's)."""
        pod = job["spec"]["template"]["spec"]
        (container,) = pod["containers"]
        if container.get("command"):
            raise ControlPlaneError(f"hook Job {job['metadata']['name']} has a command of its own")
        account = pod.get("serviceAccountName") or "default"
        config = self.account_kubeconfig(account, f"hook-{job['metadata']['name']}")
        env = {**os.environ, "KUBECONFIG": config, "POD_NAMESPACE": self.namespace}
        for var in container.get("env") or []:
            if "value" in var:
                env[var["name"]] = var["value"]
        done = subprocess.run(archway_command() + container.get("args", []), env=env,
                              capture_output=True, text=True, timeout=120, cwd=self.plane.state_dir)
        if done.returncode != 0:
            raise ControlPlaneError(f"hook Job {job['metadata']['name']} (archway "
                                    f"{' '.join(container.get('args', []))}) failed with "
                                    f"{done.returncode}: {(done.stderr or done.stdout)[-2000:]}")
        return done.stdout

    def account_kubeconfig(self, account: str, name: str) -> str:
        token = self.kube.service_account_token(self.namespace, account, seconds=7 * 86400)
        return kubeconfig(self.plane.path(f"{name}.kubeconfig"), self.plane.server,
                          self.plane.ca_path, token, f"system:serviceaccount:{self.namespace}:{account}")

    # --- archway on this machine ---------------------------------------------------------
    def resource_names(self) -> dict:
        """The names the chart gave its objects, read from what it installed."""
        manifest = self.helm("get", "manifest", self.release).stdout
        names: dict[str, list[str]] = {}
        for doc in yaml.safe_load_all(manifest):
            if doc:
                names.setdefault(doc["kind"], []).append(doc["metadata"]["name"])
        return names

    def chart_config(self, key: str) -> dict:
        (name,) = [n for n in self.resource_names()["ConfigMap"] if n.endswith("-config")]
        data = self.kube.get(f"/api/v1/namespaces/{self.namespace}/configmaps/{name}")["data"]
        return yaml.safe_load(data[key])

    def service_account(self, component: str) -> str:
        """The ServiceAccount of the chart's `component` (webhook or scheduler) pods."""
        for name in self.resource_names()["ServiceAccount"]:
            account = self.kube.get(f"/api/v1/namespaces/{self.namespace}/serviceaccounts/{name}")
            if account["metadata"]["labels"].get("app.kubernetes.io/component") == component:
                return name
        raise ControlPlaneError(f"the chart installed no ServiceAccount for {component}")

    def tls_files(self) -> tuple[str, str, str]:
        """The serving pair the certgen hook stored (as the webhook pod mounts it) and the CA."""
        (name,) = [n for n in self.kube_secrets() if n.endswith("-tls")]
        data = self.kube.get(f"/api/v1/namespaces/{self.namespace}/secrets/{name}")["data"]
        folder = self.plane.path("archway-tls")
        os.makedirs(folder, mode=0o700, exist_ok=True)
        paths = []
        for key in ("tls.crt", "tls.key", "ca.crt"):
            path = os.path.join(folder, key)
            with open(path, "wb") as f:
                f.write(base64.b64decode(data[key]))
            os.chmod(path, 0o600)
            paths.append(path)
        return paths[0], paths[1], paths[2]

    def kube_secrets(self) -> list[str]:
        return [s["metadata"]["name"] for s in
                self.kube.items(f"/api/v1/namespaces/{self.namespace}/secrets")]

    def host_config(self, key: str, name: str, port: int, account: str, overrides: dict,
                    tls: tuple[str, str, str] | None) -> str:
        """The chart's rendered config + the fragment + what running here needs."""
        # No metrics_bind: /metrics on the one port a test reads (the chart's pods have two).
        server: dict = {"bind": f"127.0.0.1:{port}", "metrics_bind": None,
                        "state_dir": self.plane.path(f"{name}-state")}
        here = {"server": server,
                "kubernetes": {"kubeconfig": self.account_kubeconfig(account, name),
                               "namespace": self.namespace}}
        if tls:
            server.update(cert_file=tls[0], key_file=tls[1])
        config = deep_merge(deep_merge(deep_merge(self.chart_config(key), self.archway_config),
                                       overrides), here)
        path = self.plane.path(f"{name}.yaml")
        with open(path, "w") as f:
            yaml.safe_dump(config, f)
        return path

    def start_webhook(self, name: str, port: int, overrides: dict | None = None) -> Archway:
        tls = self.tls_files()
        path = self.host_config("webhook.yaml", name, port, self.service_account("webhook"),
                                overrides or {}, tls)
        archway = self._serve(name, path, port, tls[2])
        return archway

    def start_replica(self, name: str, overrides: dict | None = None) -> Archway:
        """Another webhook replica (its own port; the apiserver calls only the first)."""
        archway = self.start_webhook(name, free_port(), overrides)
        self.replicas.append(archway)
        return archway

    def restart_webhook(self, overrides: dict | None = None) -> Archway:
        assert self.webhook is not None
        stop_process(self.webhook.process)
        self.webhook = self.start_webhook("archway-webhook", self.webhook_port, overrides)
        self.save()
        return self.webhook

    def start_extender(self, overrides: dict | None = None) -> Archway:
        path = self.host_config("extender.yaml", "archway-extender", self.extender_port,
                                self.service_account("scheduler"), overrides or {}, None)
        return self._serve("archway-extender", path, self.extender_port, None)

    def restart_extender(self, overrides: dict | None = None) -> Archway:
        assert self.extender is not None
        stop_process(self.extender.process)
        self.extender = self.start_extender(overrides)
        self.save()
        return self.extender

    def _serve(self, name: str, config_path: str, port: int, ca: str | None) -> Archway:
        process = start_process(name, archway_command() + ["--config", config_path, "serve"],
                                self.plane.state_dir, env=dict(os.environ, PYTHONUNBUFFERED="1"))
        archway = Archway(name, port, config_path, process, ca)
        wait_answering(f"archway serve ({name})", process,
                       lambda: archway.get("/readyz", timeout=2).status_code == 200, timeout=60)
        return archway

    def start_second_scheduler(self) -> Process:
        (name,) = [n for n in self.resource_names()["ConfigMap"] if n.endswith("-scheduler")]
        data = self.kube.get(f"/api/v1/namespaces/{self.namespace}/configmaps/{name}")["data"]
        config = yaml.safe_load(data["scheduler-config.yaml"])
        account = self.service_account("scheduler")
        token = self.kube.service_account_token(self.namespace, account, seconds=7 * 86400)
        return self.plane.start_scheduler("archway-scheduler", token, config,
                                          user=f"system:serviceaccount:{self.namespace}:{account}")

    @property
    def scheduler_name(self) -> str:
        return self.values.get("scheduler", {}).get("name") or "archway-scheduler"

    # --- readiness -------------------------------------------------------------------------
    def webhook_acts(self) -> bool:
        """Does the apiserver call archway? A dry-run create (nothing stored; archway declares
        no side effects) shows archway's patch or warning."""
        pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "archway-probe"},
               "spec": {"containers": [{"name": "probe", "image": "probe.invalid/archway:probe"}]}}
        response = self.kube.session.post(
            f"{self.plane.server}/api/v1/namespaces/{PROBE_NAMESPACE}/pods", params={"dryRun": "All"},
            json=pod, timeout=30)
        if response.status_code >= 400:
            return "archway" in response.text
        stored = response.json()
        marks = {**(stored["metadata"].get("annotations") or {}),
                 **(stored["metadata"].get("labels") or {})}
        return (any(k.startswith("archway.dev/") for k in marks)
                or "archway" in response.headers.get("Warning", ""))

    def wait_until_webhook_acts(self, timeout: float = 30.0) -> None:
        if not self.kube.exists(f"/api/v1/namespaces/{PROBE_NAMESPACE}"):
            self.plane.new_namespace(PROBE_NAMESPACE)
        end = time.monotonic() + timeout
        while not self.webhook_acts():
            if time.monotonic() > end:
                raise ControlPlaneError(f"the apiserver did not call archway within {timeout:g} s "
                                        f"(MutatingWebhookConfiguration of release {self.release})")
            time.sleep(0.2)

    # --- state ---------------------------------------------------------------------------
    def save(self) -> None:
        state = {"release": self.release, "namespace": self.namespace,
                 "webhook_port": self.webhook_port, "extender_port": self.extender_port}
        with open(self.plane.path("archway.json"), "w") as f:
            json.dump(state, f)
        self.plane.processes.update({a.name: a.process for a in
                                     [self.webhook, self.extender, *self.replicas] if a})
        self.plane.save()
