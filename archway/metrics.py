"""Every Prometheus metric archway exports, declared once, here.

Under gunicorn's several worker processes, `archway serve` points PROMETHEUS_MULTIPROC_DIR at a
fresh per-run directory before any worker starts: each process then writes its samples to files
there, and /metrics aggregates them all (MultiProcessCollector), whichever worker answers the
scrape. prometheus_client chooses that storage when it is first imported, so nothing the CLI
imports at start-up may import this module (a test checks it): only the workers and the commands
that serve do, after serve.py set the directory. Without the variable (tests, a worker built in
a test's process) the default in-process registry is used.
"""
import os

import prometheus_client
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    REGISTRY,
    CollectorRegistry,
    generate_latest,
    multiprocess,
)

MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"


class _RememberedLabels:
    """`labels(...)` answered from a dict after its first call with those values.

    prometheus_client takes the metric's lock and converts and checks every label value on each
    call: with 8 handler threads contending for the GIL that was ~8 % of a warm admission's
    CPU (py-spy, docs/benchmarks.md figure 1). A child, once made, is the same object forever.
    """

    def labels(self, *values, **by_name):
        if by_name:
            return super().labels(*values, **by_name)  # type: ignore[misc]
        children = self.__dict__.get("_archway_children")
        if children is None:
            children = self.__dict__.setdefault("_archway_children", {})
        child = children.get(values)
        if child is None:
            child = children[values] = super().labels(*values)  # type: ignore[misc]
        return child


class Counter(_RememberedLabels, prometheus_client.Counter):
    pass


class Histogram(_RememberedLabels, prometheus_client.Histogram):
    pass


class Gauge(_RememberedLabels, prometheus_client.Gauge):
    pass

# Warm admissions take well under a millisecond: fine buckets there, coarse ones up to the deadline.
LATENCY_BUCKETS = (0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
                   2.0, 3.0, 5.0, 10.0)

# --- the process -------------------------------------------------------------------------------
BUILD_INFO = Gauge("archway_build_info", "Always 1; the version label is the running archway's",
                   ["version"], multiprocess_mode="max")
TLS_CERTIFICATE_EXPIRY = Gauge(
    "archway_tls_certificate_expiry_timestamp_seconds",
    "Unix time the serving certificate (server.cert_file) expires, read at every scrape",
    multiprocess_mode="livemostrecent")
TRUST_PATH_OK = Gauge(
    "archway_trust_path_ok",
    "1 when every caBundle of archway's MutatingWebhookConfiguration verifies the certificate "
    "this pod serves (and the TLS Secret's, when archway repairs it), 0 when the apiserver "
    "cannot have verified it; checked every 5 s by the pod's gate controller process",
    multiprocess_mode="livemostrecent")
TRUST_PATH_REPAIRS = Counter(
    "archway_trust_path_repairs_total",
    "Repairs of the trust path by the leader, by outcome: repaired (the caBundle patched or a "
    "Secret stored), failed", ["outcome"])

# --- admission ----------------------------------------------------------------------------------
ADMISSIONS = Counter("archway_admissions_total", "Admission requests answered, by outcome",
                     ["outcome"])
ADMISSION_DURATION = Histogram("archway_admission_duration_seconds",
                               "Time to answer an admission request, server side",
                               buckets=LATENCY_BUCKETS)
ADMISSION_WARNINGS = Counter("archway_admission_warnings_total",
                             "Warnings returned to clients in admission responses")
IMAGE_RESOLUTIONS = Counter(
    "archway_image_resolutions_total",
    "Image resolutions during admission: source is where the answer came from (oci-index, "
    "sif-https...) or the reference scheme when it failed; result is resolved, no_arch or an "
    "error kind", ["source", "result"])
AUDIT_DECISIONS = Counter(
    "archway_audit_decisions_total",
    "Pods admitted in audit mode (admission.mode or the namespace label archway.dev/mode), by "
    "what enforce mode would have done: mutated, unchanged, denied, fail_open", ["would"])
UNSCHEDULABLE_PODS = Counter(
    "archway_unschedulable_pods_total",
    "Pods whose images' architectures no current node they tolerate has (the node cache's "
    "view), by action: warned or denied", ["action"])
CLIENT_CUTS = Counter(
    "archway_client_connections_cut_total",
    "Client connections archway closed before their request was in: handshake_timeout, "
    "header_timeout, body_timeout (too slow), tls_failed (no TLS client), plain_http (HTTP "
    "on the TLS port, answered 400), overflow (the oldest partial or idle connection, to make "
    "room)", ["reason"])
OWNER_WAITS = Counter(
    "archway_admission_owner_waits_total",
    "Admissions of pods whose controller the workload watch had not brought, by result: found "
    "or missed (waited), busy, not_watching or missed_before (answered at once)", ["result"])
BAD_REQUESTS = Counter("archway_bad_requests_total",
                       "Requests rejected as malformed, by HTTP status", ["code"])

