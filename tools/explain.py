"""`archway explain -f FILE|DIR|-` and `archway explain pod/NAME -n NS`: what archway would do.

For every workload in the manifests (a file, every manifest under a directory, or stdin) or one
live pod, the images with their architectures and the patch archway would apply under the
current config, preferred terms and tolerations included: the pre-flight check a CI job runs on `helm template | archway explain -f -`.
Exit 0 when every workload can run somewhere, 1 when one cannot (no common architecture, or
its own kubernetes.io/arch pin excludes its images' architectures) or an image could not be
read, 2 on usage errors.

The decision is `placement.decide`, the webhook's own; this module only gathers its inputs and
prints its answer. Nothing heavy is imported before the command runs (see archway/metrics.py).
"""
import json
import os
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import yaml

from archway.errors import ArchwayError
from archway.podview import PodShapeError, PodView
from archway.vocabulary import (
    ANNOTATION_FAILED,
    join_architectures,
    share_no_architecture,
    told_architectures,
)
from archway.webhook.learning import Learned
from archway.webhook.placement import Decision, decide, display_image
from archway.webhook.policy import Policy
from archway.workloads import Workload, workloads_in

if TYPE_CHECKING:   # the policy modules read the cluster: imported when a command runs
    from archway.webhook.placementpolicies import InForce

    from .explainpolicy import KnownPolicies

MAX_MANIFEST_BYTES = 64 * 1024 * 1024
EXIT_OK, EXIT_CANNOT_RUN, EXIT_USAGE = 0, 1, 2


@dataclass(frozen=True)
class Explanation:
    workload: Workload
    results: dict                 # image -> ImageInfo | ArchwayError
    decision: Decision
    annotations: dict | None = None   # a live pod's archway.dev/* annotations
    events: tuple = ()                # a live pod's (and its controller's) archway Events
    learned: Learned | None = None    # what the live pod's workload learned (learning.py)
    in_force: "InForce | None" = None   # the policy it was judged under, and what shaped it
    pod: PodView | None = None        # the pod template read: its OS and image volumes

    @property
    def os(self) -> str:
        """The pod's OS (`kubernetes.io/os`): which platforms of its images count."""
        return self.pod.os if self.pod is not None else "linux"

    @property
    def unreadable(self) -> list[str]:
        from archway.registry.model import ImageInfo
        return [image for image, result in self.results.items()
                if not isinstance(result, ImageInfo)]

    @property
    def can_run(self) -> bool:
        """Some architecture runs every image and the pod's own arch pin allows it, and every
        image could be read."""
        return not self.cannot_run and not self.unreadable

    @property
    def cannot_run(self) -> str:
        """Why no node of any architecture can run the workload ("" when one can, or unknown)."""
        d = self.decision
        if not d.allowed:
            return d.message
        if d.architectures == frozenset():
            return share_no_architecture(told_architectures(self.results, self.os), self.results, self.os)
        return d.conflict


def explain_workload(workload: Workload, results: dict, policy: Policy, *, nodes=None,
                     annotations=None, events=(), learned: Learned | None = None,
                     known: "KnownPolicies | None" = None, namespace_object: dict | None = None,
                     archway_scheduler: str | None = None) -> Explanation:
    """`known`: the policy objects and Namespaces to judge it under (the webhook's precedence);
    None: `policy` as it is."""
    pod = _view(workload)
    mine = {image: results.get(image) for image in pod.images}
    in_force = None
    if known is not None:
        in_force = known.in_force(policy, dict(pod.labels), workload.namespace or "default",
                                  namespace_object=namespace_object,
                                  archway_scheduler=archway_scheduler)
        policy = in_force.policy
    decision = decide(pod, mine, policy, nodes=nodes, learned=learned,
                      node_oses=frozenset(n.os for n in nodes) if nodes is not None else None)
    return Explanation(workload, mine, decision, annotations, tuple(events), learned, in_force, pod)


