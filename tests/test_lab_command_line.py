"""The lab's command line (lab/__main__.py, behind scripts/cluster.sh) before it starts anything:
each command runs its own function, the refusals, and which Nodes the control plane makes for
each way of starting (issue 34, finding 8: with KWOK's Nodes, no API-only Node beside them).
Starting for real: tests/e2e/test_cluster_script.py."""
import pytest

from lab import __main__ as lab_main
from lab.cluster import realnode
from lab.cluster.controlplane import DEFAULT_NODES, ControlPlane


@pytest.fixture(autouse=True)
def own_state_home(tmp_path, monkeypatch):
    """Where `up` records its state folder: this test's, never the user's."""
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "xdg-state"))
    monkeypatch.delenv("ARCHWAY_CLUSTER_DIR", raising=False)


def parsed(*argv: str):
    return lab_main.parse(["--state-dir", "/nonexistent/lab-state", *argv])


@pytest.mark.parametrize(("command", "function"), [
    (["up"], lab_main.up), (["up", "--kwok-nodes", "6"], lab_main.up),
    (["down"], lab_main.down), (["status"], lab_main.status)])
def test_each_command_runs_its_own_function(command, function):
    assert parsed(*command).func is function


def test_status_and_down_of_no_cluster(tmp_path, capsys):
    state = str(tmp_path / "cluster")
    assert lab_main.main(["--state-dir", state, "status"]) == 3
    assert lab_main.main(["--state-dir", state, "down"]) == 0
    assert f"no cluster in {state}" in capsys.readouterr().out


def test_down_and_status_in_a_new_shell_find_the_cluster_up_started(tmp_path, monkeypatch, capsys):
    """Issue 38, finding 9: `ARCHWAY_CLUSTER_DIR=X cluster.sh up`, then `cluster.sh down` in a
    new shell (no variable) stopped nothing: it looked in the default folder."""
    elsewhere = tmp_path / "elsewhere"
    monkeypatch.setenv("ARCHWAY_CLUSTER_DIR", str(elsewhere))
    lab_main.prepare(lab_main.parse(["up"]))          # what `up` does before it starts anything
    monkeypatch.delenv("ARCHWAY_CLUSTER_DIR")
    default = str(tmp_path / "xdg-state" / "archway" / "cluster")
    assert lab_main.parse(["down"]).state_dir == str(elsewhere)
    assert lab_main.parse(["status"]).state_dir == str(elsewhere)
    assert lab_main.parse(["up"]).state_dir == default        # a new `up` goes where it always did
    assert lab_main.parse(["--state-dir", "/x", "down"]).state_dir == "/x"
    assert lab_main.main(["down"]) == 0                       # nothing ran there: the record goes
    assert f"no cluster in {elsewhere}" in capsys.readouterr().err
    assert lab_main.parse(["down"]).state_dir == default


@pytest.mark.parametrize("others", [["--kwok-nodes", "3"], ["--real-node"], ["--in-cluster"]])
def test_karpenter_goes_with_no_other_nodes(tmp_path, capsys, others):
    state = tmp_path / "cluster"
    assert lab_main.main(["--state-dir", str(state), "up", "--karpenter", *others]) == 2
    assert "--karpenter makes its own Nodes" in capsys.readouterr().err
    assert not state.exists()


def test_an_archway_config_that_is_no_mapping_is_refused(tmp_path, capsys):
    fragment = tmp_path / "archway.yaml"
    fragment.write_text("- a list\n")
    assert lab_main.main(["--state-dir", str(tmp_path / "cluster"), "up",
                          "--archway-config", str(fragment)]) == 2
    assert "must hold a YAML mapping" in capsys.readouterr().err


def nodes_made(*argv: str, monkeypatch) -> tuple:
    """The (name, arch) Nodes the control plane of `up *argv` makes."""
    monkeypatch.setattr(realnode, "node_address", lambda: "192.0.2.2")   # no routing table read
    return ControlPlane("/nonexistent/lab-state", **lab_main.plane_options(parsed("up", *argv))).nodes


def test_only_kwok_plays_the_nodes_of_up_with_kwok_nodes(monkeypatch):
    assert nodes_made(monkeypatch=monkeypatch) == DEFAULT_NODES
    assert nodes_made("--kwok-nodes", "6", monkeypatch=monkeypatch) == ()
    assert nodes_made("--karpenter", monkeypatch=monkeypatch) == ()
    assert nodes_made("--real-node", "--kwok-nodes", "6", monkeypatch=monkeypatch) == ()


def test_the_real_node_keeps_the_api_only_nodes_of_the_other_architectures(monkeypatch):
    monkeypatch.setattr(realnode, "machine_arch", lambda: "arm64")
    for argv in (["--real-node"], ["--in-cluster"]):
        assert nodes_made(*argv, monkeypatch=monkeypatch) == (
            ("amd64-1", "amd64"), ("amd64-2", "amd64"), ("ppc64le-1", "ppc64le"))
