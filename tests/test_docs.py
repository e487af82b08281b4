"""The operator's documents say what the code does: advice that works under the chart's defaults,
every admission outcome and alert listed where an operator looks for it, every config key named
in the chart's values, and what an https:// SIF server must support."""
import os
import re
import sys

import pytest
import yaml

from archway.config import documented_keys
from lab.procs import REPO

CHART = os.path.join(REPO, "charts", "archway")
RUNBOOKS = os.path.join(REPO, "docs", "runbooks")


def read(*path: str) -> str:
    with open(os.path.join(REPO, *path)) as f:
        return f.read()


def operator_documents() -> dict[str, str]:
    paths = ["README.md", os.path.join("charts", "archway", "README.md"),
             os.path.join("charts", "archway", "values.yaml")]
    for root, _, files in os.walk(os.path.join(REPO, "docs")):
        paths += [os.path.relpath(os.path.join(root, f), REPO) for f in files if f.endswith(".md")]
    return {path: read(path) for path in paths}


def test_no_document_advises_the_key_the_chart_overrides():
    """`admission.fail_closed: true` only counts while `unresolved` is `admit`; the chart sets
    `unresolved: gate`, so the advice must be `unresolved: deny`."""
    advising = [path for path, text in operator_documents().items()
                if re.search(r"fail_closed:? *`?true", text)]
    assert advising == []
    assert "`config.admission.unresolved: deny`" in read("docs", "runbooks", "ArchwayHighFailOpenRate.md")
    assert "`admission.unresolved: deny` | denied" in read("docs", "placement.md")
    values = yaml.safe_load(read("charts", "archway", "values.yaml"))
    assert values["config"]["admission"]["unresolved"] == "gate"


# Every value of archway_admissions_total{outcome}: Decision.outcome (placement/decision.py), the
# service's gated and error (webhook/service.py).
ADMISSION_OUTCOMES = ("mutated", "unchanged", "denied", "fail_open", "gated", "audited", "error")


def test_metrics_reference_names_every_admission_outcome():
    row = next(line for line in read("docs", "metrics.md").splitlines()
               if line.startswith("| `archway_admissions_total` |"))
    assert [o for o in ADMISSION_OUTCOMES if f"`{o}`" not in row] == []
    source = read("placement", "decision.py") + read("webhook", "service.py")
    found = set(re.findall(r'outcome(?:=| = |, )"(\w+)"', source)) | set(
        re.findall(r'admission_finished\("(\w+)"', source)) | set(
        re.findall(r'outcome = "(\w+)" if', source)) | set(re.findall(r'else "(\w+)"\n', source))
    found |= set(re.findall(r'_internal_error\(\), "(\w+)"', source))
    assert found <= set(ADMISSION_OUTCOMES), found - set(ADMISSION_OUTCOMES)


def chart_alerts() -> set[str]:
    return set(re.findall(r"- alert: (\w+)", read("charts", "archway", "templates", "monitoring",
                                                  "prometheusrule.yaml")))


def test_runbook_index_and_chart_readme_list_every_alert():
    alerts = chart_alerts()
    assert {"ArchwayPodsGatedTooLong", "ArchwayImageDroppedArchitecture"} <= alerts
    assert len(alerts) == 8
    pages = {f[:-3] for f in os.listdir(RUNBOOKS) if f.endswith(".md") and f != "README.md"}
    assert pages == alerts
    index = read("docs", "runbooks", "README.md")
    chart_readme = read("charts", "archway", "README.md")
    for alert in sorted(alerts):
        assert f"| `{alert}` | [{alert}.md]({alert}.md) |" in index, alert
        assert f"`{alert}`" in chart_readme, alert


# Keys the chart writes itself (never through `config:`), and deprecated ones.
NOT_FOR_VALUES = {"placement.scheduler_name", "admission.fail_closed",
                  "kubernetes.webhook_configuration", "kubernetes.trust_repair"}


def config_section_text(values_text: str) -> dict[str, str]:
    """config.<section> -> the comment above it and everything indented under it."""
    lines = values_text.split("\nconfig:\n", 1)[1].split("\n\n", 1)[0].splitlines()
    sections: dict[str, str] = {}
    comment: list[str] = []
    current = None
    for line in lines:
        match = re.match(r"^  (\w+):", line)
        if line.startswith("  #"):
            comment.append(line)
        elif match:
            current = match.group(1)
            sections[current] = "\n".join(comment) + "\n" + line
            comment = []
        elif current and line.startswith("    "):
            sections[current] += "\n" + line
    return sections


