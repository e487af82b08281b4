"""`archway explain -f FILE|DIR|-` and `archway explain pod/NAME -n NS`: what archway would do.

For every workload in the manifests (a file, every manifest under a directory, or stdin) or one
live pod, the images with their architectures and the patch archway would apply under the
current config, preferred terms and tolerations included: the pre-flight check a CI job runs
on `helm template | archway explain -f -`.
Exit 0 when every workload can run somewhere, 1 when one cannot (no common architecture, or
its own kubernetes.io/arch pin excludes its images' architectures) or an image could not be
read, 2 on usage errors.

The decision is `placement.decide`, the webhook's own (explanation.py); this module is the
command: it gathers the inputs (manifests.py, livepod.py) and prints the answers. Nothing heavy
is imported before the command runs (see archway/metrics.py).
"""
import json
import sys

from archway.cluster.workloads import workloads_in
from archway.placement.policy import Policy

from .explanation import Explanation, explain_workload, pod_view, to_json, to_text
from .kubeargs import add_cluster_options, with_cluster
from .manifests import load_manifests, read_sources

EXIT_OK, EXIT_CANNOT_RUN, EXIT_USAGE = 0, 1, 2


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
    parser.add_argument("-n", "--namespace",
                        help="namespace of pod/NAME (default: the kubeconfig context's, as "
                             "kubectl's; in a pod its own; else default)")
    add_cluster_options(parser)
    parser.add_argument("--json", action="store_true", help="print a JSON list")
    parser.add_argument("--timeout", type=positive_seconds, default=30.0, metavar="SECONDS",
                        help="wall-clock limit for reading the images (default 30)")
    parser.set_defaults(func=run)


def run(args) -> int:
    from archway.config import load_config
    if bool(args.filename) == bool(args.target):
        print("archway explain: give either -f FILE|- or pod/NAME", file=sys.stderr)
        return EXIT_USAGE
    config = with_cluster(load_config(args.config), args)
    policy = Policy.from_config(config)
    if args.filename:
        return emit(explain_manifests(args.filename, config, policy, args.timeout), args.json)
    kind, _, name = args.target.partition("/")
    if kind not in ("pod", "pods", "po") or not name:
        print(f"archway explain: {args.target!r}: only pod/NAME can be explained live; "
              "use -f for manifests", file=sys.stderr)
        return EXIT_USAGE
    from archway.kubeclient import current_namespace

    from .livepod import explain_live_pod
    namespace = args.namespace or current_namespace(config.kubernetes)
    return emit([explain_live_pod(name, namespace, config, policy, args.timeout)], args.json)


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
    pods = [pod_view(w) for w in workloads]
    images = [image for pod in pods for image in pod.images]
    results = Resolver(config.registry, sif=config.sif).resolve_many(images, timeout=timeout)
    return [explain_workload(w, results, policy, known=known,
                             archway_scheduler=config.placement.archway_scheduler)
            for w in workloads]
