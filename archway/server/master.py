"""gunicorn's master as `archway serve` runs it: its settings (gunicorn_options), an arbiter that
also keeps the server's child processes running (archway.server.supervisor), and an application
configured from Python that loads, in each worker, the app the caller hands it.
"""
import logging
import sys
from collections.abc import Callable, Sequence

from gunicorn.app.base import BaseApplication
from gunicorn.arbiter import Arbiter

from archway import metrics
from archway.errors import ConfigError

from .supervisor import Supervisor
from .worker import MAX_CONNECTIONS, GuardedThreadWorker

GRACEFUL_TIMEOUT_SECONDS = 10
# The apiserver's HTTP client drops idle connections after 90 s. Keeping ours open longer means
# the client, not the server, always closes first, so no POST is ever sent on a connection the
# server is closing at that instant (Go does not retry a POST that failed that way).
KEEPALIVE_SECONDS = 100


def gunicorn_options(config, bind: str, tls) -> dict:
    """gunicorn's settings for `config` (its server section) on `bind` (and
    server.metrics_bind); `tls`: (cert_path, key_path, ...) or None for plain HTTP."""

    def child_exit(_arbiter, worker):
        metrics.mark_process_dead(worker.pid)

    options = {
        "bind": [bind] + ([config.server.metrics_bind] if config.server.metrics_bind else []),
        "workers": config.server.workers,
        "threads": config.server.threads,
        # gthread, with handshakes and request heads read in its main loop under deadlines
        # (slow clients never hold a thread) and connections spread over the workers.
        "worker_class": type("ArchwayWorker", (GuardedThreadWorker,),
                             {"preread_limit": config.server.max_body_bytes}),
        "reuse_port": True,            # each worker also listens on a socket of its own
        # The worker enforces MAX_CONNECTIONS itself (closing the oldest idle connection to make
        # room); gunicorn's own cap, which stops accepting, stays out of its way.
        "worker_connections": 2 * MAX_CONNECTIONS,
        # gthread workers heartbeat from their main loop, so this only catches a hung worker;
        # admissions themselves end at admission.deadline_seconds.
        "timeout": 30,
        "graceful_timeout": GRACEFUL_TIMEOUT_SECONDS,
        "keepalive": KEEPALIVE_SECONDS,
        "accesslog": None,             # one line per admission comes from the app, without secrets
        "errorlog": "-",
        "loglevel": "info",
        "proc_name": "archway",
        "preload_app": False,          # the app (and its resolver) is built in each worker
        "control_socket_disable": True,
        "child_exit": child_exit,
    }
    if config.server.log_format == "json":
        from archway.logs import logging_dict
        options["logconfig_dict"] = logging_dict(logging.getLogger().level)
    if tls:
        from archway.certs.tls import gunicorn_ssl_context
        options.update(certfile=tls[0], keyfile=tls[1],
                       ssl_context=gunicorn_ssl_context(tls[0], tls[1]))
    return options


class SupervisingArbiter(Arbiter):
    """gunicorn's master, also looking after the application's child processes at every turn
    of its loop (at least once a second, and at once when a child exits)."""
    app: "Application"

    def manage_workers(self):
        super().manage_workers()
        for child in self.app.children:
            child.tick()

    def reap_workers(self):
        for child in self.app.children:
            child.reap()   # before waitpid(-1) takes its exit status
        super().reap_workers()


class Application(BaseApplication):
    """gunicorn configured from Python: no config file, no command line of its own.
    `options`: gunicorn's settings (gunicorn_options); `load_app`: runs in each worker after the
    fork (preload_app is off) and returns the worker's own WSGI app; `children`: the processes
    the master keeps running beside the workers, stopped with the server."""

    def __init__(self, options: dict, load_app: Callable[[], Callable],
                 children: Sequence[Supervisor] = ()):
        self.options = options
        self.load_app = load_app
        self.children = list(children)
        super().__init__()

    def run(self):
        try:
            SupervisingArbiter(self).run()
        except RuntimeError as e:   # as BaseApplication.run
            print(f"\nError: {e}\n", file=sys.stderr, flush=True)
            sys.exit(1)

    def load_config(self):
        for key, value in self.options.items():
            if key not in self.cfg.settings:
                raise ConfigError(f"gunicorn has no setting {key!r}")
            self.cfg.set(key, value)
        if self.children:
            self.cfg.set("on_exit", self._stop_children)

    def _stop_children(self, _arbiter) -> None:
        for child in self.children:
            child.stop()

    def load(self):
        return self.load_app()
