"""gunicorn's master as `archway serve` runs it, on gunicorn's documented seams only: a custom
Application (`gunicorn.app.base.BaseApplication`, configured from Python: no config file, no
command line of its own), archway's worker class (archway.server.worker), server hooks and
settings (gunicorn_options).
"""
import logging
import os
import signal
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
    server.metrics_bind, registry.events.listen); `tls`: (cert_path, key_path, ...) or None for plain HTTP."""

    def child_exit(_arbiter, worker):
        metrics.mark_process_dead(worker.pid)

    binds = [bind] + ([config.server.metrics_bind] if config.server.metrics_bind else [])
    urls = [f"{'https' if tls else 'http'}://{address}" for address in binds]
    events = config.registry.events
    if events.listen:   # its own port, in TLS or not (archway.server.routes.Site.plain_ports)
        binds.append(events.listen)
        urls.append(f"{'https' if tls and events.tls else 'http'}://{events.listen}")

    def on_starting(_arbiter):
        logging.getLogger("gunicorn.error").addFilter(ListeningAt(urls))

    options = {
        "bind": binds,
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
        "on_starting": on_starting,
    }
    if config.server.log_format == "json":
        from archway.logs import logging_dict
        options["logconfig_dict"] = logging_dict(logging.getLogger().level)
    if tls:
        options.update(certfile=tls[0], keyfile=tls[1])
    return options


class ListeningAt(logging.Filter):
    """gunicorn's "Listening at: ADDRESSES (PID)" line, with the addresses archway serves.

    gunicorn names the sockets its master bound; with reuse_port (archway's) each worker binds
    its own and the master names none: "Listening at:  (6871)". Its names are http:// on a TLS
    port besides. A filter on gunicorn's logger (Python's logging, installed from the
    on_starting hook) fills in the URLs: the line stays where it was, in gunicorn's format, in
    text and JSON logs alike."""

    def __init__(self, urls: list[str]):
        super().__init__()
        self.urls = ", ".join(urls)

    def filter(self, record: logging.LogRecord) -> bool:
        if (isinstance(record.msg, str) and record.msg.startswith("Listening at: %s")
                and isinstance(record.args, tuple) and record.args):
            record.args = (self.urls, *record.args[1:])
        return True


# A server stopped by SIGINT (Ctrl-C) exits as a shell reports a process SIGINT ended (128 + 2),
# as archway's other commands do (archway.main.cli): gunicorn's master exits 0 after any stop.
INTERRUPTED = 128 + signal.SIGINT


class StopSignal(logging.Filter):
    """Which signal gunicorn's master last handled, as its "Handling signal: NAME" line says.
    gunicorn has no hook for a signal, and its handlers are its own: archway reads its log
    line (passing every line on unchanged) rather than replace them."""

    def __init__(self):
        super().__init__()
        self.handled: str | None = None    # not `name`: a Filter's name says which loggers pass

    def filter(self, record: logging.LogRecord) -> bool:
        if (record.msg == "Handling signal: %s" and isinstance(record.args, tuple)
                and record.args and record.args[0] != "chld"):
            self.handled = str(record.args[0])
        return True


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
        stopped_by = StopSignal()
        logging.getLogger("gunicorn.error").addFilter(stopped_by)
        try:
            self.run()
            status = 0
        except SystemExit as e:   # the arbiter ends through sys.exit
            if os.getpid() != master:
                raise
            status = exit_status(e)
        finally:
            logging.getLogger("gunicorn.error").removeFilter(stopped_by)
        return INTERRUPTED if status == 0 and stopped_by.handled == "int" else status
