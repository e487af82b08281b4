"""`archway gate release-all`: remove archway's scheduling gate from every pod, nothing else.

What the chart's pre-delete hook Job runs on `helm uninstall`, and what an operator runs when
archway's gate controller is gone: each gated pod gets the update that only removes archway's
gate and label (always valid for the apiserver), other controllers' gates untouched.
"""
import logging

from archway.config import load_config
from archway.errors import ArchwayError

# Imported by the CLI for every subcommand: the Kubernetes client is imported when used.

log = logging.getLogger("archway.gate")

_ATTEMPTS = 5


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "gate", help="manage the pods archway gated (admission.unresolved: gate)",
        description="Pods archway admitted SchedulingGated until it reads their images.")
    commands = parser.add_subparsers(dest="gate_command", metavar="COMMAND", required=True)
    release = commands.add_parser(
        "release-all", help="remove archway's scheduling gate from every pod (uninstall hook)",
        description="Remove the scheduling gate archway.dev/resolving (and the label "
                    "archway.dev/gated) from every pod of the cluster; pods are released "
                    "unplaced. Other gates are kept.")
    release.set_defaults(func=_release_all)


def release_all(api) -> tuple[int, int]:
    """(released, failed): every gated pod of the cluster (`api`: a KubeApi), paged."""
    from .release import is_gated
    released = failed = 0
    for page in api.pages("/api/v1/pods", 500, timeout=60):
        for pod in page.get("items") or []:
            if is_gated(pod):
                if _release(api, pod):
                    released += 1
                else:
                    failed += 1
    return released, failed


def _release(api, pod: dict) -> bool:
    from archway.kubeapi import ApiError

    from .put import put_release
    from .release import gate_only_release
    for _ in range(_ATTEMPTS):
        try:
            put = put_release(api, pod, gate_only_release(pod))
        except ApiError as e:
            meta = pod.get("metadata") or {}
            log.error("cannot release %s/%s: %s", meta.get("namespace"), meta.get("name"), e)
            return False
        if put.fresh is None:
            return True
        pod = put.fresh   # changed meanwhile: release what it is now
    return False


def _release_all(args) -> int:
    from archway.kubeapi import ApiError, KubeApi
    from archway.kubeclient import build_api_client, no_api_configured
    config = load_config(args.config)
    api_client, source = build_api_client(config.kubernetes)
    if api_client is None:
        raise no_api_configured(source)
    try:
        released, failed = release_all(KubeApi(api_client))
    except ApiError as e:   # the list itself failed: nothing was released
        raise ArchwayError(f"cannot list the pods: {e}") from None
    print(f"archway: released {released} gated pod(s) ({source}); {failed} failed")
    return 1 if failed else 0
