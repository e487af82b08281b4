"""The closed loop's cases against what a real kubelet writes (issue 48, finding 8): each fails
for real on the real node (containerd + runc refuse the binary: a real `exec format error`), and
archway acts on the statuses and logs the kubelet wrote, not on statuses a test made up.

- a container with terminationMessagePolicy FallbackToLogsOnError: the kubelet copies the log's
  tail into the terminated state's message, so archway learns from the status, no log read;
  an init container the kernel refuses: its log is read (no message); a StatefulSet learns on
  its own metadata, a CronJob through a Job made from it (on the CronJob, not the Job);
- an eviction a PodDisruptionBudget holds: EvictionBlocked, then evicted once the budget allows,
  the healthy pod it counted never touched;
- audit mode (the namespace's label, a PlacementPolicy): the Events and the metric, nothing that
  changes placement (no annotation, no eviction);
- a tag re-pushed with a build that runs: the exclusion reset, and the next pod runs on this
  machine's architecture for real;
- a gated pod of a workload that learned (archway started again, the registry answering
  nothing): released with the exclusion.

The arm64 Nodes are API-only: a pod bound there never runs (the refused image's arm64 entry is
never pulled)."""
import contextlib
import os
import signal
import time

import pytest

from lab.cluster.nodeimages import OciImage, go_binary, machine_arch, push_index
from lab.kube import pod_path
from tests.e2e.loop import app_pods, deployment_path, events
from tests.e2e.workloads import create_deployment, deployment, gated, node_arch

from .test_closed_loop import log_reads, preferring, ready, refused_multiarch_image
from .test_crash_loops import default_remediation
from .test_incluster import fresh_namespace, pause_image

FAILED = "archway.dev/failed-architectures"
EXCLUDED = "archway.dev/excluded-architectures"
EXEC_FORMAT_ERRORS = "archway_exec_format_errors_total"
TAG_TTL = 5


def counted(install, name: str, **labels) -> float:
    """A counter summed over archway's webhook pods (the leader's gate controller counts)."""
    total = 0.0
    for text in install.webhook_metrics():
        for line in text.splitlines():
            if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
                total += float(line.rsplit(" ", 1)[1])
    return total


def annotations_of(kube, path: str) -> dict:
    return kube.get(path)["metadata"].get("annotations") or {}


def bound_again(kube, namespace: str, app: str, gone: set[str]) -> list[dict]:
    """The pods of `app` bound to a node, none of whose uid is in `gone`."""
    return [p for p in app_pods(kube, namespace, app)
            if p["metadata"]["uid"] not in gone and p["spec"].get("nodeName")]


def terminated_of(pod: dict, key: str = "containerStatuses") -> list[dict]:
    """The terminated states (current or last) the kubelet wrote in the pod's `key` statuses."""
    found = []
    for status in pod["status"].get(key) or []:
        for where in ("state", "lastState"):
            if "terminated" in (status.get(where) or {}):
                found.append({"container": status["name"], **status[where]["terminated"]})
    return found


