"""archway's own image, as users get it: scripts/build-image.sh builds the repository's Dockerfile
for linux/amd64 and linux/arm64 and pushes ONE index to a real docker-registry; `archway inspect`
reads that index back (archway eats its own food); each platform is pulled and run the way the
chart's webhook Deployment runs it: uid/gid from the pod securityContext, read-only root, the
chart's volumes (config, TLS Secret, the scratch emptyDir for /tmp and the state directory). The
arm64 image runs under qemu-user. The first build on a machine makes the Debian bases (minutes;
cached in ~/.cache/archway/image afterwards).
"""
import json
import os
import re
import subprocess
import sys
import tomllib

import pytest
import requests
import yaml

from archway import __version__
from lab.procs import REPO, Server, free_port, require_binary
from tests.infra.fixtures import plain_registry, test_ca
from tests.infra.image import Mount, PulledImage, elf_machine, pod_argv, pod_command

PLATFORMS = ("linux/amd64", "linux/arm64")
# The first build makes the Debian bases, arm64's under emulation: minutes, not seconds.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(3600)]
CHART = os.path.join(REPO, "charts", "archway")
# Native code from the base and from the cross-installed wheels: built for the image's arch.
NATIVE_PROBES = ("/usr/bin/python3", "/opt/archway/lib/yaml/_yaml.cpython-311-{m}-linux-gnu.so",
                 "/opt/archway/lib/cryptography/hazmat/bindings/_rust.abi3.so")
# Compressed layers per platform; 77 MB when this was written (docs/image.md says so).
MAX_PUSHED_BYTES = 120_000_000


def release_version() -> str:
    with open(os.path.join(REPO, "pyproject.toml"), "rb") as f:
        return tomllib.load(f)["project"]["version"]


@pytest.fixture(scope="module")
def pushed(plain_registry):
    """The chart README's quickstart, step 1, against the real registry: `scripts/release.sh
    image REPO` builds with build-image.sh, pushes REPO:v<version> and reads it back."""
    repository = f"{plain_registry.host}/archway/archway"
    result = subprocess.run(
        ["bash", "scripts/release.sh", "image", repository, "--platforms", ",".join(PLATFORMS),
         "--insecure-registry"], cwd=REPO, capture_output=True, text=True, timeout=3600,
        check=False)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    ref = f"{repository}:v{release_version()}"
    assert f"pushed {ref}@sha256:" in result.stderr
    assert f"release.sh: {ref} has amd64 and arm64" in result.stderr
    return ref


@pytest.fixture(scope="module", params=PLATFORMS)
def image(request, pushed, tmp_path_factory):
    pulled = PulledImage(pushed, request.param, str(tmp_path_factory.mktemp("image")))
    yield pulled
    pulled.close()


@pytest.fixture(scope="module")
def webhook_pod(tmp_path_factory):
    """The chart's webhook Deployment and its archway config, rendered with default values but
    `unresolved: admit`: the chart's `gate` needs a Kubernetes API (archway refuses to start
    without one, tested elsewhere), and none runs here."""
    home = tmp_path_factory.mktemp("helm")
    env = {**os.environ, **{f"HELM_{k}_HOME": str(home / k.lower()) for k in ("CACHE", "CONFIG", "DATA")}}
    out = subprocess.run([require_binary("helm"), "template", "arch", CHART, "-n", "archway-system",
                          "--set", "config.admission.unresolved=admit"],
                         capture_output=True, text=True, env=env, timeout=120, check=True).stdout
    docs = [d for d in yaml.safe_load_all(out) if d]
    deployment = next(d for d in docs if d["kind"] == "Deployment"
                      and d["metadata"]["labels"]["app.kubernetes.io/component"] == "webhook")
    configmap = next(d for d in docs if d["kind"] == "ConfigMap" and "webhook.yaml" in d["data"])
    return deployment["spec"]["template"]["spec"], yaml.safe_load(configmap["data"]["webhook.yaml"])


def run_in_pod(image, argv, mounts, *, user="65532:65532", timeout=300):
    return subprocess.run(pod_command(image, argv, mounts, user=user), env=image.env(),
                          capture_output=True, text=True, timeout=timeout, check=False)