def load_manifests(text: str, origin: str) -> list:
    """Multi-document YAML (JSON is YAML); ArchwayError when it does not parse."""
    try:
        return [doc for doc in yaml.safe_load_all(text) if doc is not None]
    except yaml.YAMLError as e:
        raise ArchwayError(f"{origin} is not valid YAML or JSON: {e}") from None


MANIFEST_SUFFIXES = (".yaml", ".yml", ".json")


def manifest_files(directory: str) -> list[str]:
    """Every *.yaml, *.yml and *.json under `directory`, sorted by path; hidden files and
    directories (.git) skipped."""
    found = []
    for root, dirs, files in os.walk(directory):
        dirs[:] = [d for d in dirs if not d.startswith(".")]
        found += [os.path.join(root, name) for name in files
                  if name.endswith(MANIFEST_SUFFIXES) and not name.startswith(".")]
    return sorted(found)


def read_sources(path: str) -> list[tuple[str, str]]:
    """(text, origin) of each manifest file of -f PATH: a file, a directory (every manifest
    under it) or - (stdin); all of them together bounded in size."""
    if path != "-" and os.path.isdir(path):
        files = manifest_files(path)
        if not files:
            raise ArchwayError(f"no *.yaml, *.yml or *.json file under {path}")
    else:
        files = [path]
    sources, size = [], 0
    for file in files:
        text, origin = read_source(file, MAX_MANIFEST_BYTES - size)
        size += len(text)
        sources.append((text, origin))
    return sources


def read_source(path: str, limit: int = MAX_MANIFEST_BYTES) -> tuple[str, str]:
    """(text, origin) of one file or - (stdin), at most `limit` characters."""
    if path == "-":
        text, origin = sys.stdin.read(limit + 1), "stdin"
    else:
        try:
            with open(path, encoding="utf-8") as f:
                text = f.read(limit + 1)
        except FileNotFoundError:
            raise ArchwayError(f"no such file: {path}") from None
        except (OSError, UnicodeDecodeError) as e:
            raise ArchwayError(f"cannot read {path}: {getattr(e, 'strerror', None) or e}") from None
        origin = path
    if len(text) > limit:
        raise ArchwayError(f"{origin} makes the manifests larger than {MAX_MANIFEST_BYTES} bytes")
    return text, origin


# --- output ------------------------------------------------------------------------------------

def image_json(image: str, result, os: str = "linux", volume: str = "") -> dict:
    """One image of a workload: its architectures for the pod's OS `os`, every platform, the
    image volume it is pulled for (`volume`), or its error."""
    from archway.registry.inspect import normalized, pinned
    from archway.registry.model import ImageInfo
    reference = normalized(image)
    row = {"image": display_image(image),
           "reference": display_image(reference) if reference else None, "volume": volume or None}
    if isinstance(result, ImageInfo):
        return {**row, "architectures": sorted(result.architectures_for(os)),
                "platforms": sorted(str(p) for p in result.platforms), "digest": result.digest,
                "pinned": pinned(image, result.digest), "source": result.source,
                "note": result.note or None, "error": None}
    return {**row, "architectures": [], "platforms": [], "digest": None, "pinned": None,
            "source": None, "note": None, "error": str(result) if result is not None else "no answer"}


def _image_rows(explanation: "Explanation") -> list[dict]:
    pod = explanation.pod
    return [image_json(image, result, explanation.os, pod.volume_name(image) if pod else "")
            for image, result in explanation.results.items()]


