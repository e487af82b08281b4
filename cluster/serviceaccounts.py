"""Which imagePullSecrets each ServiceAccount names, from a list + watch of ServiceAccounts.

The pull-secret reader (pullsecrets.py) asks this before it GETs a ServiceAccount: a burst of
pods in a namespace then costs no request at all (a TTL cache of GETs cost one per namespace,
per worker, per expiry), and a ServiceAccount whose imagePullSecrets change is seen as soon as
the watch delivers the change, not after the TTL. Only the secrets' names are kept, keyed
namespace/name: a cluster of 15,000 ServiceAccounts is a few MB, listed in pages.
"""
from dataclasses import dataclass

from archway.watchcache import WatchCache


@dataclass(frozen=True)
class AccountFacts:
    name: str                       # namespace/name
    pull_secrets: tuple[str, ...]   # imagePullSecrets' names, in order, no blanks


def account_key(namespace: str, name: str) -> str:
    return f"{namespace}/{name}"


def account_facts(obj: dict) -> AccountFacts | None:
    meta = obj.get("metadata") if isinstance(obj, dict) else None
    if not isinstance(meta, dict):
        return None
    namespace, name = meta.get("namespace"), meta.get("name")
    if not (isinstance(namespace, str) and namespace and isinstance(name, str) and name):
        return None
    refs = obj.get("imagePullSecrets")
    names = tuple(r["name"] for r in refs if isinstance(r, dict)
                  and isinstance(r.get("name"), str) and r["name"]) if isinstance(refs, list) else ()
    return AccountFacts(account_key(namespace, name), names)


class ServiceAccountCache(WatchCache[AccountFacts]):
    def __init__(self, api_client_factory, **kwargs):
        super().__init__(api_client_factory, what="serviceaccount",
                         path="/api/v1/serviceaccounts", facts=account_facts, **kwargs)

    def _name_of(self, obj: dict):
        meta = obj.get("metadata") or {}
        return account_key(meta.get("namespace") or "", meta.get("name") or "")

    def pull_secrets(self, namespace: str, name: str) -> tuple[str, ...] | None:
        """The ServiceAccount's imagePullSecrets' names; None when the cache cannot say (not
        synced yet, or the watch has not delivered this ServiceAccount: a GET must)."""
        if not self.synced:
            return None
        facts = self.items.get(account_key(namespace, name))
        return facts.pull_secrets if facts is not None else None