def test_one_index_with_both_architectures_as_archway_sees_it(pushed, plain_registry, tmp_path):
    config = tmp_path / "archway.yaml"
    config.write_text(yaml.safe_dump({"registry": {"insecure_hosts": [plain_registry.host]}}))
    result = subprocess.run([sys.executable, "-m", "archway.main.cli", "inspect", "--json",
                             "--config", str(config), pushed],
                            cwd=REPO, capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode == 0, result.stderr
    (row,) = json.loads(result.stdout)
    assert row["error"] is None
    assert row["source"] == "oci-index"
    assert row["platforms"] == list(PLATFORMS)
    assert row["architectures"] == ["amd64", "arm64"]


def test_each_platform_is_built_for_its_architecture(image):
    machine = {"amd64": "x86_64", "arm64": "aarch64"}[image.architecture]
    for probe in NATIVE_PROBES:
        assert elf_machine(image.path(probe.format(m=machine))) == image.architecture, probe


def test_the_image_is_small_no_compiler_no_pip_cache_no_tests(image, pushed, plain_registry):
    for absent in ("/usr/bin/gcc", "/usr/bin/cc", "/root/.cache", "/var/lib/archway/.cache", "/src",
                   "/wheels", "/opt/archway/lib/pip", "/usr/lib/python3/dist-packages/pip",
                   "/opt/archway/lib/tests", "/opt/archway/lib/archway/tests"):
        assert not os.path.lexists(image.path(absent)), absent
    index = plain_registry.get_manifest("archway/archway", pushed.rpartition(":")[2]).json()
    (entry,) = [m for m in index["manifests"] if m["platform"]["architecture"] == image.architecture]
    manifest = plain_registry.get_manifest("archway/archway", entry["digest"]).json()
    pushed_bytes = sum(layer["size"] for layer in manifest["layers"])
    unpacked = sum(os.lstat(os.path.join(d, f)).st_size
                   for d, _, files in os.walk(image.rootfs) for f in files)
    print(f"{image.architecture}: {pushed_bytes / 1e6:.1f} MB pushed (compressed layers), "
          f"{unpacked / 1e6:.1f} MB unpacked")
    assert pushed_bytes < MAX_PUSHED_BYTES


def test_version_runs_as_the_image_user_under_a_read_only_root(image, tmp_path):
    assert image.config["User"] == "65532:65532"
    result = run_in_pod(image, pod_argv(image, ["--version"]), [], user=image.config["User"])
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == f"archway {__version__}"
    # The root really is read-only, even for root: what the pod's writes rely on is its volumes.
    probe = run_in_pod(image, ["/bin/sh", "-c", "touch /opt/probe"], [], user="0:0")
    assert probe.returncode != 0 and "Read-only file system" in probe.stderr


def chart_mounts(pod_spec, directory, config_text, tls) -> list[Mount]:
    """The webhook container's volumeMounts, each backed by a directory like the kubelet's."""
    volumes = {v["name"]: v for v in pod_spec["volumes"]}
    (webhook,) = [c for c in pod_spec["containers"] if c["name"] == "webhook"]
    mounts = []
    for vm in webhook["volumeMounts"]:
        volume = volumes[vm["name"]]
        source = os.path.join(directory, vm["name"], vm.get("subPath", ""))
        os.makedirs(source, exist_ok=True)
        if "emptyDir" in volume:   # fsGroup 65532 makes it the pod's
            os.chown(source, 65532, 65532)
        elif "configMap" in volume:
            for item in volume["configMap"]["items"]:
                with open(os.path.join(source, item["path"]), "w") as f:
                    f.write(config_text)
        elif "secret" in volume:
            for item in volume["secret"]["items"]:
                path = os.path.join(source, item["path"])
                with open(tls.cert_path if item["key"] == "tls.crt" else tls.key_path, "rb") as f:
                    data = f.read()
                with open(path, "wb") as f:
                    f.write(data)
                os.chown(path, 0, 65532)
                os.chmod(path, volume["secret"]["defaultMode"])
        else:
            pytest.fail(f"volume kind of {volume} not reproduced by this test")
        mounts.append(Mount(source, vm["mountPath"], read_only=vm.get("readOnly", False)))
    return mounts


def test_serve_answers_healthz_over_tls_as_the_chart_runs_it(image, webhook_pod, test_ca, tmp_path):
    pod_spec, config = webhook_pod
    security = pod_spec["securityContext"]
    (webhook,) = [c for c in pod_spec["containers"] if c["name"] == "webhook"]
    assert webhook["securityContext"]["readOnlyRootFilesystem"] is True
    user = f"{security['runAsUser']}:{security['runAsGroup']}"
    assert user == image.config["User"], "the chart and the Dockerfile disagree on uid/gid"
    port = free_port()
    config["server"]["bind"] = f"127.0.0.1:{port}"   # the pod's own network namespace: host's here
    tls = test_ca.issue("archway-webhook", ("127.0.0.1",))
    mounts = chart_mounts(pod_spec, str(tmp_path), yaml.safe_dump(config), tls)
    env = image.env({e["name"]: e["value"] for e in webhook.get("env", [])})
    argv = pod_argv(image, webhook["args"])
    with Server(pod_command(image, argv, mounts, user=user), port=port, env=env,
                log_path=str(tmp_path / "serve.log"), ready_timeout=240) as server:
        r = requests.get(f"https://127.0.0.1:{port}/healthz", verify=test_ca.cert_path, timeout=60)
        assert r.status_code == 200, server.log()
    assert "archway: serving the webhook" in server.log()


def test_the_default_command_serves_with_a_self_signed_pair_in_the_state_dir(image, tmp_path):
    """No config at all (the image's CMD): the pair is generated under HOME, the chart's emptyDir."""
    cmd = image.config["Cmd"]
    assert cmd[:2] == ["serve", "--bind"]
    port = free_port()
    state, tmp = tmp_path / "state", tmp_path / "tmp"
    for d in (state, tmp):
        d.mkdir()
        os.chown(d, 65532, 65532)
    # Where the chart mounts its scratch emptyDir; the image must keep its state there (HOME).
    mounts = [Mount(str(tmp), "/tmp"), Mount(str(state), "/var/lib/archway")]
    argv = pod_argv(image, ["serve", "--bind", f"127.0.0.1:{port}", *cmd[3:]])
    with Server(pod_command(image, argv, mounts, user=image.config["User"]), port=port,
                env=image.env(), log_path=str(tmp_path / "serve.log"), ready_timeout=240) as server:
        ca = state / ".local" / "state" / "archway" / "tls" / "ca.crt"
        r = requests.get(f"https://127.0.0.1:{port}/healthz", verify=str(ca), timeout=60)
        assert r.status_code == 200, server.log()


# --- the chart README's quickstart on a real control plane ------------------------------------------

def quickstart_lines() -> list[str]:
    """The quickstart's commands, one per line (continuations joined), comments dropped."""
    with open(os.path.join(CHART, "README.md")) as f:
        section = f.read().split("## Quickstart", 1)[1].split("\n## ", 1)[0]
    block = section.split("```sh\n", 1)[1].split("```", 1)[0].replace("\\\n", " ")
    return [line.strip() for line in block.splitlines() if line.strip() and not line.startswith("#")]


def test_the_quickstart_installs_the_pushed_image_on_a_real_control_plane(pushed, tmp_path):
    """Steps 2 and 4 of the chart README, as written, against a real control plane (no kubelet:
    `--wait` would wait for pods that never run, so it goes, and the hooks' Jobs, which nothing
    would run, are run as lab/cluster/chart.py runs them: each Job's command, here, as its
    ServiceAccount). Step 1 is the `pushed` fixture; step 3 needs running pods."""
    from lab.cluster.chart import ChartInstall
    from lab.cluster.controlplane import ControlPlane
    lines = quickstart_lines()
    install = next(line for line in lines if line.startswith("helm install "))
    uninstall = next(line for line in lines if line.startswith("helm uninstall "))
    delete_namespace = next(line for line in lines if line.startswith("kubectl delete namespace"))

    def run(command: str, plane: ControlPlane) -> subprocess.CompletedProcess:
        command = re.sub(r" --wait(?=\s|$)| --timeout \S+", "", command)   # no kubelet
        env = dict(os.environ, REPO=pushed.rsplit(":", 1)[0], KUBECONFIG=plane.admin_kubeconfig,
                   PATH=f"{os.path.dirname(plane.binary('kubectl'))}:{os.environ['PATH']}",
                   **{f"HELM_{k}_HOME": str(tmp_path / "helm" / k) for k in ("CACHE", "CONFIG", "DATA")})
        return subprocess.run(["bash", "-c", command], cwd=REPO, env=env, capture_output=True,
                              text=True, timeout=300)

    with ControlPlane(str(tmp_path / "plane")) as plane:
        kube = plane.kube
        done = run(install.replace("helm install ", "helm install --no-hooks ", 1), plane)
        assert done.returncode == 0, done.stderr
        chart = ChartInstall(plane, release="archway", namespace="archway")
        for event in ("pre-install", "post-install"):
            chart.run_hooks(event)
        # Every archway pod runs exactly the image step 1 pushed, on a node of its architectures.
        pods = kube.wait_for(lambda: (found := kube.items("/api/v1/namespaces/archway/pods"))
                             and all(p["spec"].get("nodeName") for p in found) and found,
                             timeout=60, what="the webhook's pods bound")
        assert {c["image"] for p in pods for c in p["spec"]["containers"]} == {pushed}
        nodes = {n["metadata"]["name"]: n["metadata"]["labels"]["kubernetes.io/arch"]
                 for n in kube.items("/api/v1/nodes")}
        assert {nodes[p["spec"]["nodeName"]] for p in pods} <= {"amd64", "arm64"}
        # The webhook is registered with the CA of the Secret the certgen hook made.
        (config,) = kube.items("/apis/admissionregistration.k8s.io/v1/mutatingwebhookconfigurations")
        (tls,) = [s for s in kube.items("/api/v1/namespaces/archway/secrets")
                  if s["type"] == "kubernetes.io/tls"]
        assert config["webhooks"][0]["clientConfig"]["caBundle"] == tls["data"]["ca.crt"]
        assert config["webhooks"][0]["clientConfig"]["service"]["namespace"] == "archway"

        chart.run_hooks("pre-delete")
        done = run(uninstall.replace("helm uninstall ", "helm uninstall --no-hooks ", 1), plane)
        assert done.returncode == 0, done.stderr
        assert not kube.items("/apis/admissionregistration.k8s.io/v1/mutatingwebhookconfigurations")
        # The Secrets belonged to the webhook configuration: the garbage collector takes them.
        kube.wait_for(lambda: not [s for s in kube.items("/api/v1/namespaces/archway/secrets")
                                   if s["type"] == "kubernetes.io/tls"], timeout=60,
                      what="the TLS Secret collected")
        done = run(delete_namespace + " --wait=false", plane)
        assert done.returncode == 0, done.stderr
        assert kube.get("/api/v1/namespaces/archway")["status"]["phase"] == "Terminating"