def to_json(explanation: Explanation) -> dict:
    w, d = explanation.workload, explanation.decision
    data: dict[str, Any] = {
        "kind": w.kind, "namespace": w.namespace, "name": w.name, "origin": w.origin,
        "os": explanation.os, "images": _image_rows(explanation),
        "architectures": sorted(d.architectures) if d.architectures is not None else None,
        "can_run": explanation.can_run, "cannot_run": explanation.cannot_run or None,
        "allowed": d.allowed, "outcome": d.outcome,
        "would": d.would or None, "reason": d.reason, "message": d.message or None,
        "warnings": list(d.warnings), "patch": list(d.patch),
        "policy": _policy_json(explanation.in_force),
    }
    if explanation.annotations is not None:
        data["annotations"] = explanation.annotations
        data["events"] = list(explanation.events)
        learned = explanation.learned
        data["learned"] = None if learned is None else {
            "workload": learned.workload, "architectures": sorted(learned.architectures),
            "evidence": [e.to_json() for e in learned.evidence],
            "excluded": sorted(d.excluded), "note": d.learned or None,
            "problem": learned.problem or None}
    return data


def to_text(explanation: Explanation) -> str:
    w, d = explanation.workload, explanation.decision
    lines = [f"{w.display_name}" + (f"  ({w.origin})" if w.origin else "")]
    lines += _image_lines(_image_rows(explanation), explanation.os)
    on_os = "" if explanation.os == "linux" else f" ({explanation.os})"
    if explanation.cannot_run:
        lines.append(f"  CANNOT RUN: {explanation.cannot_run}")
    elif d.architectures is None:
        lines.append(f"  runs on: unknown (no image told its architectures){on_os}")
    else:
        lines.append(f"  runs on: {join_architectures(d.architectures)}{on_os}")
    lines += _policy_lines(explanation.in_force)
    if explanation.learned is not None:
        lines += _learned_lines(explanation.learned, d)
    lines += _decision_lines(d)
    if explanation.annotations is not None:
        lines += _live_lines(explanation.annotations, explanation.events)
    return "\n".join(lines) + "\n"


def _image_lines(rows: list[dict], os: str) -> list[str]:
    lines = []
    for row in rows:
        shown = row["image"] + (f"  ->  {row['reference']}"
                                if row["reference"] and row["reference"] != row["image"] else "")
        lines.append(f"  image {shown}" + (f"  (image volume '{row['volume']}')"
                                           if row["volume"] else ""))
        if row["error"]:
            lines.append(f"    error: {row['error']}")
            continue
        archs = " ".join(row["architectures"]) or ("unknown" if not row["platforms"]
                                                   else f"none for {os}")
        lines.append(f"    architectures: {archs}"
                     f"  ({row['source']}, {row['pinned'] or row['digest'] or 'no digest'})")
        if row["platforms"] and any(not p.startswith(os + "/") for p in row["platforms"]):
            lines.append(f"    platforms: {' '.join(row['platforms'])}")
        if row["note"] and not row["platforms"]:
            lines.append(f"    note: {row['note']}")
    return lines or ["  no images"]


def _decision_lines(d: Decision) -> list[str]:
    lines = [f"  audit mode: enforce would have {d.would}"] if d.would else []
    if d.patch:
        lines.append("  archway would apply this JSON patch:")
        lines += ["    " + line for line in yaml.safe_dump(
            list(d.patch), sort_keys=False, width=100).rstrip().splitlines()]
    elif d.allowed:
        lines.append(f"  archway would change nothing ({d.reason})")
    return lines + [f"  warning: {warning}" for warning in d.warnings]


def _policy_lines(in_force) -> list[str]:
    from .explainpolicy import policy_lines
    return policy_lines(in_force)


def _policy_json(in_force) -> dict | None:
    from .explainpolicy import policy_json
    return policy_json(in_force)


def _live_lines(annotations: dict, events) -> list[str]:
    """What archway wrote on a live pod: its annotations and Events."""
    lines = ["  archway annotations on the pod:" if annotations
             else "  archway annotations on the pod: none"]
    lines += [f"    {key}: {value}" for key, value in sorted(annotations.items())]
    return lines + [f"  event {event['type']} {event['reason']} on "
                    f"{event['object']}: {event['message']}" for event in events]


