"""The figures of the scale section's further measurements (load.py at every size, events.py at
the largest), numbered 25b-25g beside figure 25; pure formatting of what was measured."""
from bench.common.plots import plot
from bench.common.report import Figure
from bench.common.rounds import Steady, ratios
from bench.common.stats import median
from bench.sections.kube import GO_ARM, GO_RATIO_TARGET, RACE_NOTE, go_figure, rate_plot

STARTUP_P99_TARGET = 5.0
STARTUP_RATIO_TARGET = 1.2
SCHEDULE_RATIO_TARGET = 0.7
RELIST_STALL_TARGET = 5.0    # seconds: no create waits beyond the apiserver's webhook timeout
SPECS = (("25b", "pod startup latency, client create -> Running seen by a watch, archway vs skipped",
          f"p99 ratio <= {STARTUP_RATIO_TARGET}, p99 <= {STARTUP_P99_TARGET:g} s"),
         ("25c", "kube-apiserver's POST pods latency from its /metrics, with vs without archway", "info"),
         ("25d", "archway's requests to the apiserver per minute at rest", "info"),
         ("25e", "watch expiry (410) at the largest size: admissions during the relist, relist time",
          f"none failed, slowest < {RELIST_STALL_TARGET:g} s"),
         ("25f", "gate controller leader killed at the largest size: new leader gates, releases, learns",
          "info"),
         ("25g", "pods bound per second, archway's scheduler + extender vs default, at the largest "
                 "size, client limits lifted", f">= {SCHEDULE_RATIO_TARGET}"),
         ("25j", "scheduling cycles (and pods bound) per second, the same kube-scheduler with "
                 "archway's extender vs a minimal Go extender, at the largest size, client "
                 "limits lifted",
          f">= {GO_RATIO_TARGET}"))


def figures(sizes: list[dict]) -> list[Figure]:
    largest = sizes[-1]
    events = largest.get("events") or {}
    return [_startup(sizes), _apiserver(sizes), _at_rest(sizes),
            *(_at_largest(number, largest["nodes"], events.get(key) or {}, measured)
              for number, key, measured in (("25e", "relist", _relist),
                                            ("25f", "failover", _failover),
                                            ("25g", "schedule", _schedule))),
            _against_go(largest["nodes"], events.get("schedule") or {})]


def _spec(number: str) -> tuple[str, str]:
    (name, target), = [(n, t) for num, n, t in SPECS if num == number]
    return name, target


def _failed(number: str, found: dict) -> Figure:
    name, target = _spec(number)
    return Figure(number, name, f"not measured ({found.get('error', 'no result')})", target, False)


def _left_out(number: str) -> Figure:
    name, target = _spec(number)
    return Figure(number, name, "not measured (left out: ARCHWAY_SCALE_EVENTS)", target, None)


def _at_largest(number: str, nodes: int, found: dict, measured) -> Figure:
    """A figure of the largest size only; `measured(found)` gives (value, met, notes)."""
    if found.get("left_out"):
        return _left_out(number)
    if "error" in found or not found:
        return _failed(number, found)
    name, target = _spec(number)
    value, met, notes, *steady = measured(found)     # a figure over rounds gives them too
    figure = Figure(number, f"{name} ({nodes:,} Nodes)", value, target, met, notes,
                    rounds=steady[0] if steady else None)
    if number == "25g":
        figure.data["plots"] = rate_plot(f"{nodes:,} Nodes, client limits lifted (fig. 25g)",
                                         found["rates"])
    return figure


def _against_go(nodes: int, found: dict) -> Figure:
    """25j: 25g's rounds, whose races had the Go extender's arm too (figure 19c's)."""
    if found.get("left_out"):
        return _left_out("25j")
    if "error" in found or GO_ARM not in found.get("rates", {}):
        return _failed("25j", found)
    name, target = _spec("25j")
    return go_figure("25j", f"{name} ({nodes:,} Nodes)", target, found["rates"],
                     found["algorithm_ms"], found["details"], found["load"])


def _startup(sizes: list[dict]) -> Figure:
    name, target = _spec("25b")
    p99_ratios, rows, met = [], [], True
    for s in sizes:
        a, k = s["startup"]["admitted"], s["startup"]["skipped"]
        ratio = a["p99"] / k["p99"]
        p99_ratios.append(ratio)
        met = met and ratio <= STARTUP_RATIO_TARGET and a["p99"] <= STARTUP_P99_TARGET
        rows.append(f"{s['nodes']:,} Nodes: archway p50 {a['p50']:.2f} / p99 {a['p99']:.2f} s, "
                    f"skipped p50 {k['p50']:.2f} / p99 {k['p99']:.2f} s (create call p99 "
                    f"{1000 * a['create_p99']:.0f} vs {1000 * k['create_p99']:.0f} ms); load "
                    f"{s['startup']['load']}")
    return Figure("25b", name, " / ".join(f"{r:.2f}" for r in p99_ratios) + " p99 ratio", target, met,
                  ["pods created at a steady 10/s, archway's and skipped ones (label "
                   "archway.dev/skip) alternately, 150 of each, on KWOK Nodes by the default "
                   "scheduler; timed from the client's create (creationTimestamp is set after "
                   "mutating admission) to Running seen through a watch", *rows],
                  data={"plots": startup_plot(sizes)})


