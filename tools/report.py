"""`archway report [--target-arch ARCH] [--json]`: every workload in the cluster with its images'
architectures and whether it could move to ARCH — the migration readiness table operators
otherwise build by hand — and the architectures its pods run on now, flagging those its images
no longer offer (a tag re-pushed without one: the next reschedule there breaks).

Through the kubeconfig: Deployments, StatefulSets, DaemonSets, CronJobs, and the Jobs,
ReplicaSets and Pods no such workload controls (each workload once, at its top). Images are read
with the workload's pull secrets, as the webhook would. Progress goes to stderr; stdout is a
table for people or JSON for tools.
"""
import json
import sys
import time
from dataclasses import dataclass

from archway.cluster.workloads import Workload, controller_of, is_top_level, workloads_in
from archway.errors import ArchwayError
from archway.placement.archset import pod_arch_constraint
from archway.placement.decision import display_image
from archway.podview import PodView
from archway.vocabulary import common_architectures, told_architectures

from .kubeargs import add_cluster_options, with_cluster

# The order of the table: long-lived workloads first.
REPORTED_KINDS = ("Deployment", "StatefulSet", "DaemonSet", "CronJob", "Job", "ReplicaSet", "Pod")


@dataclass(frozen=True)
class Row:
    workload: Workload
    architectures: frozenset[str] | None    # S; None: no image told its architectures
    unreadable: tuple[str, ...]              # images that could not be read
    lacking: tuple[str, ...]                 # images without the target arch
    pinned: str                              # the pod's own arch constraint, when it excludes target
    movable: str                             # yes | no | unknown ("" without a target)
    running: frozenset[str] = frozenset()    # the architectures of the nodes its pods run on
    not_offered: tuple[str, ...] = ()        # of those, the ones its images no longer offer


def assess(workload: Workload, pod: PodView, results: dict, target: str | None,
           running: frozenset[str] = frozenset()) -> Row:
    """Pure: what the images of one workload say about moving it to `target`, and which of the
    architectures its pods run on (`running`) they no longer offer."""
    from archway.registry.model import ImageInfo
    mine = {image: results.get(image) for image in pod.images}
    told = told_architectures(mine, pod.os)
    archs = common_architectures(told)
    # Images as shown: a password in an https:// SIF URL never reaches the report.
    unreadable = tuple(display_image(i) for i, r in mine.items() if not isinstance(r, ImageInfo))
    lacking: tuple[str, ...] = ()
    pinned, movable = "", ""
    if target:
        lacking = tuple(display_image(i) for i, a in told.items() if target not in a)
        own = pod_arch_constraint(pod)
        if own is not None and not own.within(frozenset([target])):
            pinned = own.describe()
        if lacking or pinned:
            movable = "no"
        elif unreadable or archs is None:
            movable = "unknown"
        else:
            movable = "yes"
    not_offered = tuple(sorted(running - archs)) if archs else ()
    return Row(workload, archs, unreadable, lacking, pinned, movable, running, not_offered)


WorkloadKey = tuple[str, str, str]   # (kind, namespace, name)


def running_architectures(pods, owners: dict[WorkloadKey, tuple[str, str] | None],
                          node_archs: dict[str, str | None]) -> dict[WorkloadKey, frozenset[str]]:
    """Pure: workload -> the architectures of the nodes its pods are bound to. `pods`: (namespace,
    name, controller (kind, name) or None, node); `owners`: the controller of each ReplicaSet and
    Job, so a pod counts for its Deployment or CronJob."""
    running: dict[WorkloadKey, set[str]] = {}
    for namespace, name, controller, node in pods:
        arch = node_archs.get(node)
        if not arch:
            continue
        key: WorkloadKey = ("Pod", namespace, name)
        if controller is not None:
            key = (controller[0], namespace, controller[1])
            parent = owners.get(key)
            if parent is not None:
                key = (parent[0], namespace, parent[1])
        running.setdefault(key, set()).add(arch)
    return {key: frozenset(archs) for key, archs in running.items()}


def row_json(row: Row) -> dict:
    w = row.workload
    data = {"kind": w.kind, "namespace": w.namespace, "name": w.name,
            "images": [display_image(i) for i in PodView.of(w.pod).images],
            "architectures": sorted(row.architectures) if row.architectures is not None else None,
            "unreadable": list(row.unreadable)}
    if row.movable:
        data.update(movable=row.movable, lacking=list(row.lacking), pinned=row.pinned or None)
    data.update(running_architectures=sorted(row.running), not_offered=list(row.not_offered))
    return data


