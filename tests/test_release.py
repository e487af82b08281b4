"""Release hygiene: one version in pyproject.toml and the chart, a changelog that has it, and
scripts/release.sh, the release steps in one place, doing what its header says (on copies of the
repository: nothing here touches this checkout or its tags)."""
import datetime
import os
import re
import shutil
import subprocess
import tomllib

import pytest

from lab.procs import REPO, require_binary

SEMVER = re.compile(r"^\d+\.\d+\.\d+$")


def chart_field(text: str, key: str) -> str:
    return re.search(rf'^{key}: "?([^"\n]+)"?$', text, re.M).group(1)


def versions(root: str = REPO) -> tuple[str, str, str]:
    with open(os.path.join(root, "pyproject.toml"), "rb") as f:
        project = tomllib.load(f)["project"]["version"]
    with open(os.path.join(root, "charts", "archway", "Chart.yaml")) as f:
        chart = f.read()
    return project, chart_field(chart, "version"), chart_field(chart, "appVersion")


def release(root: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([require_binary("bash"), "scripts/release.sh", *args], cwd=root,
                          capture_output=True, text=True, timeout=60)


def test_the_version_is_the_same_everywhere():
    project, chart, app = versions()
    assert SEMVER.match(project) and project == chart == app
    result = release(REPO, "check")
    assert result.returncode == 0 and result.stdout == f"{project}\n", result.stderr


def test_the_changelog_has_every_version_newest_first():
    with open(os.path.join(REPO, "CHANGELOG.md")) as f:
        headings = re.findall(r"^## (.+)$", f.read(), re.M)
    assert headings[0] == "Unreleased" or headings[0].startswith(versions()[0] + " ")
    released = [h.split(" ")[0] for h in headings if h != "Unreleased"]
    assert versions()[0] in released and "0.1.0" in released
    assert all(SEMVER.match(v) for v in released)
    key = [tuple(map(int, v.split("."))) for v in released]
    assert key == sorted(key, reverse=True)


@pytest.fixture
def copy(tmp_path):
    """The files release.sh reads and writes, in a git repository of their own."""
    root = tmp_path / "archway"
    for name in ("pyproject.toml", "CHANGELOG.md", os.path.join("charts", "archway", "Chart.yaml"),
                 os.path.join("scripts", "release.sh")):
        os.makedirs(root / os.path.dirname(name), exist_ok=True)
        shutil.copy(os.path.join(REPO, name), root / name)
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@example.com"]
    subprocess.run(["git", "init", "-q"], cwd=root, check=True)
    subprocess.run([*git, "add", "-A"], cwd=root, check=True)
    subprocess.run([*git, "commit", "-qm", "start"], cwd=root, check=True)
    return str(root), git


def test_check_names_the_version_that_disagrees(copy):
    root, _ = copy
    path = os.path.join(root, "charts", "archway", "Chart.yaml")
    with open(path) as f:
        text = f.read()
    with open(path, "w") as f:
        f.write(re.sub(r"^appVersion: .*$", 'appVersion: "7.7.7"', text, flags=re.M))
    result = release(root, "check")
    assert result.returncode == 1 and "appVersion 7.7.7" in result.stderr


def test_set_writes_one_version_everywhere_and_dates_the_changelog(copy):
    root, _ = copy
    with open(os.path.join(root, "CHANGELOG.md")) as f:
        had_unreleased = "\n## Unreleased\n" in f.read()
    result = release(root, "set", "9.8.7")
    assert result.returncode == 0, result.stderr
    assert versions(root) == ("9.8.7", "9.8.7", "9.8.7")
    assert release(root, "check").stdout == "9.8.7\n"
    with open(os.path.join(root, "CHANGELOG.md")) as f:
        changelog = f.read()
    today = datetime.datetime.now(datetime.UTC).date().isoformat()
    assert (f"\n## 9.8.7 ({today})\n" in changelog) == had_unreleased
    assert "\n## Unreleased\n" not in changelog
    for wrong in ("v9.8.7", "9.8", "9.8.7-rc1", ""):
        refused = release(root, "set", wrong)
        assert refused.returncode != 0 and versions(root)[0] == "9.8.7", wrong


def test_tag_needs_a_changelog_entry_and_a_clean_tree(copy):
    root, git = copy
    release(root, "set", "9.8.7")
    dirty = release(root, "tag")
    assert dirty.returncode == 1 and "commit them first" in dirty.stderr
    subprocess.run([*git, "commit", "-qam", "9.8.7"], cwd=root, check=True)
    changelog = os.path.join(root, "CHANGELOG.md")
    with open(changelog) as f:
        text = f.read()
    if "## 9.8.7 (" not in text:     # no Unreleased section was there to date
        with open(changelog, "w") as f:
            f.write(text.replace("\n## ", "\n## 9.8.7 (2030-01-01)\n\n## ", 1))
        subprocess.run([*git, "commit", "-qam", "changelog"], cwd=root, check=True)
    tagged = release(root, "tag")
    assert tagged.returncode == 0, tagged.stderr
    kind = subprocess.run(["git", "cat-file", "-t", "v9.8.7"], cwd=root, capture_output=True,
                          text=True).stdout.strip()
    assert kind == "tag"      # annotated
    again = release(root, "tag")
    assert again.returncode == 1 and "tag v9.8.7 exists" in again.stderr
    release(root, "set", "9.8.8")
    subprocess.run([*git, "commit", "-qam", "9.8.8"], cwd=root, check=True)
    missing = release(root, "tag")
    assert missing.returncode == 1 and "no section '## 9.8.8" in missing.stderr