def startup_plot(sizes: list[dict]) -> dict:
    """25b's curves: each size's p99, and its blocks' range where the run measured them."""
    from .load import STARTUP_BLOCKS, STARTUP_PODS

    def curve(startups: list[dict]) -> dict:
        values = {"x": [s["nodes"] for s in sizes], "y": [s["p99"] for s in startups]}
        if all(s.get("p99_blocks") for s in startups):
            values |= {"low": [min(s["p99_blocks"]) for s in startups],
                       "high": [max(s["p99_blocks"]) for s in startups]}
        return values
    return plot("scale-startup", "What archway adds to pod startup: p99 from create to "
                "Running, with and without archway, against cluster size (figure 25b)",
                "cluster size (KWOK Nodes)", "pod startup p99 (s)", {
                    label: curve([s["startup"][kind] for s in sizes])
                    for label, kind in (("pods archway admits", "admitted"),
                                        ("pods it skips (label archway.dev/skip)", "skipped"))},
                log_x=True, whiskers=f"the lowest to the highest p99 of {STARTUP_BLOCKS} blocks "
                f"of {STARTUP_PODS // STARTUP_BLOCKS} pods in creation order")


def _apiserver(sizes: list[dict]) -> Figure:
    from .load import summary
    rows = [f"{s['nodes']:,} Nodes: without {summary(s['apiserver']['skipped'])}; with "
            f"{summary(s['apiserver']['admitted'])}; of which the webhook call "
            f"{summary(s['apiserver']['webhook'])}; load {s['apiserver']['load']}" for s in sizes]
    means = []
    for s in sizes:
        w, k = s["apiserver"]["admitted"], s["apiserver"]["skipped"]
        means.append(f"{1000 * w['sum'] / max(1, w['count']):.1f} vs "
                     f"{1000 * k['sum'] / max(1, k['count']):.1f} ms")
    name, target = _spec("25c")
    return Figure("25c", name, "mean " + " / ".join(means), target, None,
                  ["apiserver_request_duration_seconds{verb=POST,resource=pods} over a block of "
                   "100 skipped creates, then 100 archway admits, each at 10/s; "
                   "apiserver_admission_webhook_admission_duration_seconds (type admit) in the "
                   "second; p50/p99 as the histogram's bucket bounds", *rows])


def _at_rest(sizes: list[dict]) -> Figure:
    name, target = _spec("25d")
    rows = [f"{s['nodes']:,} Nodes: {s['at_rest']['per_minute']:.0f}/min ("
            + ", ".join(f"{k} {v:g}" for k, v in sorted(s["at_rest"]["by_kind"].items()))
            + f"); load {s['rest_load']}" for s in sizes]
    return Figure("25d", name, " / ".join(f"{s['at_rest']['per_minute']:.0f}" for s in sizes)
                  + " per minute", target, None,
                  ["every request of archway's ServiceAccounts received in 30 s with no pod "
                   "created, from the audit log, each once (a watch counts when opened)", *rows])


def _relist(found: dict) -> tuple[str, bool, list[str]]:
    relists = ", ".join(f"{a} {t:.1f} s ({found['pages'][a]} pages)"
                        for a, t in sorted(found["relist_s"].items()))
    met = not found["problems"] and found["max_ms"] < 1000 * RELIST_STALL_TARGET
    return (f"{found['answered']} answered, slowest {found['max_ms']:.0f} ms; relist "
            f"{max(found['relist_s'].values(), default=0):.1f} s", met,
            [f"kube-apiserver restarted (down {found['down_s']:.1f} s); pods created one "
             f"after another from its return until 15 s after every archway process logged "
             f"its watch expired; p99 {found['p99_ms']:.0f} ms; relist per ServiceAccount "
             f"(first list received -> last page answered, audit log): {relists}; "
             f"problems: {found['problems'][:3] or 'none'}; load {found['load']}"])


def _failover(found: dict) -> tuple[str, None, list[str]]:
    when = found["when"]
    parts = [f"{k} {when[k]:.1f} s" if k in when else f"{k} not within 300 s"
             for k in ("lease", "released", "running", "learned")]
    return (", ".join(parts), None,
            [f"the leading replica SIGKILLed with a pod it gated waiting (registry slow, "
             f"then fast again); seconds after the kill until the Lease "
             f"({found['lease_s']:g} s) had a new holder, the pod was released, Running, "
             f"and the new leader's caches ({', '.join(found['learned'])}) synced; load "
             f"{found['load']}"])


def _schedule(found: dict) -> tuple[str, bool, list[str], Steady]:
    rates = found["rates"]
    steady = ratios(rates["archway-scheduler"], rates["kube-scheduler"])
    return (f"{steady.describe()} ({median(rates['archway-scheduler']):.0f} vs "
            f"{median(rates['kube-scheduler']):.0f} pods/s)", steady.median >= SCHEDULE_RATIO_TARGET,
            [f"as figure 19b: 1,000 pods created with the scheduler stopped, then started "
             f"with qps/burst 5000; {RACE_NOTE}; {len(steady.values)} interleaved rounds; "
             f"load {found['load']}", found["details"]], steady)
