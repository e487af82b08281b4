"""`kubectl archway` (issue 47): the plugin executable kubectl runs, and the cluster it reads
found as kubectl finds it: --kubeconfig, else $KUBECONFIG's files merged, else ~/.kube/config;
--context, else current-context; `explain pod/NAME` in -n, else the context's namespace, else
default.

Real parts: kubeconfig files written here, two stand-in API servers (one per context) that
record the request `explain` makes: the path names the namespace, the server the context."""
import os
import tomllib

import pytest

from archway.main import kubectl
from lab.procs import REPO
from lab.servers.faults import ScriptedServer

NOT_FOUND = (404, {"Content-Type": "application/json"},
             b'{"kind":"Status","status":"Failure","reason":"NotFound","code":404,'
             b'"message":"pods \\"web\\" not found"}')


@pytest.fixture
def apis():
    servers = {name: ScriptedServer(lambda request: NOT_FOUND) for name in ("a", "b")}
    try:
        yield servers
    finally:
        for server in servers.values():
            server.stop()


@pytest.fixture
def home(tmp_path, monkeypatch):
    for name in ("ARCHWAY_CONFIG", "KUBECONFIG", "KUBERNETES_SERVICE_HOST"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.chdir(tmp_path)
    return tmp_path


def write_kubeconfig(path, apis, *, current: str | None, contexts=("a", "b"),
                     namespaces=None) -> str:
    namespaces = namespaces or {"a": "shop", "b": "dev"}
    lines = ["apiVersion: v1", "kind: Config", "clusters:"]
    lines += [f"- {{name: {n}, cluster: {{server: 'http://{apis[n].host}'}}}}" for n in contexts]
    lines += ["users:", "- {name: u, user: {token: not-a-secret}}", "contexts:"]
    for n in contexts:
        namespace = f", namespace: {namespaces[n]}" if namespaces.get(n) else ""
        lines.append(f"- {{name: {n}, context: {{cluster: {n}, user: u{namespace}}}}}")
    if current:
        lines.append(f"current-context: {current}")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def asked(apis) -> list[tuple[str, str]]:
    """(server, path) of each request since the last look."""
    seen = [(name, r.path) for name, server in apis.items() for r in server.requests]
    for server in apis.values():
        server.requests.clear()
    return seen


def explain(*args) -> int:
    return kubectl.main(["explain", "pod/web", *args])


def test_the_current_context_and_its_namespace(apis, home, monkeypatch, capsys):
    monkeypatch.setenv("KUBECONFIG", write_kubeconfig(home / "kc", apis, current="a"))
    assert explain() == 2
    assert asked(apis) == [("a", "/api/v1/namespaces/shop/pods/web")]
    assert 'pods "web" not found' in capsys.readouterr().err


@pytest.mark.parametrize("flags, expected", [
    (["--context", "b"], ("b", "dev")),
    (["--context=b"], ("b", "dev")),
    (["-n", "other"], ("a", "other")),
    (["--namespace=other"], ("a", "other")),
    (["--context", "b", "-n", "other"], ("b", "other")),
])
def test_context_and_namespace_flags(apis, home, monkeypatch, flags, expected):
    monkeypatch.setenv("KUBECONFIG", write_kubeconfig(home / "kc", apis, current="a"))
    assert explain(*flags) == 2
    server, namespace = expected
    assert asked(apis) == [(server, f"/api/v1/namespaces/{namespace}/pods/web")]


def test_kubeconfig_files_merge_as_kubectl_merges_them(apis, home, monkeypatch):
    """The first file to set current-context wins; a context named in both is the first's."""
    first = write_kubeconfig(home / "one", apis, current=None, contexts=("a",))
    second = write_kubeconfig(home / "two", apis, current="b", namespaces={"a": "not-this",
                                                                         "b": "dev"})
    monkeypatch.setenv("KUBECONFIG", os.pathsep.join([first, second]))
    assert explain() == 2
    assert asked(apis) == [("b", "/api/v1/namespaces/dev/pods/web")]
    assert explain("--context", "a") == 2
    assert asked(apis) == [("a", "/api/v1/namespaces/shop/pods/web")]


def test_a_context_without_a_namespace_means_default(apis, home, monkeypatch):
    monkeypatch.setenv("KUBECONFIG", write_kubeconfig(home / "kc", apis, current="a",
                                                      namespaces={"a": None, "b": "dev"}))
    assert explain() == 2
    assert asked(apis) == [("a", "/api/v1/namespaces/default/pods/web")]


def test_the_kubeconfig_flag_then_kubeconfig_then_the_home_file(apis, home, monkeypatch):
    write_kubeconfig(home / ".kube" / "config", apis, current="b")
    assert explain() == 2                                       # ~/.kube/config
    assert asked(apis) == [("b", "/api/v1/namespaces/dev/pods/web")]
    monkeypatch.setenv("KUBECONFIG", write_kubeconfig(home / "kc", apis, current="a"))
    assert explain() == 2                                       # $KUBECONFIG over it
    assert asked(apis) == [("a", "/api/v1/namespaces/shop/pods/web")]
    flag = write_kubeconfig(home / "flag", apis, current="b", namespaces={"b": "flagged"})
    assert explain("--kubeconfig", flag) == 2                   # --kubeconfig over both
    assert asked(apis) == [("b", "/api/v1/namespaces/flagged/pods/web")]


def test_archway_explain_without_n_uses_the_context_namespace_too(apis, home, monkeypatch):
    from archway.main.cli import main
    monkeypatch.setenv("KUBECONFIG", write_kubeconfig(home / "kc", apis, current="b"))
    assert main(["explain", "pod/web"]) == 2
    assert asked(apis) == [("b", "/api/v1/namespaces/dev/pods/web")]


def test_report_reads_the_chosen_context(apis, home, monkeypatch, capsys):
    monkeypatch.setenv("KUBECONFIG", write_kubeconfig(home / "kc", apis, current="a"))
    kubectl.main(["report", "--context", "b", "-n", "dev"])
    assert {server for server, _ in asked(apis)} == {"b"}
    assert all("/namespaces/dev/" in path for _, path in asked(apis)), asked(apis)


def test_inspect_ignores_kubectls_cluster_flags(home, capsys):
    assert kubectl.main(["inspect", "--context", "x", "-n", "y", "./missing.sif"]) == 1
    assert "no such file: ./missing.sif" in capsys.readouterr().out


def test_other_commands_and_no_command_say_what_the_plugin_runs(home, capsys):
    assert kubectl.main(["serve"]) == 2
    assert "'serve' is not one of inspect, explain, report" in capsys.readouterr().err
    assert kubectl.main([]) == 2 and "usage: kubectl archway" in capsys.readouterr().err
    assert kubectl.main(["--help"]) == 0 and "usage: kubectl archway" in capsys.readouterr().out


def test_the_package_installs_the_plugin_beside_archway():
    with open(os.path.join(REPO, "pyproject.toml"), "rb") as f:
        scripts = tomllib.load(f)["project"]["scripts"]
    assert scripts["kubectl-archway"] == "archway.main.kubectl:main"
    module, _, function = scripts["kubectl-archway"].partition(":")
    assert callable(getattr(__import__(module, fromlist=[function]), function))

