"""What the admission service asks of the world, as small interfaces: the objects behind them
(the resolver, the pull-secret reader, the Lease observer, the Event sink, the node cache) are
built by wiring.py, and tests hand in their own."""
from collections.abc import Mapping
from typing import Any, Protocol

from archway.cluster.pullsecrets import PullCredentials
from archway.podview import PodView
from archway.registry.credentials import Keyring


class ImageResolver(Protocol):
    def resolve_many(self, images, *, keyring: Keyring | None = None, timeout: float | None,
                     revalidate=frozenset(), limit: int | None = None,
                     scope: str | None = None, wait: bool = True,
                     record: bool = True) -> dict[str, Any]: ...


class PullCredentialSource(Protocol):
    def credentials_for(self, pod: PodView, deadline: float) -> PullCredentials: ...


class Gating(Protocol):
    """admission.unresolved: gate -- is a gate controller alive to remove the gate? `deadline`:
    the answer may wait until then for a fresh look (archway/lease.py)."""
    def leader_fresh(self, deadline: float | None = None) -> bool: ...


class EventRecorder(Protocol):
    def record(self, regarding: dict, event_type: str, reason: str, action: str,
               note: str, *, being_created: bool = False) -> None: ...


class NodeSource(Protocol):
    """The node cache: its Nodes' facts by name, once listed (never waited for)."""

    @property
    def items(self) -> Mapping[str, Any]: ...

    def wait_synced(self, timeout: float) -> bool: ...
