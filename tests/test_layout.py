"""The package layout users rely on: one import namespace, and a CLI that starts light."""
import os
import subprocess
import sys
import zipfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_the_wheel_installs_only_the_archway_namespace(tmp_path):
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps",
                    "-q", "-w", str(tmp_path), REPO], check=True, capture_output=True)
    (wheel,) = tmp_path.glob("archway-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    top = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert top == {"archway"}
    for product in ("webhook", "extender", "registry", "certs"):
        assert f"archway/{product}/__init__.py" in names
    assert not any("/tests/" in n or n.startswith("tests/") for n in names)


def test_the_cli_imports_no_metrics_storage_before_serve_chooses_it():
    # prometheus_client fixes its value storage (in memory or multiprocess files) when first
    # imported: `archway serve` sets PROMETHEUS_MULTIPROC_DIR first, so the CLI must not import it.
    code = ("import sys, archway.cli; archway.cli.build_parser(); "
            "print(sorted(m for m in ('prometheus_client', 'flask', 'kubernetes') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True)
    assert out.stdout.strip() == "[]"