def _learned_lines(learned: Learned, d: Decision) -> list[str]:
    lines = [f"  learned: {learned.workload} failed with exec format error on "
             f"{join_architectures(learned.architectures)} (annotation {ANNOTATION_FAILED})"]
    for e in learned.evidence:
        lines.append(f"    {e.architecture}: {display_image(e.image)}"
                     f"{'@' + e.digest if e.digest and '@' not in e.image else ''}")
    if learned.problem:
        lines.append(f"    {learned.problem}")
    if d.excluded:
        lines.append(f"  kept off: {join_architectures(d.excluded)} (new pods of "
                     f"{learned.workload} are not placed there)")
    elif d.learned:
        lines.append(f"  not kept off: {d.learned}")
    return lines


def emit(explanations: list[Explanation], as_json: bool) -> int:
    if as_json:
        json.dump([to_json(e) for e in explanations], sys.stdout, indent=2)
        print()
    else:
        sys.stdout.write("\n".join(to_text(e) for e in explanations))
    return EXIT_OK if all(e.can_run for e in explanations) else EXIT_CANNOT_RUN


# --- the command -------------------------------------------------------------------------------

def register(subparsers) -> None:
    from archway.registry.inspect import positive_seconds
    parser = subparsers.add_parser(
        "explain", help="show what archway would do with workloads in manifests or a live pod",
        description="For every Pod, Deployment, StatefulSet, DaemonSet, ReplicaSet, Job and "
                    "CronJob in the manifests (-f FILE, -f DIR for every *.yaml, *.yml and "
                    "*.json under it, or -f - for stdin; multi-document YAML or JSON, Lists "
                    "opened), or for one live pod (pod/NAME -n NAMESPACE, through "
                    "the kubeconfig), print the images with their architectures and the patch "
                    "archway would apply under the current config. Exit 0 when every workload "
                    "can run somewhere, 1 when one cannot (no common architecture, or its own "
                    "kubernetes.io/arch pin excludes its images' architectures) or an image "
                    "could not be read, 2 on usage errors.")
    parser.add_argument("target", nargs="?", metavar="pod/NAME",
                        help="a live pod, read through the kubeconfig")
    parser.add_argument("-f", "--filename", metavar="FILE",
                        help="manifests to explain: a file, a directory (every *.yaml, *.yml "
                             "and *.json under it) or - for stdin")
    parser.add_argument("-n", "--namespace", default="default",
                        help="namespace of pod/NAME (default: %(default)s)")
    parser.add_argument("--json", action="store_true", help="print a JSON list")
    parser.add_argument("--timeout", type=positive_seconds, default=30.0, metavar="SECONDS",
                        help="wall-clock limit for reading the images (default 30)")
    parser.set_defaults(func=run)


def run(args) -> int:
    from archway.config import load_config
    if bool(args.filename) == bool(args.target):
        print("archway explain: give either -f FILE|- or pod/NAME", file=sys.stderr)
        return EXIT_USAGE
    config = load_config(args.config)
    policy = Policy.from_config(config)
    if args.filename:
        return emit(explain_manifests(args.filename, config, policy, args.timeout), args.json)
    kind, _, name = args.target.partition("/")
    if kind not in ("pod", "pods", "po") or not name:
        print(f"archway explain: {args.target!r}: only pod/NAME can be explained live; "
              "use -f for manifests", file=sys.stderr)
        return EXIT_USAGE
    return emit([explain_live_pod(name, args.namespace, config, policy, args.timeout)], args.json)


