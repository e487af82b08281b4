"""Checks of the bench's own helpers (statistics, table, profile summary, log parsing, the
autoscale and scale sections' pure parts, the no-op webhook): pure and fast, so they run with the
fast tier, where a change to archway's log lines, chart or metrics that the bench reads fails
at once rather than at the next bench run. The bench itself (bash bench/run.sh) is not a test.
"""
import datetime
import math

import pytest

from bench.common.report import Figure, failed_figure, summary, table
from bench.common.stats import (
    bucket_difference,
    histogram_buckets,
    histogram_quantile,
    median,
    parse_metrics,
    percentile,
    share_at_most,
)
from bench.profile import summarize

EXPOSITION = """# HELP archway_admission_duration_seconds Time to answer
# TYPE archway_admission_duration_seconds histogram
archway_admission_duration_seconds_bucket{le="0.005"} 90.0
archway_admission_duration_seconds_bucket{le="0.01"} 99.0
archway_admission_duration_seconds_bucket{le="+Inf"} 100.0
archway_admission_duration_seconds_count 100.0
archway_extender_duration_seconds_bucket{le="0.005",verb="filter"} 1.0
archway_extender_duration_seconds_bucket{le="+Inf",verb="filter"} 2.0
archway_admissions_total{outcome="mutated"} 7.0
"""


def test_percentile_is_an_observed_value_by_nearest_rank():
    samples = [5, 1, 4, 2, 3, 10, 9, 8, 7, 6]
    assert percentile(samples, 50) == 5
    assert percentile(samples, 99) == 10
    assert percentile(samples, 10) == 1
    with pytest.raises(ValueError):
        percentile([], 50)


def test_median_of_odd_and_even_counts():
    assert median([3, 1, 2]) == 2
    assert median([4, 1, 3, 2]) == 2.5


def test_parse_metrics_reads_labels_and_values():
    samples = parse_metrics(EXPOSITION)
    assert ("archway_admissions_total", {"outcome": "mutated"}, 7.0) in samples
    assert all(not name.startswith("#") for name, _, _ in samples)


def test_histogram_buckets_filter_by_label_and_share_at_most():
    buckets = histogram_buckets(EXPOSITION, "archway_admission_duration_seconds")
    assert buckets == {0.005: 90.0, 0.01: 99.0, math.inf: 100.0}
    assert share_at_most(buckets, 0.005) == 0.9
    extender = histogram_buckets(EXPOSITION, "archway_extender_duration_seconds", verb="filter")
    assert extender == {0.005: 1.0, math.inf: 2.0}
    assert histogram_buckets(EXPOSITION, "archway_extender_duration_seconds", verb="x") == {}


def test_bucket_difference_keeps_only_new_observations():
    before = {0.005: 10.0, math.inf: 10.0}
    after = {0.005: 15.0, math.inf: 20.0}
    assert bucket_difference(after, before) == {0.005: 5.0, math.inf: 10.0}


def test_histogram_quantile_interpolates_like_prometheus():
    buckets = {0.005: 90.0, 0.01: 99.0, math.inf: 100.0}
    assert histogram_quantile(buckets, 0.5) == pytest.approx(0.005 * 50 / 90)
    assert histogram_quantile(buckets, 0.95) == pytest.approx(0.005 + 0.005 * 5 / 9)
    assert histogram_quantile(buckets, 0.999) == 0.01   # in +Inf: the highest finite bound
    assert math.isnan(histogram_quantile({math.inf: 0.0}, 0.5))


def test_table_and_summary_show_every_verdict():
    figures = [Figure("1", "speed", "0.9", ">= 0.85", True),
               Figure("1b", "context", "x", "-", None),
               failed_figure("2", "latency", "< 5 ms", RuntimeError("server exited\nlog..."))]
    text = table(figures)
    assert text.splitlines()[0].startswith("| # ")
    assert "PASS" in text and "info" in text and "MISS" in text
    assert "not measured (RuntimeError: server exited)" in text
    assert summary(figures) == "1/2 targets met; missed: 2"


def test_profile_summary_counts_inclusive_and_self_samples():
    collapsed = ("main (app.py:1);handle (w.py:5);decide (placement.py:9) 30\n"
                 "main (app.py:1);handle (w.py:5) 10\n"
                 "main (app.py:1);log (logging/__init__.py:3) 60\n")
    text = summarize(collapsed, top=3)
    assert "100 samples" in text
    assert "100.0%  main (app.py)" in text           # inclusive: on every stack
    assert " 60.0%  log (__init__.py)" in text      # self: top of 60 samples
    assert " 40.0%  handle (w.py)" in text


