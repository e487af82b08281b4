"""`archway certs generate` and `archway certs bootstrap`."""
import argparse
import logging

from archway.config import KubernetesSettings
from archway.kubeclient import in_cluster_namespace, required_api_client

from .bootstrap import BootstrapError, BootstrapSpec, run_bootstrap
from .generate import generate

log = logging.getLogger(__name__)


def register(subparsers) -> None:
    certs = subparsers.add_parser("certs", help="create the webhook's TLS certificates",
                                  description="Create the webhook's TLS certificates.")
    sub = certs.add_subparsers(dest="certs_command", metavar="ACTION", required=True)

    gen = sub.add_parser(
        "generate", help="write a CA and a serving certificate for a Service into a directory",
        description="Write ca.crt, tls.crt and tls.key (0600) for the Service NAME in NS. "
                    "The SANs are NAME, NAME.NS, NAME.NS.svc and NAME.NS.svc.<cluster domain>.")
    gen.add_argument("--service", required=True, metavar="NAME")
    gen.add_argument("--namespace", required=True, metavar="NS")
    gen.add_argument("--out", required=True, metavar="DIR", help="created 0700 if missing")
    gen.add_argument("--days", type=_positive_int, default=365,
                     help="serving certificate validity (default 365)")
    gen.add_argument("--ca-days", type=_positive_int, default=3650,
                     help="CA validity (default 3650)")
    gen.add_argument("--host", action="append", default=[], metavar="NAME_OR_IP",
                     help="an extra SAN (repeatable)")
    gen.add_argument("--cluster-domain", default="cluster.local")
    gen.add_argument("--keep-ca-key", action="store_true",
                     help="also write ca.key (0600) to sign a renewal under the same caBundle")
    gen.add_argument("--force", action="store_true", help="overwrite existing files")
    gen.set_defaults(func=_generate)

    boot = sub.add_parser(
        "bootstrap", help="create or renew the TLS Secret and patch the webhook's caBundle",
        description="Run inside the cluster (Helm hook Job / CronJob): create or renew the "
                    "kubernetes.io/tls Secret for the Service and patch caBundle into every "
                    "webhook of the MutatingWebhookConfiguration. Idempotent.")
    add_bootstrap_arguments(boot)
    boot.set_defaults(func=_bootstrap)


def add_bootstrap_arguments(parser: argparse.ArgumentParser) -> None:
    """`archway certs bootstrap`'s arguments; the leader's repair of the trust path parses the
    same ones (config kubernetes.trust_repair: the chart renders the certificate Job's)."""
    parser.add_argument("--service", required=True, metavar="NAME")
    parser.add_argument("--namespace", metavar="NS",
                        help="default: the pod's own namespace (in-cluster)")
    parser.add_argument("--secret", required=True, metavar="NAME",
                        help="the TLS Secret; the CA lives in NAME-ca unless --ca-secret")
    parser.add_argument("--ca-secret", metavar="NAME")
    parser.add_argument("--webhook-config", metavar="NAME",
                        help="MutatingWebhookConfiguration to patch (omit: patch nothing)")
    parser.add_argument("--allow-missing-webhook-config", action="store_true",
                        help="succeed when it does not exist yet (the pre-install run)")
    parser.add_argument("--days", type=_positive_int, default=365)
    parser.add_argument("--ca-days", type=_positive_int, default=3650)
    parser.add_argument("--renew-before-days", type=_positive_int, default=30)
    parser.add_argument("--cluster-domain", default="cluster.local")
    parser.add_argument("--host", action="append", default=[], metavar="NAME_OR_IP",
                        help="an extra SAN (repeatable), e.g. the host of an external webhook URL")
    parser.add_argument("--kubeconfig", metavar="FILE",
                        help="default: in-cluster credentials, else $KUBECONFIG / ~/.kube/config")


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError("must be positive")
    return value


def _generate(args) -> int:
    files = generate(args.service, args.namespace, args.out, days=args.days,
                     ca_days=args.ca_days, extra_hosts=tuple(args.host),
                     cluster_domain=args.cluster_domain, keep_ca_key=args.keep_ca_key,
                     force=args.force)
    print(f"wrote {files.ca}, {files.cert}, {files.key}"
          + (f", {files.ca_key}" if files.ca_key else ""))
    print("to use them with the Helm chart (tls.mode=secret):\n"
          f"  kubectl -n {args.namespace} create secret tls {args.service}-tls "
          f"--cert={files.cert} --key={files.key}\n"
          f"  helm install ... --set tls.mode=secret --set tls.secretName={args.service}-tls "
          f"--set tls.secret.caBundle=$(base64 -w0 {files.ca})")
    return 0


class _ArgumentsError(argparse.ArgumentParser):
    def error(self, message):
        raise BootstrapError(f"archway certs bootstrap {message}")


def bootstrap_spec(arguments: list[str] | tuple[str, ...]) -> BootstrapSpec:
    """The BootstrapSpec `archway certs bootstrap ARGUMENTS` would run with (BootstrapError when
    they are not its arguments); a leading `certs bootstrap` is allowed."""
    arguments = list(arguments)
    if arguments[:2] == ["certs", "bootstrap"]:
        arguments = arguments[2:]
    parser = _ArgumentsError(prog="archway certs bootstrap", add_help=False)
    add_bootstrap_arguments(parser)
    return _spec(parser.parse_args(arguments))


def _spec(args) -> BootstrapSpec:
    namespace = args.namespace or in_cluster_namespace()
    if not namespace:
        raise BootstrapError("--namespace is required outside a pod")
    return BootstrapSpec(namespace=namespace, service=args.service, secret=args.secret,
                         ca_secret=args.ca_secret, webhook_config=args.webhook_config,
                         days=args.days, ca_days=args.ca_days,
                         renew_before_days=args.renew_before_days,
                         cluster_domain=args.cluster_domain,
                         allow_missing_webhook_config=args.allow_missing_webhook_config,
                         extra_hosts=tuple(args.host))


def _bootstrap(args) -> int:
    spec = _spec(args)
    api_client = required_api_client(KubernetesSettings(kubeconfig=args.kubeconfig),
                                     "--kubeconfig")
    result = run_bootstrap(spec, api_client)
    print(result.summary(spec))
    return 0
