"""`--kubeconfig` and `--context` of the commands that read a cluster (`explain`, `report`), as
kubectl names them: the kubectl plugin (archway.main.kubectl) passes kubectl's own on."""
import dataclasses


def add_cluster_options(parser) -> None:
    parser.add_argument("--kubeconfig", metavar="FILE",
                        help="kubeconfig file(s), a:b merged as kubectl merges $KUBECONFIG "
                             "(default: kubernetes.kubeconfig, in-cluster, $KUBECONFIG, "
                             "~/.kube/config)")
    parser.add_argument("--context", metavar="NAME",
                        help="the kubeconfig context to use (default: its current-context)")


def with_cluster(config, args):
    """`config` with the command line's --kubeconfig and --context in its kubernetes section."""
    kubernetes = config.kubernetes
    if args.kubeconfig or args.context:
        kubernetes = dataclasses.replace(kubernetes,
                                         kubeconfig=args.kubeconfig or kubernetes.kubeconfig,
                                         context=args.context or kubernetes.context)
    return dataclasses.replace(config, kubernetes=kubernetes)