def explain_manifests(path: str, config, policy: Policy, timeout: float) -> list[Explanation]:
    from archway.registry.resolver import Resolver
    workloads = [workload for text, origin in read_sources(path)
                 for workload in workloads_in(load_manifests(text, origin), origin)]
    if not workloads:
        print(f"archway explain: no Pod or workload in {'stdin' if path == '-' else path}",
              file=sys.stderr)
        return []
    from .explainpolicy import KnownPolicies, read_from_cluster
    known = KnownPolicies()
    for text, origin in read_sources(path):
        known.add(load_manifests(text, origin), origin)
    read_from_cluster(known, config)
    pods = [_view(w) for w in workloads]
    images = [image for pod in pods for image in pod.images]
    results = Resolver(config.registry, sif=config.sif).resolve_many(images, timeout=timeout)
    return [explain_workload(w, results, policy, known=known,
                             archway_scheduler=config.placement.archway_scheduler)
            for w in workloads]


def explain_live_pod(name: str, namespace: str, config, policy: Policy,
                     timeout: float) -> Explanation:
    import time

    from archway.cluster import ClusterReader
    from archway.nodes import node_facts
    from archway.registry.resolver import Resolver
    from archway.webhook.imagerecords import read_records
    from archway.webhook.pullsecrets import PullSecrets

    from .explainpolicy import KnownPolicies, read_from_cluster

    reader = ClusterReader.from_config(config)
    workload = Workload("Pod", namespace, name, reader.pod(namespace, name))
    pod = _view(workload)
    known = KnownPolicies()
    read_from_cluster(known, config)
    credentials = PullSecrets(reader.api_client).credentials_for(pod, time.monotonic() + timeout)
    resolver = Resolver(config.registry, sif=config.sif)
    records = read_records(config, reader.api_client, resolver)   # what archway knows first
    try:
        results = resolver.resolve_many(pod.images, timeout=timeout, keyring=credentials.keyring,
                                        scope=namespace)
    finally:
        if records is not None:
            records.stop()
    nodes = [f for f in map(node_facts, _nodes(reader)) if f is not None]
    annotations = {k: v for k, v in pod.annotations.items() if k.startswith("archway.dev/")}
    top = live_workload(reader, pod)
    learned = top.learned if top and config.remediation.learn_failed_architectures else None
    return explain_workload(workload, results, policy, nodes=nodes or None,
                            annotations=annotations,
                            events=archway_events(reader, pod, top.object_name if top else None),
                            learned=learned, known=known,
                            namespace_object=reader.namespace(namespace),
                            archway_scheduler=config.placement.archway_scheduler)


def live_workload(reader, pod: PodView):
    """The pod's top workload (workloadcache.WorkloadFacts) read through the API, or None (no
    controller, a kind archway does not know, or not readable)."""
    from archway.webhook.workloadcache import pod_owner, top_workload, workload_facts

    def lookup(kind: str, namespace: str, name: str):
        try:
            return workload_facts(kind)(reader.workload(kind, namespace, name))
        except ArchwayError:
            return None
    return top_workload(pod.namespace, pod_owner(pod), lookup)


def archway_events(reader, pod: PodView, workload: str | None = None) -> list[dict]:
    """archway's Events about the pod, its controller or its workload (admission Events go to
    the controller when the pod had no name yet; exec format errors also to the workload)."""
    from archway.webhook.events import REPORTING_CONTROLLER
    names = {pod.name} | {o.name for o in pod.owner_references if o.controller}
    if workload:
        names.add(workload)
    found = []
    for event in reader.events(pod.namespace):
        regarding = event.get("regarding") or {}
        if event.get("reportingController") == REPORTING_CONTROLLER and regarding.get("name") in names:
            found.append({"type": event.get("type", ""), "reason": event.get("reason", ""),
                          "object": f"{regarding.get('kind', '')}/{regarding.get('name', '')}",
                          "message": event.get("note", ""), "time": event.get("eventTime")})
    return found


def _nodes(reader) -> Iterable[dict]:
    try:
        return reader.nodes()
    except ArchwayError:
        return []   # no RBAC for nodes: the cluster's nodes are simply not consulted


def _view(workload: Workload) -> PodView:
    try:
        return PodView.of(workload.pod)
    except PodShapeError as e:
        raise ArchwayError(f"{workload.display_name} ({workload.origin}): {e}") from None