def test_log_line_patterns_match_what_archway_logs():
    from bench.common.servers import ADMISSION_LINE, FILTER_LINE
    admission = ("2026-11-22 07:45:00,520 INFO archway.admission: admission shop/web-7d9c5b8f6d-* "
                 "uid=0d6b images=1 archs=amd64,arm,arm64 outcome=mutated (required node affinity "
                 "kubernetes.io/arch In amd64, arm, arm64) warnings=0 0.4 ms")
    assert ADMISSION_LINE.search(admission)["ms"] == "0.4"
    assert ADMISSION_LINE.search(admission + " dry-run")["ms"] == "0.4"
    assert ADMISSION_LINE.search("INFO archway.admission: rejected a malformed request") is None
    extender = ("2026-11-22 08:00:00,000 INFO archway.extender: filter shop/web-x: archs=amd64 "
                "from annotation, 2500/5000 nodes pass (741.2 ms)")
    assert FILTER_LINE.search(extender)["ms"] == "741.2"


def test_bench_pool_and_wrong_placements():
    from bench.sections.autoscale.provisioning import (
        INSTANCE_CPU,
        bench_pool,
        claim_summary,
        claim_timeline,
        wrong_placements,
    )
    pool = bench_pool("bench-x")
    assert pool["metadata"]["name"] == "bench-x"
    requirements = {r["key"]: r["values"] for r in pool["spec"]["template"]["spec"]["requirements"]}
    assert requirements["kubernetes.io/arch"] == ["amd64", "arm64"]
    assert requirements[INSTANCE_CPU] == ["4", "8"]
    assert pool["spec"]["disruption"]["consolidateAfter"] == "Never"
    assert INSTANCE_CPU not in {r["key"] for r in bench_pool("y", cpus=None)["spec"]["template"]
                                ["spec"]["requirements"]}
    archs = {"n1": "amd64", "n2": "arm64"}
    pods = {"a": (frozenset({"amd64"}), "n1"), "b": (frozenset({"amd64"}), "n2"),
            "c": (frozenset({"amd64", "arm64"}), "n2"), "d": (frozenset({"arm64"}), "gone")}
    assert wrong_placements(pods, archs) == 2
    claim = {"metadata": {"labels": {"kubernetes.io/arch": "arm64",
                                     "node.kubernetes.io/instance-type": "c-4x-arm64-linux"}}}
    assert claim_summary([claim, claim]) == "2x arm64 c-4x-arm64-linux"
    assert claim_summary([]) == "none"
    claim["metadata"]["creationTimestamp"] = "2026-11-27T22:00:03Z"
    claim["status"] = {"conditions": [{"type": "Ready", "status": "True",
                                       "lastTransitionTime": "2026-11-27T22:00:05Z"}]}
    since = datetime.datetime(2026, 11, 27, 22, 0, 1, tzinfo=datetime.UTC).timestamp()
    assert claim_timeline([claim], since) == "NodeClaims created +2 to +2 s, Ready by +4 s"


def test_the_no_op_webhook_is_the_charts_webhook_deployment_serving_the_echo_app(tmp_path):
    """bench/sections/realnode.py's baseline: everything of the chart's webhook pod but the app."""
    import os
    import subprocess

    import yaml

    from bench.sections.realnode import NOOP, noop_deployment
    from lab.procs import REPO, require_binary
    env = {**os.environ, **{f"HELM_{k}_HOME": str(tmp_path / k) for k in ("CACHE", "CONFIG", "DATA")}}
    out = subprocess.run([require_binary("helm"), "template", "archway",
                          os.path.join(REPO, "charts", "archway"), "-n", "archway-system",
                          "--show-only", "templates/deployment.yaml"],
                         capture_output=True, text=True, env=env, timeout=60, check=True).stdout
    webhook = yaml.safe_load(out)
    noop = noop_deployment(webhook)
    labels = noop["spec"]["selector"]["matchLabels"]
    assert labels["app.kubernetes.io/component"] == "bench-noop"
    assert labels.items() <= noop["spec"]["template"]["metadata"]["labels"].items()
    assert webhook["spec"]["selector"]["matchLabels"]["app.kubernetes.io/component"] == "webhook"
    ours, theirs = (d["spec"]["template"]["spec"] for d in (noop, webhook))
    (app,), (chart,) = ours["containers"], theirs["containers"]
    assert app["command"] == ["python3", "/opt/bench/echo_app.py"]
    assert app["args"][:2] == chart["args"][:2] == ["--config", "/etc/archway/config/webhook.yaml"]
    assert app["readinessProbe"]["httpGet"]["path"] == "/healthz"
    for same in ("image", "resources", "securityContext", "startupProbe", "livenessProbe"):
        assert app[same] == chart[same], same
    assert {v["name"]: v.get("secret", {}).get("secretName") for v in ours["volumes"]}["tls"] == NOOP
    assert ours["securityContext"] == theirs["securityContext"]
    assert noop["spec"]["replicas"] == webhook["spec"]["replicas"]


