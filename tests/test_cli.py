"""The command line's habits: global options on either side of the command, an example in every
--help that really parses, shell completion that bash and zsh really run, explain -f DIR, and
digests printed as references. No server: the commands that read images are tested against the
real registry in test_inspect_cli.py and test_policy.py."""
import json
import os
import shlex
import subprocess
import sys

import pytest

from archway.cluster.workloads import workloads_in
from archway.errors import ArchwayError
from archway.main.cli import EXAMPLES, build_parser, subcommands
from archway.main.completion import script
from archway.registry.inspect import pinned
from archway.tools.manifests import load_manifests, manifest_files, read_sources
from lab.procs import REPO, require_binary

DIGEST = "sha256:" + "ab" * 32


def every_command():
    return ["", *(path for path, _ in subcommands(build_parser()))]


def archway_argv(line: str) -> list[str]:
    """The arguments of the `archway` command in an example line (pipes and redirections cut)."""
    lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    words = list(lexer)
    argv = []
    for word in words[words.index("archway") + 1:]:
        if word[0] in "|<>();&":
            break
        argv.append(word)
    return argv


def run_cli(*args, stdin=None):
    return subprocess.run([sys.executable, "-m", "archway.main.cli", *args], cwd=REPO, input=stdin,
                          capture_output=True, text=True, timeout=60)


def test_admission_review_prints_a_review_of_the_pod_asked_for():
    """What `archway serve`'s line to try pipes to curl (tests/test_admission_http.py posts it)."""
    result = run_cli("admission-review", "--image", "nginx:1.27", "--namespace", "shop")
    assert result.returncode == 0, result.stderr
    review = json.loads(result.stdout)
    request = review["request"]
    assert (review["apiVersion"], review["kind"]) == ("admission.k8s.io/v1", "AdmissionReview")
    assert (request["operation"], request["namespace"], request["kind"]["kind"]) == (
        "CREATE", "shop", "Pod")
    assert [c["image"] for c in request["object"]["spec"]["containers"]] == ["nginx:1.27"]
    default = json.loads(run_cli("admission-review").stdout)["request"]
    assert default["object"]["spec"]["containers"][0]["image"] == "127.0.0.1:9/team/app:1.0"
    assert default["uid"] != request["uid"]   # each review its own, as the apiserver's


# --- --help: an example for every command, and every example parses ------------------------------

@pytest.mark.parametrize("path", every_command())
def test_every_help_shows_examples_that_parse(path):
    result = run_cli(*path.split(), "--help")
    assert result.returncode == 0, result.stderr
    assert "\nexamples:\n" in result.stdout
    shown = [line.strip() for line in result.stdout.split("\nexamples:\n", 1)[1].splitlines()]
    assert shown and shown == list(EXAMPLES[path])
    for line in shown:
        args = build_parser().parse_args(archway_argv(line))
        assert args.func, line
        if path:
            assert line.startswith(f"archway {path}") or f" {path} " in f" {' '.join(archway_argv(line))} ", line


def test_every_command_and_only_they_have_examples():
    assert set(every_command()) == set(EXAMPLES)


def test_a_command_without_examples_breaks_no_other_command(monkeypatch):
    """Issue 30: a subcommand missing from EXAMPLES made build_parser raise KeyError, so every
    `archway` command failed; now only the tests above fail for it."""
    import types

    import archway.main.cli as cli
    def register(subparsers):
        subparsers.add_parser("unlisted").set_defaults(func=lambda args: 0)

    module = types.ModuleType("tests.unlisted_command")
    module.register = register  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, module.__name__, module)
    monkeypatch.setattr(cli, "_COMMAND_MODULES", (*cli._COMMAND_MODULES, module.__name__))
    parser = cli.build_parser()
    assert parser.parse_args(["inspect", "nginx"]).func
    assert parser.parse_args(["unlisted"]).func
    assert "unlisted" not in EXAMPLES


def test_an_example_that_does_not_parse_is_caught():
    """Control for the test above: a wrong option in an example fails to parse."""
    with pytest.raises(SystemExit):
        build_parser().parse_args(archway_argv("archway inspect --jsn nginx"))


# --- -v and --config before or after the command ---------------------------------------------------

