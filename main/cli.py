"""The `archway` command: inspect, explain, report, serve, admission-review, scheduler-config,
certs, gate, cleanup, completion."""
import argparse
import atexit
import importlib
import logging
import os
import sys
import threading

from archway import __version__, logs
from archway.errors import ArchwayError

# Exit statuses every command shares (docs/commands.md): 0 done, 1 done but something failed (an image
# not resolved, a workload not listed), and these.
EXIT_ERROR = 2           # one line on stderr, "archway: <cause>": config, API, address...
EXIT_INTERRUPTED = 130   # Ctrl-C
EXIT_BROKEN_PIPE = 141   # the reader of stdout went away (128 + SIGPIPE, as a shell reports)

# Each module adds its own subcommands through `register(subparsers)`.
_COMMAND_MODULES = ("archway.registry.inspect", "archway.main.serve", "archway.webhook.admissionreview",
                    "archway.extender.schedconfig",
                    "archway.certs.cli", "archway.tools.explain", "archway.tools.report",
                    "archway.gate.cli", "archway.tools.cleanup", "archway.main.completion")

# What `--help` of each command shows under "examples:" (tests/test_cli.py parses every line
# that starts with `archway`, so an example cannot drift from the options).
EXAMPLES = {
    "": ("archway inspect nginx ghcr.io/org/app:v1",
         "helm template ./mychart | archway explain -f -",
         "archway --config archway.yaml serve",
         "source <(archway completion bash)"),
    "inspect": ("archway inspect nginx ghcr.io/org/app:v1 oras://registry.example/sif/tool:1.0 ./tool.sif",
                "archway inspect --json --timeout 10 quay.io/prometheus/node-exporter"),
    "explain": ("helm template ./mychart | archway explain -f -",
                "archway explain -f k8s/ --json",
                "archway explain pod/web-5d8-x1 -n shop"),
    "report": ("archway report --target-arch arm64",
               "archway report -n shop --json"),
    "serve": ("archway serve",
              "archway serve --config archway.yaml --bind 0.0.0.0:8443 --product webhook"),
    "admission-review": ("archway admission-review | curl --cacert ~/.local/state/archway/tls/ca.crt "
                         "-H 'Content-Type: application/json' --data @- https://127.0.0.1:8443/mutate",
                         "archway admission-review --image nginx:1.27 --namespace shop"),
    "scheduler-config": ("archway scheduler-config > scheduler-config.yaml",
                         "archway scheduler-config --extender-url https://archway-extender.example:8444/scheduler "
                         "--ca-file ca.crt"),
    "certs": ("archway certs generate --service archway --namespace archway --out ./tls",),
    "certs generate": ("archway certs generate --service archway --namespace archway --out ./tls",
                       "archway certs generate --service archway --namespace archway --out ./tls "
                       "--host 10.0.0.5 --days 90"),
    "certs bootstrap": ("archway certs bootstrap --service archway --namespace archway "
                        "--secret archway-tls --webhook-config archway",),
    "gate": ("archway gate release-all",),
    "gate release-all": ("archway gate release-all",
                         "archway gate release-all --config archway.yaml -v"),
    "cleanup": ("archway cleanup -n archway-system --lease archway-gate-controller "
                "--lease archway-scheduler --wait-for-pods app.kubernetes.io/instance=archway",),
    "completion": ("source <(archway completion bash)",
                   'archway completion zsh > "${fpath[1]}/_archway"'),
}


class _HelpFormatter(argparse.HelpFormatter):
    """Descriptions are wrapped; text written with line breaks (the examples) is kept as is."""

    def _fill_text(self, text, width, indent):
        if "\n" in text:
            return "\n".join(indent + line for line in text.splitlines())
        return super()._fill_text(text, width, indent)


def subcommands(parser: argparse.ArgumentParser, path: str = ""):
    """(path, parser) of every command under `parser`: "inspect", "certs", "certs generate"..."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield f"{path} {name}".strip(), sub
                yield from subcommands(sub, f"{path} {name}".strip())


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
    for path, subparser in [("", parser), *subcommands(parser)]:
        subparser.formatter_class = _HelpFormatter
        # A command missing from EXAMPLES is tests/test_cli.py's failure, never every command's.
        examples = EXAMPLES.get(path, ())
        if examples:
            subparser.epilog = "examples:\n" + "\n".join("  " + line for line in examples)
        if subparser is parser:
            continue
        # `archway inspect --config f.yaml -v` reads as naturally as `archway --config f.yaml -v
        # inspect`, at every level (`archway certs generate --config f.yaml`). SUPPRESS: an
        # option not given after the command leaves the one given before it in place.
        subparser.add_argument("--config", metavar="FILE", default=argparse.SUPPRESS,
                               help="YAML config file (also accepted before the command)")
        subparser.add_argument("-v", "--verbose", action="store_true", default=argparse.SUPPRESS,
                               help="log debug details (also accepted before the command)")
    return parser


def main(argv=None, **options) -> int:
    """Run the command `argv` names (default: sys.argv). `options`: keyword arguments for the
    command's function, beyond its parsed arguments: how bench/ runs variants of `archway serve`
    (archway.main.serve.serve's keywords) through this same command line."""
    status = _run(argv, options)
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


def _run(argv, options: dict) -> int:
    args = build_parser().parse_args(argv)
    # Every value logged is escaped (archway.logsafe): a pod name cannot forge a log line.
    logs.configure(logging.DEBUG if args.verbose else logging.INFO)
    try:
        status = args.func(args, **options)
        sys.stdout.flush()   # a reader that went away shows here, not at interpreter exit
        return status
    except ArchwayError as e:
        print(f"archway: {e}", file=sys.stderr)
        return EXIT_ERROR
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED
    except BrokenPipeError:
        # `archway inspect ... | head -1`: the reader has what it wanted. What is still
        # buffered goes nowhere instead of failing again at exit.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_BROKEN_PIPE


if __name__ == "__main__":
    sys.exit(main())