def table(rows: list[Row], target: str | None, placements: bool = True) -> str:
    """`placements`: where the pods run is known (the nodes could be read); RUNS ON says "?"
    otherwise."""
    header = ["NAMESPACE", "KIND", "NAME", "ARCHITECTURES", "RUNS ON"]
    if target:
        header += [f"TO {target.upper()}", "WHY NOT"]
    lines = [header]
    for row in rows:
        archs = ("unknown" if row.architectures is None
                 else ",".join(sorted(row.architectures)) or "none in common")
        runs = ",".join(sorted(row.running)) or ("-" if placements else "?")
        if row.not_offered:
            runs += f" (NOT OFFERED: {','.join(row.not_offered)})"
        cells = [row.workload.namespace or "-", row.workload.kind, row.workload.name, archs, runs]
        if target:
            why = ([f"{len(row.lacking)} image(s) lack {target}: {', '.join(row.lacking)}"]
                   if row.lacking else []) + ([f"pinned to {row.pinned}"] if row.pinned else []) \
                + ([f"unreadable: {', '.join(row.unreadable)}"] if row.unreadable else [])
            cells += [row.movable, "; ".join(why) or "-"]
        lines.append(cells)
    widths = [max(len(line[i]) for line in lines) for i in range(len(header) - 1)]
    return "".join("  ".join(c.ljust(w) for c, w in zip(line, widths)) + "  " + line[-1]
                   + "\n" for line in lines)


def summary(rows: list[Row]) -> dict:
    counts: dict = {"workloads": len(rows)}
    for row in rows:
        if row.movable:
            counts[row.movable] = counts.get(row.movable, 0) + 1
    return counts


# --- the command -------------------------------------------------------------------------------

def register(subparsers) -> None:
    from archway.registry.inspect import positive_seconds
    parser = subparsers.add_parser(
        "report", help="every workload in the cluster with its images' architectures",
        description="Through the kubeconfig, list every workload (Deployments, StatefulSets, "
                    "DaemonSets, CronJobs, and the Jobs, ReplicaSets and Pods none of them "
                    "controls) with the architectures its images share and, with --target-arch, "
                    "whether it could move to that architecture. Progress on stderr. Exit 0, "
                    "1 when some kinds of workload could not be listed, 2 (one line) when "
                    "none could.")
    parser.add_argument("--target-arch", metavar="ARCH",
                        help="say for each workload whether its images run on ARCH (arm64...)")
    parser.add_argument("-n", "--namespace", help="only this namespace (default: all)")
    add_cluster_options(parser)
    parser.add_argument("--json", action="store_true", help="print JSON")
    parser.add_argument("--timeout", type=positive_seconds, default=30.0, metavar="SECONDS",
                        help="wall-clock limit for reading the images of one namespace's "
                             "workloads (default 30)")
    parser.set_defaults(func=run)


def _whole_api(error: ArchwayError) -> str | None:
    """Why no list at all can succeed, when `error` says so (the API unreachable, or the
    credentials refused: not one kind refused); None otherwise."""
    from archway.kubeapi import ApiError  # the kubernetes client: not at `archway`'s start
    cause = error.__cause__
    if isinstance(cause, ApiError) and cause.status == 0:
        return str(cause)   # "Kubernetes API https://... unreachable: Connection refused"
    if isinstance(cause, ApiError) and cause.status == 401:
        return str(error)
    return None


def _progress(text: str) -> None:
    print(f"archway report: {text}", file=sys.stderr, flush=True)


