"""The one write of a gated pod: a PUT of its release at the resourceVersion it was read at, as
the controller and `archway gate release-all` both send it."""
from dataclasses import dataclass

from archway.kubeapi import ApiError

from .release import is_gated


@dataclass(frozen=True)
class Put:
    stored: dict | None = None   # the pod as the apiserver stored the update
    fresh: dict | None = None    # changed since read and still gated: the pod as it is now
    # Neither: deleted meanwhile, or no longer gated by archway: nothing is left to release.


def pod_path(pod: dict) -> str:
    meta = pod.get("metadata") or {}
    return f"/api/v1/namespaces/{meta.get('namespace')}/pods/{meta.get('name')}"


def put_release(api, pod: dict, updated: dict) -> Put:
    """PUT `updated` over `pod` (`api`: a KubeApi). A 409 (changed since read; another gate may
    be gone) reads the pod again for the caller to decide anew. Other refusals raise ApiError."""
    path = pod_path(pod)
    try:
        return Put(stored=api.request("PUT", path, body=updated))
    except ApiError as e:
        if e.status == 404:
            return Put()
        if e.status != 409:
            raise
    try:
        fresh = api.request("GET", path)
    except ApiError as e:
        if e.status == 404:
            return Put()
        raise
    return Put(fresh=fresh if is_gated(fresh) else None)
