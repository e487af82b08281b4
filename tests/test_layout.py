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


def production_modules():
    """Every module of the installed `archway` namespace (archway/, webhook/, registry/...)."""
    import importlib
    import pkgutil

    for package in ("archway", "archway.webhook", "archway.extender", "archway.registry",
                    "archway.certs"):
        path = importlib.import_module(package).__path__
        for info in pkgutil.iter_modules(path, package + "."):
            if not info.ispkg:
                yield importlib.import_module(info.name)


def test_every_public_exception_is_an_archway_error():
    """The CLI's one handler (`archway: <cause>`, exit 2) and every `except ArchwayError` catch
    each error archway raises on purpose (issue 23: ApiError, CertificateError, LookupTimeout and
    MalformedExtenderArgs did not derive from it)."""
    from archway.errors import ArchwayError
    checked, outside = [], []
    for module in production_modules():
        for name, value in vars(module).items():
            if isinstance(value, type) and issubclass(value, BaseException) \
                    and value.__module__ == module.__name__ and not name.startswith("_"):
                checked.append(f"{module.__name__}.{name}")
                if not issubclass(value, ArchwayError):
                    outside.append(f"{module.__name__}.{name}")
    assert outside == []
    for expected in ("archway.kubeapi.ApiError", "archway.certs.x509.CertificateError",
                     "archway.registry.dns.LookupTimeout", "archway.extender.wire.MalformedExtenderArgs"):
        assert expected in checked