@pytest.mark.parametrize("section", ["registry", "sif", "admission", "placement", "kubernetes",
                                     "prometheus", "extender", "remediation"])
def test_values_comment_names_every_config_key(section):
    """What the chart passes through as `config.<section>` is named where an operator reads it."""
    text = config_section_text(read("charts", "archway", "values.yaml"))[section]
    keys = [k.split(".", 1)[1] for k in documented_keys()
            if k.startswith(section + ".") and k not in NOT_FOR_VALUES]
    missing = [k for k in keys if not all(re.search(rf"\b{part}\b", text) for part in k.split("."))]
    assert missing == []


def test_https_sif_servers_must_support_range_says_so_before_the_error_does():
    configuration = read("docs", "configuration.md")
    sif_section = configuration.split("\n## sif\n", 1)[1].split("\n## ", 1)[0]
    assert "must support HTTP Range requests" in sif_section
    assert "ignored the Range request" in sif_section       # the error an operator would see
    assert "Range" in config_section_text(read("charts", "archway", "values.yaml"))["registry"]
    assert "so its server must support\nRange" in read("docs", "commands.md")


def test_the_chart_defaults_are_the_sizing_pages_row():
    """docs/sizing.md derives the chart's default resources from the measured curve; the row it
    marks as the defaults and values.yaml say the same."""
    row = next(line for line in read("docs", "sizing.md").splitlines()
               if line.startswith("|") and "the chart's defaults" in line)
    cells = [c.strip() for c in row.strip("|").split("|")]
    values = yaml.safe_load(read("charts", "archway", "values.yaml"))

    def written(resources: dict, kind: str) -> str:
        return ", ".join(f"{k} {v}" for k, v in resources[kind].items())
    webhook, extender = values["webhook"], values["scheduler"]["extender"]
    assert cells[1] == f"{webhook['replicas']} x {webhook['workers']}"
    assert cells[2:6] == [written(webhook["resources"], "requests"),
                          written(webhook["resources"], "limits"),
                          written(extender["resources"], "requests"),
                          written(extender["resources"], "limits")]


def test_the_egress_guard_is_documented_in_the_table_it_lives_in():
    """docs/real-control-plane.md says where the real node's egress guard is, as
    lab/cluster/nodehost.py puts it (issue 38: the page said "first in FORWARD", of no table,
    while the chain is jumped to from the mangle table's FORWARD)."""
    from lab.cluster.nodehost import GUARD_TABLE, guard_rules
    jump = guard_rules("CHAIN", "bridge0", ["10.0.0.0/8"])[-1]
    assert jump[:4] == ["-t", GUARD_TABLE, "-I", "FORWARD"]
    with open(os.path.join(REPO, "docs", "real-control-plane.md")) as f:
        text = " ".join(f.read().split())
    (guard,) = re.findall(r"\*\*Every packet stays on this machine\.\*\*(.*?)\n?is dropped", text)
    assert "FORWARD" in guard and f"**{GUARD_TABLE}** table" in guard


def _quickstart_commands() -> list[str]:
    """The shell lines of "Try it on one machine" (docs/real-control-plane.md), in order."""
    with open(os.path.join(REPO, "docs", "real-control-plane.md")) as f:
        section = f.read().split("\n## Try it on one machine", 1)[1].split("\n## ", 1)[0]
    return [line for block in re.findall(r"```sh\n(.*?)```", section, re.S)
            for line in block.splitlines()]


def test_the_one_machine_quickstart_takes_away_what_it_made():
    """Issue 38, finding 9: the quickstart left /tmp/try-registry, its registry listening on
    every interface, and buildah's working containers behind."""
    lines = _quickstart_commands()
    text = "\n".join(lines)
    (addr,) = re.findall(r"addr: \"?([^\"}]*)\"?}", text)
    assert addr == "$NODE_IP:5000"        # the node's address only, never ":5000"
    assert "<<'YAML'" not in text          # the heredoc expands $NODE_IP
    commits = [line for line in lines if "buildah commit" in line]
    assert commits and all("--rm" in line.split("buildah commit", 1)[1] for line in commits)
    images = set(re.findall(r"buildah commit -q --rm \"\$c\" (try/[\w$]+)", text))
    images = {i.replace("$arch", a) for i in images
              for a in (re.findall(r"for arch in ([\w ]+);", text)[0].split() if "$arch" in i
                        else [""])}
    cleanup = lines[lines.index(next(x for x in lines if x.startswith("bash scripts/cluster.sh down"))):]
    removed = " ".join(cleanup)
    assert "rm -rf /tmp/try-registry" in removed and "try.yaml" in removed
    assert all(image in removed.split("buildah rmi", 1)[1] for image in images), images
    assert "$(cat /tmp/try-registry/pid)" in removed     # a new shell finds the registry too


