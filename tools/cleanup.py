"""`archway cleanup`: delete what archway's processes made in the cluster and helm does not own
(the Leases of the gate controller and of the second scheduler), once those processes are gone.

The chart's post-delete hook Job runs it on `helm uninstall`: a Lease deleted while its holder
still runs is made again by the holder's next renewal, so the pods are waited for first (their
Deployments are gone by then; their grace period is not).
"""
import logging
import time

from archway.config import load_config
from archway.errors import ArchwayError

log = logging.getLogger("archway.cleanup")

_POLL_SECONDS = 2.0


def register(subparsers) -> None:
    from archway.registry.inspect import positive_seconds
    parser = subparsers.add_parser(
        "cleanup", help="delete archway's Leases once its pods are gone (uninstall hook)",
        description="Wait until no Running pod matches --wait-for-pods in --namespace (at "
                    "most --timeout seconds: a pod on a node that is gone may never end), then "
                    "delete each --lease there. Exit 0 once they are gone.")
    parser.add_argument("-n", "--namespace", required=True, help="the namespace of the Leases")
    parser.add_argument("--lease", action="append", required=True, metavar="NAME",
                        help="a Lease to delete (repeatable)")
    parser.add_argument("--wait-for-pods", metavar="SELECTOR", default="",
                        help="a label selector: the pods whose processes hold the Leases")
    parser.add_argument("--timeout", type=positive_seconds, default=120.0, metavar="SECONDS",
                        help="how long to wait for those pods (default: 120)")
    parser.set_defaults(func=_cleanup)


def wait_pods_gone(api, namespace: str, selector: str, timeout: float,
                   clock=time.monotonic, sleep=time.sleep) -> list[str]:
    """The names of the Running pods still matching `selector` when `timeout` ran out; [] once
    none do. Only a Running pod's process can make its Lease again (a pod being deleted starts
    no container)."""
    end = clock() + timeout
    while True:
        answer = api.request("GET", f"/api/v1/namespaces/{namespace}/pods",
                             query={"labelSelector": selector, "limit": 50,
                                    "fieldSelector": "status.phase=Running"})
        names = [(p.get("metadata") or {}).get("name", "") for p in answer.get("items") or []]
        if not names or clock() >= end:
            return names
        sleep(_POLL_SECONDS)


def delete_leases(api, namespace: str, names: list[str]) -> list[str]:
    """Deletes each Lease; returns the names that existed."""
    from archway.kubeapi import ApiError
    deleted = []
    for name in names:
        try:
            api.request("DELETE", f"/apis/coordination.k8s.io/v1/namespaces/{namespace}/leases/{name}")
            deleted.append(name)
        except ApiError as e:
            if e.status != 404:
                raise
    return deleted


def _cleanup(args) -> int:
    from archway.kubeapi import ApiError, KubeApi
    from archway.kubeclient import build_api_client, no_api_configured
    config = load_config(args.config)
    api_client, source = build_api_client(config.kubernetes)
    if api_client is None:
        raise no_api_configured(source)
    api = KubeApi(api_client)
    try:
        running = wait_pods_gone(api, args.namespace, args.wait_for_pods,
                                 args.timeout) if args.wait_for_pods else []
        if running:   # deleted all the same: most likely their node is gone
            log.warning("pods still running after %g s: %s", args.timeout, ", ".join(running))
        deleted = delete_leases(api, args.namespace, args.lease)
    except ApiError as e:
        raise ArchwayError(f"cleanup in namespace {args.namespace}: {e}") from None
    print(f"archway: deleted Lease(s) {', '.join(deleted) or 'none'} in {args.namespace} "
          f"({source})")
    return 0