def test_the_echo_app_answers_its_canned_patch_only_to_pods_labelled_for_it(tmp_path, monkeypatch):
    import base64
    import json

    from bench.apps.echo_app import create_echo_app
    ops = [{"op": "add", "path": "/metadata/annotations", "value": {"a": "b"}}]
    (tmp_path / "patch.json").write_text(json.dumps(ops))
    monkeypatch.setenv("ECHO_PATCH", str(tmp_path / "patch.json"))
    client = create_echo_app().test_client()

    def answer(labels):
        review = {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": {
            "uid": "u", "object": {"metadata": {"labels": labels}}}}
        return client.post("/mutate", json=review).get_json()["response"]
    patched = answer({"bench": "noop-patch"})
    assert json.loads(base64.b64decode(patched["patch"])) == ops and patched["allowed"]
    assert answer({"bench": "noop"}) == {"uid": "u", "allowed": True}


def test_the_echo_app_runs_archway_serves_gunicorn_options_under_gthread_and_its_tls(tmp_path):
    """Figure 1's yardstick: archway's worker class serves archway's routes, not a WSGI app, so
    the echo app swaps in gunicorn's gthread; every other setting and the TLS context are archway's."""
    from archway.certs.tls import server_context
    from archway.config import config_from_dict
    from archway.server.master import gunicorn_options
    from bench.apps.echo_app import echo_options
    from lab.tls import CertificateAuthority
    pair = CertificateAuthority(tmp_path / "ca").issue("echo", ["127.0.0.1"])
    config = config_from_dict({"server": {"workers": 2, "threads": 8}})
    tls = (pair.chain_path, pair.key_path, pair.chain_path)
    ours = echo_options(config, "127.0.0.1:8443", tls)
    archways = gunicorn_options(config, "127.0.0.1:8443", tls)
    assert ours.pop("worker_class") == "gthread" and ours.pop("proc_name") == "archway-bench-echo"
    hook = ours.pop("ssl_context")
    for name in ("worker_class", "proc_name", "child_exit", "on_starting"):   # hooks: closures,
        archways.pop(name)                                                  # made anew each call
    ours.pop("child_exit")
    ours.pop("on_starting")
    assert ours == archways and ours["certfile"] == pair.chain_path and ours["reuse_port"]
    assert hook(None, None) is server_context(pair.chain_path, pair.key_path)


APISERVER = """apiserver_request_duration_seconds_bucket{resource="pods",subresource="",verb="POST",le="0.025"} 3
apiserver_request_duration_seconds_bucket{resource="pods",subresource="",verb="POST",le="0.1"} 9
apiserver_request_duration_seconds_bucket{resource="pods",subresource="",verb="POST",le="+Inf"} 10
apiserver_request_duration_seconds_sum{resource="pods",subresource="",verb="POST"} 0.5
apiserver_request_duration_seconds_count{resource="pods",subresource="",verb="POST"} 10
apiserver_request_duration_seconds_bucket{resource="pods",subresource="binding",verb="POST",le="+Inf"} 99
apiserver_request_duration_seconds_count{resource="pods",subresource="binding",verb="POST"} 99
"""


