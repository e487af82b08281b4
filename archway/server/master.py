"""gunicorn's master as `archway serve` runs it, on gunicorn's documented seams only: a custom
Application (`gunicorn.app.base.BaseApplication`, configured from Python: no config file, no
command line of its own), archway's worker class (archway.server.worker), server hooks and
settings (gunicorn_options).
"""
import logging
import os
from collections.abc import Callable

from gunicorn.app.base import BaseApplication

from archway import metrics
from archway.errors import ConfigError

from .loop import MAX_CONNECTIONS
from .supervisor import exit_status

GRACEFUL_TIMEOUT_SECONDS = 10
# The apiserver's HTTP client drops idle connections after 90 s. Keeping ours open longer means
# the client, not the server, always closes first, so no POST is ever sent on a connection the
# server is closing at that instant (Go does not retry a POST that failed that way).
KEEPALIVE_SECONDS = 100
WORKER_CLASS = "archway.server.worker.ArchwayWorker"
# Settings only some of the gunicorn releases pyproject allows have; set where they exist.
WHERE_KNOWN = frozenset({"control_socket_disable"})   # 27's control socket: archway needs none


def gunicorn_options(config, bind: str, tls) -> dict:
    """gunicorn's settings for `config` (its server section) on `bind` (and
    server.metrics_bind); `tls`: (cert_path, key_path, ...) or None for plain HTTP."""

    def child_exit(_arbiter, worker):
        metrics.mark_process_dead(worker.pid)

    options = {
        "bind": [bind] + ([config.server.metrics_bind] if config.server.metrics_bind else []),
        "workers": config.server.workers,
        "threads": config.server.threads,
        "worker_class": WORKER_CLASS,
        "reuse_port": True,            # each worker also listens on a socket of its own
        # archway's loop holds at most MAX_CONNECTIONS itself (closing the oldest idle one to
        # make room); gunicorn's own cap stays out of its way.
        "worker_connections": 2 * MAX_CONNECTIONS,
        # Workers heartbeat from their loop, so this only catches a hung worker; admissions
        # themselves end at admission.deadline_seconds.
        "timeout": 30,
        "graceful_timeout": GRACEFUL_TIMEOUT_SECONDS,
        "keepalive": KEEPALIVE_SECONDS,
        "accesslog": None,             # one line per admission comes from the app, without secrets
        "errorlog": "-",
        "loglevel": "info",
        "proc_name": "archway",
        "preload_app": False,          # the site (and its resolver) is built in each worker
        "control_socket_disable": True,
        "child_exit": child_exit,
    }
    if config.server.log_format == "json":
        from archway.logs import logging_dict
        options["logconfig_dict"] = logging_dict(logging.getLogger().level)
    if tls:
        options.update(certfile=tls[0], keyfile=tls[1])
    return options


class Application(BaseApplication):
    """gunicorn configured from Python. `options`: gunicorn's settings (gunicorn_options);
    `load_site`: runs in each worker after the fork (preload_app is off) and returns what the
    worker serves (an archway.server.routes.Site)."""

    def __init__(self, options: dict, load_site: Callable[[], object]):
        self.options = options
        self.load_site = load_site
        super().__init__()

    def load_config(self):
        for key, value in self.options.items():
            if key not in self.cfg.settings:
                if key in WHERE_KNOWN:
                    continue
                raise ConfigError(f"gunicorn has no setting {key!r}")
            self.cfg.set(key, value)

    def load(self):
        return self.load_site()

    def serve(self) -> int:
        """Run the master until it stops; its exit status. In a worker (gunicorn forks them
        inside run), the worker's own SystemExit goes on up."""
        master = os.getpid()
        try:
            self.run()
        except SystemExit as e:   # the arbiter ends through sys.exit
            if os.getpid() != master:
                raise
            return exit_status(e)
        return 0
