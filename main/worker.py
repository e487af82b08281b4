"""One serving worker of `archway serve`, put together in one place: what it serves
(server.product) and every part it has, as typed fields.

    webhook   POST /mutate: the admission service and what it reads (archway.webhook)
    extender  POST /scheduler/filter and /prioritize (archway.extender)
    both      the resolver (its threads, HTTP pools and cache) and the node cache, one each
    always    /healthz, /readyz and /metrics (probes.py)
    events    POST /registry-events on registry.events.listen (archway.webhook.registryevents)

`build_worker` runs once per gunicorn worker, after the fork: the resolver and the caches
belong to the worker that uses them. `Worker.start` starts what lists or reads in the
background as the worker boots (the first Nodes, the traffic sample, pre-warming), not on the
first call, which has only its own deadline to wait for them.
"""
from dataclasses import dataclass, replace

from archway import __version__, metrics
from archway.cluster.nodes import NodeCache
from archway.cluster.ranges import ClusterRanges
from archway.extender.routes import extender_routes
from archway.extender.service import Extender
from archway.hostport import split_bind
from archway.kubeclient import build_api_client
from archway.registry.resolver import Resolver
from archway.registry.sharedlookups import SharedLookups
from archway.server.routes import Route, Routes, Site
from archway.webhook.registryevents import EVENTS_ONLY, RegistryEvents
from archway.webhook.routes import mutate_route
from archway.webhook.wiring import WebhookParts, build_webhook

from .probes import Probes

PRODUCTS = ("webhook", "extender")


def products_of(choice: str) -> tuple[str, ...]:
    """server.product (or `archway serve --product`) -> the products to serve."""
    return PRODUCTS if choice == "all" else (choice,)


@dataclass(frozen=True)
class Worker:
    config: object
    resolver: Resolver
    node_cache: NodeCache | None      # one list + watch of Nodes for both products
    webhook: WebhookParts | None
    extender: Extender | None
    probes: Probes
    site: Site

    def start(self) -> None:
        if self.node_cache is not None:
            self.node_cache.ensure_started()
        if self.extender is not None:
            self.extender.start()
        if self.webhook is not None and self.webhook.prewarmer is not None:
            self.webhook.prewarmer.start()


def build_worker(config, *, product: str | None = None, resolver=None, pull_secrets=None,
                 lookups_dir: str | None = None, controller_status: str | None = None,
                 poller_status: str | None = None) -> Worker:
    """The worker serving `product` (default: server.product). `lookups_dir`: where this
    server's workers share image lookups (archway.registry.sharedlookups); None: not shared.
    `controller_status`, `poller_status`: the status files of the gate controller and the
    traffic poller this server runs, if it runs them. `resolver` and `pull_secrets` replace
    the ones built from the config."""
    products = products_of(product or config.server.product)
    if resolver is None:
        resolver = Resolver(config.registry, sif=config.sif,
                            shared=SharedLookups(lookups_dir) if lookups_dir else None)
    node_cache = NodeCache.for_config(config)
    if "webhook" not in products:   # the webhook's parts keep them, per worker
        _refuse_cluster_addresses(config, resolver)
    metrics.started(__version__)
    probes = Probes(config, resolver)
    controller_up = (probes.watch_gate_controller(controller_status)
                     if controller_status is not None else None)
    if poller_status is not None:
        probes.watch_traffic_poller(poller_status)
    routes: list[Route] = []
    webhook = extender = None
    if "webhook" in products:
        webhook = build_webhook(config, resolver, node_cache, pull_secrets)
        probes.readiness_facts.update(webhook.readiness_facts())
        probes.readiness_checks.update(webhook.readiness_checks(controller_up))
        routes.append(mutate_route(webhook.service, config.server.max_body_bytes))
    if "extender" in products:
        extender = Extender(config, resolver, node_cache=node_cache)
        routes += extender_routes(extender)
    return Worker(config, resolver, node_cache, webhook, extender, probes,
                  _with_events(config, resolver, probes.site(routes)))


def _with_events(config, resolver, site: Site) -> Site:
    """POST /registry-events alone on registry.events.listen, when configured."""
    events = config.registry.events
    if not events.listen:
        return site
    port = split_bind(events.listen)[1]
    route = RegistryEvents(events, resolver).route(events.max_body_bytes)
    return replace(site, by_port={**site.by_port, port: Routes([route], not_found=EVENTS_ONLY)},
                   plain_ports=site.plain_ports | ({port} if not events.tls else set()))


def _refuse_cluster_addresses(config, resolver) -> None:
    """The extender resolves pods' images too: the cluster's Service ranges and API server are
    read once, as the worker builds its parts."""
    if config.kubernetes.enabled == "off":
        return
    api_client, _ = build_api_client(config.kubernetes)
    ranges = ClusterRanges.for_resolver(config, api_client, resolver)
    if ranges is not None:
        ranges.refresh()