# --- gate controller (admission.unresolved: gate) -------------------------------------------------
GATED_PODS = Gauge("archway_gated_pods",
                   "Pods carrying archway's scheduling gate now, as the leading gate controller "
                   "sees them (0 on the other replicas)", multiprocess_mode="livesum")
GATE_OLDEST = Gauge("archway_gate_oldest_seconds",
                    "Age of the oldest pod carrying archway's scheduling gate (0: none), as the "
                    "leading gate controller sees it", multiprocess_mode="livemax")
# A gated pod waits from seconds (the registry was slow) to admission.gate_max_seconds.
GATE_WAIT = Histogram("archway_gate_wait_seconds",
                      "Time from a gated pod's creation to its release",
                      buckets=(0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0))
GATE_RELEASES = Counter(
    "archway_gate_releases_total",
    "Gated pods released, by outcome: placed, fallback (placement.fallback_architectures), "
    "unplaced (admission.gate_max_seconds passed, or an image can never be read), "
    "no_common_arch (kept off every node), deleted (deleted while gated)", ["outcome"])
GATE_CONTROLLER_RESTARTS = Counter(
    "archway_gate_controller_restarts_total",
    "Times archway serve started its gate controller process again after it died")

# --- the closed loop (remediation; the leading gate controller) --------------------------------
EXEC_FORMAT_ERRORS = Counter(
    "archway_exec_format_errors_total",
    "Containers seen failing to start with exec format error (in their status or log), by the "
    "architecture of their node (each container of a pod counted once)", ["architecture"])
ARCHITECTURES_DROPPED = Counter(
    "archway_image_architectures_dropped_total",
    "Tags found naming a new digest that lacks an architecture the previous digest had, by the "
    "architecture dropped", ["architecture"])
UNSEEN_PODS = Counter(
    "archway_unseen_pods_total",
    "Pods found bound in a namespace archway covers without archway's decision (admitted while "
    "its webhook was down, bypassed or failing open), each once, by what their images say of "
    "their node: wrong_architecture, runs (the node's architecture is theirs), unknown",
    ["placement"])
UNSEEN_PODS_PRESENT = Gauge(
    "archway_unseen_pods_present",
    "Pods without archway's decision present now in the namespaces archway covers, as the "
    "leading gate controller sees them (0 on the other replicas)", multiprocess_mode="livesum")
REMEDIATION_EVICTIONS = Counter(
    "archway_remediation_evictions_total",
    "Evictions of pods failing with exec format error (remediation.evict), by outcome: evicted, "
    "blocked (a PodDisruptionBudget refused it for now; asked again), refused (403: not asked "
    "again), abandoned (still blocked after the last try), failed", ["outcome"])
REMEDIATION_LOG_READS = Counter(
    "archway_remediation_log_reads_total",
    "Tails of failed containers' logs read for an exec format error (a status saying nothing of "
    "why), by outcome: matched, unmatched, failed", ["outcome"])

# --- registry and cache -------------------------------------------------------------------------
CACHE_LOOKUPS = Counter(
    "archway_cache_lookups_total",
    "Resolver cache lookups by result: fresh (answered within its TTL), stale (past its TTL, "
    "answered while a revalidation runs or after one failed), revalidate (a pod pulling Always "
    "waited for a check at the registry), miss (looked up), shared (joined a lookup already "
    "running)", ["result"])
CACHE_REVALIDATIONS = Counter(
    "archway_cache_revalidations_total",
    "Checks of cached answers at their registry, by outcome: unchanged (same digest: no "
    "manifest fetched), changed, or the error kind that kept the cached answer in use "
    "(stale-if-error)", ["outcome"])
REGISTRY_EVENTS = Counter(
    "archway_registry_events_total",
    "Registry push events (registry.events) by source (distribution, harbor, cloudevents, ecr, "
    "acr; unknown for a refused request) and outcome: queued (a pushed tag to check at its "
    "registry), coalesced (already waiting), ignored (no pushed tag: pulls, blobs, deletes), "
    "unauthorized, rate_limited, malformed (requests)", ["source", "outcome"])
PREWARM_IMAGES = Gauge(
    "archway_prewarm_images",
    "Pre-warming at start (registry.prewarm): images the cluster's workloads and pods name "
    "(found), lookups started, and how many resolved or failed once done; the furthest "
    "process of the server", ["state"], multiprocess_mode="livemax")
IMAGE_RECORD_WRITES = Counter(
    "archway_image_record_writes_total",
    "Writes of the cluster's image records (ImageRecord, ClusterImageRecord) by result: created, "
    "updated, exists (a create another process made first), conflict (an update another "
    "process made first), failed, dropped (the write queue was full), deleted (expired)",
    ["result"])
IMAGE_RECORDS_SERVED = Counter(
    "archway_image_records_served_total",
    "Lookups that found the image's record in the cluster's image records (after the process's "
    "own cache, before a registry)")
CACHE_BYTES = Gauge("archway_cache_bytes", "Approximate memory held by the resolver cache",
                    multiprocess_mode="livesum")
