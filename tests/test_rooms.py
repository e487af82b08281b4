"""The shape of the code, checked (issue 23, issue 34): every module short enough to hold in
one's head, every function simple enough to follow, no import circles, each room importing only
the rooms below it, and registry/'s and lab/'s floors as their __init__.py documents them. The
limits hold for every Python folder but tests/: the eight production packages, the lab, the
bench and the scripts; none of those imports tests/, and none imports another module's private
(underscored) names."""
import ast
import os
import re
import tomllib

import pytest
from radon.visitors import Class, ComplexityVisitor

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# folder -> import package (pyproject's package-dir)
PACKAGES = {"archway": "archway", "archway/server": "archway.server",
            "registry": "archway.registry", "webhook": "archway.webhook",
            "gate": "archway.gate", "tools": "archway.tools", "extender": "archway.extender",
            "certs": "archway.certs"}
# The Python folders outside the wheel, held to the same limits; folder -> import package.
OUTSIDE = {"lab": "lab", "bench": "bench", "scripts": "scripts"}
FOLDERS = {**PACKAGES, **OUTSIDE}
MAX_MODULE_LINES = 450
MAX_COMPLEXITY = 20   # radon's cyclomatic complexity (branches and boolean operators)

# Which rooms each room may import ("core": archway/'s ground floor). The products, webhook/ and
# extender/, never meet but in the core; the gate stands on the webhook's decision, the tools on
# both; the server (the gunicorn adapter) serves TLS and knows no product; nothing but the top
# imports the gate, the tools or the server.
MAY_IMPORT = {
    "core": set(),
    "registry": {"core"},
    "certs": {"core"},
    "server": {"core", "certs"},
    "webhook": {"core", "registry"},
    "extender": {"core", "registry"},
    "gate": {"core", "registry", "webhook", "certs"},
    "tools": {"core", "registry", "webhook"},
}
# The core's top floor: it puts the rooms together, so no room may import it.
TOP = {"archway.cli", "archway.serve", "archway.app", "archway.addresses", "archway.completion"}


def modules(folder: str) -> list[str]:
    """The folder's Python files, in its subfolders too (repository-relative paths), but for a
    subfolder that is a folder of its own in FOLDERS (archway/server)."""
    found = []
    for root, dirs, files in os.walk(os.path.join(REPO, folder)):
        here = os.path.relpath(root, REPO)
        dirs[:] = [d for d in dirs if d != "__pycache__" and os.path.join(here, d) not in FOLDERS]
        found += [os.path.relpath(os.path.join(root, name), REPO) for name in files
                  if name.endswith(".py")]
    return sorted(found)


def module_names(folders: dict[str, str]) -> dict[str, str]:
    """Dotted module name -> path, for `folders` (folder -> import package)."""
    names = {}
    for folder, package in folders.items():
        for path in modules(folder):
            parts = os.path.relpath(path, folder)[:-3].split(os.sep)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            names[".".join([package, *parts])] = path
    return names


def source(path: str) -> str:
    with open(os.path.join(REPO, path), encoding="utf-8") as f:
        return f.read()


def functions(blocks, prefix=""):
    """(dotted name, complexity) of every function, method and closure radon found."""
    for block in blocks:
        if isinstance(block, Class):
            yield from functions(block.methods, f"{prefix}{block.name}.")
            yield from functions(block.inner_classes, f"{prefix}{block.name}.")
        else:
            yield f"{prefix}{block.name}", block.complexity
            yield from functions(block.closures, f"{prefix}{block.name}.")


def folder_of(package: str, package_dir: dict[str, str]) -> str:
    """Where setuptools finds `package`: its own package-dir entry, else its parent's folder."""
    if package in package_dir:
        return package_dir[package]
    parent, _, name = package.rpartition(".")
    return f"{folder_of(parent, package_dir)}/{name}"


def test_the_limits_cover_every_production_package():
    with open(os.path.join(REPO, "pyproject.toml"), "rb") as f:
        setuptools = tomllib.load(f)["tool"]["setuptools"]
    folders = {folder_of(package, setuptools["package-dir"]) for package in setuptools["packages"]}
    assert folders == set(PACKAGES)
    assert all(PACKAGES[folder_of(package, setuptools["package-dir"])] == package
               for package in setuptools["packages"])


def test_the_limits_cover_every_python_folder_but_tests():
    skipped = {"tests", "build", "node_modules"}
    found = {top for top in os.listdir(REPO)
             if os.path.isdir(os.path.join(REPO, top)) and not top.startswith(".")
             and top not in skipped and not top.endswith(".egg-info") and modules(top)}
    assert found == {folder.split("/")[0] for folder in FOLDERS}


@pytest.mark.parametrize("folder", FOLDERS)
def test_no_module_is_over_450_lines(folder):
    long = {path: len(source(path).splitlines()) for path in modules(folder)}
    long = {path: lines for path, lines in long.items() if lines > MAX_MODULE_LINES}
    assert long == {}, "split these by job"


@pytest.mark.parametrize("folder", FOLDERS)
def test_no_function_is_over_complexity_20(folder):
    found = {f"{path}:{name}": complexity for path in modules(folder)
             for visitor in [ComplexityVisitor.from_code(source(path))]
             for name, complexity in functions(visitor.functions + visitor.classes)}
    over = {name: complexity for name, complexity in found.items() if complexity > MAX_COMPLEXITY}
    assert over == {}, "make these simpler"


