"""archway's trust path, checked where it is served and repaired by the leader.

The apiserver calls the webhook over TLS and verifies the certificate a pod serves with the
caBundle of each webhook of its MutatingWebhookConfiguration, for the Service's name
(`<service>.<namespace>.svc`). When they disagree every call fails and, under failurePolicy
Ignore, every pod is admitted without archway: nothing on archway's side sees a request.

    every webhook pod's gate controller process, every CHECK_SECONDS:
      read the configuration (and, with a repair configured, the TLS Secret and nothing else);
      does every webhook's caBundle verify the certificate this pod serves (server.cert_file),
      and the Secret's certificate (what a pod starting now mounts)?
      -> the answer in STATUS_FILE, which the workers show on /readyz, and archway_trust_path_ok
    the leader, when the answer is no and kubernetes.trust_repair is set (the chart's
    tls.mode bootstrap): `archway certs bootstrap` (bootstrap.py, the chart's certificate Job)
    with the Job's own arguments, the pair this pod serves standing in for a Secret that is gone
    or broken: it is stored again (no new key, no rollout) when the CA still signs it.

Without a repair (cert-manager, a Secret of the user's) the check only reports: cert-manager's
cainjector owns the caBundle there, and archway never writes against it.

The same check compares what selects archway's calls (each webhook's rules, selectors, match
conditions, failurePolicy and timeout) with what the chart installed (the configuration's
annotation archway.dev/installed-selection): a configuration edited to send no pods looks
healthy otherwise. That is reported, never written back: an admin may mean it (`helm upgrade`
restores the chart's; docs/runbooks/ArchwayTrustPathBroken.md).
"""
import base64
import datetime as dt
import json
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from urllib.parse import urlsplit

from archway.kubeapi import ApiError, KubeApi
from archway.statusfile import write_status

from .bootstrap import BootstrapError, BootstrapSpec, run_bootstrap
from .x509 import CertificateError, hosts_of, is_ca, is_issued_by, load_cert, load_certs, utcnow

log = logging.getLogger("archway.certs.trustpath")

CHECK_SECONDS = 5.0
STATUS_FILE = "trust-path.json"     # in the server's run directory, beside the gate controller's
MAX_PEM_BYTES = 1024 * 1024
WEBHOOK_CONFIGURATIONS = "/apis/admissionregistration.k8s.io/v1/mutatingwebhookconfigurations"
INSTALLED_SELECTION = "archway.dev/installed-selection"
SELECTION_FIELDS = ("rules", "namespaceSelector", "objectSelector", "matchConditions",
                    "failurePolicy", "timeoutSeconds")


# --- the check (pure) -------------------------------------------------------------------------

def webhook_host(webhook: dict) -> str | None:
    """The name the apiserver verifies the webhook's certificate for."""
    client_config = webhook.get("clientConfig") or {}
    service = client_config.get("service")
    if isinstance(service, dict) and service.get("name") and service.get("namespace"):
        return f"{service['name']}.{service['namespace']}.svc"
    url = client_config.get("url")
    return urlsplit(url).hostname if isinstance(url, str) else None


def distrust(ca_bundle: str | None, leaf, host: str | None, now: dt.datetime) -> str | None:
    """Why a client holding the base64 `ca_bundle` would refuse `leaf` for `host`; None: it
    would not."""
    if not ca_bundle:
        return "has no caBundle"
    try:
        cas = load_certs(base64.b64decode(ca_bundle, validate=True))
    except (ValueError, CertificateError):
        return "has a caBundle that is not a PEM certificate bundle"
    if not any(is_ca(ca) and ca.not_valid_before_utc <= now <= ca.not_valid_after_utc
               and is_issued_by(leaf, ca) for ca in cas):
        return "has a caBundle that does not hold the CA that signed"
    if not leaf.not_valid_before_utc <= now <= leaf.not_valid_after_utc:
        return "would find expired (or not yet valid)"
    if host and host.lower() not in hosts_of(leaf):
        return f"would find not naming {host} in"
    return None


def installed_selection(configuration: dict) -> dict[str, dict]:
    """webhook name -> what selects its calls as the chart installed it ({}: no such record, a
    configuration not made by the chart)."""
    text = ((configuration.get("metadata") or {}).get("annotations") or {}).get(INSTALLED_SELECTION)
    try:
        installed = json.loads(text) if isinstance(text, str) else {}
    except ValueError:
        return {}
    return {name: fields for name, fields in installed.items()
            if isinstance(fields, dict)} if isinstance(installed, dict) else {}


