"""Which pods archway's webhook is sent: the namespaceSelector and objectSelector of the pod
webhook in archway's own MutatingWebhookConfiguration (kubernetes.webhook_configuration, the
chart's: its excluded namespaces, webhook.namespaceSelectorExpressions, webhook.skipLabel). A pod
the apiserver never sends archway is not archway's to revisit (unseen.py), whatever its mode.

The configuration is read at most every READ_SECONDS, each read bounded in time. Until one read
has succeeded nothing is covered; a read that fails later keeps the last selectors, and a
configuration that is gone covers nothing.
"""
import logging
import threading
import time
from collections.abc import Callable

from archway.certs.trustpath import WEBHOOK_CONFIGURATIONS, installed_selection
from archway.kubeapi import ApiError, KubeApi
from archway.labelselector import selector_matches

log = logging.getLogger("archway.coverage")

READ_SECONDS = 30.0
READ_TIMEOUT_SECONDS = 5.0
NAMESPACE_NAME_LABEL = "kubernetes.io/metadata.name"   # every namespace has it (apiserver)


def pod_webhooks(configuration: dict) -> list[dict]:
    """The configuration's webhooks whose rules take the CREATE of pods, each as the chart
    installed it where the configuration says (trustpath.installed_selection): an edit that
    stops sending pods is reported there, and archway's revisit still covers them."""
    installed = installed_selection(configuration)
    found = []
    for webhook in configuration.get("webhooks") or []:
        if isinstance(webhook, dict) and str(webhook.get("name")) in installed:
            webhook = {**webhook, **installed[str(webhook.get("name"))]}
        rules = webhook.get("rules") if isinstance(webhook, dict) else None
        if any(isinstance(rule, dict) and _takes(rule, "resources", "pods")
               and _takes(rule, "operations", "CREATE") for rule in rules or []):
            found.append(webhook)
    return found


def _takes(rule: dict, field: str, wanted: str) -> bool:
    values = rule.get(field) or []
    return isinstance(values, list) and (wanted in values or "*" in values)


def webhook_covers(webhooks: list[dict], namespace_labels: dict, pod_labels: dict) -> bool:
    """Whether any of `webhooks` is sent a pod with these labels in a namespace with these."""
    return any(selector_matches(webhook.get("namespaceSelector"), namespace_labels)
               and selector_matches(webhook.get("objectSelector"), pod_labels)
               for webhook in webhooks)


class WebhookCoverage:
    def __init__(self, api_client, configuration: str, *,
                 clock: Callable[[], float] = time.monotonic):
        self.api = KubeApi(api_client, timeout_seconds=READ_TIMEOUT_SECONDS)
        self.configuration = configuration
        self._clock = clock
        self._lock = threading.Lock()
        self._webhooks: list[dict] | None = None    # None: never read (or gone)
        self._read_at: float | None = None

    def covers(self, namespace: str, namespace_labels: dict | None,
               pod_labels: dict) -> bool | None:
        """Whether the apiserver sends archway this pod; None: not known yet (not read)."""
        webhooks = self.webhooks()
        if webhooks is None:
            return None
        labels = {**(namespace_labels or {}), NAMESPACE_NAME_LABEL: namespace}
        return webhook_covers(webhooks, labels, pod_labels)

    def webhooks(self) -> list[dict] | None:
        with self._lock:
            now = self._clock()
            if self._read_at is None or now - self._read_at >= READ_SECONDS:
                self._read_at = now
                self._read()
            return self._webhooks

    def _read(self) -> None:
        path = f"{WEBHOOK_CONFIGURATIONS}/{self.configuration}"
        try:
            self._webhooks = pod_webhooks(self.api.request("GET", path))
        except ApiError as e:   # any failure: the last selectors read, if any, stay
            if e.status == 404:
                self._webhooks = None
            log.warning("webhook configuration %s not read (%s); until it is, pods archway "
                        "never saw are judged by the last one read, or left alone", self.configuration, e)