class _Listing:
    """The workloads `report` lists, and on the way who controls each ReplicaSet and Job and
    where each pod runs."""

    def __init__(self):
        self.workloads: list[Workload] = []
        self.failed: list[str] = []
        self.owners: dict[WorkloadKey, tuple[str, str] | None] = {}
        self.placements: list[tuple] = []

    def read(self, reader, namespace: str | None) -> "_Listing":
        """The workloads of every kind that can be listed; ArchwayError, one line, when none
        can. A kind refused (RBAC) is skipped and said after the others."""
        skipped: list[str] = []
        for kind in REPORTED_KINDS:
            try:
                found = [w for obj in reader.workloads(kind, namespace) if self._seen(obj)
                         for w in workloads_in([obj])]
            except ArchwayError as e:
                whole = _whole_api(e)
                if whole is not None:   # every other kind would fail alike, each in its timeout
                    raise ArchwayError(f"could not list any workload: {whole}") from None
                self.failed.append(kind)
                skipped.append(f"skipped {kind}s: {e}")
                continue
            self.workloads += found
            _progress(f"{len(found)} {kind}(s)")
        if len(self.failed) == len(REPORTED_KINDS):
            raise ArchwayError(f"could not list any workload: {skipped[0].split(': ', 1)[1]}"
                               + (f" (and {len(skipped) - 1} other kinds)" if len(skipped) > 1
                                  else ""))
        for line in skipped:
            _progress(line)
        return self

    def _seen(self, obj: dict) -> bool:
        """Remember who controls it and where a pod runs; True when it is reported itself."""
        meta = obj.get("metadata") or {}
        controller = controller_of(obj)
        ref = (str(controller.get("kind")), str(controller.get("name"))) if controller else None
        if obj["kind"] in ("ReplicaSet", "Job"):
            self.owners[(obj["kind"], str(meta.get("namespace")), str(meta.get("name")))] = ref
        node = (obj.get("spec") or {}).get("nodeName") if obj["kind"] == "Pod" else None
        if node:
            self.placements.append((meta.get("namespace"), meta.get("name"), ref, node))
        return is_top_level(obj)

    def running(self, reader) -> dict[WorkloadKey, frozenset[str]] | None:
        """Workload -> the architectures its pods run on; None when the nodes cannot be read."""
        from archway.cluster.nodes import node_facts
        try:
            archs = {f.name: f.arch for f in map(node_facts, reader.nodes()) if f is not None}
        except ArchwayError as e:
            _progress(f"where pods run is not shown: {e}")
            return None
        return running_architectures(self.placements, self.owners, archs)


def _resolve(pods: list[PodView], reader, config, timeout: float) -> dict[int, dict]:
    """Pod index -> its images' answers, read with its pull secrets. One resolution per set of
    credentials (namespace, ServiceAccount, pull secrets): a namespace's workloads usually share
    them, and the resolver's cache shares the rest."""
    from archway.cluster.pullsecrets import PullSecrets
    from archway.objects.imagerecords import read_records
    from archway.registry.resolver import Resolver
    resolver = Resolver(config.registry, sif=config.sif)
    records = read_records(config, reader.api_client, resolver)   # what archway knows first
    try:
        return _resolve_groups(pods, resolver, PullSecrets(reader.api_client), timeout)
    finally:
        if records is not None:
            records.stop()


def _resolve_groups(pods: list[PodView], resolver, secrets, timeout: float) -> dict[int, dict]:
    groups: dict[tuple, list[int]] = {}
    for i, pod in enumerate(pods):
        groups.setdefault((pod.namespace, pod.service_account, pod.pull_secret_names),
                          []).append(i)
    results: dict[int, dict] = {}
    for n, members in enumerate(groups.values(), 1):
        first = pods[members[0]]
        images = [image for i in members for image in pods[i].images]
        _progress(f"reading {len(set(images))} image(s) of {len(members)} workload(s) in "
                  f"{first.namespace} ({n}/{len(groups)})")
        credentials = secrets.credentials_for(first, time.monotonic() + timeout)
        answers = resolver.resolve_many(images, timeout=timeout, keyring=credentials.keyring,
                                        scope=first.namespace)
        for i in members:
            results[i] = answers
    return results


def run(args) -> int:
    from archway.cluster.reads import ClusterReader
    from archway.config import load_config
    from archway.registry.platforms import normalize

    config = with_cluster(load_config(args.config), args)
    target = normalize("linux", args.target_arch).architecture if args.target_arch else None
    reader = ClusterReader.from_config(config)
    listing = _Listing().read(reader, args.namespace)
    running = listing.running(reader)
    pods = [PodView.of(w.pod) for w in listing.workloads]
    results = _resolve(pods, reader, config, args.timeout)
    rows = [assess(w, pods[i], results.get(i, {}), target,
                   (running or {}).get((w.kind, w.namespace, w.name), frozenset()))
            for i, w in enumerate(listing.workloads)]
    stranded = [r for r in rows if r.not_offered]
    if stranded:
        _progress(f"{len(stranded)} workload(s) run on an architecture their images no longer "
                  "offer (a reschedule there will not start): " + "; ".join(
                      f"{r.workload.namespace}/{r.workload.kind} {r.workload.name} "
                      f"({', '.join(r.not_offered)})" for r in stranded))
    if args.json:
        json.dump({"target_arch": target, "summary": summary(rows),
                   "workloads": [row_json(r) for r in rows]}, sys.stdout, indent=2)
        print()
    else:
        sys.stdout.write(table(rows, target, placements=running is not None))
        if target:
            counts = summary(rows)
            _progress(f"{counts.get('yes', 0)} of {len(rows)} workloads could move to {target}; "
                      f"{counts.get('no', 0)} could not; {counts.get('unknown', 0)} unknown")
    return 1 if listing.failed else 0