def test_serving_md_says_what_a_second_server_on_an_address_gets(monkeypatch):
    """Issue 47: docs/serving.md said a second `archway serve` on the same port "joins the
    first"; it is refused (main/addresses.py). The page quotes the refusal; this is that line."""
    import socket

    from archway.main import addresses
    page = read("docs", "serving.md")
    assert "joins the first" not in page
    (quoted,) = re.findall(r"^\$ archway serve --bind (\S+)\narchway: (.*)$", page, re.M)
    bind, message = quoted
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    port = taken.getsockname()[1]
    monkeypatch.setattr(addresses, "answers_as_archway", lambda host, p: p == port)
    try:
        with pytest.raises(addresses.AddressInUse) as refused:
            addresses.ensure_free(bind.replace(bind.rsplit(":", 1)[1], str(port)), "127.0.0.1", port)
    finally:
        taken.close()
    assert str(refused.value) == message.replace(bind, f"127.0.0.1:{port}")


# --- the README's first screen, the docs' index, and every link landing (issue 47) --------------

README_FIRST_BLOCK = (
    "bash scripts/serve.sh     # install archway and run the webhook + extender on "
    "https://127.0.0.1:8443 (self-signed TLS, no cluster needed)\n"
    "bash scripts/test.sh      # install everything the tests use (apt packages, helm, Python "
    "packages) and run them\n")


def test_the_readme_opens_with_the_two_commands_and_ci_runs_the_second():
    readme = read("README.md")
    assert readme.startswith("```sh\n" + README_FIRST_BLOCK + "```\n")
    test_command = README_FIRST_BLOCK.splitlines()[1].split("#", 1)[0].strip()
    ci = [line for line in read(".ci", "run").splitlines() if line and not line.startswith("#")]
    assert test_command in ci


def test_the_readme_is_two_screens_before_the_install():
    """What it is, a picture, a try, then "Install in a cluster" within ~150 lines."""
    readme = read("README.md")
    above = readme.split("\n## Install in a cluster\n", 1)[0]
    assert len(above.splitlines()) <= 150
    picture = re.search(r"!\[[^\]]+\]\((docs/images/[\w-]+\.svg)\)", above)
    assert picture and os.path.exists(os.path.join(REPO, picture.group(1)))
    source = picture.group(1)[:-len(".svg")] + ".py"
    assert os.path.exists(os.path.join(REPO, source))


def test_the_architecture_picture_is_what_its_source_draws():
    """docs/images/architecture.svg is written by the script beside it; an edit of one alone
    shows here."""
    import importlib.util
    path = os.path.join(REPO, "docs", "images", "architecture.py")
    spec = importlib.util.spec_from_file_location("architecture_picture", path)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    drawn = module.draw()
    assert drawn == read("docs", "images", "architecture.svg")
    # an opaque background first, so it reads on GitHub's dark theme too
    assert re.search(r'<rect x="0" y="0" width="\d+" height="\d+" rx="\d+" fill="#ffffff"', drawn)


def docs_pages() -> list[str]:
    """Every page under docs/ and docs/runbooks/, relative to docs/."""
    pages = [f for f in os.listdir(os.path.join(REPO, "docs")) if f.endswith(".md")]
    pages += ["runbooks/" + f for f in os.listdir(RUNBOOKS) if f.endswith(".md")]
    return sorted(p for p in pages if p != "README.md")


INDEX_ROW = re.compile(r"^\| \[[^\]]+\]\(([\w/.-]+\.md)\) \| (.+) \|$", re.M)


def unlisted(index: str) -> list[str]:
    """The pages of docs/ and docs/runbooks/ that have no row `| [name](page) | when |` in the
    index, or whose row says too little of when to read it."""
    rows = dict(INDEX_ROW.findall(index))
    return [p for p in docs_pages() if p != "runbooks/README.md"
            and (p not in rows or len(rows[p].split()) < 4)]


