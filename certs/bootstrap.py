"""`archway certs bootstrap`: keep the webhook's TLS Secret and the caBundle of its
MutatingWebhookConfiguration right, from inside the cluster (a Helm hook Job, a CronJob).

Objects (all in the release namespace except the cluster-scoped webhook configuration):
- `<secret>-ca` (Opaque: ca.crt, ca.key): the CA. Only this program reads it; the webhook pods
  mount the TLS Secret alone, so they never hold a key that could mint certificates.
- `<secret>` (kubernetes.io/tls: tls.crt, tls.key, ca.crt): what the webhook serves; ca.crt is the
  trust bundle, the exact bytes that go into every webhook's clientConfig.caBundle.

Idempotent: a valid certificate is never regenerated. The leaf is renewed when it expires within
`renew_before`, its SANs differ from the Service's names, or it was not signed by the current CA.
The CA is kept while it can still cover a full leaf term; when it is replaced, the old CA stays in
the trust bundle until it expires.

Rotation order, so that no handshake fails:
1. a new CA (if any) is stored first, so a crash never loses the key of an issued leaf;
2. the caBundle is patched to the new trust bundle (new CA + still-valid old CAs) BEFORE any pod can
   serve a leaf signed by the new CA; the old CA remains trusted for pods still serving the old
   leaf;
3. the TLS Secret is written last; the kubelet syncs the mounted files (~1 min) and the server
   picks them up without a restart (certs/tls.py). With the CA unchanged (the usual leaf renewal),
   the caBundle does not change at all, and the old leaf stays valid (renewed `renew_before` early)
   until every pod serves the new one.
"""
import base64
import datetime as dt
import json
import logging
from dataclasses import dataclass, field

from archway.errors import ArchwayError

from .x509 import (
    CertificateError,
    Issued,
    bundle_pem,
    describe,
    hosts_of,
    is_ca,
    is_issued_by,
    issue_ca,
    issue_serving_cert,
    load_certs,
    load_issued,
    normalize_hosts,
    remaining,
    service_dns_names,
    utcnow,
)

log = logging.getLogger(__name__)

REQUEST_TIMEOUT_SECONDS = 10
MAX_TRUSTED_CAS = 3
FIELD_MANAGER = "archway-certs-bootstrap"


class BootstrapError(ArchwayError):
    """The API server refused or failed a request the bootstrap needs."""


@dataclass(frozen=True)
class BootstrapSpec:
    namespace: str
    service: str
    secret: str
    webhook_config: str | None = None      # None: do not touch any webhook configuration
    ca_secret: str | None = None           # default: "<secret>-ca"
    days: int = 365
    ca_days: int = 3650
    renew_before_days: int = 30
    cluster_domain: str = "cluster.local"
    allow_missing_webhook_config: bool = False   # the pre-install run comes before it exists
    extra_hosts: tuple[str, ...] = ()      # names the webhook is also called by (an external URL's)

    def __post_init__(self):
        if self.days <= 0 or self.renew_before_days <= 0:
            raise BootstrapError("--days and --renew-before-days must be positive")
        if self.renew_before_days >= self.days:
            raise BootstrapError("--renew-before-days must be shorter than --days, "
                                 "or every run would renew")
        if self.ca_days < self.days + self.renew_before_days:
            raise BootstrapError("--ca-days must cover at least --days + --renew-before-days")

    @property
    def ca_secret_name(self) -> str:
        return self.ca_secret or f"{self.secret}-ca"

    @property
    def hosts(self) -> list[str]:
        return list(dict.fromkeys(service_dns_names(self.service, self.namespace,
                                                    self.cluster_domain) + list(self.extra_hosts)))

    @property
    def renew_before(self) -> dt.timedelta:
        return dt.timedelta(days=self.renew_before_days)


# --- the decision (pure apart from key generation) ---------------------------------------------

@dataclass(frozen=True)
class CertPlan:
    ca: Issued
    ca_reason: str | None          # None: the stored CA is kept
    leaf: Issued
    leaf_reason: str | None        # None: the stored leaf is kept
    trust_bundle: bytes            # PEM: current CA first, then still-valid previous CAs