def selection_problems(configuration: dict) -> list[str]:
    """How the live configuration selects archway's calls otherwise than the chart installed."""
    live = {w.get("name"): w for w in configuration.get("webhooks") or [] if isinstance(w, dict)}
    problems = []
    for name, fields in sorted(installed_selection(configuration).items()):
        webhook = live.get(name)
        if webhook is None:
            problems.append(f"webhook {name} was removed from the configuration")
            continue
        changed = [f for f in SELECTION_FIELDS if f in fields and webhook.get(f) != fields[f]]
        if changed:
            problems.append(f"webhook {name}: {', '.join(changed)} not as the chart installed "
                            f"it, so the apiserver may not send archway the pods it should "
                            f"(helm upgrade restores it)")
    return problems


@dataclass(frozen=True)
class Observation:
    """What one check read."""
    configuration_name: str
    configuration: dict | None         # None: not found
    served: bytes                      # the PEM certificate this pod serves
    secret_name: str | None = None     # the TLS Secret checked ("ns/name"); None: not checked
    secret: dict | None = None         # None: not found (when checked)


def problems_of(seen: Observation, now: dt.datetime | None = None) -> list[str]:
    """Why the apiserver cannot (or a pod starting now could not) have verified archway; []
    when it can."""
    now = now or utcnow()
    if seen.configuration is None:
        return [f"MutatingWebhookConfiguration {seen.configuration_name} not found"]
    leaves, problems = [], []
    try:
        leaves.append(("the served certificate", load_cert(seen.served)))
    except CertificateError:
        problems.append("the served certificate cannot be read")
    if seen.secret_name is not None:
        secret_leaf, problem = _secret_certificate(seen.secret_name, seen.secret)
        if problem:
            problems.append(problem)
        else:
            leaves.append((f"Secret {seen.secret_name}'s certificate", secret_leaf))
    for webhook in seen.configuration.get("webhooks") or []:
        bundle = (webhook.get("clientConfig") or {}).get("caBundle")
        for what, leaf in leaves:
            why = distrust(bundle, leaf, webhook_host(webhook), now)
            if why:
                problems.append(f"webhook {webhook.get('name')} {why} {what}")
    return problems


def _secret_certificate(name: str, secret: dict | None):
    if secret is None:
        return None, f"Secret {name} is missing: a webhook pod starting now cannot mount it"
    try:
        return load_cert(base64.b64decode((secret.get("data") or {}).get("tls.crt") or "")), None
    except (ValueError, CertificateError):
        return None, f"Secret {name} holds no usable tls.crt"


# --- the loop ---------------------------------------------------------------------------------

