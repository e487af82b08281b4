"""The shape of the code, checked (issues 23, 34 and 45): every function simple enough to follow,
no import circles, each room importing only the rooms below it (no product another product, the
ground no product), the shared rooms entered through their faces, and registry/'s and lab/'s
floors as their __init__.py documents them. A module is as long as its job: no line cap. The
limits hold for every Python folder but tests/: the production packages, the lab, the bench and
the scripts; none of those imports tests/, and none imports another module's private
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
            "registry": "archway.registry", "certs": "archway.certs",
            "placement": "archway.placement", "objects": "archway.objects",
            "cluster": "archway.cluster", "webhook": "archway.webhook",
            "extender": "archway.extender", "gate": "archway.gate", "tools": "archway.tools",
            "main": "archway.main"}
# The Python folders outside the wheel, held to the same limits; folder -> import package
# (docs/: the scripts that draw its pictures).
OUTSIDE = {"lab": "lab", "bench": "bench", "scripts": "scripts", "docs": "docs"}
FOLDERS = {**PACKAGES, **OUTSIDE}
MAX_COMPLEXITY = 20   # radon's cyclomatic complexity (branches and boolean operators)

# Which rooms each room may import ("core": archway/'s ground floor). Below the products, the
# shared rooms stand on floors: what an image supports (registry), the placement model on it
# (placement, pure), archway's own objects (objects), the cluster as archway reads it (cluster).
# The products (webhook, extender, gate, tools) stand on those and never on each other; the
# server (the gunicorn adapter and the route table the products declare their routes in) knows
# no product; the top (main) puts them together and nothing imports it.
PRODUCTS = {"webhook", "extender", "gate", "tools"}
MAY_IMPORT = {
    "core": set(),
    "server": {"core", "certs"},
    "registry": {"core"},
    "certs": {"core"},
    "placement": {"core", "registry"},
    "objects": {"core", "registry", "placement"},
    "cluster": {"core", "registry", "placement", "objects"},
    "webhook": {"core", "server", "registry", "placement", "objects", "cluster"},
    "extender": {"core", "server", "registry", "placement", "cluster"},
    "gate": {"core", "registry", "certs", "placement", "objects", "cluster"},
    "tools": {"core", "registry", "placement", "objects", "cluster"},
    "main": {"core", "server", "registry", "certs", "placement", "objects", "cluster", *PRODUCTS},
}


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
    assert {"archway.main.worker", "archway.registry.resolver", "archway.webhook.service",
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
    """archway.webhook.service -> webhook; a core module -> core."""
    return name.split(".")[1] if name.count(".") >= 2 or name in ROOM_PACKAGES else "core"


ROOM_PACKAGES = {package for folder, package in PACKAGES.items() if folder != "archway"}


def test_rooms_import_only_the_rooms_below_them():
    graph = import_graph()
    assert set(MAY_IMPORT) == {room(module) for module in graph}
    wrong = sorted(f"{module} imports {imported}" for module, imports in graph.items()
                   for imported in imports
                   if room(imported) != room(module) and room(imported) not in MAY_IMPORT[room(module)])
    assert wrong == []


def test_no_product_imports_another_and_the_ground_imports_no_product():
    graph = import_graph()
    ground = {"core", "server"}
    wrong = sorted(f"{module} imports {imported}" for module, imports in graph.items()
                   for imported in imports if room(imported) in PRODUCTS
                   and (room(module) in ground or room(module) in PRODUCTS - {room(imported)}))
    assert wrong == []


# The shared rooms whose modules stand on floors their __init__.py documents.
FLOORED = ("registry", "placement", "objects", "cluster")
# The shared rooms with a face: what other rooms may use of them, in their __init__.py.
FACED = ("placement", "objects", "cluster")


def documented_floors(folder: str) -> dict[str, int]:
    """A room's __init__.py table: `  <floor>  <module>  <its job>`."""
    doc = ast.get_docstring(ast.parse(source(f"{folder}/__init__.py"))) or ""
    return {module: int(floor) for floor, module in re.findall(r"^ +(\d+) +(\w+) ", doc, re.M)}


def documented_face(folder: str) -> dict[str, set[str]]:
    """A room's face: `  <module>  <names>` under "Its face" in its __init__.py."""
    doc = ast.get_docstring(ast.parse(source(f"{folder}/__init__.py"))) or ""
    face = doc.split("Its face", 1)[1] if "Its face" in doc else ""
    return {module: {n.strip() for n in names.split(",")}
            for module, names in re.findall(r"^  (\w+) +([A-Za-z_][\w, ]*)$", face, re.M)}


@pytest.mark.parametrize("folder", FLOORED)
def test_room_modules_import_only_from_floors_below_their_own(folder):
    floors, package = documented_floors(folder), PACKAGES[folder]
    graph = import_graph()
    own = {name.rsplit(".", 1)[1] for name in graph if name.startswith(package + ".")}
    assert set(floors) == own, f"every {folder} module has one floor in {folder}/__init__.py"
    wrong = [f"{module} (floor {floors[module]}) imports {imported} (floor {floors[imported]})"
             for name, imports in graph.items() if name.startswith(package + ".")
             for module in [name.rsplit(".", 1)[1]]
             for imported in (i.rsplit(".", 1)[1] for i in imports if i.startswith(package + "."))
             if floors[imported] >= floors[module]]
    assert wrong == []


@pytest.mark.parametrize("folder", FACED)
def test_other_rooms_use_a_shared_room_only_through_its_face(folder):
    face, package = documented_face(folder), PACKAGES[folder]
    assert set(face) <= set(documented_floors(folder)), "the face names the room's modules"
    wrong = sorted(f"{name} uses {base}.{taken}" for name, path in module_names(PACKAGES).items()
                   if room(name) != folder
                   for base, taken_names in imports_of(name, path) if base.startswith(package + ".")
                   for taken in taken_names or ["(the module)"]
                   if taken not in face.get(base.rsplit(".", 1)[1], set()))
    assert wrong == []
    # and the face is what they use (the bench and the lab count): nothing public in it that
    # nobody outside the room needs
    used = {(base.rsplit(".", 1)[1], taken) for name, path in module_names(FOLDERS).items()
            if room(name) != folder
            for base, taken_names in imports_of(name, path) if base.startswith(package + ".")
            for taken in taken_names}
    unused = sorted(f"{module}.{n}" for module, names in face.items() for n in names
                    if (module, n) not in used)
    assert unused == [], "names of the face no other room uses"


def test_nothing_but_tests_imports_tests_and_the_wheel_imports_nothing_outside_it():
    wrong = sorted(f"{name} imports {base}" for name, path in module_names(FOLDERS).items()
                   for base, _ in imports_of(name, path)
                   if base.split(".")[0] == "tests"
                   or (name.startswith("archway") and base.split(".")[0] in OUTSIDE)
                   or (name.startswith("lab") and base.split(".")[0] == "pytest"))
    assert wrong == []


# gunicorn's documented extension points: a custom Application and a worker class (settings and
# server hooks travel as values). Its other modules change in minor releases.
GUNICORN_SEAMS = {"gunicorn.app.base", "gunicorn.workers.base"}


def test_gunicorn_is_used_through_its_documented_seams_only():
    used = {base for name, path in module_names(FOLDERS).items()
            for base, _ in imports_of(name, path) if base.split(".")[0] == "gunicorn"}
    assert used and used <= GUNICORN_SEAMS, used - GUNICORN_SEAMS


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