@pytest.mark.timeout(900)      # the session's install when first, then crash loops
def test_a_statefulset_learns_from_the_kubelets_message_and_a_cronjob_from_an_init_log(
        in_cluster, node_registry):
    install, plane = in_cluster, in_cluster.plane
    kube = plane.kube
    arch = machine_arch()
    default_remediation(install)
    namespace = fresh_namespace(plane, "cases")
    image = refused_multiarch_image(node_registry, f"node/refused-{namespace}")
    apps, batch = (f"/apis/apps/v1/namespaces/{namespace}",
                   f"/apis/batch/v1/namespaces/{namespace}")
    mark = plane.audit_mark()
    started = time.monotonic()

    # A StatefulSet whose container's failure leaves its log's tail as the message.
    template = preferring(deployment("db", [image], replicas=1,
                                     terminationGracePeriodSeconds=0), arch)["spec"]["template"]
    template["spec"]["containers"][0]["terminationMessagePolicy"] = "FallbackToLogsOnError"
    kube.create(f"{apps}/statefulsets", {
        "apiVersion": "apps/v1", "kind": "StatefulSet", "metadata": {"name": "db"},
        "spec": {"replicas": 1, "serviceName": "db", "selector": {"matchLabels": {"app": "db"}},
                 "template": template}})
    # A CronJob whose pods' init container the kernel refuses (no message: its log says why).
    job_template = {"spec": {"backoffLimit": 6, "template": {
        "metadata": {"labels": {"app": "nightly"}},
        "spec": {"restartPolicy": "OnFailure", "terminationGracePeriodSeconds": 0,
                 "initContainers": [{"name": "setup", "image": image}],
                 "containers": [{"name": "c0", "image": image}]}}}}
    cronjob = kube.create(f"{batch}/cronjobs", preferring({
        "apiVersion": "batch/v1", "kind": "CronJob", "metadata": {"name": "nightly"},
        "spec": {"schedule": "0 3 * * *", "jobTemplate": job_template}}, arch))

    def job_from_cronjob(name: str) -> dict:
        """What `kubectl create job NAME --from=cronjob/nightly` sends."""
        return kube.create(f"{batch}/jobs", {
            "apiVersion": "batch/v1", "kind": "Job", "metadata": {
                "name": name, "ownerReferences": [{
                    "apiVersion": "batch/v1", "kind": "CronJob", "name": "nightly",
                    "uid": cronjob["metadata"]["uid"], "controller": True}]},
            "spec": job_template["spec"]})
    job_from_cronjob("nightly-1")

    # Their first pods on the real node; what the kubelet writes of them, kept as seen.
    first = {app: kube.wait_for(lambda app=app: bound_again(kube, namespace, app, set()),
                                timeout=90, what=f"the {app} pod bound")[0]
             for app in ("db", "nightly")}
    assert {p["spec"]["nodeName"] for p in first.values()} == {install.node.name}
    gone = {p["metadata"]["uid"] for p in first.values()}
    seen: dict[str, list[dict]] = {}

    def learned(path: str):
        for app, key in (("db", "containerStatuses"), ("nightly", "initContainerStatuses")):
            for pod in app_pods(kube, namespace, app):
                if pod["metadata"]["uid"] in gone and terminated_of(pod, key):
                    seen[app] = terminated_of(pod, key)
        return annotations_of(kube, path).get(FAILED)
    for path in (f"{apps}/statefulsets/db", f"{batch}/cronjobs/nightly"):
        assert kube.wait_for(lambda path=path: learned(path), timeout=240,
                             what=f"the exec format error learned on {path}") == arch
    learned_after = time.monotonic() - started
    assert FAILED not in annotations_of(kube, f"{batch}/jobs/nightly-1")  # the CronJob's
    print(f"learned after {learned_after:.0f} s; the kubelet's terminated states: {seen}")

    # Each failing pod evicted, made again on arm64 (the StatefulSet's under the same name).
    again = {app: kube.wait_for(lambda app=app: bound_again(kube, namespace, app, gone),
                                timeout=120, what=f"the {app} pod evicted and made again")[0]
             for app in ("db", "nightly")}
    moved_after = time.monotonic() - started
    assert again["db"]["metadata"]["name"] == first["db"]["metadata"]["name"] == "db-0"
    for app, pod in again.items():
        assert node_arch(kube, pod["spec"]["nodeName"]) == "arm64", (app, pod["spec"])
        assert pod["metadata"]["annotations"][EXCLUDED] == arch
        assert events(kube, namespace, "EvictedExecFormatError", "Pod",
                      first[app]["metadata"]["name"])

    # The StatefulSet's container: learned from the status the kubelet wrote (its log's tail),
    # its log never read. The CronJob's init container: from its log, read.
    db_events = kube.wait_for(lambda: events(kube, namespace, "ExecFormatError", "Pod", "db-0"),
                              timeout=30, what="the StatefulSet pod's Event")
    print(f"the StatefulSet pod's Event: {db_events[0]['note']}")
    assert all("read in its status" in e["note"] and "exec format error" in e["note"].split(
        "read in its status", 1)[1] for e in db_events), db_events
    (init_event, *_) = kube.wait_for(lambda: events(
        kube, namespace, "ExecFormatError", "Pod", first["nightly"]["metadata"]["name"]),
        timeout=30, what="the CronJob pod's Event")
    print(f"the CronJob pod's Event: {init_event['note']}")
    assert "container setup" in init_event["note"] and "read in its log" in init_event["note"]
    for kind, name in (("StatefulSet", "db"), ("CronJob", "nightly")):
        assert kube.wait_for(lambda kind=kind, name=name: events(
            kube, namespace, "ExecFormatError", kind, name), timeout=30, what=f"the {kind}'s Event")
    reads = log_reads(plane, mark, namespace)
    assert not [name for name in reads if name.startswith("db-")], reads
    assert reads[first["nightly"]["metadata"]["name"]] and all(
        q["container"] == "setup" for q in reads[first["nightly"]["metadata"]["name"]]), reads

    # The CronJob's next run goes to arm64 from the start.
    job_from_cronjob("nightly-2")
    second = kube.wait_for(lambda: [p for p in bound_again(kube, namespace, "nightly", gone)
                                    if p["metadata"]["labels"].get("job-name") == "nightly-2"],
                           timeout=60, what="the second run's pod bound")[0]
    assert node_arch(kube, second["spec"]["nodeName"]) == "arm64"
    print(f"learned after {learned_after:.0f} s, both pods moved after {moved_after:.0f} s; "
          f"log reads: {reads}")