class TrustWatch:
    """Checks this pod's trust path every `interval`; repairs it while `leading()` says so and a
    repair is configured. `status_path`: where the workers read the last answer."""

    def __init__(self, api_client, *, configuration: str, cert_file: str, key_file: str,
                 repair: BootstrapSpec | None = None, status_path: str | None = None,
                 interval: float = CHECK_SECONDS, wall=time.time):
        self.api_client = api_client
        self.api = KubeApi(api_client, timeout_seconds=max(1.0, interval))
        self.configuration = configuration
        self.cert_file = cert_file
        self.key_file = key_file
        self.repair = repair
        self.status_path = status_path
        self.interval = interval
        self._wall = wall
        self.repairs = 0
        self.last_repair: str | None = None

    def observe(self) -> Observation:
        """Read what the check needs (ApiError when the API does not answer)."""
        configuration = self._get(f"{WEBHOOK_CONFIGURATIONS}/{self.configuration}")
        with open(self.cert_file, "rb") as f:
            served = f.read(MAX_PEM_BYTES)
        if self.repair is None:
            return Observation(self.configuration, configuration, served)
        namespace, name = self.repair.namespace, self.repair.secret
        secret = self._get(f"/api/v1/namespaces/{namespace}/secrets/{name}")
        return Observation(self.configuration, configuration, served, f"{namespace}/{name}",
                           secret)

    def turn(self, leading: bool) -> list[str]:
        """One check, and a repair when the certificates failed it and this replica leads; its
        problems after (the selection's too, which are only reported)."""
        try:
            seen = self.observe()
        except (ApiError, OSError) as e:
            self._record(None, f"not checked: {e}")
            return []
        problems = problems_of(seen)
        if problems and leading and self._repairable(seen) and self._repair(seen, problems):
            try:
                seen = self.observe()
                problems = problems_of(seen)
            except (ApiError, OSError) as e:
                log.info("trust path repaired; not checked again yet: %s", e)
        if seen.configuration is not None:
            problems = problems + selection_problems(seen.configuration)
        self._record(problems)
        return problems

    def run(self, stop: threading.Event, leading: Callable[[], bool]) -> None:
        while not stop.is_set():
            try:
                self.turn(leading())
            except Exception:    # never let the check die: its status would go stale instead
                log.exception("trust path check failed")
            stop.wait(self.interval)

    def _get(self, path: str) -> dict | None:
        try:
            return self.api.request("GET", path)
        except ApiError as e:
            if e.status == 404:
                return None
            raise

    def _repairable(self, seen: Observation) -> bool:
        # Not while the configuration is gone or going (`helm uninstall`): its Secrets go with it.
        meta = (seen.configuration or {}).get("metadata") or {}
        return self.repair is not None and seen.configuration is not None \
            and not meta.get("deletionTimestamp")

    def _repair(self, seen: Observation, problems: list[str]) -> bool:
        """True when the bootstrap wrote something: the trust path changed."""
        from archway import metrics
        assert self.repair is not None
        try:
            result = run_bootstrap(self.repair, self.api_client, served=self._served(seen))
        except (BootstrapError, CertificateError, OSError) as e:
            metrics.TRUST_PATH_REPAIRS.labels("failed").inc()
            log.error("could not repair the trust path (%s): %s", "; ".join(problems), e)
            return False
        if (result.ca, result.certificate, result.webhook_config) == ("unchanged",) * 3:
            # The Secrets and the caBundle agree; this pod's files wait for the kubelet's sync.
            log.info("trust path: nothing to repair (%s)", "; ".join(problems))
            return False
        metrics.TRUST_PATH_REPAIRS.labels("repaired").inc()
        self.repairs += 1
        self.last_repair = result.summary(self.repair)
        log.warning("trust path repaired (%s): %s", "; ".join(problems), self.last_repair)
        return True

    def _served(self, seen: Observation) -> dict[str, bytes]:
        """The pair this pod serves, as a TLS Secret holds it; ca.crt: a caBundle that trusts
        it, so a CA made anew keeps the old one trusted until every pod serves the new leaf."""
        with open(self.key_file, "rb") as f:
            served = {"tls.crt": seen.served, "tls.key": f.read(MAX_PEM_BYTES)}
        try:
            leaf = load_cert(seen.served)
        except CertificateError:
            return served
        now = utcnow()
        for webhook in (seen.configuration or {}).get("webhooks") or []:
            bundle = (webhook.get("clientConfig") or {}).get("caBundle")
            if bundle and distrust(bundle, leaf, None, now) is None:
                return {**served, "ca.crt": base64.b64decode(bundle)}
        return served

    def _record(self, problems: list[str] | None, unknown: str | None = None) -> None:
        from archway import metrics
        if problems is not None:
            metrics.TRUST_PATH_OK.set(0 if problems else 1)
        if self.status_path is None:
            return
        status = {"checked_at": self._wall(), "problems": problems, "unknown": unknown,
                  "repairs": self.repairs, "last_repair": self.last_repair}
        try:
            write_status(self.status_path, status)
        except OSError as e:
            log.warning("cannot write the trust path's status %s: %s", self.status_path, e)


# --- what the workers read --------------------------------------------------------------------

def trust_fact(status_path: str, now: float, interval: float = CHECK_SECONDS) -> str:
    """What /readyz says of the trust path, from the status file the check writes."""
    try:
        with open(status_path, encoding="utf-8") as f:
            status = json.loads(f.read(65536))
    except (OSError, ValueError):
        return "not checked yet"
    age = now - float(status.get("checked_at") or 0)
    if age > 3 * interval + 10:
        return f"not checked for {age:.0f} s"
    if status.get("problems") is None:
        return str(status.get("unknown") or "not checked")
    repaired = f" (repaired {status['repairs']} time(s))" if status.get("repairs") else ""
    if status["problems"]:
        return "the apiserver cannot reach archway as installed: " + "; ".join(status["problems"]) + repaired
    return ("ok: every webhook's caBundle verifies the served certificate and selects what "
            "the chart installed" + repaired)