def imports_of(name: str, path: str) -> list[tuple[str, list[str]]]:
    """(module, the names taken from it) of every import in the file, at the top or inside a
    function; relative imports resolved against module `name`."""
    package = name if path.endswith("__init__.py") else name.rsplit(".", 1)[0]
    found = []
    for node in ast.walk(ast.parse(source(path))):
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([node.module] if node.module else []))
            found.append((base, [a.name for a in node.names]))
        elif isinstance(node, ast.Import):
            found += [(a.name, []) for a in node.names]
    return found


def import_graph(folders: dict[str, str] = PACKAGES) -> dict[str, set[str]]:
    """module -> the modules of `folders` it imports, at the top or inside a function."""
    names = module_names(folders)
    graph = {}
    for name, path in names.items():
        found = set()
        for base, taken in imports_of(name, path):
            found |= {f"{base}.{t}" if f"{base}.{t}" in names else base for t in taken} or {base}
        graph[name] = {m for m in found if m in names and m != name}
    return graph


def test_no_module_imports_itself_in_a_circle():
    graph = import_graph(FOLDERS)
    assert {"archway.app", "archway.registry.resolver", "archway.webhook.service",
            "lab.cluster.controlplane", "lab.servers.registry", "bench.common.report"} <= set(graph)
    circles, state = [], {}

    def visit(module, path):
        state[module] = "open"
        for imported in sorted(graph[module]):
            if state.get(imported) == "open":
                circles.append(path[path.index(imported):] + [imported])
            elif imported not in state:
                visit(imported, path + [imported])
        state[module] = "done"

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])
    assert circles == []


def room(name: str) -> str:
    """archway.webhook.service -> webhook; a core module -> core (the top is its own)."""
    return name.split(".")[1] if name.count(".") >= 2 else "core"


def test_rooms_import_only_the_rooms_below_them_and_never_the_top():
    graph = import_graph()
    up = sorted((module, imported) for module, imports in graph.items()
                if module not in TOP for imported in imports & TOP)
    assert up == []
    wrong = sorted(f"{module} imports {imported}" for module, imports in graph.items()
                   if module not in TOP for imported in imports
                   if room(imported) != room(module) and room(imported) not in MAY_IMPORT[room(module)])
    assert wrong == []


def documented_floors() -> dict[str, int]:
    """registry/__init__.py's table: `  <floor>  <module>  <its job>`."""
    doc = ast.get_docstring(ast.parse(source("registry/__init__.py"))) or ""
    return {module: int(floor) for floor, module in re.findall(r"^ +(\d+) +(\w+) ", doc, re.M)}


def test_registry_modules_import_only_from_floors_below_their_own():
    floors = documented_floors()
    registry = {name.rsplit(".", 1)[1] for name in import_graph()
                if name.startswith("archway.registry.")}
    assert set(floors) == registry, "every registry module has one floor in registry/__init__.py"
    wrong = [f"{module} (floor {floors[module]}) imports {imported} (floor {floors[imported]})"
             for name, imports in import_graph().items() if name.startswith("archway.registry.")
             for module in [name.rsplit(".", 1)[1]]
             for imported in (i.rsplit(".", 1)[1] for i in imports if i.startswith("archway.registry."))
             if floors[imported] >= floors[module]]
    assert wrong == []


def test_nothing_but_tests_imports_tests_and_the_wheel_imports_nothing_outside_it():
    wrong = sorted(f"{name} imports {base}" for name, path in module_names(FOLDERS).items()
                   for base, _ in imports_of(name, path)
                   if base.split(".")[0] == "tests"
                   or (name.startswith("archway") and base.split(".")[0] in OUTSIDE)
                   or (name.startswith("lab") and base.split(".")[0] == "pytest"))
    assert wrong == []


def test_no_private_name_is_imported_from_another_module():
    names = module_names({**FOLDERS, "tests": "tests"})
    wrong = sorted(f"{name} imports {base}.{taken}" for name, path in module_names(FOLDERS).items()
                   for base, taken_names in imports_of(name, path) if base in names
                   for taken in taken_names if taken.startswith("_") and not taken.startswith("__"))
    assert wrong == []


def lab_floors() -> dict[str, int]:
    """lab/__init__.py's table: `  <floor>  <room>  <what it holds>`."""
    doc = ast.get_docstring(ast.parse(source("lab/__init__.py"))) or ""
    return {room: int(floor) for floor, room in re.findall(r"^ +(\d+) +(\w+) ", doc, re.M)}


def lab_room(name: str) -> str:
    """lab.cluster.kwok -> cluster; lab.procs -> ground; lab.__main__ -> __main__."""
    parts = name.split(".")
    if len(parts) > 2 or parts[-1] in ("cluster", "servers"):
        return parts[1]
    return "__main__" if parts[-1] == "__main__" else "ground"


def test_lab_rooms_import_only_their_own_and_the_floors_below():
    floors, graph = lab_floors(), import_graph({"lab": "lab"})
    doc = ast.get_docstring(ast.parse(source("lab/__init__.py"))) or ""
    assert set(floors) == {lab_room(name) for name in graph}, "every lab room has a floor"
    unnamed = sorted(name for name in graph if name.rsplit(".", 1)[-1] not in doc)
    assert unnamed == [], "lab/__init__.py names every lab module"
    wrong = sorted(f"{name} ({lab_room(name)}) imports {imported} ({lab_room(imported)})"
                   for name, imports in graph.items() for imported in imports
                   if lab_room(imported) != lab_room(name)
                   and floors[lab_room(imported)] >= floors[lab_room(name)])
    assert wrong == []
    # The command line is the lab's top: only its tests import it.
    everything = import_graph(FOLDERS)
    assert [name for name, imports in everything.items() if "lab.__main__" in imports] == []