def pdb(kube, namespace: str, min_available: int) -> dict:
    """The PodDisruptionBudget `budget` over the pods labelled budget=app, once the disruption
    controller has seen it (the Eviction API refuses until then)."""
    path = f"/apis/policy/v1/namespaces/{namespace}/poddisruptionbudgets"
    if kube.exists(f"{path}/budget"):
        kube.patch(f"{path}/budget", {"spec": {"minAvailable": min_available}})
    else:
        kube.create(path, {"apiVersion": "policy/v1", "kind": "PodDisruptionBudget",
                           "metadata": {"name": "budget"},
                           "spec": {"minAvailable": min_available,
                                    "selector": {"matchLabels": {"budget": "app"}}}})
    return kube.wait_for(lambda: (b := kube.get(f"{path}/budget")).get("status", {}).get(
        "observedGeneration") == b["metadata"]["generation"] and b, timeout=30,
        what="the disruption controller to see the budget")


@pytest.mark.timeout(900)
def test_an_eviction_a_disruption_budget_holds_waits_until_the_budget_allows_it(
        in_cluster, node_registry):
    install, plane = in_cluster, in_cluster.plane
    kube = plane.kube
    arch = machine_arch()
    default_remediation(install)
    namespace = fresh_namespace(plane, "budget")
    image = refused_multiarch_image(node_registry, f"node/refused-{namespace}")
    # A healthy pod the budget counts, running for real on the real node.
    kube.create(pod_path(namespace), {"metadata": {"name": "healthy", "labels": {
        "budget": "app"}}, "spec": {"terminationGracePeriodSeconds": 0,
                                    "containers": [{"name": "c0",
                                                    "image": pause_image(node_registry)}]}})
    healthy = kube.wait_for(lambda: (p := kube.get(pod_path(namespace, "healthy"))) and ready(p)
                            and p, timeout=120, what="the healthy pod Ready")
    budget = pdb(kube, namespace, min_available=2)     # 1 healthy of 2 wanted: nothing may go
    assert budget["status"]["disruptionsAllowed"] == 0, budget["status"]
    blocked_before = counted(install, "archway_remediation_evictions_total", outcome="blocked")

    body = preferring(deployment("app", [image], replicas=1, terminationGracePeriodSeconds=0),
                      arch)
    body["spec"]["template"]["metadata"]["labels"]["budget"] = "app"
    started = time.monotonic()
    create_deployment(kube, namespace, body)
    (failing,) = kube.wait_for(lambda: bound_again(kube, namespace, "app", set()), timeout=90,
                               what="the Deployment's pod bound")
    name = failing["metadata"]["name"]
    assert failing["spec"]["nodeName"] == install.node.name

    (held,) = kube.wait_for(lambda: events(kube, namespace, "EvictionBlocked", "Pod", name),
                            timeout=240, what="an EvictionBlocked Event")
    blocked_after = time.monotonic() - started
    print(f"EvictionBlocked after {blocked_after:.0f} s: {held['note']}")
    assert "disruption budget" in held["note"], held["note"]
    assert counted(install, "archway_remediation_evictions_total",
                   outcome="blocked") > blocked_before
    pod = kube.get(pod_path(namespace, name))
    assert pod["metadata"]["uid"] == failing["metadata"]["uid"]
    assert pod["metadata"].get("deletionTimestamp") is None
    assert pod["status"]["phase"] == "Running", pod["status"]   # what a budget counts
    assert annotations_of(kube, deployment_path(namespace, "app"))[FAILED] == arch

    pdb(kube, namespace, min_available=1)    # 1 healthy of 1 wanted: the unhealthy one may go
    relaxed = time.monotonic()
    (replacement,) = kube.wait_for(
        lambda: bound_again(kube, namespace, "app", {failing["metadata"]["uid"]}) if not [
            p for p in app_pods(kube, namespace, "app") if p["metadata"]["name"] == name]
        else None, timeout=120, what="archway's next try to evict the pod")
    evicted_after = time.monotonic() - relaxed
    (evicted,) = kube.wait_for(lambda: events(kube, namespace, "EvictedExecFormatError", "Pod",
                                              name), timeout=30, what="the eviction's Event")
    assert "arm64" in evicted["note"], evicted["note"]
    assert node_arch(kube, replacement["spec"]["nodeName"]) == "arm64"
    after = kube.get(pod_path(namespace, "healthy"))       # never touched
    assert after["metadata"]["uid"] == healthy["metadata"]["uid"] and ready(after)
    assert not after["metadata"].get("deletionTimestamp")
    print(f"blocked after {blocked_after:.0f} s; evicted {evicted_after:.0f} s after the budget "
          f"allowed it")


