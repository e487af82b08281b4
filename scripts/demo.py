"""See archway patch a pod, on one machine, with no cluster.

Starts a real registry (Debian's docker-registry) on 127.0.0.1, pushes a two-architecture image
and an arm64-only one, starts `archway serve` configured for that registry, posts the
AdmissionReview fixtures exactly as kube-apiserver would, and prints what archway answers and
what the pod looks like after the patch; then stops both and removes its temporary folder. Run
it with `bash scripts/demo.sh`.
"""
import base64
import json
import os
import shutil
import subprocess
import sys
import tempfile

import jsonpatch
import requests
import yaml

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from lab.procs import free_port, wait_for_port  # noqa: E402
from lab.servers.registry import RegistryServer  # noqa: E402

FIXTURES = os.path.join(REPO, "tests", "fixtures", "admission")


def post(url: str, ca: str, review_text: str) -> dict:
    answer = requests.post(url, data=review_text, verify=ca, timeout=15,
                           headers={"Content-Type": "application/json"})
    answer.raise_for_status()
    return answer.json()


def show(title: str, review: dict, reply: dict) -> None:
    response = reply["response"]
    print(f"\n=== {title}")
    print(f"allowed: {response['allowed']}")
    for warning in response.get("warnings", []):
        print(f"warning: {warning}")
    if "status" in response:
        print(f"message: {response['status'].get('message')}")
    if "patch" in response:
        patch = json.loads(base64.b64decode(response["patch"]))
        print("patch:\n" + json.dumps(patch, indent=2))
        pod = jsonpatch.apply_patch(review["request"]["object"], patch)
        placed = {k: pod["spec"][k] for k in ("nodeSelector", "affinity", "schedulerName")
                  if k in pod["spec"]}
        print("pod spec after the patch (placement fields):\n" + yaml.safe_dump(placed).rstrip())


def main() -> int:
    work = tempfile.mkdtemp(prefix="archway-demo-")
    registry = RegistryServer(os.path.join(work, "registry"))
    server = None
    try:
        registry.push_index("archway/multi", "1.0", ["linux/amd64", "linux/arm64", "linux/arm/v7"])
        registry.push_image("archway/arm64only", "1.0", "linux/arm64")
        registry.push_image("archway/amd64only", "1.0", "linux/amd64")
        config = os.path.join(work, "archway.yaml")
        with open(config, "w") as f:
            yaml.safe_dump({"registry": {"insecure_hosts": [registry.host]},
                            "server": {"state_dir": os.path.join(work, "state"), "workers": 1}}, f)
        port = free_port()
        server = subprocess.Popen([sys.executable, "-m", "archway.main.cli", "--config", config, "serve",
                                   "--bind", f"127.0.0.1:{port}"], cwd=REPO,
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_for_port(port, timeout=30, proc=server)
        url, ca = f"https://127.0.0.1:{port}/mutate", os.path.join(work, "state", "tls", "ca.crt")
        print(f"registry on {registry.host}; archway serve on {url}")
        for name, title in (("v1-pod-multiarch", "a Deployment's pod, image built for amd64, arm64 and arm/v7"),
                            ("v1-pod-single-arch", "a pod whose only image is arm64"),
                            ("v1-pod-affinity-two-terms", "a pod with two ORed affinity terms"),
                            ("v1-pod-conflicting-images", "an amd64-only and an arm64-only image")):
            with open(os.path.join(FIXTURES, f"{name}.json")) as f:
                text = f.read().replace("REGISTRY", registry.host)
            show(title, json.loads(text), post(url, ca, text))
        return 0
    finally:
        if server is not None:
            server.terminate()
            server.wait(10)
        registry.stop()
        shutil.rmtree(work, ignore_errors=True)   # the registry's blobs, archway's state and CA


if __name__ == "__main__":
    sys.exit(main())