def plan_certificates(spec: BootstrapSpec, tls_data: dict[str, bytes] | None,
                      ca_data: dict[str, bytes] | None, now: dt.datetime | None = None) -> CertPlan:
    """What the Secrets must hold, given what they hold now (decoded data, None when absent)."""
    now = now or utcnow()
    ca, ca_reason = _stored_pair(ca_data, "ca.crt", "ca.key", "CA")
    if ca is not None:
        if not is_ca(ca.cert):
            ca, ca_reason = None, "the stored CA certificate is not a CA"
        elif remaining(ca.cert, now) < dt.timedelta(days=spec.days) + spec.renew_before:
            ca_reason = f"the CA expires {ca.cert.not_valid_after_utc:%Y-%m-%d}"
            ca = None
    if ca is None:
        ca = issue_ca(f"archway CA for {spec.service}.{spec.namespace}", days=spec.ca_days, now=now)

    leaf, leaf_reason = _stored_pair(tls_data, "tls.crt", "tls.key", "certificate")
    if leaf is not None:
        leaf_reason = _leaf_problem(leaf, ca, spec, now)
        if leaf_reason:
            leaf = None
    if leaf is None:
        leaf = issue_serving_cert(ca, spec.hosts, days=spec.days, now=now,
                                  common_name=f"{spec.service}.{spec.namespace}.svc")

    previous = _previous_cas(tls_data, ca, now)
    return CertPlan(ca, ca_reason, leaf, leaf_reason, bundle_pem([ca.cert] + previous))


def _stored_pair(data, cert_key, key_key, what) -> tuple[Issued | None, str | None]:
    if not data:
        return None, f"no {what} stored yet"
    if not data.get(cert_key) or not data.get(key_key):
        return None, f"the stored {what} lacks {cert_key} or {key_key}"
    try:
        return load_issued(data[cert_key], data[key_key]), None
    except CertificateError as e:
        return None, f"the stored {what} is unusable: {e}"


def _leaf_problem(leaf: Issued, ca: Issued, spec: BootstrapSpec, now) -> str | None:
    if not is_issued_by(leaf.cert, ca.cert):
        return "the certificate was not signed by the current CA"
    if hosts_of(leaf.cert) != normalize_hosts(spec.hosts):
        return (f"the certificate names {sorted(hosts_of(leaf.cert))}, "
                f"not {sorted(normalize_hosts(spec.hosts))}")
    if leaf.cert.not_valid_before_utc > now:
        return "the certificate is not valid yet"
    if remaining(leaf.cert, now) <= spec.renew_before:
        return f"the certificate expires {leaf.cert.not_valid_after_utc:%Y-%m-%d}"
    return None


def _previous_cas(tls_data, ca: Issued, now):
    """Still-valid CAs of the stored trust bundle other than the current one: pods may still serve
    a leaf they signed until the kubelet syncs the new Secret."""
    try:
        stored = load_certs(tls_data["ca.crt"]) if tls_data and tls_data.get("ca.crt") else []
    except CertificateError:
        return []
    out = []
    for cert in stored:
        if cert != ca.cert and cert not in out and is_ca(cert) and remaining(cert, now) > dt.timedelta(0):
            out.append(cert)
    return out[:MAX_TRUSTED_CAS - 1]


def ca_bundle_patch(webhook_config: dict, ca_bundle_b64: str) -> list[dict]:
    """JSON-patch operations setting every webhook's clientConfig.caBundle (empty when all are
    right). Each write is guarded by a `test` of the webhook's name so a concurrent edit that
    reorders the list makes the patch fail instead of writing the wrong entry."""
    ops = []
    for i, webhook in enumerate(webhook_config.get("webhooks") or []):
        client_config = webhook.get("clientConfig") or {}
        if client_config.get("caBundle") == ca_bundle_b64:
            continue
        ops.append({"op": "test", "path": f"/webhooks/{i}/name", "value": webhook.get("name")})
        if "clientConfig" not in webhook:
            ops.append({"op": "add", "path": f"/webhooks/{i}/clientConfig", "value": {}})
        ops.append({"op": "add", "path": f"/webhooks/{i}/clientConfig/caBundle",
                    "value": ca_bundle_b64})
    return ops


# --- talking to the API server ------------------------------------------------------------------

@dataclass
class BootstrapResult:
    ca: str = "unchanged"            # created | renewed | unchanged
    certificate: str = "unchanged"
    webhooks_patched: int = 0
    webhook_config: str = "unchanged"  # patched | unchanged | missing | skipped
    reasons: list[str] = field(default_factory=list)
    serial: str = ""

    def summary(self, spec: BootstrapSpec) -> str:
        why = f" ({'; '.join(self.reasons)})" if self.reasons else ""
        return (f"CA secret {spec.namespace}/{spec.ca_secret_name}: {self.ca}; "
                f"TLS secret {spec.namespace}/{spec.secret}: {self.certificate} "
                f"(serial {self.serial}); webhook configuration "
                f"{spec.webhook_config or '-'}: {self.webhook_config}"
                + (f", {self.webhooks_patched} webhook(s)" if self.webhooks_patched else "") + why)


