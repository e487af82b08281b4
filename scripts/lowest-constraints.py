"""The lowest versions pyproject.toml allows, as a pip constraints file (`name==version`, one a
line), read from [project].dependencies: the ranges are written once, there.

    python3 scripts/lowest-constraints.py > lowest.txt
    pip install -c lowest.txt -e '.[test]'

Every dependency must have a `>=` lower bound: one without has no lowest version to test.
"""
import re
import sys
import tomllib
from pathlib import Path

PYPROJECT = Path(__file__).resolve().parent.parent / "pyproject.toml"
# name [extras] specifiers [; marker]: archway's dependencies use no markers or URLs.
REQUIREMENT = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)\s*(?:\[[^\]]*\])?\s*([^;]*)$")


def lower_bounds(pyproject: Path = PYPROJECT) -> dict[str, str]:
    """{name: lowest allowed version} of every runtime dependency."""
    with open(pyproject, "rb") as f:
        dependencies = tomllib.load(f)["project"]["dependencies"]
    bounds = {}
    for line in dependencies:
        match = REQUIREMENT.match(line)
        if match is None:
            raise ValueError(f"pyproject.toml: cannot read the dependency {line!r}")
        name, specifiers = match.groups()
        lower = [s.strip()[2:].strip() for s in specifiers.split(",") if s.strip().startswith(">=")]
        if len(lower) != 1:
            raise ValueError(f"pyproject.toml: {line!r} needs exactly one lower bound (>=)")
        bounds[name] = lower[0]
    return bounds


def main() -> int:
    for name, version in lower_bounds().items():
        print(f"{name}=={version}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
