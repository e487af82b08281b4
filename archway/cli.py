"""The `archway` command: inspect, serve, scheduler-config, certs."""
import argparse
import atexit
import importlib
import logging
import os
import sys
import threading

from archway import __version__, logsafe
from archway.errors import ArchwayError

# Each module adds its own subcommands through `register(subparsers)`.
_COMMAND_MODULES = ("archway.registry.inspect", "archway.serve", "archway.extender.schedconfig",
                    "archway.certs.cli", "archway.webhook.explain", "archway.webhook.report",
                    "archway.webhook.gatecli")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="archway", description="Architecture-aware pod placement for Kubernetes.")
    parser.add_argument("--config", metavar="FILE",
                        help="YAML config file (default: $ARCHWAY_CONFIG, else built-in defaults)")
    parser.add_argument("-v", "--verbose", action="store_true", help="log debug details")
    parser.add_argument("--version", action="version", version=f"archway {__version__}",
                        help="print archway's version and exit")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name in _COMMAND_MODULES:
        importlib.import_module(name).register(subparsers)
    for subparser in subparsers.choices.values():
        # `archway inspect --config f.yaml` reads as naturally as `archway --config f.yaml inspect`.
        subparser.add_argument("--config", metavar="FILE", default=argparse.SUPPRESS,
                               help=argparse.SUPPRESS)
    return parser


def main(argv=None) -> int:
    status = _run(argv)
    if argv is None and any(t.daemon and t.is_alive() for t in threading.enumerate()):
        # A command that stopped waiting for lookups still running (--timeout) ends here: a
        # daemon thread caught mid-request by interpreter shutdown can abort the process
        # (CPython < 3.14), turning exit status 1 into a crash. Exit handlers (temporary CA
        # bundles) still run.
        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)
    return status


def _run(argv) -> int:
    args = build_parser().parse_args(argv)
    # Every value logged is escaped (archway.logsafe): a pod name cannot forge a log line.
    logsafe.configure(logging.DEBUG if args.verbose else logging.INFO,
                      "%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args)
    except ArchwayError as e:
        print(f"archway: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