def example_args(path: str) -> list[str]:
    """The arguments after the command path of the first example that runs `path`."""
    words = path.split()
    for examples in EXAMPLES.values():
        for line in examples:
            argv = [a for a in archway_argv(line) if a not in ("-v", "--verbose")]
            if "--config" in argv:
                i = argv.index("--config")
                del argv[i:i + 2]
            if argv[:len(words)] == words:
                return argv[len(words):]
    raise AssertionError(f"no example runs archway {path}")


LEAF_COMMANDS = [path for path, parser in subcommands(build_parser())
                 if not any(a.nargs == "A..." for a in parser._actions)]   # not `certs`, `gate`


@pytest.mark.parametrize("path", LEAF_COMMANDS)
def test_global_options_before_or_after_the_command(path):
    words, rest = path.split(), example_args(path)
    parser = build_parser()
    plain = parser.parse_args([*words, *rest])
    assert plain.config is None and plain.verbose is False
    for argv in ([*words, *rest, "--config", "a.yaml", "-v"],
                 ["--config", "a.yaml", "-v", *words, *rest],
                 ["--config", "a.yaml", *words, "--verbose", *rest],
                 ["-v", *words, *rest, "--config=a.yaml"]):
        args = build_parser().parse_args(argv)
        assert (args.config, args.verbose, args.func) == ("a.yaml", True, plain.func), argv
    # given on both sides, the one after the command wins (it is read last)
    args = build_parser().parse_args(["--config", "before.yaml", *words, *rest, "--config", "after.yaml"])
    assert args.config == "after.yaml"


def test_nested_commands_took_no_global_option_after_them_before():
    """What failed: `archway certs generate ... --config f` and `archway inspect x -v`."""
    for argv in (["certs", "generate", "--service", "s", "--namespace", "n", "--out", "d",
                  "--config", "f.yaml"],
                 ["gate", "release-all", "-v"], ["inspect", "nginx", "-v"]):
        args = build_parser().parse_args(argv)
        assert args.config == "f.yaml" or args.verbose


# --- shell completion ------------------------------------------------------------------------------

def bash_complete(script_path: str, line: str, cwd: str) -> list[str]:
    words = line.split(" ")
    code = (f"source {shlex.quote(script_path)}\n"
            f"COMP_WORDS=({' '.join(shlex.quote(w) for w in words)})\n"
            f"COMP_CWORD={len(words) - 1}\n"
            "_archway\nprintf '%s\\n' \"${COMPREPLY[@]}\"\n")
    out = subprocess.run([require_binary("bash"), "--norc", "--noprofile", "-c", code], cwd=cwd,
                         capture_output=True, text=True, timeout=30, check=True)
    return [w for w in out.stdout.splitlines() if w]


@pytest.fixture
def completion_scripts(tmp_path):
    paths = {}
    for shell in ("bash", "zsh"):
        result = run_cli("completion", shell)
        assert result.returncode == 0, result.stderr
        assert result.stdout == script(build_parser(), shell)
        paths[shell] = str(tmp_path / f"archway.{shell}")
        with open(paths[shell], "w") as f:
            f.write(result.stdout)
    (tmp_path / "deploy.yaml").write_text("{}")
    return paths


@pytest.mark.parametrize("line, expected", [
    ("archway ", ["inspect", "serve", "admission-review", "scheduler-config", "certs", "explain",
                  "report", "gate", "cleanup", "completion"]),
    ("archway ce", ["certs"]),
    ("archway certs ", ["generate", "bootstrap"]),
    ("archway --config x.yaml -v certs gen", ["generate"]),
    ("archway certs generate --o", ["--out"]),
    ("archway serve --product ", ["all", "webhook", "extender"]),
    ("archway --config archway.yaml serve --product e", ["extender"]),
    ("archway completion ", ["bash", "zsh"]),
    ("archway inspect --ti", ["--timeout"]),
    ("archway explain --config", ["--config"]),
    ("archway explain -f dep", ["deploy.yaml"]),
    ("archway gate release-all --v", ["--verbose"]),
    ("archway report --timeout ", []),          # a number: nothing to offer
])
def test_bash_completion(completion_scripts, tmp_path, line, expected):
    assert bash_complete(completion_scripts["bash"], line, str(tmp_path)) == expected