@pytest.mark.timeout(900)
def test_in_audit_mode_a_real_exec_format_error_is_only_reported(in_cluster, node_registry):
    """By the namespace's label archway.dev/mode=audit, and by a PlacementPolicy's mode: audit."""
    install, plane = in_cluster, in_cluster.plane
    kube = plane.kube
    arch = machine_arch()
    default_remediation(install)
    stamp = int(time.time() * 1000) % 10**8
    by_label = plane.new_namespace(f"audit-label-{stamp}", labels={"archway.dev/mode": "audit"})
    by_policy = plane.new_namespace(f"audit-policy-{stamp}")
    kube.create(f"/apis/archway.dev/v1alpha1/namespaces/{by_policy}/placementpolicies", {
        "apiVersion": "archway.dev/v1alpha1", "kind": "PlacementPolicy",
        "metadata": {"name": "audit"},
        "spec": {"mode": "audit", "podSelector": {"matchLabels": {"app": "app"}}}})
    image = refused_multiarch_image(node_registry, f"node/refused-audit-{stamp}")
    # The policy in force for admission before the pod comes (its cache is a watch).
    kube.wait_for(lambda: (kube.create(pod_path(by_policy), {
        "metadata": {"generateName": "probe-", "labels": {"app": "app"}},
        "spec": {"containers": [{"name": "c0", "image": image}]}}, dryRun="All")["metadata"]
        .get("annotations") or {}).get("archway.dev/policy") == f"PlacementPolicy {by_policy}/audit",
        timeout=60, what="the audit PlacementPolicy in force")
    before = counted(install, EXEC_FORMAT_ERRORS, architecture=arch)
    started = time.monotonic()
    for namespace in (by_label, by_policy):
        create_deployment(kube, namespace, preferring(deployment(
            "app", [image], replicas=1, terminationGracePeriodSeconds=0), arch))

    failing, told = {}, {}
    for namespace in (by_label, by_policy):
        (failing[namespace],) = kube.wait_for(lambda namespace=namespace: bound_again(
            kube, namespace, "app", set()), timeout=90, what=f"the pod bound in {namespace}")
        assert failing[namespace]["spec"]["nodeName"] == install.node.name
        (told[namespace],) = kube.wait_for(lambda namespace=namespace: events(
            kube, namespace, "ExecFormatError", "Deployment", "app"), timeout=240,
            what=f"the Deployment's Event in {namespace}")
        assert "audit mode" in told[namespace]["note"], told[namespace]["note"]
        assert kube.wait_for(lambda namespace=namespace: events(
            kube, namespace, "ExecFormatError", "Pod", failing[namespace]["metadata"]["name"]),
            timeout=30, what=f"the pod's Event in {namespace}")
    reported_after = time.monotonic() - started
    assert kube.wait_for(lambda: counted(install, EXEC_FORMAT_ERRORS, architecture=arch)
                         >= before + 2 or None, timeout=30, what="the metric counted both")

    # The kubelet restarts each pod twice more after it was reported: had archway acted, it
    # would have by then. Same pod, on the real node, no annotation, no eviction.
    restarts = {ns: sum(s.get("restartCount", 0) for s in kube.get(pod_path(
        ns, failing[ns]["metadata"]["name"]))["status"].get("containerStatuses") or [])
        for ns in failing}
    for namespace, pod in failing.items():
        path = pod_path(namespace, pod["metadata"]["name"])
        kube.wait_for(lambda path=path, namespace=namespace: sum(
            s.get("restartCount", 0) for s in kube.get(path)["status"].get(
                "containerStatuses") or []) >= restarts[namespace] + 2 or None,
            timeout=180, what=f"the pod in {namespace} restarted twice more")
        now = kube.get(path)
        assert now["metadata"]["uid"] == pod["metadata"]["uid"]
        assert not now["metadata"].get("deletionTimestamp")
        assert FAILED not in annotations_of(kube, deployment_path(namespace, "app"))
        assert not events(kube, namespace, "EvictedExecFormatError")
        assert not events(kube, namespace, "EvictionBlocked")
        assert [p["metadata"]["uid"] for p in app_pods(kube, namespace, "app")] == [
            pod["metadata"]["uid"]]
    print(f"reported in audit mode after {reported_after:.0f} s: "
          f"{[e['note'] for e in told.values()]}")
    for namespace in (by_label, by_policy):
        kube.delete(f"/api/v1/namespaces/{namespace}")   # their crash loops end


