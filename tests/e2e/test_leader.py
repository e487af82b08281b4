"""Two archway replicas against the real apiserver: one gate controller leads through the Lease;
when its process dies without a word (SIGKILL) the other takes over after the Lease duration and
releases the pods the first one left gated."""
import os
import signal

from .workloads import arches_of, create_pod, describe, gated, pod, wait_bound

LEASE_PATH = "/apis/coordination.k8s.io/v1/namespaces/{}/leases/archway-gate-controller"


def holder(kube, archway) -> str:
    return kube.get(LEASE_PATH.format(archway.namespace))["spec"].get("holderIdentity") or ""


def test_a_replica_takes_over_the_gate_controller_when_the_leader_is_killed(
        archway, kube, namespace, images, slow_registry):
    from lab.cluster.controlplane import stop_process
    first = holder(kube, archway)
    replica = archway.start_replica("archway-replica")
    # The first replica leaves (gracefully: it gives the Lease up), the second takes the lead,
    # then the first comes back as a follower.
    stop_process(archway.webhook.process)
    leader = kube.wait_for(lambda: (h := holder(kube, archway)) and h != first and h,
                           timeout=60, what="the second replica to lead")
    archway.restart_webhook()
    tag = images.fresh("e2e/arm64")
    name = "gated"
    created = create_pod(kube, namespace, pod(name, [images.ref("e2e/arm64", tag, via="slow")]))
    assert gated(created), describe(kube, namespace, name)

    os.killpg(replica.process.pid, signal.SIGKILL)   # the leader dies without releasing
    slow_registry.delay = 0.0
    bound = wait_bound(kube, namespace, name, 1, timeout=60)[0]
    assert arches_of(kube, [bound]) == {"arm64"}
    new_leader = holder(kube, archway)
    assert new_leader and new_leader != leader