ZSH_DRIVER = r"""
zmodload zsh/zpty
zpty z 'zsh -f -i'
zpty -w z 'PS1="> "; autoload -Uz compinit; compinit -u -D; source %(script)s; echo READY'
zpty -r z line '*READY*'
while (( $# )); do
    typed=$1; shown=$2; shift 2
    zpty -w -n z "$typed"$'\t'
    out=""
    # read until the completion shows (at most 30 s: a busy machine), never a fixed pause
    for i in {1..300}; do
        while zpty -r -t z chunk; do out+=$chunk; done
        [[ ${out//$'\r'/} == *"$shown"* ]] && break
        sleep 0.1
    done
    print -r -- "<<$typed>>${out//$'\r'/}"
    zpty -w -n z $'\C-u'
    sleep 0.2
    while zpty -r -t z chunk; do :; done
done
zpty -d z
"""


def test_zsh_completion_in_a_real_interactive_zsh(completion_scripts, tmp_path):
    """A real interactive zsh (zsh/zpty) with compinit, TAB pressed after each line."""
    driver = tmp_path / "driver.zsh"
    driver.write_text(ZSH_DRIVER % {"script": shlex.quote(completion_scripts["zsh"])})
    typed = {"archway certs ": "generate", "archway certs gen": "archway certs generate",
             "archway serve --product ": "webhook",
             "archway -v completion z": "archway -v completion zsh",
             "archway explain -f dep": "archway explain -f deploy.yaml"}   # line: what shows
    out = subprocess.run([require_binary("zsh"), "-f", str(driver),
                          *(word for pair in typed.items() for word in pair)], cwd=tmp_path,
                         capture_output=True, text=True, timeout=240)
    answers = dict(part.split(">>", 1) for part in out.stdout.split("<<")[1:])
    assert "bootstrap" in answers["archway certs "] and "generate" in answers["archway certs "]
    assert "archway certs generate" in answers["archway certs gen"]     # completed in place
    assert all(w in answers["archway serve --product "] for w in ("all", "extender", "webhook"))
    assert "archway -v completion zsh" in answers["archway -v completion z"]
    assert "archway explain -f deploy.yaml" in answers["archway explain -f dep"]


# --- explain -f DIR --------------------------------------------------------------------------------

def test_explain_reads_every_manifest_under_a_directory(tmp_path):
    pod = "apiVersion: v1\nkind: Pod\nmetadata: {name: %s}\nspec: {containers: [{name: c, image: x}]}\n"
    (tmp_path / "a.yaml").write_text(pod % "a")
    (tmp_path / "apps" / "web").mkdir(parents=True)
    (tmp_path / "apps" / "web" / "b.yml").write_text(pod % "b" + "---\n" + pod % "b2")
    (tmp_path / "apps" / "c.json").write_text(
        '{"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "c"}, '
        '"spec": {"containers": [{"name": "c", "image": "y"}]}}')
    (tmp_path / "README.md").write_text("# not a manifest: {{ template }}")
    (tmp_path / ".git").mkdir()
    (tmp_path / ".git" / "HEAD.yaml").write_text(pod % "hidden")
    assert manifest_files(str(tmp_path)) == [
        str(tmp_path / "a.yaml"), str(tmp_path / "apps" / "c.json"),
        str(tmp_path / "apps" / "web" / "b.yml")]
    names = [(w.name, w.origin) for text, origin in read_sources(str(tmp_path))
             for w in workloads_in(load_manifests(text, origin), origin)]
    assert names == [("a", f"{tmp_path / 'a.yaml'}, document 1"),
                     ("c", f"{tmp_path / 'apps' / 'c.json'}, document 1"),
                     ("b", f"{tmp_path / 'apps' / 'web' / 'b.yml'}, document 1"),
                     ("b2", f"{tmp_path / 'apps' / 'web' / 'b.yml'}, document 2")]


