"""The image records at KWOK scale (issue 35): figure 25h, what the records cost at each size
(how many there are after the run, archway's requests on them by verb, their share of figure
25), and 25i, the same size run twice, records on and off (ARCHWAY_SCALE_RECORDS_OFF), for
figures 25, 25a, 25b and 25c side by side."""
from archway.objects.records import API_PATH
from bench.common.report import Figure
from lab.cluster.controlplane import ControlPlane
from lab.kube import Kube

from .load import ACCOUNTS, summary

RESOURCES = ("clusterimagerecords", "imagerecords")
# The chart's values for the run with the records off (its RBAC for them goes too).
OFF_VALUES = {"config": {"kubernetes": {"image_records": {"enabled": False}}}}
SPECS = (("25h", "image records at each size: objects after the run, archway's requests on them",
          "info"),
         ("25i", "records on vs off at the same size: requests per pod, RSS, admission latency",
          "info"))


def is_records(key: str) -> bool:
    """Whether a figure-25 key ("verb resource") is a request on the records' kinds."""
    return key.rsplit(" ", 1)[-1] in RESOURCES


def records_requests(plane: ControlPlane, mark: int) -> dict[str, int]:
    """verb + resource -> archway's requests on the records' kinds after `mark`, watches
    included (each request once: its auditID; a watch logs two events)."""
    seen: set[str] = set()
    counts: dict[str, int] = {}
    for event in plane.audit_events(mark):
        resource = (event.get("objectRef") or {}).get("resource", "")
        if (resource not in RESOURCES or event["auditID"] in seen
                or not event.get("user", {}).get("username", "").startswith(ACCOUNTS)):
            continue
        seen.add(event["auditID"])
        key = f"{event['verb']} {resource}"
        counts[key] = counts.get(key, 0) + 1
    return counts


def record_objects(kube: Kube) -> dict[str, int]:
    """How many records of each kind the cluster holds (all namespaces)."""
    return {r: len(kube.items(f"{API_PATH}/{r}")) for r in RESOURCES}


def _requests_text(counts: dict[str, int]) -> str:
    return ", ".join(f"{k} {n}" for k, n in sorted(counts.items())) or "none"


def records_figure(sizes: list[dict], pods: int) -> Figure:
    rows, values = [], []
    for s in sizes:
        burst = {k: n for k, n in s["requests"].items() if is_records(k)}
        counted = sum(n for k, n in s["requests"].items() if not k.endswith(" leases"))
        objects = s["records"]["objects"]
        values.append(f"{sum(objects.values())} records, {sum(burst.values())} of {counted} "
                      f"burst requests")
        rows.append(f"{s['nodes']:,} Nodes: {objects['clusterimagerecords']} ClusterImageRecords, "
                    f"{objects['imagerecords']} ImageRecords after the run; in the burst "
                    f"(figure 25, which counts them): {_requests_text(burst)}, "
                    f"{sum(burst.values())} of its {counted} requests "
                    f"({sum(burst.values()) / pods:.2f} per pod); from install to the end of the "
                    f"size, watches included: {_requests_text(s['records']['requests'])}")
    name, target = SPECS[0][1], SPECS[0][2]
    return Figure("25h", name, " / ".join(values), target, None,
                  ["ClusterImageRecords and ImageRecords listed after the size's last "
                   "measurement; archway's ServiceAccounts' requests on them from the audit log",
                   *rows])


def _ratio(s: dict) -> float:
    return s["startup"]["admitted"]["p99"] / s["startup"]["skipped"]["p99"]


def _side(s: dict, pods: int) -> str:
    others = sum(n for k, n in s["requests"].items() if not k.endswith(" leases"))
    a, k = s["startup"]["admitted"], s["startup"]["skipped"]
    return (f"{others / pods:.2f} requests per pod, webhook workers "
            f"{'/'.join(f'{v / 1e6:.0f}' for v in s['rss']['webhook'])} MB, leader "
            f"{max(s['rss']['controller'], default=0) / 1e6:.0f} MB, extender "
            f"{max(s['rss']['extender'], default=0) / 1e6:.0f} MB; startup p99 {a['p99']:.2f} s "
            f"(skipped {k['p99']:.2f} s, ratio {_ratio(s):.2f}), p50 {a['p50']:.2f} s; "
            f"webhook call {summary(s['apiserver']['webhook'])}; load {s['startup']['load']}")


def on_off_figure(sizes: list[dict], off: list[dict], pods: int) -> Figure:
    rows, values = [], []
    for s_off in off:
        (s_on,) = [s for s in sizes if s["nodes"] == s_off["nodes"]]
        rows += [f"{s_on['nodes']:,} Nodes, records on: {_side(s_on, pods)}",
                 f"{s_off['nodes']:,} Nodes, records off: {_side(s_off, pods)}"]
        # The ratio to the skipped pods of the same minute: the two runs' loads differ.
        values.append(f"{s_on['nodes']:,} Nodes: startup p99 ratio {_ratio(s_on):.2f} on / "
                      f"{_ratio(s_off):.2f} off")
    return Figure("25i", SPECS[1][1], "; ".join(values) or "not run", SPECS[1][2], None,
                  ["the same size measured twice in one run, each its own fresh cluster: the "
                   "chart with config.kubernetes.image_records.enabled true, then false", *rows])
