"""`kubectl-archway`: `kubectl archway inspect|explain|report` (kubectl runs any executable named
kubectl-NAME on its PATH as `kubectl NAME`, as it runs krew's plugins, passing every argument on).

It is `archway` with kubectl's way of finding the cluster: --kubeconfig, else every file
$KUBECONFIG lists (merged), else ~/.kube/config, before the in-cluster service account (archway's
servers look in the pod first); --context, else the current-context; and for `explain pod/NAME`
the context's namespace unless -n names one (tools/kubeargs.py, archway.kubeclient). docs/commands.md.
"""
import os
import sys

from . import cli

COMMANDS = ("inspect", "explain", "report")
USAGE = ("usage: kubectl archway {inspect,explain,report} ...\n"
         "  kubectl archway inspect IMAGE...          the platforms each image supports\n"
         "  kubectl archway explain pod/NAME [-n NS]  what archway would do, or did, with a pod\n"
         "  kubectl archway explain -f FILE|DIR|-     ... with the workloads in manifests\n"
         "  kubectl archway report [-n NS]            every workload's architectures\n"
         "kubectl's --kubeconfig, --context and -n/--namespace apply; "
         "`kubectl archway COMMAND --help` for the rest.")


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        try:
            print(USAGE, file=sys.stdout if argv else sys.stderr, flush=True)
        except BrokenPipeError:   # `kubectl archway --help | head -1`, as archway's commands
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            return cli.EXIT_BROKEN_PIPE
        return 0 if argv else cli.EXIT_ERROR
    command, rest = argv[0], argv[1:]
    if command not in COMMANDS:
        print(f"kubectl archway: {command!r} is not one of {', '.join(COMMANDS)} (the other "
              f"commands are archway's: `archway {command} --help`)", file=sys.stderr)
        return cli.EXIT_ERROR
    if command == "inspect":   # reads no cluster: kubectl's cluster flags mean nothing to it
        return cli.main([command, *_without_cluster_flags(rest)])
    if not any(a == "--kubeconfig" or a.startswith("--kubeconfig=") for a in rest):
        found = kubectl_kubeconfig(os.environ)
        if found:
            rest += ["--kubeconfig", found]
    return cli.main([command, *rest])


def kubectl_kubeconfig(environ) -> str | None:
    """The kubeconfig kubectl reads without --kubeconfig: $KUBECONFIG's files (a:b, merged by
    the client as kubectl merges them), else ~/.kube/config; None: neither (in a pod, its
    service account)."""
    listed = [p for p in environ.get("KUBECONFIG", "").split(os.pathsep) if p]
    if listed:
        return os.pathsep.join(listed)
    default = os.path.expanduser("~/.kube/config")
    return default if os.path.exists(default) else None


def _without_cluster_flags(args: list[str]) -> list[str]:
    kept, skip = [], False
    for arg in args:
        if skip:
            skip = False
        elif arg in ("--kubeconfig", "--context", "-n", "--namespace"):
            skip = True
        elif not arg.startswith(("--kubeconfig=", "--context=", "--namespace=")):
            kept.append(arg)
    return kept


if __name__ == "__main__":
    sys.exit(main())
