"""`archway serve`: the webhook and/or the extender (server.product) under a real gunicorn, over TLS.

This is the top: it reads the config, finds the TLS files, checks at start-up what every worker
would otherwise die of, says where it serves, and hands the server room (archway.server) the
gunicorn options, what each worker serves (archway.main.worker) and the processes to keep
running beside gunicorn's master (the gate controller, the traffic poller).
With no certificate configured it serves the embedded default: a local CA and serving pair
generated once into server.state_dir (archway.certs.selfsigned), so a newcomer can curl it at once.
Nothing heavy is imported at module level: the CLI imports this module for every subcommand.
"""
import logging
import os
import shlex
import shutil
import sys
import tempfile
from collections.abc import Callable
from dataclasses import replace
from functools import partial

from archway.config import deprecations, load_config
from archway.errors import ConfigError
from archway.hostport import join_host_port, split_bind

MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"
# The processes `archway serve` keeps running beside gunicorn's master
# (archway.server.supervisor): the module each runs as (`python -P -m`), and the gate
# controller's status file in the run directory (the traffic poller's is
# extender/pollerprocess.py's STATUS_FILE).
GATE_CONTROLLER_MODULE = "archway.gate.process"
GATE_CONTROLLER_STATUS_FILE = "gate-controller.json"
TRAFFIC_POLLER_MODULE = "archway.extender.pollerprocess"


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "serve", help="run the admission webhook and/or the scheduler extender under gunicorn",
        description="Serve POST /mutate (admission webhook), the scheduler extender routes, or "
                    "both (server.product), with /healthz, /readyz and /metrics. With no "
                    "certificate configured, a local CA and serving certificate are generated "
                    "once into server.state_dir.")
    parser.add_argument("--bind", metavar="HOST:PORT",
                        help="address to listen on (default: server.bind, 127.0.0.1:8443)")
    parser.add_argument("--product", choices=("all", "webhook", "extender"),
                        help="what to serve (default: server.product, all)")
    parser.set_defaults(func=_run)


def _run(args, **options) -> int:
    config = load_config(args.config)
    if args.product:
        config = replace(config, server=replace(config.server, product=args.product))
    return serve(config, bind=args.bind, **options)


def serve(config, bind: str | None = None, *, poller_process: bool = True,
          extend: Callable | None = None) -> int:
    """Run gunicorn until it is stopped (SIGTERM: graceful). Returns the exit status.

    `poller_process` False: no traffic poller process; the workers elect a poller among
    themselves, as before issue 28 (figure 7's baseline, bench/apps/poller_in_worker.py).
    `extend(worker)`: called in each worker on the parts it built (archway.main.worker.Worker:
    figure 9's fill route, bench/apps/memory_worker.py). `archway.main.cli.main(**options)`
    passes these through."""
    bind = bind or config.server.bind
    host, port = split_bind(bind)
    if config.server.metrics_bind and split_bind(config.server.metrics_bind)[1] == port:
        raise ConfigError(f"server.metrics_bind {config.server.metrics_bind} must use "
                          f"another port than the serving address {bind}")
    events = config.registry.events
    if events.listen:
        if not events.token_file:
            raise ConfigError("registry.events.listen needs registry.events.token_file: the "
                              "bearer token a registry's events must carry")
        if split_bind(events.listen)[1] in (port, split_bind(config.server.metrics_bind)[1]
                                            if config.server.metrics_bind else None):
            raise ConfigError(f"registry.events.listen {events.listen} must use another port "
                              f"than the serving and metrics addresses")
        from archway.registry.pushevents import read_token
        read_token(events.token_file)
    if config.server.log_format == "json":   # before anything logs (the certificate below)
        from archway.logs import configure
        configure(logging.getLogger().level, "json")
    tls = tls_files(config, host)
    has_api = _preflight(config, tls)
    # Before "serving" is said: an address already served fails here, naming it.
    from .addresses import ensure_free
    ensure_free(bind, host, port)
    if config.server.metrics_bind:
        ensure_free(config.server.metrics_bind, *split_bind(config.server.metrics_bind),
                    what="server.metrics_bind")
    if events.listen:
        ensure_free(events.listen, *split_bind(events.listen), what="registry.events.listen")

    # The Kubernetes client package, imported once here: the workers share its pages with this
    # process (copy-on-write) instead of each importing a copy after the fork (bench figure 9).
    import kubernetes.client  # noqa: F401

    metrics_dir = _fresh_metrics_dir()
    # prometheus_client reads this variable in each worker; it cannot be handed over otherwise.
    os.environ[MULTIPROC_ENV] = metrics_dir
    # The workers share image lookups through slot files here (registry/sharedlookups.py).
    lookups_dir = os.path.join(metrics_dir, "lookups")
    os.makedirs(lookups_dir, mode=0o700)
    # gunicorn forks its workers inside run(): a worker leaving unwinds through this very frame.
    # Only this process may clean up, or the first worker to exit deletes the directory that the
    # others are still writing to.
    master = os.getpid()
    controller = None
    if has_api and config.server.product in ("all", "webhook"):
        controller = _controller_supervisor(
            config, os.path.join(metrics_dir, GATE_CONTROLLER_STATUS_FILE))
    poller = _poller_supervisor(config) if poller_process else None
    children = [child for child in (controller, poller) if child is not None]
    try:
        _announce(config, bind, host, port, tls)
        from archway.server.master import Application, gunicorn_options
        from archway.server.supervisor import serve_beside
        load_site = partial(_worker_site, config, lookups_dir, controller, poller, extend)
        application = Application(gunicorn_options(config, bind, tls), load_site)
        return serve_beside(application.serve, children)
    finally:
        if os.getpid() == master:
            shutil.rmtree(metrics_dir, ignore_errors=True)