REGISTRY_BACKOFF_UNTIL = Gauge(
    "archway_registry_backoff_until_timestamp_seconds",
    "Unix time until which a registry host that answered HTTP 429 gets no request (compare "
    "with time()); hosts beyond the first 32 seen share host=\"other\"", ["host"],
    multiprocess_mode="max")
REGISTRY_REQUESTS = Counter("archway_registry_requests_total",
                            "HTTP requests to registries and SIF servers, by method and outcome "
                            "(a status class such as 2xx, 429 on its own, or an error kind)",
                            ["method", "outcome"])
TOKEN_REQUESTS = Counter("archway_registry_token_requests_total",
                         "Bearer token requests to registry token services, by outcome (success, "
                         "or an error kind: auth_error, rate_limited, transport_error...)",
                         ["outcome"])
CREDENTIAL_PROVIDER_CALLS = Counter(
    "archway_credential_provider_calls_total",
    "Runs of kubelet credential provider plugins, by provider and outcome (success, timeout, "
    "exit_status, invalid_response, output_too_large, exec_error); cached answers are not runs",
    ["provider", "outcome"])
SERVICE_ACCOUNT_TOKENS = Counter(
    "archway_service_account_token_requests_total",
    "TokenRequests for pods' ServiceAccounts, for credential providers with tokenAttributes "
    "(KEP-4412), by outcome (issued, refused: the API said no, failed); a token reused from "
    "memory is not a request", ["outcome"])
MIRROR_REQUESTS = Counter(
    "archway_registry_mirror_requests_total",
    "Image lookups sent to a registry mirror (registry.hosts_dir), by outcome: answered, or the "
    "error kind that made archway try the next host", ["outcome"])

# --- scheduler extender -------------------------------------------------------------------------
EXTENDER_REQUESTS = Counter("archway_extender_requests_total",
                            "Scheduler extender calls, by verb and outcome", ["verb", "outcome"])
EXTENDER_DURATION = Histogram("archway_extender_duration_seconds",
                              "Time to answer a scheduler extender call, server side", ["verb"],
                              buckets=LATENCY_BUCKETS)
PROMETHEUS_UP = Gauge("archway_prometheus_up", "1 when the last Prometheus traffic query succeeded",
                      multiprocess_mode="livemostrecent")
PROMETHEUS_SERIES = Gauge("archway_prometheus_series",
                          "Series (traffic and capacity) the last Prometheus query returned",
                          multiprocess_mode="livemostrecent")
PROMETHEUS_LAST_SUCCESS = Gauge(
    "archway_prometheus_last_success_timestamp_seconds",
    "Unix time of the last successful traffic query (data older than "
    "prometheus.stale_after_seconds is not used)", multiprocess_mode="max")
PROMETHEUS_SNAPSHOT = Gauge(
    "archway_prometheus_snapshot_timestamp_seconds",
    "Unix time of the traffic sample each serving process scores with, by pid under gunicorn "
    "(its freshness: now minus this)", multiprocess_mode="liveall")
PROMETHEUS_POLLER = Gauge(
    "archway_prometheus_poller",
    "1 in the one process of a server that queries Prometheus (the others read its snapshot)",
    multiprocess_mode="liveall")
PROMETHEUS_QUERY_ERRORS = Counter("archway_prometheus_query_errors_total",
                                  "Prometheus traffic queries that failed")


def multiprocess_dir() -> str | None:
    return os.environ.get(MULTIPROC_ENV) or None


def render() -> tuple[bytes, str]:
    """The /metrics body and its content type, aggregated over every worker process."""
    if multiprocess_dir():
        registry = CollectorRegistry()
        multiprocess.MultiProcessCollector(registry)  # type: ignore[no-untyped-call]
    else:
        registry = REGISTRY
    return generate_latest(registry), CONTENT_TYPE_LATEST


def mark_process_dead(pid: int) -> None:
    """For gunicorn's child_exit hook: drop a dead worker's live gauges."""
    if multiprocess_dir():
        multiprocess.mark_process_dead(pid)  # type: ignore[no-untyped-call]


def started(version: str) -> None:
    BUILD_INFO.labels(version).set(1)


def certificate_expires(timestamp: float) -> None:
    TLS_CERTIFICATE_EXPIRY.set(timestamp)


def admission_finished(outcome: str, seconds: float, warnings: int) -> None:
    ADMISSIONS.labels(outcome).inc()
    ADMISSION_DURATION.observe(seconds)
    if warnings:
        ADMISSION_WARNINGS.inc(warnings)


_BACKOFF_HOSTS: set[str] = set()
_MAX_BACKOFF_HOSTS = 32


def backoff_until(host: str, unix_time: float) -> None:
    if host not in _BACKOFF_HOSTS and len(_BACKOFF_HOSTS) >= _MAX_BACKOFF_HOSTS:
        host = "other"   # label values stay bounded whatever hosts pods name
    _BACKOFF_HOSTS.add(host)
    REGISTRY_BACKOFF_UNTIL.labels(host).set(unix_time)


def client_cut(reason: str) -> None:
    CLIENT_CUTS.labels(reason).inc()


def bad_request(status: int) -> None:
    BAD_REQUESTS.labels(str(status)).inc()