def test_the_docs_index_lists_every_page_with_when_to_read_it():
    index = read("docs", "README.md")
    assert unlisted(index) == []
    assert "(runbooks/README.md)" in index


def test_the_docs_index_check_sees_a_page_left_out():
    index = read("docs", "README.md")
    assert unlisted(index.replace("| [gate.md](gate.md) |", "| gate.md |")) == ["gate.md"]


def github_anchor(heading: str) -> str:
    """The anchor GitHub gives a Markdown heading: lower case, punctuation but - and _ dropped,
    spaces as -."""
    text = re.sub(r"[`*]", "", heading.strip()).lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors_of(path: str) -> set[str]:
    with open(path, encoding="utf-8") as f:
        text = re.sub(r"```.*?```", "", f.read(), flags=re.S)
    seen: dict[str, int] = {}
    anchors = set()
    for heading in re.findall(r"^#{1,6} (.+?)\s*$", text, re.M):
        anchor = github_anchor(heading)
        n = seen.get(anchor, 0)
        seen[anchor] = n + 1
        anchors.add(anchor if n == 0 else f"{anchor}-{n}")
    return anchors


MD_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
README_ANCHOR = re.compile(r"(?<![\w/.-])((?:[\w.-]+/)*README\.md)#([\w-]+)")


def broken_links(files: list[str]) -> list[str]:
    """Every Markdown link of a .md file to a file of the repository (and its #anchor), and every
    `README.md#anchor` written anywhere (code, comments, tests, charts), that does not land."""
    broken = []
    for path in files:
        full = os.path.join(REPO, path)
        with open(full, encoding="utf-8", errors="replace") as f:
            text = f.read()
        targets = []
        if path.endswith(".md"):
            targets += [t for t in MD_LINK.findall(re.sub(r"```.*?```", "", text, flags=re.S))
                        if not re.match(r"^[a-z]+:", t)]
        targets += [f"{p}#{a}" for p, a in README_ANCHOR.findall(text) if not path.endswith(".md")]
        for target in targets:
            file_part, _, anchor = target.partition("#")
            landing = (os.path.normpath(os.path.join(os.path.dirname(full), file_part)) if file_part
                       else full)
            if not path.endswith(".md") and file_part and not os.path.exists(landing):
                landing = os.path.join(REPO, file_part)       # code names paths from the root
            if not os.path.exists(landing):
                broken.append(f"{path}: {target} (no such file)")
            elif anchor and landing.endswith(".md") and anchor not in anchors_of(landing):
                broken.append(f"{path}: {target} (no such heading)")
    return broken


def linked_files() -> list[str]:
    found = []
    for root, dirs, files in os.walk(REPO):
        dirs[:] = [d for d in dirs if not d.startswith(".") and d not in (
            "__pycache__", "build", "results") and not d.endswith(".egg-info")]
        found += [os.path.relpath(os.path.join(root, f), REPO) for f in files
                  if f.endswith((".md", ".py", ".yaml", ".yml", ".tpl", ".sh", ".txt"))]
    return [f for f in found if f != os.path.join("tests", "test_docs.py")]   # its own examples


def test_every_link_and_readme_anchor_lands():
    """Issue 47 moved most of the README into docs/: whatever pointed at it still lands."""
    files = linked_files()
    assert len([f for f in files if f.endswith(".md")]) > 30
    assert broken_links(files) == []


def test_the_link_check_sees_a_heading_that_moved(tmp_path, monkeypatch):
    page = tmp_path / "page.md"
    page.write_text("# Title\n\n## Kept\n\n[here](#kept) [gone](#moved-away) "
                    "[no file](missing.md)\n")
    code = tmp_path / "code.py"
    code.write_text("# see page.md (README.md#gate-on-a-miss)\n")
    (tmp_path / "README.md").write_text("# archway\n\n## Install in a cluster\n")
    monkeypatch.setattr(sys.modules[__name__], "REPO", str(tmp_path))
    assert broken_links(["page.md", "code.py"]) == [
        "page.md: #moved-away (no such heading)", "page.md: missing.md (no such file)",
        "code.py: README.md#gate-on-a-miss (no such heading)"]
    assert github_anchor("What would archway do? Why is my pod where it is?") == \
        "what-would-archway-do-why-is-my-pod-where-it-is"
    assert github_anchor("The image: build, push, release") == "the-image-build-push-release"