def short_tag_ttl(install) -> None:
    """The chart's remediation, tags checked every TAG_TTL s: one `helm upgrade` at most."""
    config = install.archway_config
    if config.get("registry", {}).get("cache", {}).get("tag_ttl_seconds") == TAG_TTL \
            and "remediation" not in config:
        return
    config.pop("remediation", None)
    install.upgrade({"registry": {"cache": {"tag_ttl_seconds": TAG_TTL}}})


def default_tag_ttl(install) -> None:
    cache = install.archway_config.get("registry", {}).get("cache", {})
    if cache.pop("tag_ttl_seconds", None) is not None:
        if not cache:
            install.archway_config["registry"].pop("cache")
        install.upgrade({})


@pytest.mark.timeout(1200)     # two `helm upgrade --wait`s, a crash loop
def test_a_tag_repushed_with_a_build_that_runs_resets_the_exclusion_and_runs_here(
        in_cluster, node_registry):
    install, plane = in_cluster, in_cluster.plane
    kube = plane.kube
    arch = machine_arch()
    started = time.monotonic()
    short_tag_ttl(install)
    print(f"helm upgrade --wait (tag_ttl_seconds={TAG_TTL}): {time.monotonic() - started:.0f} s")
    try:
        namespace = fresh_namespace(plane, "repushed")
        repo = f"node/{namespace}"
        image = refused_multiarch_image(node_registry, repo)
        body = preferring(deployment("app", [image], replicas=1,
                                     terminationGracePeriodSeconds=0), arch)
        # A tag that moves is pulled again by the kubelet (else it runs what it has under it).
        body["spec"]["template"]["spec"]["containers"][0]["imagePullPolicy"] = "Always"
        started = time.monotonic()
        create_deployment(kube, namespace, body)
        (failing,) = kube.wait_for(lambda: bound_again(kube, namespace, "app", set()),
                                   timeout=90, what="the Deployment's pod bound")
        assert failing["spec"]["nodeName"] == install.node.name
        kube.wait_for(lambda: annotations_of(kube, deployment_path(namespace, "app")).get(FAILED),
                      timeout=240, what="the exec format error learned")
        learned_after = time.monotonic() - started
        (moved,) = kube.wait_for(lambda: bound_again(kube, namespace, "app",
                                                     {failing["metadata"]["uid"]}),
                                 timeout=120, what="the failing pod evicted and made again")
        assert node_arch(kube, moved["spec"]["nodeName"]) == "arm64"
        # The leader checks the tag at the registry (a HEAD per round) since it learned.
        mark = node_registry.mark()
        kube.wait_for(lambda: any(e.method == "HEAD" and f"/{repo}/manifests/multi" in e.path
                                  for e in node_registry.requests_since(mark)),
                      timeout=10 * TAG_TTL, what="the leader's check of the tag")

        # A fixed build under the same tag: this machine's binary runs now (a build of its own:
        # containerd names an image by any repository it pulled the same content from).
        runs = OciImage.of({"/pause": go_binary("pause"), "/build": namespace.encode()},
                           entrypoint=["/pause"])
        other = OciImage.of({"/pause": namespace.encode()}, entrypoint=["/pause"], arch="arm64")
        for part in (runs, other):
            part.push(node_registry, repo, part.digest.replace(":", "-"))
        fixed = push_index(node_registry, repo, "multi",
                           [runs.index_entry(), other.index_entry()])
        pushed = time.monotonic()
        kube.wait_for(lambda: FAILED not in annotations_of(kube, deployment_path(namespace, "app")),
                      timeout=20 * TAG_TTL, what="the leader to remove the learned exclusion")
        reset_after = time.monotonic() - pushed
        (reset,) = kube.wait_for(lambda: events(kube, namespace, "FailedArchitecturesReset",
                                                "Deployment", "app"), timeout=30,
                                 what="the FailedArchitecturesReset Event")
        assert arch in reset["note"] and fixed[:19] in reset["note"], reset["note"]

        # The pod on arm64 made again (a rollout would do as much): back on the real node, and
        # it runs there, for real.
        kube.delete(pod_path(namespace, moved["metadata"]["name"]))
        gone = {failing["metadata"]["uid"], moved["metadata"]["uid"]}

        (back,) = kube.wait_for(lambda: bound_again(kube, namespace, "app", gone), timeout=60,
                                what="the pod made again bound")
        assert back["spec"]["nodeName"] == install.node.name, back["spec"]
        path = pod_path(namespace, back["metadata"]["name"])
        back = kube.wait_for(lambda: (p := kube.get(path))["status"].get("phase") == "Running"
                             and ready(p) and p, timeout=120, what="the pod made again Running")
        assert EXCLUDED not in back["metadata"]["annotations"]
        (status,) = back["status"]["containerStatuses"]
        assert status["imageID"].rsplit("@", 1) in ([f"{node_registry.host}/{repo}", fixed],
                                                    [f"{node_registry.host}/{repo}", runs.digest]), status
        print(f"learned after {learned_after:.0f} s; reset {reset_after:.0f} s after the push; "
              f"the pod made again: {status['state']}, imageID {status['imageID']}")
    finally:
        default_tag_ttl(install)


