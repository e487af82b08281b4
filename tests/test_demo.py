"""The README's demo keeps working: it really patches pods through a real server and registry."""
import os
import subprocess
import sys

from lab.procs import REPO


def test_demo_shows_patches_and_a_denial_and_leaves_nothing(tmp_path):
    result = subprocess.run([sys.executable, "scripts/demo.py"], cwd=REPO, capture_output=True,
                            text=True, timeout=120, env={**os.environ, "TMPDIR": str(tmp_path)})
    assert result.returncode == 0, result.stderr
    assert os.listdir(tmp_path) == []        # its registry, archway's state and CA went with it
    out = result.stdout
    assert out.count("allowed: True") == 3 and out.count("allowed: False") == 1
    assert "kubernetes.io/arch: arm64" in out                      # the single-arch nodeSelector
    assert '"path": "/spec/affinity/nodeAffinity/requiredDuringSchedulingIgnoredDuringExecution' \
           '/nodeSelectorTerms/1/matchExpressions/1"' in out       # both ORed terms gained it
    assert "share no CPU architecture" in out


def test_demo_installs_only_what_the_demo_uses():
    """Issue 47: demo.sh ran `setup.sh --test` (Prometheus, containerd, buildah, qemu, helm,
    Kubernetes built from source) for a demo that starts one docker-registry."""
    import re
    with open(os.path.join(REPO, "scripts", "demo.sh")) as f:
        demo = f.read()
    assert re.findall(r"^bash scripts/setup\.sh(.*?)(?: *>|$)", demo, re.M) == [" --demo"]
    with open(os.path.join(REPO, "scripts", "setup.sh")) as f:
        setup = f.read()
    branch = setup.split("elif $for_demo; then", 1)[1].split("\nfi", 1)[0]
    installed = [w for line in re.findall(r"apt_install ([^#\n]+)", branch) for w in line.split()]
    assert installed == ["docker-registry"]
    with open(os.path.join(REPO, "scripts", "demo.py")) as f:
        imports = re.findall(r"^from (\S+) import", f.read(), re.M)
    assert not [m for m in imports if m.startswith("tests")]      # no test-only packages
