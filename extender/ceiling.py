"""extender.max_utilisation: /scheduler/filter turns away the candidate nodes whose network link
is busier than the ceiling (FailedNodes: load passes, so preemption may still weigh them), unless
every candidate is: then all pass and the log line says so. A node whose utilisation is unknown
(no link speed, no traffic series) is never turned away.

The ceiling reads the traffic sample prioritize scores with (prometheus.py's poller); while that
sample is older than prometheus.stale_after_seconds, or before the first one, it is not applied:
an outage of Prometheus costs archway's opinion, never the cluster's scheduling. The decision is
`utilisation_ceiling`, pure; `Ceiling` gathers its input and says when it goes blind.
"""
import logging

from .traffic import NodeLoad, node_loads

log = logging.getLogger("archway.extender")


def percent(fraction: float) -> str:
    """0.0801 -> "8%", 0.0014 -> "0.14%", 0.93456 -> "93%", 0.005 -> "0.5%"."""
    return f"{fraction * 100:.2g}%"


def utilisation_ceiling(loads: dict[str, NodeLoad], names, ceiling: float
                        ) -> tuple[dict[str, str], bool]:
    """(node -> why, for the nodes of `names` whose link utilisation is above `ceiling`; whether
    every one of `names` is above it). When every node is above, none is returned: the caller
    lets them all pass rather than leave the pod nowhere to go."""
    above = {}
    for name in names:
        load = loads.get(name)
        if load is None or not load.capacity:
            continue
        utilisation = load.traffic / load.capacity
        if utilisation > ceiling:
            above[name] = (f"link utilisation {percent(utilisation)} is above "
                           f"extender.max_utilisation ({percent(ceiling)})")
    everyone = bool(names) and len(above) == len(names)
    return ({} if everyone else above), everyone


class Ceiling:
    def __init__(self, ceiling: float, traffic, prometheus_settings):
        self.ceiling = ceiling
        self.traffic = traffic                 # prometheus.TrafficPoller
        self.settings = prometheus_settings    # config.PrometheusSettings
        self._blind = False                    # no fresh sample: said once, until one comes

    def apply(self, args, names: list[str], keep: list[int],
              cached_loads) -> tuple[list[int], dict[str, str], str]:
        """(the candidates to keep, node -> why for those turned away for their load, a note
        for the log line when every candidate was above the ceiling). `cached_loads(snapshot)`:
        the loads of the node cache's nodes (the extender's score book)."""
        self.traffic.ensure_started()
        snapshot = self.traffic.fresh_snapshot()
        if snapshot is None:
            if not self._blind:
                self._blind = True
                log.warning("extender.max_utilisation not applied: no traffic sample younger "
                            "than prometheus.stale_after_seconds (%gs); every node passes until "
                            "one arrives", self.settings.stale_after_seconds)
            return keep, {}, ""
        if self._blind:
            self._blind = False
            log.info("extender.max_utilisation applied again: a fresh traffic sample arrived")
        candidates = [names[i] for i in keep]
        match = self.settings.match
        if args.nodes is not None:   # full mode: the request's own addresses
            loads = node_loads(snapshot.traffic, snapshot.capacity, candidates, match=match,
                               node_addresses={node.name: node.addresses for node in args.nodes})
        else:
            loads = cached_loads(snapshot)
            missing = [n for n in candidates if n not in loads]
            if missing:
                loads = {**loads, **node_loads(snapshot.traffic, snapshot.capacity, missing,
                                               match=match)}
        busy, everyone = utilisation_ceiling(loads, candidates, self.ceiling)
        if everyone:
            return keep, {}, (f"; every candidate's link is above extender.max_utilisation "
                              f"({percent(self.ceiling)}): all pass")
        return [i for i in keep if names[i] not in busy], busy, ""