def forget_image_records(kube, image: str) -> None:
    """Delete the cluster's image records (docs/image-records.md) of `image`: else archway's
    new pods are warm from them."""
    records = "/apis/archway.dev/v1alpha1/clusterimagerecords"
    path = image.split("/", 1)[1]          # the reference without its host
    for record in kube.items(records):
        if record["spec"]["reference"].endswith("/" + path):
            kube.delete(f"{records}/{record['metadata']['name']}")


def webhook_deployment(install) -> str:
    kube = install.plane.kube
    (name,) = [d["metadata"]["name"] for d in kube.items(
        f"/apis/apps/v1/namespaces/{install.namespace}/deployments")
        if d["spec"]["selector"]["matchLabels"].get("app.kubernetes.io/component") == "webhook"]
    return f"/apis/apps/v1/namespaces/{install.namespace}/deployments/{name}"


def rolled_out(kube, path: str) -> bool:
    deployment = kube.get(path)
    status, want = deployment["status"], deployment["spec"]["replicas"]
    return (status.get("observedGeneration") == deployment["metadata"]["generation"]
            and status.get("availableReplicas") == want and status.get("replicas") == want)


@contextlib.contextmanager
def frozen(registry):
    """The registry stopped (SIGSTOP) for the block: it accepts connections and answers none, a
    registry too slow for any lookup; it answers again after (SIGCONT), whatever happened."""
    pid = registry.server.proc.pid
    os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(pid, signal.SIGCONT)


