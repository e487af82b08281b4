"""`archway scheduler-config`: the KubeSchedulerConfiguration of the second scheduler.

That scheduler runs the profile whose `schedulerName` the webhook sets on pods, and calls archway's
extender for them. The Helm chart renders the same document (keep the key order and defaults in
step with charts/archway/templates/scheduler/).
"""
import argparse
import base64
import re
import sys

import yaml

from archway.errors import ConfigError

_DURATION = re.compile(r"^([0-9]+(\.[0-9]+)?(ns|us|µs|ms|s|m|h))+$")  # Go time.ParseDuration


def build_scheduler_config(*, scheduler_name: str = "archway-scheduler",
                           extender_url: str = "http://127.0.0.1:8444/scheduler",
                           weight: int = 1, node_cache_capable: bool = True,
                           http_timeout: str = "3s", lease_name: str = "archway-scheduler",
                           lease_namespace: str = "archway", ca_pem: bytes | None = None,
                           insecure: bool = False, prioritize: bool = True) -> dict:
    """A kubescheduler.config.k8s.io/v1 KubeSchedulerConfiguration with one profile and archway
    as its extender. `ignorable: true`: when archway is down the pod is scheduled without its
    opinion instead of staying Pending. The lease is the second scheduler's own, so it never
    contends with the default scheduler's leader election. httpTimeout 3s leaves room above the
    extender's own deadline (extender.deadline_seconds, 2 s) for the answer to travel.
    `prioritize` False: no prioritizeVerb (nor its weight), for an archway without a score signal
    (no prometheus.url): its answers would be neutral, one call per pod for nothing."""
    if not scheduler_name:
        raise ConfigError("the scheduler name must not be empty")
    if prioritize and (not isinstance(weight, int) or isinstance(weight, bool) or weight <= 0):
        raise ConfigError(f"weight must be a positive integer (kube-scheduler requires it with a "
                          f"prioritizeVerb), got {weight!r}")
    if not _DURATION.match(http_timeout or ""):
        raise ConfigError(f"httpTimeout {http_timeout!r} is not a duration such as 2s or 1500ms")
    if not extender_url.startswith(("http://", "https://")):
        raise ConfigError(f"the extender URL {extender_url!r} must start with http:// or https://")
    tls = None
    if ca_pem is not None or insecure:
        if not extender_url.startswith("https://"):
            raise ConfigError("a CA or insecure TLS only applies to an https:// extender URL")
        if ca_pem is not None and insecure:
            raise ConfigError("give either a CA to verify the extender with or insecure, not both")
        if ca_pem is not None and b"-----BEGIN CERTIFICATE-----" not in ca_pem:
            raise ConfigError("the extender CA file holds no PEM certificate")
        # kube-scheduler's ExtenderTLSConfig: caData is the PEM bundle, base64 as every []byte.
        tls = ({"insecure": True} if ca_pem is None
               else {"caData": base64.b64encode(ca_pem).decode()})
    document: dict = {
        "apiVersion": "kubescheduler.config.k8s.io/v1",
        "kind": "KubeSchedulerConfiguration",
        "leaderElection": {
            "leaderElect": True,
            "resourceName": lease_name,
            "resourceNamespace": lease_namespace,
        },
        "profiles": [{"schedulerName": scheduler_name}],
        "extenders": [{
            "urlPrefix": extender_url.rstrip("/"),
            "filterVerb": "filter",
            "prioritizeVerb": "prioritize",
            "weight": weight,
            "enableHTTPS": extender_url.startswith("https://"),
            "nodeCacheCapable": node_cache_capable,
            "ignorable": True,
            "httpTimeout": http_timeout,
        }],
    }
    if not prioritize:
        del document["extenders"][0]["prioritizeVerb"], document["extenders"][0]["weight"]
    if tls is not None:
        document["extenders"][0]["tlsConfig"] = tls
    return document


def to_yaml(document: dict) -> str:
    return yaml.safe_dump(document, sort_keys=False, default_flow_style=False)


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "scheduler-config",
        help="print the KubeSchedulerConfiguration of a second scheduler that uses archway",
        description="Print a KubeSchedulerConfiguration (kubescheduler.config.k8s.io/v1) with one "
                    "profile for a second scheduler and archway's extender (filter by "
                    "architecture, prioritize by network traffic). Pass it to kube-scheduler "
                    "with --config.")
    parser.add_argument("--scheduler-name", default="archway-scheduler",
                        help="the profile's schedulerName; set the same in placement.scheduler_name "
                             "(default: %(default)s)")
    parser.add_argument("--extender-url", default="http://127.0.0.1:8444/scheduler",
                        help="where archway serves /filter and /prioritize (default: %(default)s, a "
                             "sidecar with server.tls false)")
    parser.add_argument("--weight", type=int, default=1,
                        help="multiplier of archway's 0-10 scores (default: %(default)s)")
    parser.add_argument("--prioritize", action=argparse.BooleanOptionalAction, default=True,
                        help="call archway's prioritize (its scores need prometheus.url; without "
                             "it they are neutral: --no-prioritize saves a call per pod) "
                             "(default: on)")
    parser.add_argument("--node-cache-capable", action=argparse.BooleanOptionalAction, default=True,
                        help="send node names instead of whole Node objects; archway then keeps a "
                             "node cache (default: on)")
    parser.add_argument("--http-timeout", default="3s",
                        help="how long the scheduler waits for archway (default: %(default)s)")
    parser.add_argument("--lease-name", default="archway-scheduler",
                        help="the scheduler's own leader-election lease (default: %(default)s)")
    parser.add_argument("--lease-namespace", default="archway",
                        help="namespace of that lease (default: %(default)s)")
    tls = parser.add_mutually_exclusive_group()
    tls.add_argument("--ca-file", metavar="FILE",
                     help="for an https:// extender URL: the CA that signed archway's serving "
                          "certificate, embedded as tlsConfig.caData")
    tls.add_argument("--insecure", action="store_true",
                     help="for an https:// extender URL: do not verify its certificate "
                          "(tlsConfig.insecure; tests only)")
    parser.set_defaults(func=_run)


def _run(args) -> int:
    ca_pem = None
    if args.ca_file:
        try:
            with open(args.ca_file, "rb") as f:
                ca_pem = f.read(1024 * 1024)
        except FileNotFoundError:
            raise ConfigError(f"no such file: {args.ca_file}") from None
        except OSError as e:
            raise ConfigError(f"cannot read {args.ca_file}: {e.strerror}") from None
    document = build_scheduler_config(
        scheduler_name=args.scheduler_name, extender_url=args.extender_url, weight=args.weight,
        node_cache_capable=args.node_cache_capable, http_timeout=args.http_timeout,
        lease_name=args.lease_name, lease_namespace=args.lease_namespace, ca_pem=ca_pem,
        insecure=args.insecure, prioritize=args.prioritize)
    sys.stdout.write(to_yaml(document))
    return 0