def run_bootstrap(spec: BootstrapSpec, api_client, now: dt.datetime | None = None,
                  attempts: int = 3, served: dict[str, bytes] | None = None) -> BootstrapResult:
    """Bring the Secrets and the caBundle in line; retried when a concurrent writer wins a race.
    `served` (tls.crt, tls.key, ca.crt: what a running webhook pod serves and is trusted with)
    stands in for a TLS Secret that is gone or broken, so a valid served pair is stored again
    rather than replaced (certs/trustpath.py)."""
    from kubernetes.client.exceptions import ApiException
    from urllib3.exceptions import HTTPError

    from archway.kubeapi import unreachable

    for attempt in range(attempts):
        try:
            return _bootstrap_once(spec, _Kube(api_client), now, served)
        except ApiException as e:
            if e.status != 409 or attempt == attempts - 1:
                raise BootstrapError(_api_message(e)) from None
            log.info("another writer changed an object meanwhile; starting over")
        except (HTTPError, OSError) as e:   # refused, timed out, TLS: nothing was written
            raise BootstrapError(unreachable(api_client.configuration.host, e)) from None
    raise AssertionError("unreachable")


def _bootstrap_once(spec: BootstrapSpec, kube: "_Kube", now, served=None) -> BootstrapResult:
    result = BootstrapResult()
    tls_secret = kube.read_secret(spec.namespace, spec.secret)
    ca_secret = kube.read_secret(spec.namespace, spec.ca_secret_name)
    tls_data = _decoded(tls_secret)
    if served and _stored_pair(tls_data, "tls.crt", "tls.key", "certificate")[0] is None:
        tls_data = served
    plan = plan_certificates(spec, tls_data, _decoded(ca_secret), now)
    result.serial = f"{plan.leaf.cert.serial_number:x}"
    webhook_config = kube.read_webhook_config(spec.webhook_config) if spec.webhook_config else None
    # Owned by the webhook configuration, the Secrets go with it (`helm uninstall`): Helm never
    # knew them. The pre-install run comes before it exists; a later run adopts them.
    owner = owner_reference(webhook_config)

    ca_data = {"ca.crt": plan.ca.cert_pem, "ca.key": plan.ca.key_pem}
    if plan.ca_reason:                                      # 1. the CA first
        result.ca = "created" if ca_secret is None else "renewed"
        if ca_secret is not None:
            result.reasons.append(plan.ca_reason)
        kube.write_secret(spec.namespace, spec.ca_secret_name, "Opaque", ca_data, ca_secret, owner)
        log.info("stored CA %s", describe(plan.ca.cert))
    elif _unowned(ca_secret, owner):
        kube.write_secret(spec.namespace, spec.ca_secret_name, "Opaque", ca_data, ca_secret, owner)
        log.info("Secret %s now belongs to %s", spec.ca_secret_name, spec.webhook_config)

    bundle_b64 = base64.b64encode(plan.trust_bundle).decode()
    if spec.webhook_config:                                 # 2. trust before serving
        result.webhook_config, result.webhooks_patched = _patch_ca_bundle(
            spec, kube, bundle_b64, webhook_config)
    else:
        result.webhook_config = "skipped"

    wanted = {"tls.crt": plan.leaf.cert_pem, "tls.key": plan.leaf.key_pem,
              "ca.crt": plan.trust_bundle}
    current = _decoded(tls_secret) or {}
    if _unowned(tls_secret, owner) and not plan.leaf_reason and current == wanted:
        kube.write_secret(spec.namespace, spec.secret, "kubernetes.io/tls", wanted, tls_secret,
                          owner)
        log.info("Secret %s now belongs to %s", spec.secret, spec.webhook_config)
    elif plan.leaf_reason or any(current.get(k) != v for k, v in wanted.items()):
        result.certificate = "created" if tls_secret is None else "renewed"
        if tls_secret is not None:
            result.reasons.append(plan.leaf_reason or (
                "the trust bundle changed" if current.get("ca.crt") != plan.trust_bundle
                else "the stored PEM data was not in canonical form"))
        kube.write_secret(spec.namespace, spec.secret, "kubernetes.io/tls", wanted, tls_secret,
                          owner)
        log.info("stored serving certificate %s", describe(plan.leaf.cert))
    return result


def owner_reference(webhook_config: dict | None) -> dict | None:
    """An ownerReference to the webhook configuration (a cluster-scoped owner may own namespaced
    objects); None when it does not exist (yet)."""
    meta = (webhook_config or {}).get("metadata") or {}
    if not meta.get("uid"):
        return None
    return {"apiVersion": "admissionregistration.k8s.io/v1", "kind": "MutatingWebhookConfiguration",
            "name": meta["name"], "uid": meta["uid"]}