@pytest.mark.timeout(900)     # a crash loop, a rollout of archway
def test_a_gated_pod_of_a_workload_that_learned_is_released_with_the_exclusion(
        in_cluster, node_registry):
    """A Deployment learned from a real failure here; archway starts again knowing nothing of
    its image (its caches die with its pods, the cluster's records of the image deleted) while
    the registry answers nothing: the next pod is gated, and the new leader places it once the
    registry answers, kept off the architecture its workload failed on."""
    install, plane = in_cluster, in_cluster.plane
    kube = plane.kube
    arch = machine_arch()
    default_remediation(install)
    namespace = fresh_namespace(plane, "gated")
    image = refused_multiarch_image(node_registry, f"node/{namespace}")
    create_deployment(kube, namespace, preferring(deployment(
        "app", [image], replicas=1, terminationGracePeriodSeconds=0), arch))
    (failing,) = kube.wait_for(lambda: bound_again(kube, namespace, "app", set()), timeout=90,
                               what="the Deployment's pod bound")
    assert failing["spec"]["nodeName"] == install.node.name
    (moved,) = kube.wait_for(lambda: bound_again(kube, namespace, "app",
                                                 {failing["metadata"]["uid"]}),
                             timeout=240, what="the failing pod learned, evicted, made again")
    assert node_arch(kube, moved["spec"]["nodeName"]) == "arm64"
    assert annotations_of(kube, deployment_path(namespace, "app"))[FAILED] == arch

    # archway's webhook pods (and with them the leader) all gone, the records of the image
    # deleted, the registry answering nothing: archway's new pods start knowing nothing of it.
    webhook = webhook_deployment(install)
    replicas = kube.get(webhook)["spec"]["replicas"]
    gone = {failing["metadata"]["uid"], moved["metadata"]["uid"]}
    with frozen(node_registry):
        try:
            kube.patch(webhook, {"spec": {"replicas": 0}})
            kube.wait_for(lambda: not kube.items(pod_path(install.namespace), labelSelector=(
                "app.kubernetes.io/component=webhook")), timeout=120,
                what="archway's webhook pods gone")
            forget_image_records(kube, image)
        finally:
            kube.patch(webhook, {"spec": {"replicas": replicas}})
            kube.wait_for(lambda: rolled_out(kube, webhook), timeout=240,
                          what="archway's webhook pods back")
        install.wait_until_webhook_acts(timeout=60)    # the Service reaches them again
        kube.delete(pod_path(namespace, moved["metadata"]["name"]), gracePeriodSeconds=0)
        (replacement,) = kube.wait_for(lambda: [
            p for p in app_pods(kube, namespace, "app") if p["metadata"]["uid"] not in gone],
            timeout=60, what="the replacement pod")
        assert gated(replacement), replacement
        assert not replacement["spec"].get("nodeName")
        thawed = time.monotonic()
    (bound,) = kube.wait_for(lambda: bound_again(kube, namespace, "app", gone), timeout=120,
                             what="the gated pod released and bound")
    released_after = time.monotonic() - thawed
    assert bound["metadata"]["uid"] == replacement["metadata"]["uid"]
    assert node_arch(kube, bound["spec"]["nodeName"]) == "arm64"
    assert bound["metadata"]["annotations"][EXCLUDED] == arch
    kube.wait_for(lambda: "Placed" in [e["reason"] for e in kube.events_for(
        namespace, bound["metadata"]["name"])], timeout=30, what="the Placed Event")
    print(f"the gated pod released {released_after:.1f} s after the registry answered again")