def test_explain_directory_errors_name_the_file(tmp_path, monkeypatch):
    with pytest.raises(ArchwayError, match="no \\*.yaml, \\*.yml or \\*.json file under"):
        read_sources(str(tmp_path))
    (tmp_path / "a.yaml").write_text("x" * 100)
    (tmp_path / "b.yaml").write_text("y" * 100)
    monkeypatch.setattr("archway.tools.manifests.MAX_MANIFEST_BYTES", 150)
    with pytest.raises(ArchwayError, match=f"{tmp_path / 'b.yaml'} makes the manifests larger"):
        read_sources(str(tmp_path))
    (tmp_path / "b.yaml").write_text("kind: [unclosed")
    result = run_cli("explain", "-f", str(tmp_path))
    assert result.returncode == 2 and f"{tmp_path / 'b.yaml'} is not valid YAML" in result.stderr


# --- digests as references ------------------------------------------------------------------------

@pytest.mark.parametrize("image, digest, shown", [
    ("nginx", DIGEST, f"docker.io/library/nginx@{DIGEST}"),
    ("ghcr.io/org/app:v1", DIGEST, f"ghcr.io/org/app@{DIGEST}"),
    (f"ghcr.io/org/app:v1@{DIGEST}", DIGEST, f"ghcr.io/org/app@{DIGEST}"),
    ("localhost:5000/team/app:1", DIGEST, f"localhost:5000/team/app@{DIGEST}"),
    ("oras://registry.example/sif/tool:1.0", DIGEST, f"oras://registry.example/sif/tool@{DIGEST}"),
    ("library://alice/tools/busybox:1.35", "sha256." + "ab" * 32, None),
    ("https://files.example/x.sif", None, None),
    ("nginx", None, None),
])
def test_pinned_reference(image, digest, shown):
    assert pinned(image, digest) == shown


# --- every error archway raises on purpose is one line and exit status 2 (issue 23) --------------

def _api_error():
    from kubernetes import client

    from archway.kubeapi import KubeApi
    from lab.procs import free_port
    api = KubeApi(client.ApiClient(client.Configuration(host=f"http://127.0.0.1:{free_port()}")),
                  timeout_seconds=2)
    api.request("GET", "/api/v1/namespaces")


def _certificate_error():
    from archway.certs.x509 import load_cert
    load_cert(b"-----BEGIN CERTIFICATE-----\nnot one\n-----END CERTIFICATE-----\n")


def _lookup_timeout():
    import threading
    import time

    from archway.registry.dns import NameLookups
    never = threading.Event()
    lookups = NameLookups(getaddrinfo=lambda *args: never.wait(10))   # a resolver that hangs
    try:
        lookups.getaddrinfo("registry.example", 443, deadline=time.monotonic() + 0.05)
    finally:
        never.set()


def _malformed_extender_args():
    from archway.extender.wire import parse_extender_args
    parse_extender_args(b'{"Pod": {}, "NodeNames": [1]}')


def _too_many_nodes():
    from archway.extender.wire import MAX_CANDIDATE_NODES, parse_extender_args
    names = ",".join(f'"n{i}"' for i in range(MAX_CANDIDATE_NODES + 1))
    parse_extender_args(f'{{"Pod": {{}}, "NodeNames": [{names}]}}'.encode())


@pytest.mark.parametrize("failure, words", [
    (_api_error, "unreachable"),
    (_certificate_error, "not a PEM certificate"),
    (_lookup_timeout, "the DNS lookup of registry.example did not answer in time"),
    (_malformed_extender_args, "NodeNames"),
    (_too_many_nodes, "65536"),
], ids=["ApiError", "CertificateError", "LookupTimeout", "MalformedExtenderArgs", "TooManyNodes"])
def test_the_clis_one_handler_catches_every_archway_error(monkeypatch, capsys, failure, words):
    """ApiError, CertificateError, LookupTimeout and the extender's parse errors once escaped
    the handler as tracebacks: each is an ArchwayError now. The failure is injected as the
    command's own (the real function raising it for real)."""
    import archway.main.cli
    import archway.registry.inspect

    def command(args):
        failure()
        return 0

    monkeypatch.setattr(archway.registry.inspect, "run", command)
    assert archway.main.cli.main(["inspect", "nginx"]) == archway.main.cli.EXIT_ERROR
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("archway: ") and words in lines[0], lines