def _controller_supervisor(config, status_path: str):
    """The gate controller beside the webhook (a Kubernetes API is configured), kept running
    by `archway serve` (archway.server.supervisor)."""
    from archway import metrics
    from archway.server.supervisor import Supervisor, start_process
    return Supervisor(lambda: start_process(GATE_CONTROLLER_MODULE, config), status_path,
                      what="gate controller", on_exit=metrics.mark_process_dead,
                      on_restart=metrics.GATE_CONTROLLER_RESTARTS.inc)


def _poller_supervisor(config):
    """The extender's traffic poller in a process of its own (extender/pollerprocess.py), so
    that no worker parses Prometheus' answer while it answers prioritize (figure 7). Set up
    before the workers fork: they learn from the environment that they only follow it."""
    if config.server.product not in ("all", "extender") or not config.prometheus.url:
        return None
    from archway import metrics
    from archway.extender.pollerprocess import POLLER_PROCESS_ENV, STATUS_FILE
    from archway.extender.service import traffic_dir
    from archway.server.supervisor import Supervisor, start_process
    directory = traffic_dir()
    assert directory is not None   # serve set the metrics directory before
    os.makedirs(directory, mode=0o700, exist_ok=True)
    os.environ[POLLER_PROCESS_ENV] = "1"
    return Supervisor(lambda: start_process(TRAFFIC_POLLER_MODULE, (config, directory)),
                      os.path.join(directory, STATUS_FILE),
                      what="traffic poller", on_exit=metrics.mark_process_dead)


def _worker_site(config, lookups_dir: str, controller, poller, extend):
    """What one worker serves, built after the fork (preload_app is off): the worker's own
    parts (archway.main.worker), with what they list or start at boot started."""
    from .worker import build_worker
    worker = build_worker(config, lookups_dir=lookups_dir,
                          controller_status=controller.status_path if controller is not None else None,
                          poller_status=poller.status_path if poller is not None else None)
    worker.start()
    if extend is not None:
        extend(worker)
    return worker.site


def tls_files(config, host: str):
    """(cert_path, key_path, path_for_curl_cacert) or None for plain HTTP."""
    server = config.server
    if not server.tls:
        return None
    if bool(server.cert_file) != bool(server.key_file):
        raise ConfigError("server.cert_file and server.key_file must be set together")
    if server.cert_file:
        cert, key = os.path.expanduser(server.cert_file), os.path.expanduser(server.key_file)
        return cert, key, cert
    from archway.certs.selfsigned import DEFAULT_HOSTS, ensure_self_signed
    hosts = list(DEFAULT_HOSTS)
    if host not in ("0.0.0.0", "::") and host not in hosts:
        hosts.append(host)
    try:
        files = ensure_self_signed(server.state_dir, hosts)
    except OSError as e:
        where = f"{e.filename}: " if e.filename else ""
        raise ConfigError(
            f"server.state_dir {server.state_dir} is not writable ({where}"
            f"{e.strerror or e}): archway keeps its self-signed certificate there; set "
            f"server.state_dir to a writable directory, or server.cert_file and "
            f"server.key_file") from None
    return files.cert_path, files.key_path, files.ca_path


