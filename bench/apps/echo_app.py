"""The baseline of figure 1: the least any Flask admission webhook does, under stock gunicorn with
`archway serve`'s settings.

It parses the AdmissionReview and answers it (uid echoed, allowed) and nothing else: no image
lookup, no patch, no metrics, no log line. It is a WSGI app, which archway's own worker class
(archway.server.worker) does not serve, so it runs under gunicorn's stock gthread worker; every
other setting is archway's (`archway.server.master.gunicorn_options`: workers, threads,
keep-alive, timeouts, reuse_port, the certificate `archway.main.serve.tls_files` finds), and
gunicorn's `ssl_context` hook hands it the very TLS context archway serves with
(`archway.certs.tls.server_context`). The throughput ratio is thus archway's request handling
and serving loop against a bare Flask app under gthread, on the same TLS.

    python3 -m bench.apps.echo_app --config FILE serve --bind 127.0.0.1:PORT

With ECHO_PATCH naming a file of a JSON patch, a pod labelled bench=noop-patch gets that patch
(figure 18e: what the apiserver's applying a patch like archway's costs, without archway).
"""
import argparse
import base64
import os
import sys

from flask import Flask, jsonify, request

from archway.certs.tls import server_context
from archway.config import load_config
from archway.hostport import split_bind
from archway.main import serve
from archway.server.master import Application, gunicorn_options


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


def echo_options(config, bind: str, tls) -> dict:
    """archway serve's gunicorn settings with gunicorn's gthread worker in place of archway's."""
    options = gunicorn_options(config, bind, tls)
    options.update(worker_class="gthread", proc_name="archway-bench-echo")
    if tls:
        cert, key = options["certfile"], options["keyfile"]
        # gunicorn asks for a context per accepted connection; server_context caches it per pair.
        options["ssl_context"] = lambda _conf, _default: server_context(cert, key)
    return options


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="bench.apps.echo_app")
    parser.add_argument("--config", required=True)
    parser.add_argument("command", choices=["serve"])
    parser.add_argument("--bind", required=True)
    args = parser.parse_args(argv)
    config = load_config(args.config)
    host, _ = split_bind(args.bind)
    tls = serve.tls_files(config, host)
    # archway's gunicorn application, which loads in each worker what it is given: the Flask app.
    return Application(echo_options(config, args.bind, tls), create_echo_app).serve()


if __name__ == "__main__":
    sys.exit(main())
