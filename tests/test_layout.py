"""The package layout users rely on: one import namespace, and a CLI that starts light."""
import os
import re
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
    code = ("import sys, archway.main.cli; archway.main.cli.build_parser(); "
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


# --- what comments and documents name is in the tree ---------------------------------------------

ROOMS = ("archway", "registry", "certs", "placement", "objects", "cluster", "webhook", "extender",
         "gate", "tools", "main")
TOP = ROOMS + ("tests", "bench", "charts", "docs", "scripts")
# A path under one of this repository's folders, naming a file by its kind (an image name such as
# archway/multi has no extension). bench/results/ is written by the benchmarks, never kept.
NAMED_PATH = re.compile(r"(?<![\w/.:-])((?:" + "|".join(TOP)
                        + r")/[\w./-]*\.(?:py|md|yaml|yml|json|sh|tpl|lua|toml))\b")
BARE_MODULE = re.compile(r"(?<![\w/.-])([a-z_]\w*\.py)\b")
TEXT_KINDS = (".py", ".md", ".yaml", ".yml", ".json", ".sh", ".tpl", ".toml", ".lua", ".txt")


def repository_files() -> list[str]:
    found = []
    for root, dirs, files in os.walk(REPO):
        dirs[:] = [d for d in dirs if not d.startswith(".") and d not in ("__pycache__", "build")]
        found += [os.path.relpath(os.path.join(root, f), REPO) for f in files]
    return found


def stale_names(files: list[str]) -> list[str]:
    """Where a comment, docstring or document names a path that is not in the tree: every
    `room/…/file.ext`, and in a production module every bare `module.py`, which must be in its
    own folder, the core's, or another room's."""
    present = set(files)
    in_rooms = {os.path.basename(f) for f in files if f.split(os.sep)[0] in ROOMS}
    stale = []
    for path in files:
        if not path.endswith(TEXT_KINDS) or path.startswith(os.path.join("bench", "results")):
            continue
        with open(os.path.join(REPO, path), encoding="utf-8", errors="replace") as f:
            lines = f.read().splitlines()
        production = path.split(os.sep)[0] in ROOMS and path.endswith(".py")
        for number, line in enumerate(lines, 1):
            for match in NAMED_PATH.finditer(line):
                named = match.group(1)
                if named not in present and not named.startswith("bench/results/"):
                    stale.append(f"{path}:{number}: {named}")
            if production:
                for match in BARE_MODULE.finditer(line):
                    if match.group(1) not in in_rooms:
                        stale.append(f"{path}:{number}: {match.group(1)}")
    return stale


def test_every_path_a_comment_or_document_names_is_in_the_tree():
    """Issue 30: five comments named modules that had moved (the gate controller's gate.py,
    config.py, extender.py, metrics.py and traffic.py under webhook's folder)."""
    assert stale_names(repository_files()) == []


def test_stale_names_sees_a_moved_module():
    files = repository_files()
    present = [f for f in files if f != os.path.join("gate", "release.py")]
    assert any(s.startswith("gate/controller.py:") and s.endswith("release.py")
               for s in stale_names(present))


def test_the_layout_lists_every_room():
    """CONTRIBUTING.md's "Layout" (the README's until issue 47)."""
    with open(os.path.join(REPO, "CONTRIBUTING.md"), encoding="utf-8") as f:
        layout = f.read().split("## Layout", 1)[1].split("\n## ", 1)[0]
    listed = set(re.findall(r"^\| `([\w/]+)/` \|", layout, re.M))
    assert set(ROOMS) <= listed, set(ROOMS) - listed


def test_the_in_cluster_image_is_rebuilt_when_any_folder_of_the_wheel_changes():
    """The real-node tier's image is cached by a digest of what the Dockerfile copies: every
    folder the wheel installs must be in it, or a change there would be tested on a stale image."""
    import tomllib

    from lab.cluster.incluster import image_inputs
    with open(os.path.join(REPO, "pyproject.toml"), "rb") as f:
        folders = tomllib.load(f)["tool"]["setuptools"]["package-dir"].values()
    assert {folder.split("/")[0] for folder in folders} <= set(image_inputs())