def _preflight(config, tls) -> bool:
    """Fail at start-up, with the config's words, on what every worker would otherwise die of.
    Returns whether a Kubernetes API is configured.

    Nothing is built here that workers would inherit: the resolver (its CA bundle file, pools,
    threads) is made in each worker after the fork.
    """
    from archway.kubeclient import build_api_client
    from archway.registry.credentials import Keyring
    from archway.registry.providers import CredentialProviders
    from archway.registry.proxy import ProxyRules
    from archway.registry.trust import read_ca_file
    if tls is not None:
        from archway.certs.tls import server_context
        server_context(tls[0], tls[1])  # ConfigError when the pair does not load
    if config.registry.credentials_file:
        Keyring.from_file(config.registry.credentials_file)
    if config.registry.ca_file:
        read_ca_file(config.registry.ca_file)
    CredentialProviders.from_settings(config.registry.credential_providers)
    if config.kubernetes.trust_repair:   # the leader would repair with them (certs/trustpath.py)
        from archway.certs.bootstrap import BootstrapError
        from archway.certs.cli import bootstrap_spec
        try:
            bootstrap_spec(config.kubernetes.trust_repair)
        except BootstrapError as e:
            raise ConfigError(f"kubernetes.trust_repair: {e}") from None
    ProxyRules.from_settings(config.registry.proxy)   # a bad proxy URL or variable
    hosts_dir = config.registry.hosts_dir
    if hosts_dir and not os.path.isdir(os.path.expanduser(hosts_dir)):
        raise ConfigError(f"registry.hosts_dir {hosts_dir} is not a directory")
    api_client, source = build_api_client(config.kubernetes)  # ConfigError on a bad kubeconfig
    if api_client is None and source not in ("none", "disabled"):
        logging.getLogger("archway.server").warning("serving without a Kubernetes API: %s", source)
    elif api_client is None:
        logging.getLogger("archway.server").info("%s", no_cluster_line(config, source))
    if config.admission.unresolved == "gate" and api_client is None \
            and config.server.product in ("all", "webhook"):
        raise ConfigError("admission.unresolved is gate, but no Kubernetes API is configured "
                          "(kubernetes.enabled / kubeconfig / in-cluster): nobody could ever "
                          "remove the gate from a pod. Use admit or deny, or configure the API.")
    for warning in deprecations(config):
        logging.getLogger("archway.server").warning(warning)   # text or JSON, as every line
    return api_client is not None


def no_cluster_line(config, source: str) -> str:
    """The one line of a server without a Kubernetes API (each cache and worker says it only at
    debug level): why, and what archway then goes without."""
    why = ("kubernetes.enabled is off" if source == "disabled" else
           "no Kubernetes cluster configured (KUBECONFIG, kubernetes.kubeconfig, in-cluster)")
    product = config.server.product
    missing = ["namespaces, workloads and PlacementPolicies are not read"] \
        if product in ("all", "webhook") else []
    if product in ("all", "extender"):
        missing.append("the extender lists no nodes and estimates placements from its own "
                       "prioritize answers")
    return f"{why}: " + "; ".join(missing)


def _fresh_metrics_dir() -> str:
    # Per run: files left by a previous run's workers would be summed into this one's metrics.
    parent = os.environ.get(MULTIPROC_ENV) or None
    if parent:
        os.makedirs(parent, exist_ok=True)
    return tempfile.mkdtemp(prefix="archway-metrics-", dir=parent)


def _announce(config, bind, host, port, tls) -> None:
    if config.server.metrics_bind:
        logging.getLogger("archway.server").info(
            "/metrics, /healthz and /readyz also on %s (only those)", config.server.metrics_bind)
    if config.registry.events.listen:
        logging.getLogger("archway.server").info(
            "registry push events: POST /registry-events on %s (%s)", config.registry.events.listen,
            "TLS" if tls and config.registry.events.tls else "plain HTTP")
    if config.server.log_format == "json":   # a log pipeline gets log lines only
        logging.getLogger("archway.server").info(
            "serving %s on %s (workers=%d, threads=%d)", config.server.product, bind,
            config.server.workers, config.server.threads)
        return
    url_host = "127.0.0.1" if host in ("0.0.0.0", "::") else host
    base = f"{'https' if tls else 'http'}://{join_host_port(url_host, port)}"
    product = config.server.product
    what = "the webhook and the extender" if product == "all" else f"the {product}"
    print(f"archway: serving {what} on {base} (workers={config.server.workers},"
          f" threads={config.server.threads}, bind {bind})", flush=True)
    if tls:
        print(f"archway: TLS certificate {tls[0]}; clients trust it with: "
              f"curl --cacert {tls[2]} ...", flush=True)
    if product != "extender":
        # A review the installed archway prints (archway.webhook.admissionreview): no file of a
        # checkout, which neither the image nor a pip install has.
        print(f"archway: try  {_archway_command()} admission-review | curl "
              f"{'--cacert ' + shlex.quote(tls[2]) + ' ' if tls else ''}"
              f"-H 'Content-Type: application/json' --data @- {base}/mutate", flush=True)


def _archway_command() -> str:
    """How a shell here runs archway: `archway` when it is on PATH, else this interpreter."""
    return "archway" if shutil.which("archway") else f"{shlex.quote(sys.executable)} -m archway.main.cli"
