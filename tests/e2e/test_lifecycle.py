"""archway's own lifecycle against the real apiserver: gating works from the first admission the
readiness probe lets in, and a gate controller that dies is started again and gates and
releases as before."""
import os
import signal

from lab.procs import wait_until

from .workloads import arches_of, create_pod, describe, gated, pod, wait_bound


def controller_pid(archway) -> int | None:
    """The gate controller process beside the webhook's gunicorn master."""
    master = archway.webhook.process.pid
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat", "rb") as f:
                fields = f.read().split(b") ", 1)[1].split()
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmdline = f.read()
        except OSError:
            continue
        if int(fields[1]) == master and b"archway.gate.process" in cmdline and fields[0] != b"Z":
            return int(pid)
    return None


def test_the_first_misses_after_a_start_are_gated(archway, kube, namespace, images, slow_registry):
    archway.restart_webhook()          # returns as soon as /readyz answers 200
    tags = [images.fresh("e2e/arm64") for _ in range(4)]
    for i, tag in enumerate(tags):
        created = create_pod(kube, namespace, pod(f"first-{i}", [images.ref("e2e/arm64", tag,
                                                                              via="slow")]))
        assert gated(created), describe(kube, namespace, f"first-{i}")
    slow_registry.delay = 0.0
    for i in range(len(tags)):
        assert arches_of(kube, wait_bound(kube, namespace, f"first-{i}", 1, timeout=30)) == {"arm64"}


def test_a_killed_gate_controller_is_started_again_and_releases_gated_pods(
        archway, kube, namespace, images, slow_registry):
    first = wait_until(lambda: controller_pid(archway), timeout=20, what="the gate controller")
    os.kill(first, signal.SIGKILL)
    second = wait_until(lambda: (pid := controller_pid(archway)) and pid != first and pid,
                        timeout=20, what="the gate controller to be started again")
    facts = wait_until(lambda: (r := archway.webhook.get("/readyz").json()).get(
        "gate_controller") == "leader alive" and r, timeout=30, what="a leader again")
    assert "restarted 1 time" in facts["gate_controller_process"], facts
    assert archway.webhook.get("/healthz").status_code == 200
    metrics = archway.webhook.get("/metrics").text
    assert "archway_gate_controller_restarts_total 1.0" in metrics

    created = create_pod(kube, namespace, pod("after-restart", [
        images.ref("e2e/arm64", images.fresh("e2e/arm64"), via="slow")]))
    assert gated(created), describe(kube, namespace, "after-restart")
    slow_registry.delay = 0.0
    bound = wait_bound(kube, namespace, "after-restart", 1, timeout=30)
    assert arches_of(kube, bound) == {"arm64"}
    assert controller_pid(archway) == second