def _unowned(secret: dict | None, owner: dict | None) -> bool:
    """True when `secret` exists and lacks the ownerReference `owner` (None: nothing to own)."""
    if secret is None or owner is None:
        return False
    refs = (secret.get("metadata") or {}).get("ownerReferences") or []
    return not any(ref.get("uid") == owner["uid"] for ref in refs)


def _patch_ca_bundle(spec: BootstrapSpec, kube: "_Kube", bundle_b64: str,
                     config: dict | None) -> tuple[str, int]:
    if config is None:
        if spec.allow_missing_webhook_config:
            log.info("MutatingWebhookConfiguration %s does not exist yet; a later run patches it",
                     spec.webhook_config)
            return "missing", 0
        raise BootstrapError(f"MutatingWebhookConfiguration {spec.webhook_config} not found")
    ops = ca_bundle_patch(config, bundle_b64)
    if not ops:
        return "unchanged", 0
    assert spec.webhook_config is not None   # a config was read for it
    kube.patch_webhook_config(spec.webhook_config, ops)
    patched = sum(1 for op in ops if op["path"].endswith("/caBundle"))
    log.info("patched caBundle of %d webhook(s) in %s", patched, spec.webhook_config)
    return "patched", patched


def _decoded(secret: dict | None) -> dict[str, bytes] | None:
    if secret is None:
        return None
    out = {}
    for k, v in (secret.get("data") or {}).items():
        try:
            out[k] = base64.b64decode(v, validate=True)
        except (ValueError, TypeError):
            out[k] = b""   # garbage counts as missing
    return out


def _api_message(e) -> str:
    try:
        message = json.loads(e.body).get("message") or e.reason
    except (TypeError, ValueError, AttributeError):
        message = e.reason
    return f"the API server answered {e.status}: {message}"


# Every call bounded in time; answers kept as raw JSON: nothing of an object is lost or
# re-validated by the client's models on the way (a write's answer is not even parsed).
_RAW = {"_preload_content": False, "_request_timeout": REQUEST_TIMEOUT_SECONDS}


class _Kube:
    """The five API calls the bootstrap makes, on plain dicts."""

    def __init__(self, api_client):
        from kubernetes import client
        self.core = client.CoreV1Api(api_client)
        self.admission = client.AdmissionregistrationV1Api(api_client)
        self.client = client

    def read_secret(self, namespace: str, name: str) -> dict | None:
        return self._read(self.core.read_namespaced_secret, name, namespace)

    def read_webhook_config(self, name: str) -> dict | None:
        return self._read(self.admission.read_mutating_webhook_configuration, name)

    def _read(self, method, *args) -> dict | None:
        from kubernetes.client.exceptions import ApiException
        try:
            response = method(*args, **_RAW)
        except ApiException as e:
            if e.status == 404:
                return None
            raise
        return json.loads(response.data)

    def write_secret(self, namespace: str, name: str, secret_type: str,
                     data: dict[str, bytes], existing: dict | None,
                     owner: dict | None = None) -> None:
        """Create or replace; `owner` is added to the ownerReferences the Secret has."""
        labels = {"app.kubernetes.io/managed-by": "archway-certs-bootstrap"}
        meta = self.client.V1ObjectMeta(name=name, namespace=namespace, labels=labels)
        owners = [r for r in ((existing or {}).get("metadata") or {}).get("ownerReferences") or []
                  if not owner or r.get("uid") != owner["uid"]]
        if owner:
            owners.append(owner)
        meta.owner_references = [self.client.V1OwnerReference(
            api_version=r["apiVersion"], kind=r["kind"], name=r["name"], uid=r["uid"],
            controller=r.get("controller"), block_owner_deletion=r.get("blockOwnerDeletion"))
            for r in owners] or None
        encoded: dict[str, bytes | str] = {k: base64.b64encode(v).decode() for k, v in data.items()}
        if existing is None:
            body = self.client.V1Secret(metadata=meta, type=secret_type, data=encoded)
            self.core.create_namespaced_secret(namespace, body, field_manager=FIELD_MANAGER,
                                               **_RAW)
            return
        # Replace with the resourceVersion read: a concurrent writer makes this fail with 409.
        old_meta = existing.get("metadata") or {}
        meta.resource_version = old_meta.get("resourceVersion")
        meta.labels = {**(old_meta.get("labels") or {}), **labels}
        meta.annotations = old_meta.get("annotations")
        body = self.client.V1Secret(metadata=meta, type=existing.get("type") or secret_type,
                                    data=encoded)
        self.core.replace_namespaced_secret(name, namespace, body, field_manager=FIELD_MANAGER,
                                            **_RAW)

    def patch_webhook_config(self, name: str, ops: list[dict]) -> None:
        self.admission.patch_mutating_webhook_configuration(
            name, ops, field_manager=FIELD_MANAGER, _content_type="application/json-patch+json",
            **_RAW)
