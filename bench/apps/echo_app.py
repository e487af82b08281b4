"""The baseline of figure 1: the least any Flask admission webhook does, served exactly as
`archway serve` serves archway.

It parses the AdmissionReview and answers it (uid echoed, allowed) and nothing else: no image
lookup, no patch, no metrics, no log line. Everything around it is archway's own serving code:
`archway.serve.tls_files` and `archway.server.master.gunicorn_options` give the same gunicorn
settings (gthread, workers, threads, keep-alive, timeouts) and the same TLS context on the same
certificate, so the throughput ratio isolates what archway's request handling costs.

    python3 -m bench.apps.echo_app --config FILE serve --bind 127.0.0.1:PORT

With ECHO_PATCH naming a file of a JSON patch, a pod labelled bench=noop-patch gets that patch
(figure 18e: what the apiserver's applying a patch like archway's costs, without archway).
"""
import argparse
import base64
import os
import sys

from flask import Flask, jsonify, request
from gunicorn.app.base import BaseApplication

from archway import serve
from archway.config import load_config
from archway.hostport import split_bind
from archway.server.master import gunicorn_options


def _canned_patch() -> str | None:
    path = os.environ.get("ECHO_PATCH")
    if not path:
        return None
    with open(path, "rb") as f:
        return base64.b64encode(f.read()).decode()


def create_echo_app() -> Flask:
    app = Flask("echo")
    patch = _canned_patch()

    @app.post("/mutate")
    def mutate():
        review = request.get_json()
        answer = {"uid": review["request"]["uid"], "allowed": True}
        if patch and ((review["request"].get("object") or {}).get("metadata") or {}).get(
                "labels", {}).get("bench") == "noop-patch":
            answer.update(patchType="JSONPatch", patch=patch)
        return jsonify({"apiVersion": review["apiVersion"], "kind": review["kind"],
                        "response": answer})

    @app.get("/healthz")
    def healthz():
        return jsonify(status="ok")

    return app


class _EchoGunicorn(BaseApplication):
    def __init__(self, options: dict):
        self.options = options
        super().__init__()

    def load_config(self):
        for key, value in self.options.items():
            self.cfg.set(key, value)

    def load(self):
        return create_echo_app()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="bench.apps.echo_app")
    parser.add_argument("--config", required=True)
    parser.add_argument("command", choices=["serve"])
    parser.add_argument("--bind", required=True)
    args = parser.parse_args(argv)
    config = load_config(args.config)
    host, _ = split_bind(args.bind)
    tls = serve.tls_files(config, host)
    options = gunicorn_options(config, args.bind, tls)
    options["proc_name"] = "archway-bench-echo"
    _EchoGunicorn(options).run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