def test_the_scale_sections_apiserver_histograms_and_its_figures_at_one_size():
    from bench.sections import scale
    from bench.sections.scale import figures as scale_figures
    from bench.sections.scale.load import POST_PODS, bucket_quantile, delta, histogram, summary
    h = histogram(APISERVER, "apiserver_request_duration_seconds", **POST_PODS)
    assert h == {"buckets": {0.025: 3, 0.1: 9, float("inf"): 10}, "sum": 0.5, "count": 10}
    assert bucket_quantile(h, 0.5) == 0.1 and bucket_quantile(h, 0.99) == float("inf")
    assert delta(h, h)["count"] == 0 and summary(delta(h, h)) == "no calls"
    # One size (ARCHWAY_SCALE_SIZES=300) formats without dividing by the sizes' span.
    kinds = ("webhook", "controller", "extender", "masters")
    size = {"nodes": 300, "ready_s": 10, "rss": {k: [60e6] for k in kinds}, "burst_s": 5,
            "cpu_rest": dict.fromkeys(kinds, 0.0), "cpu_burst": dict.fromkeys(kinds, 0.1),
            "rest_load": "1 1 1", "requests": {}, "at_rest": {"per_minute": 78.0, "by_kind": {}},
            "startup": {"admitted": {"p50": 1, "p99": 2.5, "create_p99": 0.1},
                        "skipped": {"p50": 1, "p99": 2.0, "create_p99": 0.1}, "load": "1 1 1"},
            "apiserver": {"skipped": h, "admitted": h, "webhook": h, "load": "1 1 1"},
            "events": {"relist": {"error": "RuntimeError: x"}, "failover": {"left_out": True},
                       "schedule": {"rates": {"kube-scheduler": [100.0, 100.0, 100.0],
                                              "archway-scheduler": [80.0, 90.0, 85.0],
                                              "go-extender": [100.0, 100.0, 100.0]},
                                    "algorithm_ms": {"kube-scheduler": [1.0] * 3,
                                                     "archway-scheduler": [2.4, 2.5, 2.6],
                                                     "go-extender": [2.0] * 3},
                                    "details": "d", "load": "1 1 1"}}}
    figures = [scale.memory_figure([size]), scale.requests_figure([size]),
               *scale_figures.figures([size])]
    verdicts = {f.number: f.verdict for f in figures}
    assert verdicts["25b"] == "MISS" and verdicts["25"] == "PASS"    # p99 ratio 1.25
    assert verdicts["25e"] == "MISS" and "RuntimeError: x" in figures[5].measured
    assert verdicts["25f"] == "info" and "left out" in figures[6].measured
    # 25g against the default, 25j against the Go extender: the same rounds' third arm, judged
    # on the cycles per second the call leaves the scheduler (1 / the algorithm's mean per pod)
    assert verdicts["25g"] == "PASS" and verdicts["25j"] == "PASS"
    against_go = figures[8]
    assert against_go.measured.startswith("cycles/s 0.80 ±8% (3 rounds: 0.77 to 0.83) (2.50 vs "
                                          "2.00 ms per pod); bound/s 0.85 ±12% (3 rounds: 0.80 "
                                          "to 0.90) (85 vs 100 pods/s)"), against_go.measured
    assert any("archway 2.40, 2.50, 2.60, Go 2.00, 2.00, 2.00 ms" in n for n in against_go.notes)
    size["events"]["schedule"]["algorithm_ms"]["archway-scheduler"] = [4.0] * 3   # half Go's
    assert {f.number: f.verdict for f in scale_figures.figures([size])}["25j"] == "MISS"
    bars = figures[7].data["plots"]["scheduling-rate"]["series"]
    assert bars["kube-scheduler + a minimal Go extender"]["y"] == [100.0]


def test_the_scale_sections_records_requests_and_their_figures():
    from bench.sections.scale import records
    from bench.sections.scale.load import ACCOUNTS, histogram

    def event(audit_id, verb, resource, user=ACCOUNTS + "archway-webhook"):
        return {"auditID": audit_id, "verb": verb, "user": {"username": user},
                "objectRef": {"resource": resource}}

    class Plane:   # the audit log as ControlPlane.audit_events reads it
        def audit_events(self, mark):
            return iter([event("1", "list", "clusterimagerecords"),
                         event("2", "watch", "clusterimagerecords"),
                         event("2", "watch", "clusterimagerecords"),   # a watch logs twice
                         event("3", "create", "clusterimagerecords"),
                         event("4", "watch", "imagerecords"),
                         event("5", "list", "nodes"),
                         event("6", "create", "clusterimagerecords", user="kubernetes-admin")])

    counts = records.records_requests(Plane(), 0)
    assert counts == {"list clusterimagerecords": 1, "watch clusterimagerecords": 1,
                      "create clusterimagerecords": 1, "watch imagerecords": 1}
    assert records.is_records("patch imagerecords") and not records.is_records("get nodes")
    h = histogram(APISERVER, "apiserver_request_duration_seconds", verb="POST", resource="pods",
                  subresource="")
    kinds = ("webhook", "controller", "extender", "masters")
    size = {"nodes": 300, "rss": {k: [60e6] for k in kinds},
            "requests": {"create clusterimagerecords": 1, "get leases": 9, "get secrets": 1},
            "startup": {"admitted": {"p50": 1, "p99": 2.5}, "skipped": {"p50": 1, "p99": 2.0},
                        "load": "1 1 1"},
            "apiserver": {"webhook": h},
            "records": {"on": True, "objects": {"clusterimagerecords": 2, "imagerecords": 0},
                        "requests": counts}}
    figure = records.records_figure([size], 100)
    assert figure.measured == "2 records, 1 of 2 burst requests"   # Lease renewals apart
    assert "create clusterimagerecords 1, 1 of its 2 requests (0.01 per pod)" in figure.notes[1]
    off = {**size, "requests": {"get secrets": 1}}
    side = records.on_off_figure([size], [off], 100)
    assert side.measured == "300 Nodes: startup p99 ratio 1.25 on / 1.25 off"
    assert "0.02 requests per pod" in side.notes[1] and "0.01 requests per pod" in side.notes[2]
