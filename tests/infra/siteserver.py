"""A real gunicorn with archway's worker (archway.server) serving routes of a test's own, for the
server's tests (tests/test_server.py):

    python -m tests.infra.siteserver --bind 127.0.0.1:PORT [--threads N] [--reuse-port]
                                     [--tls-dir DIR]   (a local CA and serving pair made there)

    POST /echo     on the loop, unless the body asks {"thread": true}; says which answered it
                   (and with {"big": true} pads the answer past any socket buffer)
    POST /slow     on a thread, 0.5 s: when the request arrived and when a thread took it
    GET  /probe    on the loop
"""
import argparse
import json
import sys
import threading
import time

from archway.server.master import WORKER_CLASS, Application
from archway.server.routes import Reply, Request, Route, Routes, Site

BIG = 8 * 1024 * 1024   # an answer larger than any socket buffer here


def _json(value: dict) -> Reply:
    return Reply(200, json.dumps(value).encode())


def echo(request: Request) -> Reply | None:
    asked = json.loads(request.body or b"{}")
    if asked.get("thread") and not request.may_wait:
        return None
    answer = {"n": asked.get("n"),
              "on_loop": threading.current_thread() is threading.main_thread()}
    if asked.get("big"):
        answer["pad"] = "x" * BIG
    return _json(answer)


def slow(request: Request) -> Reply:
    taken = time.monotonic()
    time.sleep(0.5)
    return _json({"arrived": request.arrived, "taken": taken})


def site() -> Site:
    return Site(Routes([Route("POST", "/echo", echo, on_loop=True),
                        Route("POST", "/slow", slow),
                        Route("GET", "/probe", lambda _r: _json({"ok": True}), on_loop=True)]))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="tests.infra.siteserver")
    parser.add_argument("--bind", required=True)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--reuse-port", action="store_true")
    parser.add_argument("--tls-dir")
    args = parser.parse_args(argv)
    options = {"bind": [args.bind], "workers": 1, "threads": args.threads,
               "worker_class": WORKER_CLASS, "reuse_port": args.reuse_port, "keepalive": 100,
               "graceful_timeout": 10, "errorlog": "-", "control_socket_disable": True}
    if args.tls_dir:
        from archway.certs.selfsigned import ensure_self_signed
        files = ensure_self_signed(args.tls_dir, ["127.0.0.1"])
        options.update(certfile=files.cert_path, keyfile=files.key_path)
    return Application(options, site).serve()


if __name__ == "__main__":
    sys.exit(main())
